"""What the cache is worth, in the engine's own prefill seconds: saved by its
hits, lost to recomputation, bought by more memory. One definition each,
read by the catalogue (the page's signals), the stream's report (bought,
lost where the event stream is on), the status page, `kvwatch diagnose` and
the capacity report.

Lost and bought are tokens x the window's marginal prefill seconds per
computed token (prefill_seconds_per_token: the slope of vLLM's prefill time
fitted over the window's polls against requests and computed tokens;
SGLang's extend forward passes' seconds over the tokens it computed). Saved
prices each cached token at its position in the prompt (cached_token_seconds:
a token's cost taken to grow linearly with the context before it, fitted
over the polls that finished one request with the positions as a third
column), since a long prefix's
tokens cost more than the short suffixes a cache-hit window computes. With
batching those are request-seconds, not wall time: a cost in the engine's
own measure, not a bill."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvwatch.signals.derivations import (
    CACHED_BY_SOURCE, HOST_SERVED, LOCAL_COMPUTE, OFFLOAD_SERVED, RETRACTED_PROMPT, View, _offload_added_seconds,
    _prefill_seconds_per_token, mean_tokens,
)
from kvwatch.stream_report import KVEventsReport
from kvwatch.window.steps import POSITION_FIT, PREFILL_FIT

# vLLM before 0.32 names two sources of cached prompt tokens (0.16+).
_BY_SOURCE_TIERS = (("local", "prompt_tokens_by_source/local_cache_hit"), ("external", OFFLOAD_SERVED))
GIB = float(1 << 30)
# The point of diminishing returns on the sizing curve: the smallest extra
# cache that buys this share of what the largest step buys.
DIMINISHING_SHARE = 0.9


# The fit's two columns (requests, computed tokens) must differ in shape
# across the steps: below this share of det / (Snn * Stt) they are one column.
FIT_MIN_SPREAD = 0.01
# A cost a position below zero by less than this share of a token's is the
# float rounding of a zero (the solve's terms run to 1e11), not a cost.
POSITION_ROUNDING = 1e-9


def fitted_prefill_cost(view: View) -> tuple[float, float] | None:
    """(a, b): a request's fixed prefill seconds and the seconds per computed
    token, from the least-squares fit of prefill seconds = a*requests +
    b*computed tokens over the window's steps (the cross products each step
    adds, kvwatch.window.steps.PREFILL_FIT). None where the steps cannot tell
    the two apart (one shape of request throughout, or a fit with a cost
    below zero)."""
    c = view.increase.counters
    sums = [c.get(PREFILL_FIT + name) for name in ("nn", "nt", "tt", "np", "tp")]
    if any(value is None for value in sums):
        return None
    nn, nt, tt, np_, tp = (float(value or 0.0) for value in sums)
    det = nn * tt - nt * nt
    if nn <= 0 or tt <= 0 or det <= FIT_MIN_SPREAD * nn * tt:
        return None
    a, b = (tt * np_ - nt * tp) / det, (nn * tp - nt * np_) / det
    return (a, b) if a >= 0 and b > 0 else None


def _det3(a: list[list[float]]) -> float:
    return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1]) - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))


def _solve3(m: list[list[float]], v: list[float]) -> list[float]:
    """x with m x = v (3 x 3, Cramer's rule); m is not singular."""
    whole = _det3(m)
    return [_det3([[v[r] if k == col else m[r][k] for k in range(3)] for r in range(3)]) / whole for col in range(3)]


def fitted_position_cost(view: View) -> tuple[float, float, float] | None:
    """(a, b, c): a request's fixed prefill seconds, a computed token's
    seconds at position 0, and what each position further into the context
    adds to a token (attention reads every earlier position), from the
    least-squares fit of prefill seconds = a + b*computed tokens + c*their
    positions' sum over the window's polls that finished one request
    (POSITION_FIT: only there does the page say where a request's tokens
    sat). None where those polls cannot tell the three apart (too few, or
    their prompts and cached parts of one shape throughout) or a cost comes
    out below zero."""
    fit = position_fit(view)
    if fit is None or fit[0] < 0 or fit[1] <= 0 or fit[2] < -POSITION_ROUNDING * fit[1]:
        return None
    # An engine of one cost a token fits c to zero give or take the solve's rounding.
    return fit[0], fit[1], max(fit[2], 0.0)


def position_fit(view: View) -> tuple[float, float, float] | None:
    """fitted_position_cost's least squares as they come out, signs unchecked;
    None where the polls cannot tell the three columns apart."""
    c = view.increase.counters
    sums = [c.get(POSITION_FIT + name) for name in ("n", "t", "q", "tt", "tq", "qq", "p", "tp", "qp")]
    if any(value is None for value in sums):
        return None
    n, t, q, tt, tq, qq, p, tp, qp = (float(value or 0.0) for value in sums)
    if n <= 0 or tt <= 0 or qq <= 0:
        return None
    gram = [[n, t, q], [t, tt, tq], [q, tq, qq]]
    # The columns' spread as with two (FIT_MIN_SPREAD): the determinant over the diagonal's product.
    scale = [value ** 0.5 for value in (n, tt, qq)]
    unit = [[gram[r][k] / (scale[r] * scale[k]) for k in range(3)] for r in range(3)]
    if _det3(unit) <= FIT_MIN_SPREAD:
        return None
    a, b, per_position = (x / scale[r] for r, x in enumerate(_solve3(unit, [rhs / scale[r] for r, rhs in
                                                                            enumerate((p, tp, qp))])))
    return a, b, per_position


def cached_token_seconds(view: View) -> float | None:
    """What one cached token saved: the seconds computing it would have
    cost at the position it sat at. Attention makes a token's cost grow with
    the context before it, so a token at position p costs b + c*p
    (fitted_position_cost); the window's cached tokens sat at their mean
    position (from the requests' prompt and computed lengths; each poll's
    requests taken as one shape, a lower bound where they mix). Where the
    fit cannot tell c apart, the marginal rate of a computed token
    (prefill_seconds_per_token)."""
    fit, c = fitted_position_cost(view), view.increase.counters
    cached, positions = c.get(PREFILL_FIT + "k"), c.get(PREFILL_FIT + "h")
    if fit is None or not cached or positions is None:
        return prefill_seconds_per_token(view)
    return fit[1] + fit[2] * float(positions) / float(cached)


def prefill_seconds_per_token(view: View) -> float | None:
    """The window's marginal prefill seconds per computed prompt token (the
    rate lost and bought are priced at, and saved where the positions cannot
    be told apart). A request's prefill time holds
    a fixed cost whatever its prompt (on vLLM at least one engine step: its
    overhead and its batch-mates' decodes; on the CPU tier about 5.8 ms
    against 23 us a token), so a hit saves only the per-token part: the
    slope of the fit over the window's steps (fitted_prefill_cost) where the
    steps tell it apart. Else one mean inter-token latency a request is
    taken off the mean before dividing (on the simulator's healthy scenario
    the plain mean priced the hits 1.9x what they saved; less that step,
    0.95x). SGLang's extend passes' seconds are GPU time already; without
    the latency, or with nothing left once it is taken off, the mean (an
    upper bound)."""
    increase = view.increase
    computed = increase.counters.get(LOCAL_COMPUTE)
    fit = fitted_prefill_cost(view)
    if computed and fit is not None:
        return fit[1]
    prefill, itl = increase.histograms.get("prefill_time"), increase.histograms.get("inter_token_latency")
    if not computed or prefill is None or itl is None or not itl.count or prefill.sum <= 0:
        return _prefill_seconds_per_token(view)
    marginal = prefill.sum - prefill.count * itl.sum / itl.count
    # Prefill no longer than a step a request: its share cannot be told apart; the mean is an upper bound.
    return marginal / computed if marginal > 0 else _prefill_seconds_per_token(view)


def _tier_tokens(view: View) -> dict[str, float]:
    counters = view.increase.counters
    tiers = {key[len(CACHED_BY_SOURCE):]: value for key, value in counters.items() if key.startswith(CACHED_BY_SOURCE)}
    if tiers:
        return tiers
    return {tier: counters[key] for tier, key in _BY_SOURCE_TIERS if key in counters}


def _load_back_seconds(view: View, tiers: Mapping[str, float]) -> dict[str, float]:
    """Seconds the lower tiers took to load back what they served, where the
    engine measures it: vLLM's offload tier (host from 0.32, external
    before), SGLang's HiCache host tier."""
    found = {}
    offload = _offload_added_seconds(view)
    if offload is not None:
        found["host" if "host" in tiers else "external"] = offload
    load_back = view.increase.histograms.get("hicache_load_back_time")
    if load_back is not None and HOST_SERVED in view.increase.counters:
        found["host"] = found.get("host", 0.0) + load_back.sum
    return found


def saved_seconds(view: View) -> dict[str, float] | None:
    """Prefill seconds the cache saved in the window, by tier: the tokens each
    tier served x what a cached token saved (cached_token_seconds: its cost
    at the position it sat at), less the seconds that tier took to load them
    back where measured. None without a computed token or prefill time to
    price them at."""
    per_token = cached_token_seconds(view)
    tiers = _tier_tokens(view)
    if per_token is None or not tiers:
        return None
    cost = _load_back_seconds(view, tiers)
    return {tier: tokens * per_token - cost.get(tier, 0.0) for tier, tokens in tiers.items()}


def recomputed_prompt_tokens(view: View) -> tuple[float, bool] | None:
    """Prompt tokens computed again after a preemption in the window, and
    whether that is a count (SGLang's retracted tokens) or an upper bound
    (vLLM: preemptions x the mean prompt of the requests finished)."""
    counters = view.increase.counters
    again = counters.get(RETRACTED_PROMPT)
    if again is not None:
        return again, True
    preemptions = counters.get("preemptions")
    if preemptions is None:
        return None
    if preemptions <= 0:
        return 0.0, True
    prompt = mean_tokens(view, "prompt_len", "prompt_tokens")
    return None if prompt is None else (preemptions * prompt, False)


def lost_seconds(view: View) -> float | None:
    """Prefill seconds the window spent recomputing preempted requests'
    prompts, from the page (recomputed_prompt_tokens x the per-token rate)."""
    per_token = prefill_seconds_per_token(view)
    recomputed = recomputed_prompt_tokens(view)
    if per_token is None or recomputed is None:
        return None
    return recomputed[0] * per_token


def stream_lost_seconds(window: Mapping[str, Any], block_size: float | None, per_token: float | None) -> float | None:
    """Prefill seconds spent storing again blocks evicted before their reuse
    (a preempted request's evicted prefix included), from the event stream."""
    again = window.get("stored_again")
    if again is None or not block_size or per_token is None:
        return None
    return float(again) * float(block_size) * per_token


def lost_by_tenant(rows: list[dict[str, Any]], per_token: float | None) -> list[dict[str, Any]] | None:
    """Per LoRA adapter (tenants.lora_rows: the top K and "other"), the
    prefill seconds its recomputed tokens cost: the tokens x the per-token
    rate the window's stream lost is priced at, so the adapters' seconds are
    that lost split by who recomputed, never a second price. None without a
    rate."""
    if per_token is None:
        return None
    return [{"kind": "lora", "tenant": row["tenant"], "seconds": float(row["recomputed_tokens"]) * per_token}
            for row in rows]


def priced_rate(stream: Mapping[str, Any] | None) -> float | None:
    """The prefill seconds per token with_worth priced the stream's window at
    (`window.prefill_seconds_per_token`), None where it had none."""
    rate = ((stream or {}).get("window") or {}).get("prefill_seconds_per_token")
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None


def bought(sizing: Mapping[str, Any], window_seconds: float, block_size: float | None,
           per_token: float | None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Each sizing-curve step as the extra GiB it costs and the prefill
    seconds per hour it would have saved (its blocks kept x block size x the
    per-token rate, over the window), and the point of diminishing returns:
    the smallest step buying DIMINISHING_SHARE of the largest's saving.
    Reads the stream's report's existing fields only."""
    rows = []
    for point in sizing.get("points") or []:
        kept, extra_bytes = point.get("blocks_kept"), point.get("extra_bytes")
        per_hour = (float(kept) * float(block_size) * per_token * 3600.0 / window_seconds
                    if kept is not None and block_size and per_token is not None and window_seconds > 0 else None)
        rows.append({"extra_cache": point.get("extra_cache"),
                     "extra_gib": None if extra_bytes is None else float(extra_bytes) / GIB,
                     "saved_prefill_seconds_per_hour": per_hour})
    priced = [row for row in rows if row["saved_prefill_seconds_per_hour"] is not None]
    if not priced or max(row["saved_prefill_seconds_per_hour"] for row in priced) <= 0:
        return rows, None
    best = max(row["saved_prefill_seconds_per_hour"] for row in priced)
    knee = next(row for row in priced if row["saved_prefill_seconds_per_hour"] >= DIMINISHING_SHARE * best - 1e-12)
    # Reached only at the largest step, the curve is still rising there: no point of diminishing returns
    # on it (the largest step measured against itself is no knee).
    return rows, (None if knee is priced[-1] else knee)


def with_worth(report: KVEventsReport, view: View | None) -> KVEventsReport:
    """The stream's report with what it says the cache is worth: the window's
    prefill seconds lost to blocks stored again (`window.lost_prefill_seconds`)
    and the rate they are priced at (`window.prefill_seconds_per_token`, which
    prices each adapter's share: lost_by_tenant), and each sizing step's GiB and seconds per hour (`sizing.points[]`,
    `sizing.diminishing_returns`). The one place kvwatch reads the report's
    fields for this; a report without a view to price it at is left alone."""
    per_token = None if view is None else prefill_seconds_per_token(view)
    sizing = dict(report.get("sizing") or {})
    window = report["window"].copy()
    block_size = report.get("block_size") or (None if view is None else view.block_size)
    window["lost_prefill_seconds"] = stream_lost_seconds(window, block_size, per_token)
    window["prefill_seconds_per_token"] = per_token
    window["tokens_per_block"] = block_size
    rows, knee = bought(sizing, float(window.get("seconds") or 0.0), block_size, per_token)
    points = [dict(point, **row) for point, row in zip(sizing.get("points") or [], rows)]
    sizing.update(points=points, diminishing_returns=knee)
    out = report.copy()  # the keys keep their places: the JSON reads the same
    out["window"], out["sizing"] = window, sizing
    return out


def currency(seconds: float | None, gpu_hour_price: float | None) -> float | None:
    """GPU-seconds at a price per GPU-hour (the setting), None without one."""
    if seconds is None or gpu_hour_price is None:
        return None
    return seconds / 3600.0 * gpu_hour_price


# --- the PromQL twins ({sel}, {w}, {by} as in the catalogue) -----------------

def _increase(metric: str, extra: str = "") -> str:
    return f"sum by ({{by}}) (increase({metric}{{{{{{sel}}{extra}}}}}[{{w}}]))"


# The window's prefill seconds per computed prompt token (vLLM's prefill
# histogram's sum, else SGLang's extend forward passes' seconds).
PER_TOKEN_PROMQL = (
    "(\n  (\n    (" + _increase("kvwatch_engine_request_prefill_time_seconds_sum") + "\n     - on ({by}) "
    + _increase("kvwatch_engine_request_prefill_time_seconds_count") + "\n     * on ({by}) ("
    + _increase("kvwatch_engine_inter_token_latency_seconds_sum") + "\n       / on ({by}) ("
    + _increase("kvwatch_engine_inter_token_latency_seconds_count") + " > 0))) > 0\n  )\n  or\n  ("
    + _increase("kvwatch_engine_request_prefill_time_seconds_sum") + " > 0)\n  or\n  ("
    + _increase("kvwatch_engine_prefill_forward_seconds_total") + " > 0)\n)\n/ on ({by}) ("
    + _increase("kvwatch_engine_prompt_tokens_by_source_total", ',source="local_compute"') + " > 0)")

_TIER_TOKENS_PROMQL = (
    "(\n  sum by ({by}, tier) (label_replace(increase(kvwatch_engine_prompt_tokens_cached_by_source_total{{{sel}}}[{w}]), "
    "\"tier\", \"$1\", \"source\", \"(.*)\"))\n  or\n  (\n    (\n"
    "      label_replace(" + _increase("kvwatch_engine_prompt_tokens_by_source_total", ',source="local_cache_hit"')
    + ", \"tier\", \"local\", \"\", \"\")\n      or\n"
    "      label_replace(" + _increase("kvwatch_engine_prompt_tokens_by_source_total", ',source="external_kv_transfer"')
    + ", \"tier\", \"external\", \"\", \"\")\n    )\n"
    "    unless on ({by}) " + _increase("kvwatch_engine_prompt_tokens_cached_by_source_total") + "\n  )\n)")

_OFFLOAD_SECONDS_PROMQL = (
    "(" + _increase("kvwatch_engine_kv_offload_load_seconds_total")
    + "\n     + on ({by}) (" + _increase("kvwatch_engine_kv_offload_lookup_sync_delay_seconds_sum") + " or "
    + _increase("kvwatch_engine_kv_offload_load_seconds_total") + " * 0)\n     + on ({by}) ("
    + _increase("kvwatch_engine_kv_offload_lookup_async_delay_seconds_sum") + " or "
    + _increase("kvwatch_engine_kv_offload_load_seconds_total") + " * 0))")

# The offload tier's seconds go to tier host (vLLM 0.32+) or external (before).
_LOAD_BACK_PROMQL = (
    "(\n  label_replace(\n    " + _OFFLOAD_SECONDS_PROMQL + "\n    and on ({by}) "
    + _increase("kvwatch_engine_prompt_tokens_cached_by_source_total", ',source="host"')
    + ",\n    \"tier\", \"host\", \"\", \"\")\n  or\n  label_replace(\n    " + _OFFLOAD_SECONDS_PROMQL
    + "\n    unless on ({by}) " + _increase("kvwatch_engine_prompt_tokens_cached_by_source_total")
    + ",\n    \"tier\", \"external\", \"\", \"\")\n  or\n  label_replace(\n"
    "    " + _increase("kvwatch_engine_hicache_load_back_seconds_sum") + ",\n    \"tier\", \"host\", \"\", \"\")\n)")

SAVED_PROMQL = (
    _TIER_TOKENS_PROMQL + "\n* on ({by}) group_left ()\n(\n" + PER_TOKEN_PROMQL + "\n)\n"
    "- on ({by}, tier)\n(" + _LOAD_BACK_PROMQL + " or on ({by}, tier) (" + _TIER_TOKENS_PROMQL + " * 0))")

LOST_PROMQL = (
    "(\n  " + _increase("kvwatch_engine_retracted_prompt_tokens_total") + "\n  or\n  "
    + _increase("kvwatch_engine_preemptions_total") + "\n  * on ({by}) (\n"
    "    sum by ({by}) (rate(kvwatch_engine_request_prompt_tokens_sum{{{sel}}}[{w}]))\n"
    "    / on ({by}) (sum by ({by}) (rate(kvwatch_engine_request_prompt_tokens_count{{{sel}}}[{w}])) > 0)\n  )\n)\n"
    "* on ({by}) (\n" + PER_TOKEN_PROMQL + "\n)")


# --- what every surface shows ---------------------------------------------

SAVED_SIGNAL = "kvwatch_cache_saved_prefill_seconds"
LOST_SIGNAL = "kvwatch_cache_lost_prefill_seconds"
CAVEAT = ("the engine's own prefill request-seconds, priced from its own prefill times (a cached token at its "
          "position where the polls tell it, else at the window's rate per computed token): with batching they "
          "overlap, so read them as work, not wall time; at a price per GPU-hour, the cost of that work, not a bill")


def _stream_lost(stream: Mapping[str, Any] | None, model: str, engine: str | None) -> float | None:
    """The stream's lost seconds where it is up and is this engine's."""
    if not stream or not stream.get("up"):
        return None
    page = stream.get("page_engine") or {}
    if page and (page.get("model_name"), page.get("engine")) != (model, engine):
        return None
    return (stream.get("window") or {}).get("lost_prefill_seconds")


def summary(model: str, engine: str | None, values: Mapping[str, Any], view: View,
            stream: KVEventsReport | None, gpu_hour_price: float | None,
            adapters: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One engine's (or model's) worth over the window: saved by tier, lost
    and its basis (the stream's count where it is on, else the page's count
    or upper bound), lost per LoRA adapter where the stream counts it
    (`adapters`: tenants.lora_rows of that stream), the stream's sizing
    steps, their money at the price, and the sentences every surface prints.
    With nothing priced, a record whose one sentence says why (unpriced_line):
    an engine does not drop out of the worth section while it warms up."""
    by_tier = values.get(SAVED_SIGNAL)
    saved_by_tier = dict(by_tier) if isinstance(by_tier, Mapping) else None
    saved = sum(saved_by_tier.values()) if saved_by_tier is not None else None
    # The page's figure always; the stream's count, where it is on, is lost (the page's stays beside it).
    page_lost, counted = values.get(LOST_SIGNAL), recomputed_prompt_tokens(view)
    page_basis = "page_count" if counted is not None and counted[1] else "page_upper_bound"
    lost, basis = _stream_lost(stream, model, engine), "stream"
    if lost is None:
        lost, basis = page_lost, page_basis
    if saved is None and lost is None:
        return {"model_name": model, "engine": engine, "window_seconds": view.increase.seconds,
                "saved_seconds": None, "lost_seconds": None, "lines": [unpriced_line(view)]}
    sizing = ((stream.get("sizing") if stream else None) or {}) if basis == "stream" else {}
    out = {"model_name": model, "engine": engine, "window_seconds": view.increase.seconds,
           "prefill_seconds_per_token": prefill_seconds_per_token(view),
           "cached_token_seconds": cached_token_seconds(view),
           "saved_seconds": saved, "saved_by_tier": saved_by_tier,
           "lost_seconds": lost, "lost_basis": None if lost is None else basis,
           "lost_page_seconds": page_lost if basis == "stream" else None,
           "lost_page_basis": (None if page_lost is None else page_basis) if basis == "stream" else None,
           "lost_by_tenant": lost_by_tenant(adapters or [], priced_rate(stream)) if basis == "stream" else None,
           "bought": [{**{key: point.get(key) for key in ("extra_cache", "extra_gib", "saved_prefill_seconds_per_hour")},
                       "saved_money_per_hour": currency(point.get("saved_prefill_seconds_per_hour"), gpu_hour_price)}
                      for point in sizing.get("points") or []],
           "diminishing_returns": sizing.get("diminishing_returns"),
           "gpu_hour_price": gpu_hour_price,
           "saved_money": currency(saved, gpu_hour_price), "lost_money": currency(lost, gpu_hour_price)}
    out["lines"] = lines(out)
    return out


def unpriced_line(view: View) -> str:
    """Why a window prices neither saved nor lost, in one sentence."""
    counters, histograms = view.increase.counters, view.increase.histograms
    if prefill_seconds_per_token(view) is None:
        measured = "prefill_time" in histograms or "prefill_forward_seconds" in counters
        why = ("no request finished its prefill in it" if measured and LOCAL_COMPUTE in counters
               else "the engine reports no prefill time and computed tokens to price a token at")
    else:
        why = "the engine reports neither the tokens its cache served nor its preemptions"
    return f"Not priced over {view.increase.seconds:.0f} s: {why}."


def figure(value: float) -> str:
    """A worth figure as the sentences write it: 3 significant digits under
    100, whole (grouped) from there; the capacity table writes it alike."""
    return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"


def _seconds(value: float | None) -> str:
    return "unknown" if value is None else f"{figure(value)} s"


def _amount(value: float) -> str:
    # Cents where there are any; three figures below that (a short window's work is a fraction of a cent).
    return f"{value:,.2f}" if abs(value) >= 0.995 or value == 0 else f"{value:.3g}"


def _money(value: float | None, per: str = "") -> str:
    return "" if value is None else f" ({_amount(value)}{per} at the price per GPU-hour)"


_BASES = {"stream": "counted from the event stream's blocks stored again after their eviction",
          "page_count": "from the page's counts (the engine's recomputed prompt tokens, or no preemption)",
          "page_upper_bound": "an upper bound from the page (preemptions x the mean prompt)"}


# The adapters the sentence names, the most lost first; the JSON and the gauges carry them all.
TENANTS_NAMED = 3


def tenants_line(rows: list[dict[str, Any]] | None) -> str | None:
    """Lost by the adapters that lost most, where the stream names one beside
    the base model (with the base model alone it is the whole of lost)."""
    if not rows or all(row["tenant"] == "(base)" for row in rows):
        return None
    ranked = sorted(rows, key=lambda row: (-row["seconds"], row["tenant"]))
    named = ", ".join(f"{row['tenant']} {_seconds(row['seconds'])}" for row in ranked[:TENANTS_NAMED])
    rest = len(ranked) - TENANTS_NAMED
    return f"Lost by adapter: {named}" + (f" and {rest} more" if rest > 0 else "") + "."


def lines(worth: Mapping[str, Any]) -> list[str]:
    """The sentences the status page, `kvwatch diagnose` and the capacity
    report print, made once here."""
    window = f"over {worth['window_seconds']:.0f} s"
    out = []
    if worth["saved_seconds"] is not None:
        tiers = ", ".join(f"{tier} {_seconds(s)}" for tier, s in sorted(worth["saved_by_tier"].items()) if s)
        out.append(f"Saved: {_seconds(worth['saved_seconds'])} of prefill {window}"
                   + (f" ({tiers})" if tiers else "") + _money(worth["saved_money"]) + ".")
    if worth["lost_seconds"] is not None:
        page = worth.get("lost_page_seconds")
        beside = (f"; the page's own figure, {_BASES[worth['lost_page_basis']]}, says {_seconds(page)}"
                  if page is not None and worth.get("lost_page_basis") else "")
        out.append(f"Lost to recomputation: {_seconds(worth['lost_seconds'])} {window}, "
                   f"{_BASES[worth['lost_basis']]}" + _money(worth["lost_money"]) + beside + ".")
    tenants = tenants_line(worth.get("lost_by_tenant"))
    if tenants:
        out.append(tenants)
    priced = [p for p in worth["bought"] if p.get("saved_prefill_seconds_per_hour") is not None]
    if priced:
        steps = "; ".join(f"x{p['extra_cache']:g}" + (f" (+{p['extra_gib']:.3g} GiB)" if p.get("extra_gib") else "")
                          + f" {_seconds(p['saved_prefill_seconds_per_hour'])}/h"
                          + _money(p.get("saved_money_per_hour"), "/h") for p in priced)
        out.append(f"Bought by more cache (estimate): {steps}.")
        knee = worth.get("diminishing_returns")
        if knee:
            gib = f" (+{knee['extra_gib']:.3g} GiB)" if knee.get("extra_gib") else ""
            out.append(f"Diminishing returns past x{knee['extra_cache']:g} more cache{gib}: it buys "
                       f"{DIMINISHING_SHARE:.0%} of what the largest step would.")
        elif max(p["saved_prefill_seconds_per_hour"] for p in priced) > 0:
            out.append(f"No point of diminishing returns up to x{priced[-1]['extra_cache']:g} more cache: every "
                       f"smaller step buys under {DIMINISHING_SHARE:.0%} of what it would.")
    if out:
        out.append(f"Seconds are {CAVEAT}.")
    return out


def stream_lines(window: Mapping[str, Any], sizing: Mapping[str, Any]) -> list[str]:
    """The sentences for a stream's report alone (`kvwatch capacity --kvwatch`):
    what blocks evicted before reuse cost, and what more cache buys."""
    lost = window.get("lost_prefill_seconds")
    return lines({"window_seconds": float(window.get("seconds") or 0.0), "saved_seconds": None,
                  "lost_seconds": lost, "lost_basis": None if lost is None else "stream", "lost_money": None,
                  "bought": list(sizing.get("points") or []), "diminishing_returns": sizing.get("diminishing_returns")})
