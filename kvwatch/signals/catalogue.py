"""The catalogue: every signal kvwatch derives, declared once.

Each entry names the exported metric, its unit, a help text naming its vLLM
sources, how it is derived in-process from a window, its PromQL twin over the
series kvwatch re-exports (for recording rules and dashboards), and the
dashboard group it belongs to. The exporter, the JSON API, the rules, the
dashboards and the README's metrics table are all generated from this file.

Two kinds of entries:
- ENGINE_SERIES: vLLM's own series, re-exported under one stable name per
  concept whatever the vLLM version spelled (`kvwatch_engine_*`). Counters and
  histograms pass through unchanged (resets included; Prometheus' rate()
  handles them), so recording rules can aggregate them correctly across many
  sidecars: ratios of summed rates, `sum by (le)` before quantiles.
- SIGNALS: windowed values computed in-process (`kvwatch_*` per model and
  engine, `kvwatch_model_*` per model), for the status page, the CLI, the
  diagnosis, and for anyone without recording rules.

PromQL templates use `{sel}` for the label selector (without braces), `{w}`
for the range and `{by}` for the aggregation labels.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable

from kvwatch import units
from kvwatch.signals.series import ENGINE_SERIES, IDENTITY, INFO_KEYS, TIER_SERIES
from kvwatch.snapshot import EngineSnapshot, Histogram
from kvwatch.window import Increase

QUANTILES = (0.5, 0.95, 0.99)

# The span the exhaustion trend is fitted over: long enough to smooth single
# requests, short enough to follow a ramp. One declaration: the PromQL twin's
# deriv() and avg_over_time() range, and the sidecar's fit in seconds.
TREND_RANGE = "5m"
TREND_SECONDS = units.parse_duration(TREND_RANGE)

# A catalogue unit -> how each surface shows it: Grafana's unit, and the word
# a person reads beside a bare number on the status page and in the CLI ("" where
# the formatted value already says it: 12.5%, 340 ms, 3.1/s).
@dataclass(frozen=True)
class Unit:
    grafana: str
    label: str


UNITS: dict[str, Unit] = {
    "ratio": Unit("percentunit", ""),
    "seconds": Unit("s", ""),
    "tokens": Unit("short", "tokens"),
    "requests": Unit("short", "requests"),
    "per_second": Unit("ops", ""),
    "bytes": Unit("bytes", "bytes"),
    "blocks": Unit("short", "blocks"),
    "state": Unit("short", ""),
    "preemptions": Unit("short", "preemptions"),
    "failures": Unit("short", "failures"),
    "notifications": Unit("short", "notifications"),
    "transfers": Unit("short", "transfers"),
    "descriptors": Unit("short", "descriptors"),
}


# Which side of a threshold a person wants a value on: "high" (hit ratio,
# headroom, up), "low" (usage, latency, errors, findings) or None (neither:
# throughput, running requests). Declared once per entry below; the
# dashboards colour every threshold and value mapping from it, so a panel
# cannot turn red on the good side.
GOOD_DIRECTIONS = ("high", "low", None)


# --------------------------------------------------------------------------
# kvwatch's own families: the poll's health, identity, configuration, findings
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class HealthFamily:
    """One of kvwatch's own families: the poll's health, its identity, the
    engine's configuration and the active findings."""

    name: str  # as the client library names it (a counter without _total)
    kind: str  # gauge | counter | untyped
    labels: tuple[str, ...]
    help: str
    good: str | None = None  # GOOD_DIRECTIONS

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_up", "gauge", (), "1 if the latest poll of the engine's /metrics succeeded, else 0.", good="high"),
    HealthFamily("kvwatch_stats_disabled", "gauge", (),
                 "1 while the engine answers its /metrics without engine series (vLLM with --disable-log-stats, "
                 "or another program at the target): not unreachable, but blind; else 0.", good="low"),
    HealthFamily("kvwatch_build_info", "gauge", ("version",), "kvwatch's version; always 1."),
    HealthFamily("kvwatch_polls", "counter", (), "Polls of the engine's /metrics."),
    HealthFamily("kvwatch_poll_errors", "counter", ("reason",),
                 "Failed polls by reason (refused, dns, timeout, tls, http_3xx/4xx/5xx, content_type, too_large, "
                 "truncated, decode, no_engine_metrics, ...).", good="low"),
    HealthFamily("kvwatch_parse_errors", "counter", (),
                 "Malformed lines in the engine's pages (skipped; the rest of the page counts).", good="low"),
    HealthFamily("kvwatch_dropped_series", "counter", (), "(model, engine) pairs dropped by the max_series cap.", good="low"),
    HealthFamily("kvwatch_poll_duration_seconds", "gauge", (), "Wall time of the latest poll.", good="low"),
    HealthFamily("kvwatch_page_late_seconds", "gauge", (),
                 "How long the engine took to answer the latest page kvwatch read (a busy vLLM answers /metrics "
                 "seconds late under load; the page is kept and stamped at the time it was answered); after a poll "
                 "that timed out while the engine was busy (kvwatch_busy), the deadline waited.", good="low"),
    HealthFamily("kvwatch_busy", "gauge", (),
                 "1 while the engine is busy, not down: its /metrics answered at least busy_late_seconds late, or "
                 "not within the deadline shortly after a page (busy_timeout_seconds), while requests ran or waited; "
                 "kvwatch_page_late_seconds says how late (for a timeout, the deadline waited: at least). 0 "
                 "otherwise; KvwatchEngineUnreachable leaves a busy engine out.", good="low"),
    HealthFamily("kvwatch_poll_cpu_seconds", "gauge", (),
                 "CPU time of the latest poll (fetch, parse, signals, diagnosis).", good="low"),
    HealthFamily("kvwatch_last_success_timestamp_seconds", "gauge", (), "Unix time of the latest successful poll."),
    HealthFamily("kvwatch_window_seconds", "gauge", (), "Span the windowed signals cover now."),
    HealthFamily("kvwatch_engine_info", "gauge", IDENTITY + INFO_KEYS,
                 "The engine's KV-cache configuration (from vllm:cache_config_info); changes() on it marks a "
                 "configuration change."),
    HealthFamily("kvwatch_source_present", "gauge", ("family",),
                 "1 if the engine's latest page carried this family (vLLM's newest name for it), 0 if not: unknown "
                 "is not zero, so a signal whose families are 0 here is absent, never 0 (/api/v1/signals "
                 "dark_signals names the flag that lights a config-gated one)."),
    HealthFamily("kvwatch_finding", "gauge", ("symptom", "cause", "severity") + IDENTITY,
                 "1 for each active diagnosis finding (absent when not active); a finding stays active until its "
                 "condition has been clear for the hold (diagnosis: finding_hold_seconds); see "
                 "/api/v1/diagnosis for its evidence and clearing_since. One cause per symptom per engine: the "
                 "primary (other causes found at once are kvwatch_finding_contributor).", good="low"),
    HealthFamily("kvwatch_finding_contributor", "gauge", ("symptom", "cause", "contributor") + IDENTITY,
                 "1 for each contributing factor of an active finding: another cause of the same symptom on the "
                 "same engine that the diagnosis also found, weaker than the primary `cause` (absent when none).",
                 good="low"),
    HealthFamily("kvwatch_finding_alternative", "gauge", ("symptom", "cause", "alternative", "decided_by") + IDENTITY,
                 "1 for each cause an active finding cannot be told apart from, once per source that would decide "
                 "(`decided_by`: kv_cache_metrics, kv_events, request_lengths); absent when the finding is decided.",
                 good=None),
    # Untyped: Prometheus' lint refuses a `quantile` label on a gauge, and the
    # label names the quantile it marks (Prometheus stores it as a gauge).
    HealthFamily("kvwatch_source_fault", "gauge", ("family", "fault") + IDENTITY,
                 "1 for each value of the engine's latest page (or ratio of the window) that cannot be true: "
                 "fault=below_zero, above_one (a share above 1), not_finite (NaN, infinity), part_above_whole (hits "
                 "that rose more than their lookups). A fault of the engine's metrics: the value is not clamped, it "
                 "is left out, so its signals are absent; /api/v1/signals source_faults has the value read.",
                 good="low"),
    HealthFamily("kvwatch_source_faults", "counter", ("fault",),
                 "Values that cannot be true read since kvwatch started, by fault (one per value per poll; "
                 "`undescribed` counts those beyond the hundred a page's faults describe).", good="low"),
    HealthFamily("kvwatch_quantile_pinned", "untyped", ("signal", "quantile", "bound") + IDENTITY,
                 "1 for each windowed quantile pinned at a bucket edge, where its value is a bound and not an "
                 "estimate: bound=\"upper\" (pinned in the first bucket; the value is that bucket's bound and the "
                 "quantile is at most it), bound=\"lower\" (pinned at the last finite bucket; the quantile is at "
                 "least it). `signal` is the exported family (kvwatch_model_* with engine=\"\" per model); absent "
                 "when no quantile is pinned.", good=None),
)
HEALTH_BY_NAME = {family.name: family for family in HEALTH}

