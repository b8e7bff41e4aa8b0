"""The canonical snapshot: what one poll of an engine's /metrics says, in
kvwatch's own vocabulary, whatever the engine's version spelled.

Canonical keys (the adapter's alias table maps every vLLM spelling to these):

gauges      kv_usage, running, waiting, waiting_by_reason/<reason>,
            v0_prefix_hit_rate, sleep_state/<state>, engine_healthy,
            offload_cpu_pinned
counters    prefix_queries, prefix_hits, external_prefix_queries,
            external_prefix_hits, preemptions, prompt_tokens,
            generation_tokens, decode_tokens, prompt_tokens_cached, prompt_tokens_recomputed,
            prompt_tokens_by_source/<source>,
            prompt_tokens_cached_by_source/<tier>, finished/<finished_reason>,
            admission_rejections/<reason>, offload_{load,store}_{bytes,seconds},
            offload_allocation_failures, nixl_failed_transfers,
            nixl_failed_notifications, nixl_expired_requests
histograms  ttft, queue_time, prefill_time, decode_time, inference_time,
            e2e_latency, inter_token_latency, tpot, prompt_len,
            generation_len, kv_block_lifetime, kv_block_idle_before_evict,
            kv_block_reuse_gap, preemptions_per_request

A labelled family is flattened into `<key>/<label value>` so that deltas and
windows work on flat dicts.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
from dataclasses import dataclass, field, fields


_ZEROS = itertools.repeat(0)


@dataclass(frozen=True, slots=True)
class Histogram:
    """A cumulative histogram as scraped: upper bounds (the last is +Inf) and
    cumulative counts, plus sum and count. Bounds are the scraped ones, never
    assumed, because vLLM 0.32+ lets users change them."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    sum: float
    count: float

    def minus(self, earlier: "Histogram") -> "Histogram | None":
        """This histogram's increase since `earlier`, or None when the two are
        not comparable (bounds changed) or a reset happened (anything fell,
        the sum included: the observations are durations and sizes, never
        negative, so a smaller sum means the engine counted again from zero)."""
        if earlier.bounds != self.bounds or self.count < earlier.count or self.sum < earlier.sum:
            return None
        cumulative = tuple(map(operator.sub, self.cumulative, earlier.cumulative))
        # `c < 0` for each bucket, in C (this runs once per histogram per poll).
        # A smallest bucket >= 0 says none is below 0 (min() is cheaper than
        # comparing each with 0); only a NaN bucket can hide one from min().
        if cumulative and not min(cumulative) >= 0 and any(map(operator.lt, cumulative, _ZEROS)):
            return None
        return Histogram(self.bounds, cumulative, self.sum - earlier.sum, self.count - earlier.count)

    def plus(self, other: "Histogram") -> "Histogram | None":
        if other.bounds != self.bounds:
            return None
        return Histogram(
            self.bounds,
            tuple(map(operator.add, self.cumulative, other.cumulative)),
            self.sum + other.sum,
            self.count + other.count,
        )

    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def quantile(self, q: float) -> "Quantile | None":
        """Prometheus' histogram_quantile on these buckets (linear interpolation
        inside the bucket; the first bucket's lower edge is 0), and whether the
        answer is pinned at the first or last finite bound, where it only says
        "at most" or "at least"."""
        total = self.cumulative[-1] if self.cumulative else 0.0
        if total <= 0 or not self.bounds:
            return None
        rank = q * total
        counts = self.cumulative
        index = bisect.bisect_left(counts, rank)
        if index < len(self.bounds) and index < len(counts) and all(map(operator.le, counts, counts[1:])):
            # Non-decreasing counts (always, unless a bucket fell): the first
            # bucket at or above the rank, found by bisection, is the one
            # the scan below stops at.
            bound, cumulative = self.bounds[index], counts[index]
        else:
            for index, (bound, cumulative) in enumerate(zip(self.bounds, counts)):
                if cumulative >= rank:
                    break
        if math.isinf(bound):
            # In the +Inf bucket: Prometheus answers the last finite bound.
            finite = self.bounds[-2] if len(self.bounds) > 1 else 0.0
            return Quantile(finite, "last")
        lower = self.bounds[index - 1] if index > 0 else 0.0
        below = self.cumulative[index - 1] if index > 0 else 0.0
        in_bucket = cumulative - below
        value = bound if in_bucket <= 0 else lower + (bound - lower) * (rank - below) / in_bucket
        return Quantile(value, "first" if index == 0 else None)

    def reported_quantile(self, q: float) -> "Quantile | None":
        """The quantile as kvwatch reports it. Pinned in the first bucket, all
        that is known is that it lies below the first bound, so the value is
        that bound (an upper bound, "<"): the interpolation inside the bucket
        assumes observations spread evenly from 0, which says nothing. Pinned
        at the last finite bound, it is that bound already (a lower bound, ">")."""
        quantile = self.quantile(q)
        if quantile is not None and quantile.pinned == "first":
            return Quantile(self.bounds[0], "first")
        return quantile


