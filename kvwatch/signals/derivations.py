"""How each windowed signal is derived: the View a derivation reads (one
engine or one model over the window), the Signal entry's type, the
derivations themselves (including the TTFT decomposition every surface
shares), and the PromQL helpers the catalogue's twins are written with.
The entries live in kvwatch.signals.catalogue."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, overload

from kvwatch import units
from kvwatch.snapshot import EngineSnapshot, Histogram
from kvwatch.window import Increase

QUANTILES = (0.5, 0.95, 0.99)

# The span the exhaustion trend is fitted over: long enough to smooth single
# requests, short enough to follow a ramp. One declaration: the PromQL twin's
# deriv() and avg_over_time() range, and the sidecar's fit in seconds.
TREND_RANGE = "5m"
TREND_SECONDS = units.parse_duration(TREND_RANGE)

# --------------------------------------------------------------------------
# Windowed signals
# --------------------------------------------------------------------------


@dataclass
class View:
    """What a derivation reads: the latest values and the window's increase,
    for one engine or one model (engines merged)."""

    latest: EngineSnapshot
    increase: Increase
    usage_max: float | None
    running_max: float | None
    capacity_tokens: float | None
    block_size: float | None
    # KV bytes held, summed over the view's engines (usage x kv_cache_memory_bytes
    # each); None unless every engine states its cache's bytes.
    kv_used_bytes: float | None = None
    # Whole-block arithmetic, summed over the view's engines; None unless
    # every engine states num_gpu_blocks and block_size and its blocks hold
    # capacity_tokens (not so on hybrid models, where block_size is the
    # minimum over KV groups).
    usable_blocks: float | None = None  # num_gpu_blocks - 1 (vLLM's null block is never allocated)
    used_blocks: float | None = None  # usage x usable blocks, whole
    block_tokens: float | None = None  # used blocks x block_size
    bytes_per_block: float | None = None
    usage_mean: float | None = None
    # Seconds until usage reaches 1 at the window's least-squares trend, the
    # soonest engine of the view; None when usage is not rising.
    exhaustion_eta: float | None = None
    notes: list[str] = field(default_factory=list)
    # The quantiles the derivation running now found pinned at a bucket edge,
    # {quantile: "<" | ">"}; evaluate() files them under the signal's name.
    pinned: dict[str, str] = field(default_factory=dict)
    # canonical counter key -> how the engine's version counts it where that
    # differs from the current meaning (Snapshot.counting): `caveats` and
    # `unlit_reasons` say so beside the signals read from it.
    counting: dict[str, str] = field(default_factory=dict)

    def gauge(self, key: str) -> float | None:
        return self.latest.gauges.get(key)


@dataclass(frozen=True)
class Signal:
    name: str
    unit: str
    help: str
    derive: Callable[[View], float | None | dict[str, float]]
    group: str  # exhaustion | prefix | first_token | throughput
    promql: str  # fleet twin over kvwatch_engine_* series
    label: str | None = None  # the dimension a dict-valued derivation returns
    # A dashboard key ("overview", "exhaustion", ...): the signal gets a panel
    # of its own there, titled `title`, after the board's hand-laid panels.
    panel: str | None = None
    title: str = ""
    # Its recording rule's name parts, `level:metric:operations`: the metric
    # part and the operations ({w} is the rate window).
    record: tuple[str, str] = ("", "")
    # The labels its twin's output keeps beyond the engine's (its `by`
    # clause), named in its recording rule's level, and the labels that rule
    # sets (the TTFT shares' twin is the queue's share: part="queue").
    output_labels: tuple[str, ...] = ()
    record_labels: tuple[tuple[str, str], ...] = ()
    # Canonical snapshot keys the signal cannot do without: where one was not
    # on the page the signal is absent, and /api/v1/signals says so (and
    # names the flag, for a config-gated family).
    needs: tuple[str, ...] = ()
    # What a person reads: the status page and `kvwatch diagnose` label the
    # signal with this (the unit is shown beside it, from `unit`).
    display: str = ""
    # GOOD_DIRECTIONS: the side of a threshold a person wants it on.
    good: str | None = None
    # `help` is one line (the exported # HELP, a panel's description);
    # where more needs saying, docs/metrics.md shows this instead.
    doc: str = ""
    # Why the PromQL twin is not this value exactly, polled the same way; ""
    # when it is, which tests/test_recorded_twins_agree.py checks for every such signal.
    inexact_twin: str = ""


@overload
def _clamp01(value: float) -> float: ...
@overload
def _clamp01(value: None) -> None: ...
def _clamp01(value: float | None) -> float | None:
    # Usage outside 0..1 never reaches here (kvwatch.engines.plausible.screen takes it
    # out of the snapshot as a source fault); this only keeps arithmetic on a
    # hand-built view in range.
    if value is None:
        return None
    # min(1.0, max(0.0, value)) spelled out, without two builtin calls (NaN
    # and -0.0 give 0.0 as there; tests compare the two).
    return (value if value < 1.0 else 1.0) if value > 0.0 else 0.0


def _usage(view: View) -> float | None:
    return _clamp01(view.gauge("kv_usage"))


def _free_tokens(view: View) -> float | None:
    usage = _usage(view)
    if usage is None or view.capacity_tokens is None:
        return None
    # Rounded down to a whole token: headroom never promises a token the
    # cache does not have (usage is block-granular, tokens are whole).
    return float(math.floor(view.capacity_tokens * (1.0 - usage)))


def _used_bytes(view: View) -> float | None:
    return None if view.kv_used_bytes is None else float(round(view.kv_used_bytes))


def _prefix_hit_ratio(view: View) -> float | None:
    ratio = view.increase.ratio("prefix_hits", "prefix_queries")
    if ratio is not None:
        return ratio
    # V0 only had a gauge; -1 means it has no data yet.
    legacy = view.gauge("v0_prefix_hit_rate")
    if legacy is not None and legacy >= 0:
        view.notes.append("prefix hit ratio from the V0 gauge vllm:gpu_prefix_cache_hit_rate (not windowed)")
        return legacy
    return None


def _cached_share(view: View) -> float | None:
    ratio = view.increase.ratio("prompt_tokens_cached", "prompt_tokens")
    if ratio is not None:
        return ratio
    # Before vLLM 0.16 there is no cached-token counter; local plus external
    # hits in tokens (vLLM 0.9+) say the same.
    prompt = view.increase.counters.get("prompt_tokens")
    hits = view.increase.counters.get("prefix_hits")
    if prompt and hits is not None and "prefix_hits" not in view.counting:
        cached = hits + view.increase.counters.get("external_prefix_hits", 0.0)
        # More cached tokens than prompt tokens: the counters disagree (see Increase.ratio).
        return cached / prompt if cached <= prompt else None
    # A version whose hits count re-lookups has no fallback: unlit_reasons says why.
    return None


def caveats(view: View, values: Mapping[str, object]) -> dict[str, str]:
    """Signals whose value the engine's version counts differently, each with
    the sentence that says how (/api/v1/signals' `caveats`, the page, and the
    findings that cite them): the lookup hit ratio where a waiting request's
    re-lookups are counted, the preemption rate where the counter trails."""
    found = {}
    counting = view.counting
    if values.get("kvwatch_prefix_cache_hit_ratio") is not None and "prefix_queries" in counting:
        counters = view.increase.counters
        queries, prompt = counters.get("prefix_queries"), counters.get("prompt_tokens")
        text = counting["prefix_queries"]
        if queries and prompt and queries > prompt:
            text = (f"the window's lookups ({queries:.0f} tokens) exceed its prompt tokens ({prompt:.0f}): "
                    + text)
        served = values.get("kvwatch_prompt_tokens_cached_ratio")
        found["kvwatch_prefix_cache_hit_ratio"] = text + (
            f"; the share of prompt tokens served from a cache in the window is {served:.3g} "
            "(kvwatch_prompt_tokens_cached_ratio)" if isinstance(served, float) else
            "; this version counts no prompt tokens served from a cache (vllm:prompt_tokens_cached_total is 0.16+), "
            "so that share is unknown")
    if values.get("kvwatch_preemptions_per_second") is not None and "preemptions" in counting:
        found["kvwatch_preemptions_per_second"] = counting["preemptions"]
    found.update(_storage_unweighed(view, values))
    return found


def unlit_reasons(view: View, values: Mapping[str, object]) -> dict[str, str]:
    """Why a signal is absent although the families it reads were on the
    page, where the view tells: signal name -> one sentence
    (/api/v1/signals' `dark_signals`)."""
    found = {}
    counters = view.increase.counters
    prompt, hits = counters.get("prompt_tokens"), counters.get("prefix_hits")
    if (values.get("kvwatch_prompt_tokens_cached_ratio") is None and "prompt_tokens_cached" not in counters
            and prompt and hits is not None):
        cached = hits + counters.get("external_prefix_hits", 0.0)
        fallback = (f"this page has no vllm:prompt_tokens_cached_total (vLLM 0.16+), and the fallback, prefix hits "
                    f"over prompt tokens ({cached:.0f} / {prompt:.0f} = {cached / prompt:.3g} in the window), is "
                    "refused: ")
        if "prefix_hits" in view.counting:
            found["kvwatch_prompt_tokens_cached_ratio"] = fallback + view.counting["prefix_hits"]
        elif cached > prompt:
            found["kvwatch_prompt_tokens_cached_ratio"] = fallback + "more hits than prompt tokens is no share"
    return found


# Each quantile with its name in the values (str(q), written once).
_QUANTILE_NAMES = tuple((q, str(q)) for q in QUANTILES)


def _quantiles(key: str, label: str) -> Callable[[View], dict[str, float] | None]:
    def derive(view: View) -> dict[str, float] | None:
        histogram = view.increase.histograms.get(key)
        if histogram is None or histogram.count <= 0:
            return None
        values = {}
        for q, name in _QUANTILE_NAMES:
            quantile = histogram.reported_quantile(q)
            if quantile is None:
                continue
            values[name] = quantile.value
            bound = quantile.bound
            if bound is not None:
                # Structured for every surface (evaluate() files it under the signal's name).
                view.pinned[name] = bound
                side = "at most" if bound == "<" else "at least"
                where = "in the first bucket" if bound == "<" else "at the last finite bucket"
                view.notes.append(f"{label} p{q * 100:g} is {side} {quantile.value:g}: pinned {where}")
        return values or None

    return derive


def _histogram_mean(view: View, key: str) -> float | None:
    histogram = view.increase.histograms.get(key)
    return histogram.mean() if histogram is not None else None


def _mean(key: str) -> Callable[[View], float | None]:
    def derive(view: View) -> float | None:
        return _histogram_mean(view, key)

    return derive


@dataclass(frozen=True)
class TtftDecomposition:
    """Mean time to first token split into queue, prefill and the rest: the
    one decomposition the signal, the finding, the status page and the rules
    (Fragments.queue_mean/prefill_mean/front_end_mean) read. Shares sum to at
    most 1: queue first, prefill within what is left, the rest clamped at 0."""

    ttft_mean: float
    queue_mean: float | None
    prefill_mean: float | None
    shares: dict[str, float]
    # (queue + prefill) / TTFT when above 1: the engine's histograms disagree
    # (queue and prefill are observed when a request finishes, TTFT at its
    # first token, so over a window of changing load the parts lag).
    parts_over_ttft: float | None = None

    @property
    def other_mean(self) -> float | None:
        if self.queue_mean is None or self.prefill_mean is None:
            return None
        return max(0.0, self.ttft_mean - self.queue_mean - self.prefill_mean)

    @property
    def note(self) -> str | None:
        if self.parts_over_ttft is None:
            return None
        return (f"queue + prefill means are {self.parts_over_ttft:.0%} of the TTFT mean: vLLM observes them when a "
                "request finishes and TTFT at its first token, so under changing load the histograms disagree; "
                "shares are clamped to sum to 100 %")


def ttft_decomposition(view: View) -> TtftDecomposition | None:
    ttft = _histogram_mean(view, "ttft")
    if not ttft:
        return None
    queue = _histogram_mean(view, "queue_time")
    prefill = _histogram_mean(view, "prefill_time")
    queue_share = min(1.0, (queue or 0.0) / ttft)
    prefill_share = min(1.0 - queue_share, (prefill or 0.0) / ttft)
    shares = {"queue": queue_share, "prefill": prefill_share, "other": max(0.0, 1.0 - queue_share - prefill_share)}
    over = ((queue or 0.0) + (prefill or 0.0)) / ttft
    return TtftDecomposition(ttft, queue, prefill, shares, over if over > 1.0 + 1e-9 else None)


def ttft_parts(view: View) -> dict[str, float] | None:
    """The shares of the one decomposition (see TtftDecomposition); unknown
    where the queue or prefill time is (no request finished in the window
    while first tokens came: the whole TTFT is not "other")."""
    parts = ttft_decomposition(view)
    if parts is None or parts.queue_mean is None or parts.prefill_mean is None:
        return None
    if parts.note:
        view.notes.append(parts.note)
    return parts.shares


def _rate(key: str) -> Callable[[View], float | None]:
    return lambda view: view.increase.rate(key)


def _labelled_rates(prefix: str) -> Callable[[View], dict[str, float] | None]:
    head = prefix + "/"

    def derive(view: View) -> dict[str, float] | None:
        seconds = view.increase.seconds
        if seconds <= 0:
            return None
        found = {
            key.split("/", 1)[1]: value / seconds
            for key, value in view.increase.counters.items()
            if key.startswith(head)
        }
        return found or None

    return derive


def _failed_rate(view: View) -> float | None:
    if view.increase.seconds <= 0 or not any(k.startswith("finished/") for k in view.increase.counters):
        return None
    failed = sum(view.increase.counters.get(f"finished/{reason}", 0.0) for reason in ("abort", "error"))
    return failed / view.increase.seconds


def _waiting_by_reason(view: View) -> dict[str, float] | None:
    found = {
        key.split("/", 1)[1]: value for key, value in view.latest.gauges.items() if key.startswith("waiting_by_reason/")
    }
    return found or None


def mean_tokens(view: View, histogram_key: str, counter_key: str) -> float | None:
    """Mean tokens per finished request: from the length histogram, else the
    token counter over finished requests."""
    histogram = view.increase.histograms.get(histogram_key)
    if histogram is not None and histogram.count > 0:
        return histogram.mean()
    finished = sum(v for k, v in view.increase.counters.items() if k.startswith("finished/"))
    tokens = view.increase.counters.get(counter_key)
    if finished > 0 and tokens is not None:
        return tokens / finished
    return None


def _capacity_requests(view: View) -> float | None:
    """How many requests of the window's mean prompt+generation length the KV
    capacity holds at once, after rounding each request up to whole blocks.
    A bound, not a promise: prefix sharing raises it; unequal lengths,
    reserves and fragmentation lower it."""
    prompt = mean_tokens(view, "prompt_len", "prompt_tokens")
    generated = mean_tokens(view, "generation_len", "generation_tokens")
    if view.capacity_tokens is None or prompt is None or generated is None or prompt + generated <= 0:
        return None
    per_request = prompt + generated
    if view.block_size:
        blocks = view.capacity_tokens // view.block_size
        return float(blocks // math.ceil(per_request / view.block_size))
    return float(view.capacity_tokens // per_request)


def _used_blocks(view: View) -> float | None:
    return view.used_blocks


def _free_blocks(view: View) -> float | None:
    if view.usable_blocks is None or view.used_blocks is None:
        return None
    return view.usable_blocks - view.used_blocks


def requests_fit_now(view: View) -> float | None:
    """Requests of the running ones' current mean footprint (used blocks /
    running) the usable blocks hold, rounded down: the capacity ceiling at
    current lengths. It falls as running requests decode and grow, before
    the cache is full; kvwatch_kv_cache_capacity_requests reads finished
    requests' lengths and does not move until they finish."""
    running = view.gauge("running")
    if view.usable_blocks is None or not view.used_blocks or not running:
        return None
    return float(math.floor(view.usable_blocks * running / view.used_blocks))


def token_usage_estimate(view: View) -> float | None:
    """Tokens held over the tokens the usable blocks hold. Usage counts whole
    blocks; each running request's last block is partly filled, on average
    by half, so the tokens held are about used blocks x block_size less
    (block_size - 1) / 2 per running request. Prefix sharing does not change
    it (shared blocks are full)."""
    running = view.gauge("running")
    if view.block_tokens is None or view.usable_blocks is None or not view.block_size or running is None:
        return None
    held = max(0.0, view.block_tokens - running * (view.block_size - 1) / 2)
    return held / (view.usable_blocks * view.block_size)


def _exhaustion_eta(view: View) -> float | None:
    return view.exhaustion_eta


def _from_cache(view: View) -> dict[str, float] | None:
    counters = view.increase.counters
    total = sum(v for k, v in counters.items() if k.startswith("prompt_tokens_by_source/"))
    if total <= 0:
        return None
    return {tier: counters.get(f"prompt_tokens_by_source/{source}", 0.0) / total
            for tier, source in (("local", "local_cache_hit"), ("external", "external_kv_transfer"))}


CACHED_BY_SOURCE = "prompt_tokens_cached_by_source/"
LOCAL_COMPUTE = "prompt_tokens_by_source/local_compute"


def prompt_tokens_by_tier(view: View) -> dict[str, float] | None:
    """Every cache tier's share of the window's prompt tokens, and the
    computed share, token-weighted (counter increases, never averaged
    gauges): each tier's cached tokens (vLLM's prompt_tokens_cached_by_source:
    device, host, disk, p2p, external_unspecified; SGLang's
    prefill_effective_tokens: device, host, storage) over the tiers' sum plus
    the computed tokens (vLLM's prompt_tokens_by_source{local_compute},
    SGLang's prefill_effective_tokens{input}). The shares sum to 1."""
    counters = view.increase.counters
    computed = counters.get(LOCAL_COMPUTE)
    tiers = {key[len(CACHED_BY_SOURCE):]: value for key, value in counters.items()
             if key.startswith(CACHED_BY_SOURCE)}
    if computed is None or not tiers:
        return None
    total = sum(tiers.values()) + computed
    if total <= 0:
        return None
    shares = {tier: value / total for tier, value in tiers.items()}
    shares["computed"] = computed / total
    return shares


RETRACTED_PROMPT = "retracted_prompt_tokens"


def recomputed_prompt_share(view: View) -> float | None:
    """The share of the window's prefill work spent computing again the
    prompts of preempted (SGLang: retracted) requests: recomputed / (computed
    once + recomputed). Computed once is prompt_tokens_by_source{local_compute}
    (vLLM counts each prompt there once, preemptions aside; SGLang's
    prefill_effective_tokens{input} excludes retracted re-counts). Recomputed:
    SGLang counts it (num_retracted_input_tokens_total); vLLM does not, so it is
    estimated as preemptions x the mean prompt length of the requests finished
    in the window (request_prompt_tokens), an upper bound: a resumed request
    may find part of its prompt still in the prefix cache, and the generated
    tokens it also recomputes are not counted. None with no preemption family
    (unknown, not 0) or no prefill."""
    counters = view.increase.counters
    computed = counters.get(LOCAL_COMPUTE)
    if computed is None:
        return None
    again = counters.get(RETRACTED_PROMPT)
    if again is None:
        preemptions = counters.get("preemptions")
        if preemptions is None:
            return None
        if preemptions > 0:
            prompt = mean_tokens(view, "prompt_len", "prompt_tokens")
            if prompt is None:
                return None
            again = preemptions * prompt
        else:
            again = 0.0
    total = computed + again
    return again / total if total > 0 else None


def _first_bucket_at_one(histogram: Histogram) -> float | None:
    for bound, cumulative in zip(histogram.bounds, histogram.cumulative):
        if bound == 1.0:
            return cumulative
    return None


def preemption_repeat_share(view: View) -> float | None:
    """At least this share of the window's preemptions (of requests that
    finished in it) fell on requests preempted two or more times: each such
    request counts at least 2. Near 1: a few requests thrash; near 0: many
    requests were each preempted once (broad pressure)."""
    histogram = view.increase.histograms.get("preemptions_per_request")
    if histogram is None or histogram.sum <= 0:
        return None
    at_most_once = _first_bucket_at_one(histogram)
    if at_most_once is None:
        view.notes.append("vllm:request_num_preemptions has no le=1 bucket: the repeat share is not computed")
        return None
    return min(1.0, 2 * max(0.0, histogram.count - at_most_once) / histogram.sum)


def _quantile_of(view: View, key: str, q: float) -> float | None:
    histogram = view.increase.histograms.get(key)
    if histogram is None or histogram.count <= 0:
        return None
    quantile = histogram.quantile(q)
    return None if quantile is None else quantile.value


def reuse_shortfall_blocks(view: View) -> float | None:
    """Blocks the cache lacks to keep idle prefixes until their typical reuse.
    Evictable blocks count as free, so the free pool is where idle prefixes
    wait; by Little's law, at the same eviction rate a pool holds a block
    about (pool / eviction rate) seconds. Blocks now leave after the median
    idle time I while the median reuse gap is G: keeping them G seconds takes
    a pool G / I times larger, i.e. pool x (G / I - 1) more blocks. 0 when
    blocks outlive the reuse gap; absent without --kv-cache-metrics."""
    idle = _quantile_of(view, "kv_block_idle_before_evict", 0.5)
    gap = _quantile_of(view, "kv_block_reuse_gap", 0.5)
    if idle is None or gap is None or view.usable_blocks is None or view.usage_mean is None:
        return None
    if gap <= idle:
        return 0.0
    pool = view.usable_blocks * (1.0 - view.usage_mean)
    return float(math.ceil(pool * (gap / max(idle, 1e-3) - 1.0)))


def _reuse_shortfall_bytes(view: View) -> float | None:
    blocks = reuse_shortfall_blocks(view)
    if blocks is None or view.bytes_per_block is None:
        return None
    return float(round(blocks * view.bytes_per_block))


def _sleeping(view: View) -> float | None:
    awake = view.gauge("sleep_state/awake")
    return None if awake is None else (0.0 if awake >= 1 else 1.0)


def _offload_rates(view: View) -> dict[str, float] | None:
    if view.increase.seconds <= 0:
        return None
    counters = view.increase.counters
    found = {direction: counters[key] / view.increase.seconds for direction, key in _OFFLOAD_BYTES if key in counters}
    return found or None


_OFFLOAD_BYTES = tuple((direction, f"offload_{direction}_bytes") for direction in ("load", "store"))


# The tokens vLLM's KV connector delivered (for the OffloadingConnector, the
# offload tier's): prompt_tokens_by_source{external_kv_transfer}, vLLM 0.16+.
OFFLOAD_SERVED = "prompt_tokens_by_source/external_kv_transfer"
_LOOKUP_DELAYS = (("sync", "offload_lookup_sync_delay"), ("async", "offload_lookup_async_delay"))


def _offload_added_seconds(view: View) -> float | None:
    """Seconds the offload tier added in the window: its loads (the engine's
    load time counter) plus the time its lookups took, inside the scheduler's
    step (sync) and while a request waited on a deferred lookup (async),
    where the engine exports them."""
    load = view.increase.counters.get("offload_load_seconds")
    if load is None:
        return None
    histograms = view.increase.histograms
    return load + sum(histograms[key].sum for _kind, key in _LOOKUP_DELAYS if key in histograms)


# SGLang's HiCache host tier (L2): the tokens it served (prefill_effective_tokens
# {mode="host_hit"}), the time of its loads back to the GPU and the bytes it
# moved both ways. Its storage tier (L3) exports no seconds and no bytes.
HOST_SERVED = "prompt_tokens_cached_by_source/host"
STORAGE_SERVED = "prompt_tokens_cached_by_source/storage"
_HOST_BYTES = ("hicache_load_back_bytes", "hicache_backup_bytes")
STORAGE_UNWEIGHED = ("the storage tier (HiCache L3) served {tokens:.0f} tokens in the window but is not weighed: "
                     "SGLang exports no seconds and no bytes for it (sglang:prefetch_bandwidth and backup_bandwidth "
                     "are GB/s per batch, prefetch_pgs and backup_pgs pages)")


def _prefill_seconds_per_token(view: View) -> float | None:
    """The window's prefill seconds per computed prompt token: vLLM's
    request_prefill_time_seconds sum, else SGLang's extend forward passes'
    GPU seconds, over prompt_tokens_by_source{local_compute}."""
    computed = view.increase.counters.get(LOCAL_COMPUTE)
    if not computed:
        return None
    prefill = view.increase.histograms.get("prefill_time")
    if prefill is not None:
        return prefill.sum / computed if prefill.sum > 0 else None
    forward = view.increase.counters.get("prefill_forward_seconds")
    return forward / computed if forward else None


def cache_tier_cost(view: View) -> dict[str, float] | None:
    """Whether a cache tier pays for itself: the seconds it added over the
    prefill seconds the tokens it served would have cost to compute, at the
    window's prefill seconds per computed token (_prefill_seconds_per_token).
    Below 1 the tier saved more time than it cost. vLLM's offload tier: its
    loads and lookups; SGLang's host tier: its loads back to the GPU
    (load_back_duration_seconds). An estimate: with batching, vLLM's sides
    are request-seconds, not wall time. None without served tokens, computed
    tokens or prefill time to weigh."""
    per_token = _prefill_seconds_per_token(view)
    if per_token is None:
        return None
    counters = view.increase.counters
    found = {}
    served, added = counters.get(OFFLOAD_SERVED), _offload_added_seconds(view)
    if added is not None and served:
        found["offload"] = added / (served * per_token)
    load_back, served = view.increase.histograms.get("hicache_load_back_time"), counters.get(HOST_SERVED)
    if load_back is not None and served:
        found["host"] = load_back.sum / (served * per_token)
    return found or None


def cache_tier_bytes_per_token(view: View) -> dict[str, float] | None:
    """Bytes a tier moved (stored and loaded) per prompt token it served in
    the window: the KV bytes of a token when every stored token is served
    once, more when stores go unused. vLLM's offload tier; SGLang's host tier
    (backups to host memory and loads back)."""
    counters = view.increase.counters
    found = {}
    served = counters.get(OFFLOAD_SERVED)
    moved = [counters[key] for _direction, key in _OFFLOAD_BYTES if key in counters]
    if served and moved:
        found["offload"] = sum(moved) / served
    served = counters.get(HOST_SERVED)
    moved = [counters[key] for key in _HOST_BYTES if key in counters]
    if served and moved:
        found["host"] = sum(moved) / served
    return found or None


def _storage_unweighed(view: View, values: Mapping[str, object]) -> dict[str, str]:
    """The cache-tier signals lit for SGLang's host tier, where its storage
    tier served tokens it cannot be weighed on."""
    if "hicache_load_back_time" not in view.increase.histograms and not any(
            key in view.increase.counters for key in _HOST_BYTES):
        return {}
    tokens = view.increase.counters.get(STORAGE_SERVED)
    if not tokens:
        return {}
    text = STORAGE_UNWEIGHED.format(tokens=tokens)
    return {name: text for name in ("kvwatch_cache_tier_cost_ratio", "kvwatch_cache_tier_moved_bytes_per_token")
            if values.get(name) is not None}


def _offload_lookup_delay(view: View) -> dict[str, float] | None:
    means = {kind: _histogram_mean(view, key) for kind, key in _LOOKUP_DELAYS}
    found = {kind: value for kind, value in means.items() if value is not None}
    return found or None


_STORES_DROPPED = (("allocation_failure", "offload_allocation_failures"),
                   ("below_reuse_threshold", "offload_stores_skipped"))


def _offload_stores_dropped(view: View) -> dict[str, float] | None:
    if view.increase.seconds <= 0:
        return None
    counters = view.increase.counters
    found = {reason: counters[key] / view.increase.seconds for reason, key in _STORES_DROPPED if key in counters}
    return found or None


_LMCACHE_LOOKUP_TIERS = (("l1", "lookup_hit_l1_tokens"), ("l2", "lookup_hit_l2_tokens"))


def lmcache_lookup_by_tier(view: View) -> dict[str, float] | None:
    """LMCache's multiprocess server: the share of the window's looked-up
    tokens each of its tiers held (l1: CPU memory already had them; l2:
    storage added them, to be loaded into L1 first) and the share neither
    held (not_found), token-weighted from the lookup counters; the shares sum
    to 1. None with no lookup in the window or without the L1/L2 split."""
    counters = view.increase.counters
    requested = counters.get("lookup_requested_tokens")
    tiers = {tier: counters[key] for tier, key in _LMCACHE_LOOKUP_TIERS if key in counters}
    if not requested or len(tiers) < len(_LMCACHE_LOOKUP_TIERS):
        return None
    shares = {tier: value / requested for tier, value in tiers.items()}
    # The hit counter where it is read (l1 + l2 = hit), so a page's own total decides what was not found.
    found = counters.get("lookup_hit_tokens", sum(tiers.values()))
    shares["not_found"] = max(0.0, requested - found) / requested
    return shares


def _kv_fetch_by_stage(view: View) -> dict[str, float] | None:
    found = {key.split("/", 1)[1]: value for key, value in view.latest.gauges.items()
             if key.startswith("kv_fetch_by_stage/")}
    return found or None


def _sel(metric: str) -> str:
    # The result is spliced into a template that is .format()ted later, so the
    # selector's braces must stay escaped: `metric{{{sel}}}` -> `metric{<sel>}`.
    return metric + "{{{sel}}}"


def _ratio_of_rates(numerator: str, denominator: str) -> str:
    return (
        f"sum by ({{by}}) (rate({_sel(numerator)}[{{w}}]))\n/\n"
        f"sum by ({{by}}) (rate({_sel(denominator)}[{{w}}]))"
    )


def _quantile_promql(histogram: str) -> str:
    return f"histogram_quantile({{q}}, sum by ({{by}}, le) (rate({_sel(histogram + '_bucket')}[{{w}}])))"


def _mean_promql(histogram: str) -> str:
    return _ratio_of_rates(histogram + "_sum", histogram + "_count")