# Prometheus' own series about kvwatch's targets, which the dashboards and
# alerts read beside kvwatch's (not exported by kvwatch).
SCRAPE: tuple[HealthFamily, ...] = (
    HealthFamily("up", "gauge", (), "1 while Prometheus scraped the target (kvwatch) successfully, else 0.",
                 good="high"),
)


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
    # Canonical snapshot keys the signal cannot do without: where one was not
    # on the page the signal is absent, and /api/v1/signals says so (and
    # names the flag, for a config-gated family).
    needs: tuple[str, ...] = ()
    # What a person reads: the status page and `kvwatch diagnose` label the
    # signal with this (the unit is shown beside it, from `unit`).
    display: str = ""
    # GOOD_DIRECTIONS: the side of a threshold a person wants it on.
    good: str | None = None


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
    """The shares of the one decomposition (see TtftDecomposition)."""
    parts = ttft_decomposition(view)
    if parts is None:
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


SIGNALS: tuple[Signal, ...] = (
    # --- cache exhaustion ---
    Signal("kvwatch_kv_cache_usage_ratio", "ratio",
           "KV-cache usage now, 0..1 (vllm:kv_cache_usage_perc / vllm:gpu_cache_usage_perc); a reading outside 0..1 is "
           "a fault of the source, absent here and named by kvwatch_source_fault, never clamped.",
           _usage, "exhaustion", "max by ({by}) (kvwatch_engine_kv_cache_usage_ratio{{{sel}}})",
           display="KV cache usage", record=("kvwatch_kv_cache_usage_ratio", "max"), good="low"),
    Signal("kvwatch_kv_cache_usage_max_ratio", "ratio",
           "Highest KV-cache usage seen in the window (vllm:kv_cache_usage_perc).",
           lambda v: _clamp01(v.usage_max), "exhaustion",
           "max by ({by}) (max_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}]))",
           display="KV cache usage, window peak", record=("kvwatch_kv_cache_usage_ratio", "max_over_time{w}"), good="low"),
    Signal("kvwatch_kv_cache_capacity_tokens", "tokens",
           "KV-cache capacity in tokens (vllm:cache_config_info).",
           lambda v: v.capacity_tokens, "exhaustion",
           "sum by ({by}) (kvwatch_engine_kv_cache_capacity_tokens{{{sel}}})",
           display="KV cache capacity", record=("kvwatch_kv_cache_capacity_tokens", "sum"), good="high"),
    Signal("kvwatch_kv_cache_free_tokens", "tokens",
           "KV-cache headroom in tokens: capacity x (1 - usage), rounded down to a whole token "
           "(vllm:cache_config_info, vllm:kv_cache_usage_perc).",
           _free_tokens, "exhaustion",
           "sum by ({by}) (floor(kvwatch_engine_kv_cache_capacity_tokens{{{sel}}} * (1 - kvwatch_engine_kv_cache_usage_ratio{{{sel}}})))",
           display="KV cache headroom", record=("kvwatch_kv_cache_free_tokens", "sum"), good="high"),
    Signal("kvwatch_kv_cache_used_bytes", "bytes",
           "KV-cache bytes held now: usage x the cache's bytes, rounded to a whole byte "
           "(vllm:kv_cache_usage_perc, vllm:cache_config_info kv_cache_memory_bytes, a number from vLLM 0.24 or given "
           "--kv-cache-memory-bytes (0.20.2 states it then); absent where it is \"None\", as on 0.10.2).",
           _used_bytes, "exhaustion",
           "sum by ({by}) (clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * kvwatch_engine_kv_cache_memory_bytes{{{sel}}})",
           panel="overview", title="KV bytes in use",
           display="KV cache in use", record=("kvwatch_kv_cache_used_bytes", "sum"), good="low"),
    Signal("kvwatch_kv_cache_capacity_requests", "requests",
           "Concurrent requests the KV capacity holds at the window's mean prompt+generation length, block-rounded and rounded down to a whole request; a bound, not a promise "
           "(vllm:cache_config_info, vllm:request_prompt_tokens, vllm:request_generation_tokens).",
           _capacity_requests, "exhaustion",
           "floor(\nsum by ({by}) (kvwatch_engine_kv_cache_capacity_tokens{{{sel}}})\n/ on ({by}) (\n"
           + _mean_promql("kvwatch_engine_request_prompt_tokens") + "\n+ on ({by})\n"
           + _mean_promql("kvwatch_engine_request_generation_tokens") + "\n)\n)",
           display="Requests the cache holds", record=("kvwatch_kv_cache_capacity_requests", "ratio_rate{w}"), good="high"),
    Signal("kvwatch_preemptions_per_second", "per_second",
           "Preemptions per second over the window (vllm:num_preemptions_total).",
           _rate("preemptions"), "exhaustion",
           "sum by ({by}) (rate(kvwatch_engine_preemptions_total{{{sel}}}[{w}]))",
           display="Preemptions", record=("kvwatch_preemptions", "rate{w}"), good="low"),
    Signal("kvwatch_requests_running", "requests",
           "Requests running now (vllm:num_requests_running).",
           lambda v: v.gauge("running"), "exhaustion",
           "sum by ({by}) (kvwatch_engine_requests_running{{{sel}}})",
           display="Running", record=("kvwatch_requests_running", "sum")),
    Signal("kvwatch_requests_running_max", "requests",
           "Most requests running at once in the window: the concurrency actually reached (vllm:num_requests_running).",
           lambda v: v.running_max, "exhaustion",
           "sum by ({by}) (max_over_time(kvwatch_engine_requests_running{{{sel}}}[{w}]))",
           display="Running, window peak", record=("kvwatch_requests_running", "max_over_time{w}")),
    Signal("kvwatch_requests_waiting", "requests",
           "Requests waiting now (vllm:num_requests_waiting).",
           lambda v: v.gauge("waiting"), "exhaustion",
           "sum by ({by}) (kvwatch_engine_requests_waiting{{{sel}}})",
           display="Waiting", record=("kvwatch_requests_waiting", "sum"), good="low"),
    Signal("kvwatch_requests_waiting_by_reason", "requests",
           "Requests waiting now by reason: capacity (no KV blocks) or deferred (vllm:num_requests_waiting_by_reason, vLLM 0.20+).",
           _waiting_by_reason, "exhaustion",
           "sum by ({by}, reason) (kvwatch_engine_requests_waiting_by_reason{{{sel}}})", label="reason",
           record=("kvwatch_requests_waiting", "sum"), needs=("waiting_by_reason",), display="Waiting by reason",
           good="low"),
    # --- KV blocks, occupancy and trend ---
    Signal("kvwatch_kv_cache_used_blocks", "blocks",
           "KV blocks held now, whole: usage x (num_gpu_blocks - 1), since vLLM keeps one null block aside "
           "(vllm:kv_cache_usage_perc, vllm:cache_config_info; absent on hybrid models, whose blocks differ by group).",
           _used_blocks, "exhaustion",
           "sum by ({by}) (round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)))",
           record=("kvwatch_kv_cache_used_blocks", "sum"), display="KV blocks in use", good="low"),
    Signal("kvwatch_kv_cache_free_blocks", "blocks",
           "KV blocks free now, whole (evictable prefix-cache blocks count as free): the capacity ceiling left, "
           "(num_gpu_blocks - 1) - used (vllm:kv_cache_usage_perc, vllm:cache_config_info).",
           _free_blocks, "exhaustion",
           "sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) - round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)))",
           panel="exhaustion", title="Free KV blocks (the ceiling left)",
           record=("kvwatch_kv_cache_free_blocks", "sum"), display="KV blocks free", good="high"),
    Signal("kvwatch_kv_cache_requests_fit_now", "requests",
           "Requests of the running ones' current mean footprint the cache holds, rounded down: usable blocks x "
           "running / used blocks. It falls as decodes grow, before the cache is full; "
           "kvwatch_kv_cache_capacity_requests reads finished requests' lengths instead "
           "(vllm:kv_cache_usage_perc, vllm:num_requests_running, vllm:cache_config_info; absent with nothing "
           "running and on hybrid models).",
           requests_fit_now, "exhaustion",
           "floor(\nsum by ({by}) (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)\n* sum by ({by}) (kvwatch_engine_requests_running{{{sel}}})\n"
           "/ (sum by ({by}) (round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1))) > 0)\n)",
           record=("kvwatch_kv_cache_requests_fit_now", "ratio"), display="Requests that fit at current lengths",
           good="high"),
    Signal("kvwatch_kv_cache_token_usage_estimate_ratio", "ratio",
           "Estimated share of the cache's token slots holding tokens: usage counts whole blocks and each running "
           "request's last block is on average half filled, so this is (used blocks x block_size - running x "
           "(block_size - 1) / 2) / (usable blocks x block_size); '95 % full' in blocks is fewer tokens "
           "(vllm:kv_cache_usage_perc, vllm:num_requests_running, vllm:cache_config_info).",
           token_usage_estimate, "exhaustion",
           "sum by ({by}) (clamp_min(round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)) * kvwatch_engine_kv_cache_block_size_tokens{{{sel}}} - kvwatch_engine_requests_running{{{sel}}} * (kvwatch_engine_kv_cache_block_size_tokens{{{sel}}} - 1) / 2, 0))\n/\n"
           "sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) * kvwatch_engine_kv_cache_block_size_tokens{{{sel}}})",
           record=("kvwatch_kv_cache_token_usage_estimate", "ratio"), display="KV token slots filled (estimate)", good="low"),
    Signal("kvwatch_kv_cache_exhaustion_eta_seconds", "seconds",
           "Seconds until KV usage reaches 1 at its least-squares trend over the last 5 minutes (PromQL deriv()), the "
           "soonest engine; absent unless usage rises and is now at least its 5-minute mean (vllm:kv_cache_usage_perc).",
           _exhaustion_eta, "exhaustion",
           "min by ({by}) (\n  (1 - clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1))\n  / (deriv(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[" + TREND_RANGE + "]) > 0)\n"
           "  and kvwatch_engine_kv_cache_usage_ratio{{{sel}}} >= avg_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[" + TREND_RANGE + "])\n)",
           panel="exhaustion", title="Time until the KV cache is full at this trend",
           record=("kvwatch_kv_cache_exhaustion_eta_seconds", "deriv" + TREND_RANGE), display="Time until KV cache full", good="high"),
    Signal("kvwatch_preemptions_on_repeat_requests_ratio", "ratio",
           "At least this share of the preemptions of requests finished in the window fell on requests preempted "
           "two or more times: near 1 a few requests thrash, near 0 many were each preempted once (broad pressure) "
           "(vllm:request_num_preemptions, vLLM 0.30+).",
           preemption_repeat_share, "exhaustion",
           "clamp_max(2 * clamp_min(sum by ({by}) (rate(kvwatch_engine_request_num_preemptions_count{{{sel}}}[{w}])) "
           "- sum by ({by}) (rate(kvwatch_engine_request_num_preemptions_bucket{{{sel},le=\"1.0\"}}[{w}])), 0)\n/\n"
           "(sum by ({by}) (rate(kvwatch_engine_request_num_preemptions_sum{{{sel}}}[{w}])) > 0), 1)",
           record=("kvwatch_preemptions_on_repeat_requests", "ratio_rate{w}"), needs=("preemptions_per_request",), display="Preemptions on repeat requests", good="low"),
    Signal("kvwatch_admission_rejections_per_second", "per_second",
           "Requests rejected at a queue limit per second, by reason: a cause apart from the KV cache, the queue "
           "was full (vllm:admission_rejections_total, vLLM 0.32+).",
           _labelled_rates("admission_rejections"), "exhaustion",
           "sum by ({by}, reason) (rate(kvwatch_engine_admission_rejections_total{{{sel}}}[{w}]))", label="reason",
           record=("kvwatch_admission_rejections", "rate{w}"), needs=("admission_rejections",), display="Admission rejections", good="low"),
    Signal("kvwatch_engine_sleeping", "state",
           "1 while the engine sleeps (sleep level 1 or 2), 0 while awake: a sleeping engine is not a down one "
           "(vllm:engine_sleep_state, vLLM 0.11.1+).",
           _sleeping, "exhaustion",
           "max by ({by}) (1 - kvwatch_engine_sleep_state{{{sel},sleep_state=\"awake\"}})",
           record=("kvwatch_engine_sleeping", "max"), needs=("sleep_state",), display="Engine sleeping"),
    # --- prefix cache ---
    Signal("kvwatch_prefix_cache_hit_ratio", "ratio",
           "Lookup hit ratio: prefix-cache hits over queries in the window, from token counters, not lifetime totals; "
           "re-lookups after preemption and scheduling retries count again, so it is not the share of prompt tokens "
           "served from a cache (kvwatch_prompt_tokens_from_cache_ratio) "
           "(vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, formerly gpu_prefix_cache_*; V0: vllm:gpu_prefix_cache_hit_rate).",
           _prefix_hit_ratio, "prefix",
           _ratio_of_rates("kvwatch_engine_prefix_cache_hits_total", "kvwatch_engine_prefix_cache_queries_total"),
           display="Prefix cache hit ratio", record=("kvwatch_prefix_cache_hit", "ratio_rate{w}"), good="high"),
    Signal("kvwatch_external_prefix_cache_hit_ratio", "ratio",
           "External (KV connector) prefix-cache hits over queries in the window (vllm:external_prefix_cache_{hits,queries}_total).",
           lambda v: v.increase.ratio("external_prefix_hits", "external_prefix_queries"), "prefix",
           _ratio_of_rates("kvwatch_engine_external_prefix_cache_hits_total", "kvwatch_engine_external_prefix_cache_queries_total"),
           display="External prefix cache hit ratio", record=("kvwatch_external_prefix_cache_hit", "ratio_rate{w}"),
           needs=("external_prefix_queries",), good="high"),
    Signal("kvwatch_prompt_tokens_cached_ratio", "ratio",
           "Share of prompt tokens served from a cache in the window (vllm:prompt_tokens_cached_total / vllm:prompt_tokens_total; "
           "before 0.16 prefix hits / prompt tokens).",
           _cached_share, "prefix",
           _ratio_of_rates("kvwatch_engine_prompt_tokens_cached_total", "kvwatch_engine_prompt_tokens_total"),
           record=("kvwatch_prompt_tokens_cached", "ratio_rate{w}"), display="Prompt tokens served from a cache, all tiers", good="high"),
    Signal("kvwatch_prompt_tokens_from_cache_ratio", "ratio",
           "Share of prompt tokens served from a cache, by tier: local (this engine's prefix cache) and external "
           "(a KV connector); the rest was computed. Not the lookup hit ratio, which re-lookups inflate "
           "(vllm:prompt_tokens_by_source_total, vLLM 0.16+).",
           _from_cache, "prefix",
           "(\n  label_replace(sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_cache_hit\"}}[{w}])), \"tier\", \"local\", \"\", \"\")\n"
           "  or\n  label_replace(sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"external_kv_transfer\"}}[{w}])), \"tier\", \"external\", \"\", \"\")\n)\n"
           "/ ignoring (tier) group_left\nsum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel}}}[{w}]))",
           label="tier", panel="prefix_cache", title="Prompt tokens served from a cache, by tier",
           record=("kvwatch_prompt_tokens_from_cache", "ratio_rate{w}"), needs=("prompt_tokens_by_source",), display="Prompt tokens served from a cache, by tier", good="high"),
    Signal("kvwatch_prompt_tokens_by_tier_ratio", "ratio",
           "Share of the window's prompt tokens each cache tier served, and the share computed (tier=\"computed\"), "
           "token-weighted: a tier's cached tokens over every tier's plus the computed ones; the shares sum to 1. "
           "Tiers as the engine names them: vLLM device, host, disk, p2p, external_unspecified "
           "(vllm:prompt_tokens_cached_by_source_total and prompt_tokens_by_source_total{source=\"local_compute\"}, "
           "vLLM 0.32+); SGLang device, host, storage (sglang:prefill_effective_tokens_total{mode}, input = computed).",
           prompt_tokens_by_tier, "prefix",
           "sum by ({by}, tier) (\n"
           "  label_replace(rate(kvwatch_engine_prompt_tokens_cached_by_source_total{{{sel}}}[{w}]), \"tier\", \"$1\", \"source\", \"(.*)\")\n"
           "  or\n"
           "  label_replace(rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_compute\"}}[{w}]), \"tier\", \"computed\", \"\", \"\")\n"
           ")\n/ ignoring (tier) group_left\n"
           "sum by ({by}) (\n"
           "  rate(kvwatch_engine_prompt_tokens_cached_by_source_total{{{sel}}}[{w}])\n"
           "  or\n"
           "  rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_compute\"}}[{w}])\n"
           ")",
           label="tier", panel="prefix_cache", title="Prompt tokens by the cache tier that served them, and computed",
           record=("kvwatch_prompt_tokens_by_tier", "ratio_rate{w}"),
           needs=("prompt_tokens_cached_by_source", "prompt_tokens_by_source"),
           display="Prompt tokens by cache tier", good=None),
    Signal("kvwatch_kv_cache_reuse_shortfall_blocks", "blocks",
           "KV blocks the cache lacks to keep idle prefixes until their typical reuse: free pool x (median reuse "
           "gap / median idle time before eviction - 1), 0 when blocks outlive the reuse gap "
           "(vllm:kv_block_reuse_gap_seconds, vllm:kv_block_idle_before_evict_seconds: --kv-cache-metrics).",
           reuse_shortfall_blocks, "prefix",
           "ceil(sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) * (1 - avg_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}])))\n* clamp_min(\n"
           "  histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_reuse_gap_seconds_bucket{{{sel}}}[{w}])))\n"
           "  / clamp_min(histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_idle_before_evict_seconds_bucket{{{sel}}}[{w}]))), 0.001)\n  - 1, 0))",
           record=("kvwatch_kv_cache_reuse_shortfall_blocks", "ratio_rate{w}"),
           needs=("kv_block_reuse_gap", "kv_block_idle_before_evict"), display="KV blocks short of keeping reuse", good="low"),
    Signal("kvwatch_kv_cache_reuse_shortfall_bytes", "bytes",
           "The reuse shortfall in bytes: blocks x kv_cache_memory_bytes / num_gpu_blocks (--kv-cache-metrics, "
           "bytes as for kvwatch_kv_cache_used_bytes).",
           _reuse_shortfall_bytes, "prefix",
           "ceil(sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) * (1 - avg_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}])) * kvwatch_engine_kv_cache_memory_bytes{{{sel}}} / kvwatch_engine_kv_cache_blocks{{{sel}}})\n* clamp_min(\n"
           "  histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_reuse_gap_seconds_bucket{{{sel}}}[{w}])))\n"
           "  / clamp_min(histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_idle_before_evict_seconds_bucket{{{sel}}}[{w}]))), 0.001)\n  - 1, 0))",
           record=("kvwatch_kv_cache_reuse_shortfall_bytes", "ratio_rate{w}"),
           needs=("kv_block_reuse_gap", "kv_block_idle_before_evict"), display="KV bytes short of keeping reuse", good="low"),
    Signal("kvwatch_kv_offload_bytes_per_second", "per_second",
           "Bytes per second moved to (store) and from (load) the KV offload tier (vllm:kv_offload_{load,store}_bytes_total, "
           "else the deprecated vllm:kv_offload_total_bytes_total{transfer_type}, never both; OffloadingConnector only).",
           _offload_rates, "prefix",
           "(\n  label_replace(sum by ({by}) (rate(kvwatch_engine_kv_offload_load_bytes_total{{{sel}}}[{w}])), \"direction\", \"load\", \"\", \"\")\n"
           "  or\n  label_replace(sum by ({by}) (rate(kvwatch_engine_kv_offload_store_bytes_total{{{sel}}}[{w}])), \"direction\", \"store\", \"\", \"\")\n)",
           label="direction", record=("kvwatch_kv_offload_bytes", "rate{w}"),
           needs=("offload_load_bytes", "offload_store_bytes"), display="KV offload transfer rate"),
    # --- first token ---
    Signal("kvwatch_time_to_first_token_seconds", "seconds",
           "Time to first token quantiles over the window, from bucket increases with the scraped bounds (vllm:time_to_first_token_seconds).",
           _quantiles("ttft", "TTFT"), "first_token",
           _quantile_promql("kvwatch_engine_time_to_first_token_seconds"), label="quantile",
           display="Time to first token", record=("kvwatch_time_to_first_token_seconds", "histogram_quantile_rate{w}"), good="low"),
    Signal("kvwatch_time_to_first_token_mean_seconds", "seconds",
           "Mean time to first token over the window (vllm:time_to_first_token_seconds _sum/_count).",
           _mean("ttft"), "first_token", _mean_promql("kvwatch_engine_time_to_first_token_seconds"),
           display="Time to first token, mean", record=("kvwatch_time_to_first_token_seconds", "mean_rate{w}"), good="low"),
    Signal("kvwatch_queue_time_seconds", "seconds",
           "Queue (WAITING) time quantiles over the window (vllm:request_queue_time_seconds).",
           _quantiles("queue_time", "queue time"), "first_token",
           _quantile_promql("kvwatch_engine_request_queue_time_seconds"), label="quantile",
           display="Queue time", record=("kvwatch_queue_time_seconds", "histogram_quantile_rate{w}"), good="low"),
    Signal("kvwatch_queue_time_mean_seconds", "seconds",
           "Mean queue time over the window (vllm:request_queue_time_seconds _sum/_count).",
           _mean("queue_time"), "first_token", _mean_promql("kvwatch_engine_request_queue_time_seconds"),
           display="Queue time, mean", record=("kvwatch_queue_time_seconds", "mean_rate{w}"), good="low"),
    Signal("kvwatch_prefill_time_seconds", "seconds",
           "Prefill time quantiles over the window (vllm:request_prefill_time_seconds).",
           _quantiles("prefill_time", "prefill time"), "first_token",
           _quantile_promql("kvwatch_engine_request_prefill_time_seconds"), label="quantile",
           display="Prefill time", record=("kvwatch_prefill_time_seconds", "histogram_quantile_rate{w}"), good="low"),
    Signal("kvwatch_prefill_time_mean_seconds", "seconds",
           "Mean prefill time over the window (vllm:request_prefill_time_seconds _sum/_count).",
           _mean("prefill_time"), "first_token", _mean_promql("kvwatch_engine_request_prefill_time_seconds"),
           display="Prefill time, mean", record=("kvwatch_prefill_time_seconds", "mean_rate{w}"), good="low"),
    Signal("kvwatch_time_to_first_token_share_ratio", "ratio",
           "Share of mean TTFT spent in queue, in prefill, and elsewhere (front end, tokenization, scheduling); the PromQL twin is the queue part "
           "(vllm:time_to_first_token_seconds, vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds).",
           ttft_parts, "first_token",
           _mean_promql("kvwatch_engine_request_queue_time_seconds") + "\n/ on ({by})\n"
           + _mean_promql("kvwatch_engine_time_to_first_token_seconds"), label="part",
           display="Time to first token split", record=("kvwatch_time_to_first_token_share", "ratio_rate{w}"), good="low"),
    # --- throughput and failures ---
    Signal("kvwatch_requests_finished_per_second", "per_second",
           "Finished requests per second by reason (vllm:request_success_total).",
           _labelled_rates("finished"), "throughput",
           "sum by ({by}, finished_reason) (rate(kvwatch_engine_requests_finished_total{{{sel}}}[{w}]))",
           label="finished_reason",
           display="Finished requests", record=("kvwatch_requests_finished", "rate{w}")),
    Signal("kvwatch_requests_failed_per_second", "per_second",
           "Requests ending in abort or error per second (vllm:request_success_total{finished_reason=~\"abort|error\"}).",
           _failed_rate, "throughput",
           "sum by ({by}) (rate(kvwatch_engine_requests_finished_total{{{sel},finished_reason=~\"abort|error\"}}[{w}]))",
           display="Failed requests", record=("kvwatch_requests_failed", "rate{w}"), good="low"),
    Signal("kvwatch_prompt_tokens_per_second", "per_second",
           "Prompt tokens per second, cached included (vllm:prompt_tokens_total).",
           _rate("prompt_tokens"), "throughput",
           "sum by ({by}) (rate(kvwatch_engine_prompt_tokens_total{{{sel}}}[{w}]))",
           display="Prompt tokens", record=("kvwatch_prompt_tokens", "rate{w}")),
    Signal("kvwatch_generation_tokens_per_second", "per_second",
           "Generated tokens per second (vllm:generation_tokens_total).",
           _rate("generation_tokens"), "throughput",
           "sum by ({by}) (rate(kvwatch_engine_generation_tokens_total{{{sel}}}[{w}]))",
           display="Generated tokens", record=("kvwatch_generation_tokens", "rate{w}")),
    Signal("kvwatch_prompt_tokens_per_request_mean", "tokens",
           "Mean prompt tokens per finished request in the window (vllm:request_prompt_tokens).",
           lambda v: mean_tokens(v, "prompt_len", "prompt_tokens"), "throughput",
           _mean_promql("kvwatch_engine_request_prompt_tokens"),
           display="Prompt length, mean", record=("kvwatch_prompt_tokens_per_request", "mean_rate{w}")),
    Signal("kvwatch_generation_tokens_per_request_mean", "tokens",
           "Mean generated tokens per finished request in the window (vllm:request_generation_tokens).",
           lambda v: mean_tokens(v, "generation_len", "generation_tokens"), "throughput",
           _mean_promql("kvwatch_engine_request_generation_tokens"),
           display="Generated length, mean", record=("kvwatch_generation_tokens_per_request", "mean_rate{w}")),
)