if [f.name for f in fields(Histogram)] != ["bounds", "cumulative", "sum", "count"]:  # a check -O keeps
    raise TypeError("Histogram's fields changed: update _histogram_init, which sets them in this order")
_set_bounds, _set_cumulative, _set_sum, _set_count = (getattr(Histogram, f.name).__set__ for f in fields(Histogram))


def _histogram_init(self: Histogram, bounds: tuple[float, ...], cumulative: tuple[float, ...], sum: float,
                    count: float) -> None:
    # What the generated frozen __init__ does (object.__setattr__ per field),
    # setting each slot directly for a third less work: histograms are built
    # per histogram per poll and per window read.
    _set_bounds(self, bounds)
    _set_cumulative(self, cumulative)
    _set_sum(self, sum)
    _set_count(self, count)


Histogram.__init__ = _histogram_init  # type: ignore[method-assign]  # the faster __init__ above


@dataclass(frozen=True, slots=True)
class Quantile:
    value: float
    pinned: str | None  # "first" (answer is an upper bound) / "last" (a lower bound) / None

    @property
    def bound(self) -> str | None:
        """How a pinned quantile reads: "<" (at most the value), ">" (at least it), None when not pinned."""
        return PINNED_BOUNDS.get(self.pinned) if self.pinned else None


# The one way a pinned quantile is written on every surface: the JSON's
# `pinned` maps, the page, the CLI, and the exported `bound` label.
# A counter that falls by no more than this share of its value did not
# restart: that is rounding (a counter accumulated or carried as a 32-bit
# float holds 24 significant bits, 2**-23 of its value; folding processes'
# doubles in another order moves the last bits too). Counted as a reset, a
# counter of 50 falling by 1e-6 each poll added its whole value every poll
# (10 preemptions/s, a false critical finding).
COUNTER_ROUNDING = 2.0 ** -23

PINNED_BOUNDS = {"first": "<", "last": ">"}
PINNED_LABELS = {"<": "upper", ">": "lower"}


def bounded_text(text: str, bound: str | None) -> str:
    """A written value, with a pinned quantile's bound ("<" / ">", `Quantile.bound`)
    before it: "< 300 ms", "> 80 s"."""
    return f"{bound} {text}" if bound in ("<", ">") else text


@dataclass(slots=True)
class EngineSnapshot:
    """One (model_name, engine) of one poll."""

    model: str
    engine: str
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    # Creation time of the engine's counters (`_created`): a change, together
    # with a series that went down, means the engine restarted.
    created: float | None = None


