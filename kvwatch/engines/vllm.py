"""The vLLM adapter: one canonical Snapshot per poll from any vLLM between the
V0 engine (0.4) and 0.33.

All version knowledge lives in the alias tables below: for each canonical key,
the vLLM families that have carried it, newest first. The first one present for
an engine wins, so a version that emits both names (0.9.2 to 0.11 emit
`kv_cache_usage_perc` and `gpu_cache_usage_perc`) reads the current one.

Label handling:
- a missing `engine` label means "0" (V0 and V1 before 0.8.3 had none);
- a missing `model_name` means "unknown";
- any other label that is not the family's own dimension (`pid` in
  multiprocess mode, Ray's `WorkerId`/`NodeAddress`/...) is folded by type:
  counters and histograms are summed (each request is recorded by exactly one
  process), gauges take the maximum (each pid keeps the last value it wrote,
  and for usage the maximum is the one that matters).
"""

from __future__ import annotations

import math
import time as _time

from kvwatch.exposition import Family, FamilySelector
from kvwatch.snapshot import EngineSnapshot, Histogram, Snapshot

# Spellings of the namespace on the wire: the native one, the OpenMetrics
# `escaping=underscores` rewrite, and Ray Serve's.
PREFIXES = ("vllm:", "vllm_", "ray_vllm:", "ray_vllm_")

# canonical key -> vLLM families, newest first.
GAUGES: dict[str, tuple[str, ...]] = {
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    # V0 only; -1 means "no data yet".
    "v0_prefix_hit_rate": ("gpu_prefix_cache_hit_rate",),
}
COUNTERS: dict[str, tuple[str, ...]] = {
    # Tokens since 0.9.0; blocks in V1 0.7.3-0.8.x. Ratios are unaffected.
    "prefix_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    "external_prefix_queries": ("external_prefix_cache_queries",),
    "external_prefix_hits": ("external_prefix_cache_hits",),
    "preemptions": ("num_preemptions",),
    # All prompt tokens, cached ones included.
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "prompt_tokens_cached": ("prompt_tokens_cached",),
}
# Labelled families flattened as "<key>/<label value>".
LABELLED_GAUGES: dict[str, tuple[str, str]] = {
    "waiting_by_reason": ("num_requests_waiting_by_reason", "reason"),
}
LABELLED_COUNTERS: dict[str, tuple[str, str]] = {
    "finished": ("request_success", "finished_reason"),
    "prompt_tokens_by_source": ("prompt_tokens_by_source", "source"),
}
HISTOGRAMS: dict[str, tuple[str, ...]] = {
    "ttft": ("time_to_first_token_seconds",),
    "queue_time": ("request_queue_time_seconds", "time_in_queue_requests"),
    "prefill_time": ("request_prefill_time_seconds",),
    "decode_time": ("request_decode_time_seconds",),
    "inference_time": ("request_inference_time_seconds",),
    "e2e_latency": ("e2e_request_latency_seconds",),
    # Per output event (with speculative decoding one event carries several
    # tokens); `tpot` below is the per-request mean per token.
    "inter_token_latency": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "tpot": ("request_time_per_output_token_seconds",),
    "prompt_len": ("request_prompt_tokens",),
    "generation_len": ("request_generation_tokens",),
    "kv_block_lifetime": ("kv_block_lifetime_seconds",),
    "kv_block_idle_before_evict": ("kv_block_idle_before_evict_seconds",),
    "kv_block_reuse_gap": ("kv_block_reuse_gap_seconds",),
}
CACHE_CONFIG = "cache_config_info"
LORA = "lora_requests_info"
# The counter whose `_created` series marks the engine's start.
RESTART_MARKER = "prompt_tokens"

# Labels that identify an engine, and the per-family dimensions we keep.
IDENTITY_LABELS = ("model_name", "engine")


def all_families() -> list[str]:
    names: list[str] = []
    for table in (GAUGES, COUNTERS, HISTOGRAMS):
        for aliases in table.values():
            names.extend(aliases)
    names.extend(family for family, _ in LABELLED_GAUGES.values())
    names.extend(family for family, _ in LABELLED_COUNTERS.values())
    names.extend((CACHE_CONFIG, LORA))
    return names