SIGNALS_BY_NAME = {signal.name: signal for signal in SIGNALS}


def good_direction(name: str) -> str | None:
    """The declared good side ("high", "low" or None) of a catalogue entry:
    a signal, a re-exported engine series or a health family, by its
    exported name (a counter with or without `_total`)."""
    if name in SIGNALS_BY_NAME:
        return SIGNALS_BY_NAME[name].good
    if name in TIER_SIGNALS_BY_NAME:
        return TIER_SIGNALS_BY_NAME[name].good
    for stream in STREAM_SIGNALS + STREAM_SIZING:
        if name == stream.name:
            return stream.good
    for entry in ENGINE_SERIES + HEALTH + SCRAPE + TIER_HEALTH + TIER_SERIES + CENTRAL_HEALTH + STREAM_HEALTH:
        if name in (entry.name, entry.sample_name):
            return entry.good
    raise KeyError(f"{name} is not in the catalogue")


# --------------------------------------------------------------------------
# LMCache's health and signals (its series: kvwatch.signals.series)
# --------------------------------------------------------------------------

TIER_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_lmcache_up", "gauge", (),
                 "1 if the latest poll of LMCache's page (lmcache_target) succeeded and carried its counters, else 0; "
                 "absent unless lmcache_target is set. The engine's signals do not depend on it.", good="high"),
)