@dataclass(slots=True)
class Snapshot:
    time: float
    engines: dict[tuple[str, str], EngineSnapshot]
    # engine -> cache_config_info labels, read as an open map (the label set
    # changes with every vLLM release).
    cache_config: dict[str, dict[str, str]] = field(default_factory=dict)
    # lora_requests_info labels of the most recent series, or None without LoRA.
    lora: dict[str, str] | None = None
    # The adapter names of each lora_requests_info series set since the
    # previous page, oldest first (engines/vllm.py LoraSeries).
    lora_used: tuple[tuple[str, ...], ...] = ()
    # canonical key -> the vLLM family that supplied it (tells versions apart).
    sources: dict[str, str] = field(default_factory=dict)
    parse_errors: list = field(default_factory=list)
    # process_start_time_seconds of the page: a new value means the engine's
    # process restarted, so every counter started again from zero.
    process_start: float | None = None
    # The adapter's tables (shared, never mutated): canonical key -> the
    # engine's family name, and -> the flag that lights a config-gated one.
    # A key absent from `sources` was not on the page.
    families: dict[str, str] = field(default_factory=dict)
    gates: dict[str, str] = field(default_factory=dict)
    # Values the page carried that cannot be true (kvwatch.engines.plausible.SourceFault),
    # taken out of `engines`: a fault of the source, never clamped.
    faults: list = field(default_factory=list)
    faults_dropped: int = 0  # beyond kvwatch.engines.plausible.MAX_FAULTS: counted, not described
    # canonical counter key -> how this page's engine version counts it, where
    # that differs from the current meaning (vllm.counting_caveats): the
    # signals and findings read from it carry the sentence.
    counting: dict[str, str] = field(default_factory=dict)
    # The namespace the page's sample lines were spelled in ("sglang:", or
    # "sglang_" after OpenMetrics' escaping=underscores; several joined by
    # "," on a page that mixes them); "" where the adapter does not say.
    spelling: str = ""

    def present(self) -> dict[str, bool]:
        """Engine family -> whether the page carried it (with samples)."""
        return {family: key in self.sources for key, family in sorted(self.families.items())}

    def capacity_tokens(self, engine: str) -> float | None:
        return capacity_tokens(self.cache_config.get(engine, {}))


def capacity_tokens(cache_config: dict[str, str]) -> float | None:
    """KV capacity in tokens: `kv_cache_size_tokens` where vLLM states it
    (group-aware, since 0.24), else num_gpu_blocks x block_size."""
    stated = _number(cache_config.get("kv_cache_size_tokens"))
    if stated:
        return stated
    blocks = _number(cache_config.get("num_gpu_blocks"))
    block_size = _number(cache_config.get("block_size"))
    if blocks and block_size:
        return blocks * block_size
    return None


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:  # "None", "auto", ...
        return None
    return value if math.isfinite(value) else None


def config_number(cache_config: dict[str, str], key: str) -> float | None:
    return _number(cache_config.get(key))


# cache_config_info labels of a hybrid (attention + Mamba) model's state cache.
MAMBA_KEYS = ("mamba_cache_mode", "mamba_block_size", "mamba_cache_dtype", "mamba_ssm_cache_dtype",
              "mamba_page_size_padded")


def hybrid_cache(cache_config: dict[str, str]) -> dict[str, str | float] | None:
    """The Mamba state cache of a hybrid model, from cache_config_info's
    `mamba_*` labels; None on an attention-only model. vLLM sets
    mamba_block_size on every model with Mamba layers (to block_size with
    prefix caching, mamba_cache_mode "align"; to max_model_len without, mode
    "none") and leaves it "None" otherwise, while mamba_cache_dtype and
    mamba_ssm_cache_dtype carry their defaults on every model: so only a
    numeric mamba_block_size marks a hybrid one."""
    block = config_number(cache_config, "mamba_block_size")
    if not block:
        return None
    found: dict[str, str | float] = {"mamba_block_size": block}
    for key in MAMBA_KEYS:
        if key == "mamba_block_size" or cache_config.get(key) in (None, "None"):
            continue
        number = config_number(cache_config, key)
        found[key] = number if number is not None else cache_config[key]
    return found