class VllmAdapter:
    """Turns the text of a vLLM /metrics page into a Snapshot. Keep one
    instance per target: it caches the parsed spellings and label sets."""

    def __init__(self, max_series: int = 10_000):
        self.selector = FamilySelector(all_families(), PREFIXES)
        # A page with more (model, engine) pairs than this is capped: the rest
        # are dropped and counted, so one label value per request cannot grow
        # kvwatch's memory without bound.
        self.max_series = max_series
        self.dropped_series = 0

    def adapt(self, text: str, at: float | None = None) -> Snapshot:
        page = self.selector.parse(text)
        families = page.families
        snapshot = Snapshot(time=_time.time() if at is None else at, engines={}, parse_errors=page.errors)

        def engine_of(labels: dict[str, str]) -> EngineSnapshot | None:
            key = (labels.get("model_name", "unknown"), labels.get("engine", "0"))
            found = snapshot.engines.get(key)
            if found is None:
                if len(snapshot.engines) >= self.max_series:
                    self.dropped_series += 1
                    return None
                found = snapshot.engines[key] = EngineSnapshot(*key)
            return found

        for key, aliases in GAUGES.items():
            family = _first_present(families, aliases, snapshot.sources, key)
            if family is None:
                continue
            for suffix, labels, value in family.samples:
                if suffix == "" and not math.isnan(value):
                    engine = engine_of(labels)
                    if engine is not None:
                        _fold_max(engine.gauges, key, value)

        for key, (name, dimension) in LABELLED_GAUGES.items():
            family = families.get(name)
            if family is None:
                continue
            snapshot.sources[key] = name
            for suffix, labels, value in family.samples:
                if suffix == "" and not math.isnan(value):
                    engine = engine_of(labels)
                    if engine is not None:
                        _fold_max(engine.gauges, f"{key}/{labels.get(dimension, '')}", value)

        for key, aliases in COUNTERS.items():
            family = _first_present(families, aliases, snapshot.sources, key)
            if family is None:
                continue
            for suffix, labels, value in family.samples:
                if suffix in ("_total", "") and not math.isnan(value):
                    engine = engine_of(labels)
                    if engine is not None:
                        engine.counters[key] = engine.counters.get(key, 0.0) + value
                elif suffix == "_created" and aliases[0] == RESTART_MARKER:
                    engine = engine_of(labels)
                    if engine is not None:
                        engine.created = value if engine.created is None else min(engine.created, value)

        for key, (name, dimension) in LABELLED_COUNTERS.items():
            family = families.get(name)
            if family is None:
                continue
            snapshot.sources[key] = name
            for suffix, labels, value in family.samples:
                if suffix in ("_total", "") and not math.isnan(value):
                    engine = engine_of(labels)
                    if engine is not None:
                        flat = f"{key}/{labels.get(dimension, '')}"
                        engine.counters[flat] = engine.counters.get(flat, 0.0) + value

        for key, aliases in HISTOGRAMS.items():
            family = _first_present(families, aliases, snapshot.sources, key)
            if family is not None:
                for labels, histogram in _histograms(family, snapshot.parse_errors):
                    engine = engine_of(labels)
                    if engine is not None:
                        existing = engine.histograms.get(key)
                        merged = histogram if existing is None else existing.plus(histogram)
                        if merged is not None:
                            engine.histograms[key] = merged

        cache_config = families.get(CACHE_CONFIG)
        if cache_config is not None:
            for suffix, labels, _value in cache_config.samples:
                if suffix == "":
                    snapshot.cache_config[labels.get("engine", "0")] = labels

        lora = families.get(LORA)
        if lora is not None:
            latest = max((s for s in lora.samples if s[0] == ""), key=lambda s: s[2], default=None)
            if latest is not None:
                snapshot.lora = latest[1]
        return snapshot


def _first_present(families: dict[str, Family], aliases: tuple[str, ...], sources: dict[str, str], key: str) -> Family | None:
    for alias in aliases:
        family = families.get(alias)
        if family is not None and family.samples:
            sources[key] = alias
            return family
    return None


def _fold_max(target: dict[str, float], key: str, value: float) -> None:
    previous = target.get(key)
    target[key] = value if previous is None else max(previous, value)


def _identity(labels: dict[str, str]) -> tuple[str, str]:
    return labels.get("model_name", "unknown"), labels.get("engine", "0")


def _histograms(family: Family, errors: list) -> list[tuple[dict[str, str], Histogram]]:
    """Group a histogram family's samples into one Histogram per label set
    (minus `le`), summing series that differ only in folded labels."""
    groups: dict[tuple, dict] = {}
    for suffix, labels, value in family.samples:
        if suffix == "_created":
            continue
        if suffix == "_bucket":
            le = labels.get("le")
            if le is None:
                continue
            identity = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        else:
            identity = tuple(sorted(labels.items()))
        group = groups.setdefault(identity, {"buckets": {}, "sum": None, "count": None})
        if suffix == "_bucket":
            try:
                bound = float(le)
            except ValueError:
                continue
            group["buckets"][bound] = group["buckets"].get(bound, 0.0) + value
        elif suffix == "_sum":
            group["sum"] = value
        elif suffix == "_count":
            group["count"] = value

    # Fold label sets that share (model_name, engine).
    folded: dict[tuple[str, str], tuple[dict[str, str], Histogram]] = {}
    for identity, group in groups.items():
        buckets = group["buckets"]
        if not buckets or math.inf not in buckets:
            errors.append(f"{family.name}: histogram without a +Inf bucket, ignored")
            continue
        bounds = tuple(sorted(buckets))
        cumulative = tuple(buckets[b] for b in bounds)
        count = group["count"] if group["count"] is not None else cumulative[-1]
        histogram = Histogram(bounds, cumulative, group["sum"] or 0.0, count)
        labels = dict(identity)
        key = _identity(labels)
        if key in folded:
            merged = folded[key][1].plus(histogram)
            if merged is not None:
                folded[key] = (folded[key][0], merged)
        else:
            folded[key] = (labels, histogram)
    return list(folded.values())