# Central mode (`kvwatch serve --prometheus`): its own health beside every
# replica's series, without replica labels (kvwatch/central/app.py).
CENTRAL_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_central_store_up", "gauge", (),
                 "Central mode: 1 if the latest refresh read the store's query API, else 0 (the replicas' series "
                 "then stay as last read, their findings marked down on the page).", good="high"),
    HealthFamily("kvwatch_central_replicas", "gauge", (), "Central mode: replicas diagnosed at the latest refresh."),
    HealthFamily("kvwatch_central_replicas_dropped", "gauge", (),
                 "Central mode: replicas the store has beyond --max-replicas at the latest refresh, not diagnosed; "
                 "above 0, raise --max-replicas (and the memory request) or narrow --selector.", good="low"),
    HealthFamily("kvwatch_central_last_success_timestamp_seconds", "gauge", (),
                 "Central mode: Unix time of the latest refresh that read the store."),
)


TIER_SIGNALS: tuple[Signal, ...] = (
    Signal("kvwatch_lmcache_hit_ratio", "ratio",
           "LMCache's hit ratio over the window: tokens delivered over tokens asked for, from counter deltas "
           "(lmcache:num_hit_tokens / lmcache:num_requested_tokens); absent with no retrievals in the window. "
           "LMCache's retrieve_hit_rate gauge is never read: it covers one log interval and reads 1 with none.",
           lambda v: v.increase.ratio("hit_tokens", "requested_tokens"), "prefix",
           _ratio_of_rates("kvwatch_lmcache_hit_tokens_total", "kvwatch_lmcache_requested_tokens_total"),
           needs=("hit_tokens", "requested_tokens"), display="LMCache hit ratio", good="high"),
    Signal("kvwatch_lmcache_prompt_tokens_served_ratio", "ratio",
           "Share of the prompt tokens LMCache's connector saw that LMCache delivered, over the window: how much "
           "prefill the tier saved (lmcache:num_hit_tokens / lmcache:num_prompt_tokens); absent with no prompt "
           "tokens in the window or in builds without num_prompt_tokens.",
           lambda v: v.increase.ratio("hit_tokens", "prompt_tokens"), "prefix",
           _ratio_of_rates("kvwatch_lmcache_hit_tokens_total", "kvwatch_lmcache_prompt_tokens_total"),
           needs=("hit_tokens", "prompt_tokens"), display="Prompt tokens from LMCache", good="high"),
    Signal("kvwatch_lmcache_retrieved_tokens_per_second", "per_second",
           "Tokens LMCache delivered to the engine per second over the window (lmcache:num_hit_tokens).",
           _rate("hit_tokens"), "prefix",
           "sum by ({by}) (rate(kvwatch_lmcache_hit_tokens_total{{{sel}}}[{w}]))",
           needs=("hit_tokens",), display="LMCache tokens retrieved", good="high"),
    Signal("kvwatch_lmcache_stored_tokens_per_second", "per_second",
           "Tokens stored into LMCache per second over the window (lmcache:num_stored_tokens).",
           _rate("stored_tokens"), "prefix",
           "sum by ({by}) (rate(kvwatch_lmcache_stored_tokens_total{{{sel}}}[{w}]))",
           needs=("stored_tokens",), display="LMCache tokens stored"),
)
TIER_SIGNALS_BY_NAME = {signal.name: signal for signal in TIER_SIGNALS}


# --------------------------------------------------------------------------
# The engine's KV-cache event stream's health and signals (kvwatch/kvevents)
# --------------------------------------------------------------------------

# One stream per kvwatch (`kv_events`): no model or engine label (vLLM's
# events do not name them; one endpoint is one engine's publisher). Present
# only while `kv_events` is set; the series and signals only once an event
# arrived.
STREAM_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_kv_events_up", "gauge", (),
                 "1 while kvwatch listens for the engine's KV-cache events (kv_events) and at least one has arrived, "
                 "else 0; absent unless kv_events is set. The page's signals do not depend on it.", good="high"),
    HealthFamily("kvwatch_kv_events_messages", "counter", (), "Event messages (batches) received from the engine."),
    HealthFamily("kvwatch_kv_events_dropped_messages", "counter", (),
                 "Messages kvwatch dropped because its intake queue was full (a flood faster than it accounts); "
                 "what they held is missing from every count.", good="low"),
    HealthFamily("kvwatch_kv_events_missed_messages", "counter", (),
                 "Sequence numbers that never arrived (the engine's publisher dropped them past its high-water "
                 "mark, or the connection lost them); what they held is missing from every count.", good="low"),
    HealthFamily("kvwatch_kv_events_malformed_messages", "counter", (),
                 "Messages or events that were not vLLM's KV-cache events (bad frames, bad msgpack, absurd block "
                 "counts, over the byte cap); skipped.", good="low"),
    HealthFamily("kvwatch_kv_events_publisher_restarts", "counter", (),
                 "Times the engine's sequence numbers started over (its publisher restarted)."),
    HealthFamily("kvwatch_kv_events_last_message_age_seconds", "gauge", (),
                 "Seconds since the latest event message (an idle engine sends none).", good="low"),
    HealthFamily("kvwatch_kv_events_tracked_blocks", "gauge", (),
                 "Block hashes the ledger tracks now (bounded by kv_events_table_bytes)."),
    HealthFamily("kvwatch_kv_events_sampling_ratio", "gauge", (),
                 "Share of the hash space the ledger tracks: 1 until the table fills, then halved as needed; "
                 "stored-again counts and the sizing curve are scaled from the sample.", good="high"),
)


@dataclass(frozen=True)
class StreamSignal:
    name: str
    unit: str
    key: str  # the report's window key
    help: str
    promql: str
    display: str
    good: str | None = None


STREAM_SIGNALS: tuple[StreamSignal, ...] = (
    StreamSignal("kvwatch_kv_events_blocks_stored_per_second", "per_second", "stored_per_second",
                 "Blocks stored per second over the window (BlockStored).",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_total{{{sel}}}[{w}]))", "Blocks stored"),
    StreamSignal("kvwatch_kv_events_blocks_evicted_per_second", "per_second", "evicted_per_second",
                 "Blocks evicted per second over the window (BlockRemoved).",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_evicted_total{{{sel}}}[{w}]))", "Blocks evicted",
                 good="low"),
    StreamSignal("kvwatch_kv_events_blocks_stored_again_per_second", "per_second", "stored_again_per_second",
                 "Blocks stored again after their eviction per second over the window: recomputation a larger "
                 "cache would have saved.",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_again_total{{{sel}}}[{w}]))",
                 "Blocks stored again after eviction", good="low"),
    StreamSignal("kvwatch_kv_events_stored_again_ratio", "ratio", "stored_again_ratio",
                 "Share of the window's stored blocks that were stored again after their eviction; absent with "
                 "no stores in the window. High: eviction before reuse; 0 while stores go on: no reuse.",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_again_total{{{sel}}}[{w}])) / "
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_total{{{sel}}}[{w}]))",
                 "Stored again after eviction", good="low"),
    StreamSignal("kvwatch_kv_events_return_after_eviction_seconds", "seconds", "return_seconds_median",
                 "Median time from a block's eviction to its return over the window (the bucket bound of "
                 "kvwatch_kv_events_eviction_return_seconds); absent with no returns.",
                 "histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_kv_events_eviction_return_seconds_bucket"
                 "{{{sel}}}[{w}])))", "Eviction to return (median)"),
)
STREAM_SIGNALS_BY_NAME = {signal.name: signal for signal in STREAM_SIGNALS}

# The sizing curve (kvwatch/kvevents/source.py: sizing_curve), per extra cache
# as a multiple of the engine's cache (label `extra_cache`).
STREAM_SIZING: tuple[StreamSignal, ...] = (
    StreamSignal("kvwatch_kv_events_sizing_hit_ratio", "ratio", "hit_ratio",
                 "Estimated prefix-cache hit ratio over the window with a cache larger by `extra_cache` times the "
                 "engine's (its returns whose distance is below the extra blocks counted as hits with the page's "
                 "hits; vllm:prefix_cache_hits / prefix_cache_queries for the rest). An estimate: first order.",
                 "max by ({by}, extra_cache) (kvwatch_kv_events_sizing_hit_ratio{{{sel}}})", "Hit ratio with more cache",
                 good="high"),
    StreamSignal("kvwatch_kv_events_sizing_recomputation_avoided_ratio", "ratio", "recomputation_avoided_ratio",
                 "Estimated share of the window's blocks stored again after eviction that a cache larger by "
                 "`extra_cache` times the engine's would have kept.",
                 "max by ({by}, extra_cache) (kvwatch_kv_events_sizing_recomputation_avoided_ratio{{{sel}}})",
                 "Recomputation avoided", good="high"),
)
