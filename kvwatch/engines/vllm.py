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
  and for usage the maximum is the one that matters). A summed counter must
  not fall when one replica goes away or restarts (the window would read the
  fall as a reset of the sum, and count the whole sum as one step's
  increase): _Folds keeps what each replica had counted, so the sum only
  ever grows by the replicas' own increases;
- the same series twice on one page (same name and labels) is a parse error:
  the first value counts, the others are reported, never added.
"""

from __future__ import annotations

import itertools
import math
import operator
import time as _time

from kvwatch.engines.base import EngineAdapter
from kvwatch.exposition import Family, FamilySelector
from kvwatch.engines.plausible import add_fault, family_name, screen
from kvwatch.snapshot import COUNTER_ROUNDING, EngineSnapshot, Histogram, Snapshot

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
    # OffloadingConnector's CPU tier: the share of its blocks pinned by
    # in-flight transfers (evictable blocks subtracted), so it reads 0 on a
    # full tier at rest. Never call it usage.
    "offload_cpu_pinned": ("kv_offload_cpu_cache_usage_perc",),
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
    # vLLM 0.16-0.19 only: the one token recomputed when a whole prompt was
    # cached (the model needs one token to compute logits from); not
    # preemption recompute.
    "prompt_tokens_recomputed": ("prompt_tokens_recomputed",),
    # OffloadingConnector (--kv-transfer-config); the deprecated
    # kv_offload_total_* forms are read only where these are absent
    # (COUNTER_FALLBACKS): both count the same bytes.
    "offload_load_bytes": ("kv_offload_load_bytes",),
    "offload_store_bytes": ("kv_offload_store_bytes",),
    "offload_load_seconds": ("kv_offload_load_time",),
    "offload_store_seconds": ("kv_offload_store_time",),
    "offload_allocation_failures": ("kv_offload_allocation_failure",),
    # NixlConnector (--kv-transfer-config).
    "nixl_failed_transfers": ("nixl_num_failed_transfers",),
    "nixl_failed_notifications": ("nixl_num_failed_notifications",),
    "nixl_expired_requests": ("nixl_num_kv_expired_reqs",),
    "nixl_notifications_after_expiry": ("nixl_num_notifications_after_expiry",),
}
# canonical key -> (deprecated family, its label, the value that means the
# key): read only when no family of COUNTERS[key] is on the page, so the
# deprecated and the current forms are never added together.
COUNTER_FALLBACKS: dict[str, tuple[str, str, str]] = {
    "offload_load_bytes": ("kv_offload_total_bytes", "transfer_type", "CPU_to_GPU"),
    "offload_store_bytes": ("kv_offload_total_bytes", "transfer_type", "GPU_to_CPU"),
    "offload_load_seconds": ("kv_offload_total_time", "transfer_type", "CPU_to_GPU"),
    "offload_store_seconds": ("kv_offload_total_time", "transfer_type", "GPU_to_CPU"),
}
# Labelled families flattened as "<key>/<label value>".
LABELLED_GAUGES: dict[str, tuple[str, str]] = {
    "waiting_by_reason": ("num_requests_waiting_by_reason", "reason"),
    # awake=1, or weights_offloaded=1 / discard_all=1 for sleep levels 1 and 2.
    "sleep_state": ("engine_sleep_state", "sleep_state"),
}
LABELLED_COUNTERS: dict[str, tuple[str, str]] = {
    "finished": ("request_success", "finished_reason"),
    # local_compute, local_cache_hit, external_kv_transfer: sums to prompt_tokens.
    "prompt_tokens_by_source": ("prompt_tokens_by_source", "source"),
    # device, host, p2p, disk, external_unspecified: sums to local + external hits.
    "prompt_tokens_cached_by_source": ("prompt_tokens_cached_by_source", "source"),
}
# Families that carry only part of an engine's identity. engine_healthy
# (--enable-fault-tolerance) has `engine` and no `model_name`: it applies to
# every model's engine of that index. admission_rejections has `model_name`
# and no `engine` (the front end rejects before any engine sees the request):
# it is booked on the model's lowest engine, so a model's sum is right and no
# engine "0" is invented where the page has none.
ENGINE_ONLY_GAUGES: dict[str, str] = {
    "engine_healthy": "engine_healthy",
}
MODEL_ONLY_COUNTERS: dict[str, tuple[str, str]] = {
    "admission_rejections": ("admission_rejections", "reason"),
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
    # Observed for every finished request, 0 included (0 and 1 share the
    # first bucket, le=1).
    "preemptions_per_request": ("request_num_preemptions",),
    # OffloadingConnector: bytes per load / store operation (the deprecated
    # kv_offload_size{transfer_type} is read only where these are absent,
    # HISTOGRAM_FALLBACKS).
    "offload_load_size": ("kv_offload_load_size",),
    "offload_store_size": ("kv_offload_store_size",),
    # NixlConnector: per transfer, its duration, the time to post it, its
    # bytes and its descriptors.
    "nixl_transfer_time": ("nixl_xfer_time_seconds",),
    "nixl_post_time": ("nixl_post_time_seconds",),
    "nixl_transfer_bytes": ("nixl_bytes_transferred",),
    "nixl_descriptors": ("nixl_num_descriptors",),
}
# canonical key -> (deprecated histogram, its label, the value that means the
# key), read as COUNTER_FALLBACKS are: only where HISTOGRAMS[key] is absent.
HISTOGRAM_FALLBACKS: dict[str, tuple[str, str, str]] = {
    "offload_load_size": ("kv_offload_size", "transfer_type", "CPU_to_GPU"),
    "offload_store_size": ("kv_offload_size", "transfer_type", "GPU_to_CPU"),
}
# vLLM family -> the releases that export it ("0.9.2+", "V0 to 0.10"), as
# compared across the release wheels (see docs/metrics.md, generated from
# this table and the ones above).
VERSIONS: dict[str, str] = {
    "kv_cache_usage_perc": "0.9.2+",
    "gpu_cache_usage_perc": "V0; V1 to 0.10 (hidden in 0.11, removed in 0.12)",
    "num_requests_running": "all",
    "num_requests_waiting": "all",
    "gpu_prefix_cache_hit_rate": "V0 only (removed in 0.9.1)",
    "kv_offload_cpu_cache_usage_perc": "0.27+ (OffloadingConnector's CPU tier)",
    "prefix_cache_queries": "0.9.2+",
    "gpu_prefix_cache_queries": "V1 0.7.3 to 0.11 (blocks before 0.9, tokens after)",
    "prefix_cache_hits": "0.9.2+",
    "gpu_prefix_cache_hits": "V1 0.7.3 to 0.11 (blocks before 0.9, tokens after)",
    "external_prefix_cache_queries": "0.11.1+ (always registered; 0 without a KV connector)",
    "external_prefix_cache_hits": "0.11.1+ (always registered; 0 without a KV connector)",
    "num_preemptions": "V1 0.8+",
    "prompt_tokens": "all",
    "generation_tokens": "all",
    "prompt_tokens_cached": "0.16+",
    "prompt_tokens_recomputed": "0.16 to 0.19 only",
    "kv_offload_load_bytes": "0.27+",
    "kv_offload_store_bytes": "0.27+",
    "kv_offload_load_time": "0.27+",
    "kv_offload_store_time": "0.27+",
    "kv_offload_allocation_failure": "0.27+",
    "kv_offload_total_bytes": "deprecated CPU-offload form, still emitted beside the load/store split",
    "kv_offload_total_time": "deprecated CPU-offload form, still emitted beside the load/store split",
    "nixl_num_failed_transfers": "with NixlConnector",
    "nixl_num_failed_notifications": "with NixlConnector",
    "nixl_num_kv_expired_reqs": "with NixlConnector",
    "nixl_num_notifications_after_expiry": "with NixlConnector (recent releases; 0.32 has it)",
    "kv_offload_load_size": "0.27+",
    "kv_offload_store_size": "0.27+",
    "kv_offload_size": "deprecated CPU-offload form ({transfer_type}), still emitted beside the load/store split",
    "nixl_xfer_time_seconds": "with NixlConnector",
    "nixl_post_time_seconds": "with NixlConnector",
    "nixl_bytes_transferred": "with NixlConnector",
    "nixl_num_descriptors": "with NixlConnector",
    "num_requests_waiting_by_reason": "0.20+",
    "engine_sleep_state": "0.11.1+",
    "request_success": "all",
    "prompt_tokens_by_source": "0.16+",
    "prompt_tokens_cached_by_source": "0.32+",
    "engine_healthy": "with fault tolerance (recent releases)",
    "admission_rejections": "0.32+",
    "time_to_first_token_seconds": "all",
    "request_queue_time_seconds": "0.6+",
    "time_in_queue_requests": "V0 0.6 to 0.9.0",
    "request_prefill_time_seconds": "0.6+",
    "request_decode_time_seconds": "0.6+",
    "request_inference_time_seconds": "0.6+",
    "e2e_request_latency_seconds": "all",
    "inter_token_latency_seconds": "0.10.2+",
    "time_per_output_token_seconds": "V0; V1 to 0.11 (hidden 0.12 to 0.14, removed in 0.15)",
    "request_time_per_output_token_seconds": "0.11+",
    "request_prompt_tokens": "all",
    "request_generation_tokens": "all",
    "kv_block_lifetime_seconds": "0.12+",
    "kv_block_idle_before_evict_seconds": "0.12+",
    "kv_block_reuse_gap_seconds": "0.12+",
    "request_num_preemptions": "0.30+",
    "cache_config_info": "all (its labels change with every release; kv_cache_size_tokens and "
                         "kv_cache_max_concurrency 0.24+; kv_cache_memory_bytes already on 0.10.2, as \"None\" there (its CPU "
                         "worker ignores --kv-cache-memory-bytes), a number on 0.20.2 given that flag; mamba_block_size is a number "
                         "only on hybrid models, whose mamba_* labels kvwatch shows in capacity and the exhaustion "
                         "evidence)",
    "lora_requests_info": "with LoRA",
}
# canonical key -> what lights it: the families vLLM registers only when a
# flag asks for them. Where such a family is absent, its signals are absent
# (never 0) and /api/v1/signals names the flag.
GATES: dict[str, str] = {
    "kv_block_lifetime": "--kv-cache-metrics",
    "kv_block_idle_before_evict": "--kv-cache-metrics",
    "kv_block_reuse_gap": "--kv-cache-metrics",
    "offload_cpu_pinned": "--kv-transfer-config with the OffloadingConnector (CPU tier)",
    "offload_load_bytes": "--kv-transfer-config with the OffloadingConnector",
    "offload_store_bytes": "--kv-transfer-config with the OffloadingConnector",
    "offload_load_seconds": "--kv-transfer-config with the OffloadingConnector",
    "offload_store_seconds": "--kv-transfer-config with the OffloadingConnector",
    "offload_allocation_failures": "--kv-transfer-config with the OffloadingConnector",
    "nixl_failed_transfers": "--kv-transfer-config with the NixlConnector",
    "nixl_failed_notifications": "--kv-transfer-config with the NixlConnector",
    "nixl_expired_requests": "--kv-transfer-config with the NixlConnector",
    "nixl_notifications_after_expiry": "--kv-transfer-config with the NixlConnector",
    "offload_load_size": "--kv-transfer-config with the OffloadingConnector",
    "offload_store_size": "--kv-transfer-config with the OffloadingConnector",
    "nixl_transfer_time": "--kv-transfer-config with the NixlConnector",
    "nixl_post_time": "--kv-transfer-config with the NixlConnector",
    "nixl_transfer_bytes": "--kv-transfer-config with the NixlConnector",
    "nixl_descriptors": "--kv-transfer-config with the NixlConnector",
    "engine_healthy": "--enable-fault-tolerance",
}


# Counters that meant something else in older releases: canonical key -> (the
# test on the page's families that tells an older release, what its counter
# counts there). The tests are read from the families a page carries, since no
# vLLM page states its version; each was seen on a real build (the captures in
# tests/fixtures/vllm-0.10.2-cpu and vllm-0.20.2-cpu). Signals and findings
# read from such a counter say so (Snapshot.counting).
RELOOKUPS = (
    "vLLM before 0.32 (this page has no vllm:prompt_tokens_cached_by_source; seen on 0.10.2 and 0.20.2) counts a "
    "request that waits for KV space in the prefix-cache lookup counters again at every scheduling attempt, so "
    "hits over queries is a ratio of lookups, inflated or deflated by re-lookups, not the share of prompt tokens "
    "served from the cache")
LATE_PREEMPTIONS = (
    "vLLM's V1 engine before 0.11 (this page still carries vllm:gpu_cache_usage_perc; seen on 0.10.2) counts a "
    "preemption when the preempted request next produces output, so the counter trails the event")


def counting_caveats(families: dict[str, Family]) -> dict[str, str]:
    """canonical counter key -> how this page's release counts it, where that
    differs from the current meaning (empty for a current page)."""
    found = {}
    v1_lookups = "prefix_cache_queries" in families or "gpu_prefix_cache_queries" in families
    if v1_lookups and "prompt_tokens_cached_by_source" not in families:
        found["prefix_queries"] = found["prefix_hits"] = RELOOKUPS
    # V1 0.8 to 0.10 still showed gpu_cache_usage_perc (hidden in 0.11); V0,
    # which had it too, had no lookup counters but its hit-rate gauge.
    if "num_preemptions" in families and "gpu_cache_usage_perc" in families and v1_lookups:
        found["preemptions"] = LATE_PREEMPTIONS
    return found


def key_families() -> dict[str, str]:
    """canonical key -> the newest vLLM family that carries it."""
    keys: dict[str, str] = {}
    for table in (GAUGES, COUNTERS, HISTOGRAMS):
        keys.update({key: aliases[0] for key, aliases in table.items()})
    for table in (LABELLED_GAUGES, LABELLED_COUNTERS, MODEL_ONLY_COUNTERS):
        keys.update({key: family for key, (family, _label) in table.items()})
    keys.update(ENGINE_ONLY_GAUGES)
    return keys


KEY_FAMILIES = key_families()


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
    names.extend(family for family, _, _ in COUNTER_FALLBACKS.values())
    names.extend(family for family, _, _ in HISTOGRAM_FALLBACKS.values())
    names.extend(ENGINE_ONLY_GAUGES.values())
    names.extend(family for family, _ in MODEL_ONLY_COUNTERS.values())
    names.extend((CACHE_CONFIG, LORA))
    return names


class VllmAdapter(EngineAdapter):
    """Turns the text of a vLLM /metrics page into a Snapshot. Keep one
    instance per target: it caches the parsed spellings and label sets."""

    name = "vllm"
    title = "vLLM"
    prefixes = PREFIXES
    families = KEY_FAMILIES
    gates = GATES
    versions = VERSIONS

    def __init__(self, max_series: int = 10_000):
        super().__init__(max_series)
        self._selector: FamilySelector | None = None
        # Derived forms of the parser's cached label sets, which come back as
        # the same objects poll after poll (see _SeriesCache).
        self._series = _SeriesCache()
        self._cache_clears = 0
        self._folds = _Folds()
        self._process_start: float | None = None

    @property
    def selector(self) -> FamilySelector:
        # Built on the first page: a reader that hands over families
        # (adapt_families) never needs it.
        if self._selector is None:
            self._selector = FamilySelector(all_families(), PREFIXES)
        return self._selector

    def adapt(self, text: str, at: float | None = None) -> Snapshot:
        selector = self.selector
        page = selector.parse(text)
        if selector.cache_clears != self._cache_clears:
            self._cache_clears = selector.cache_clears
            self._series.clear()
        return self.adapt_families(page.families, page.errors, _process_start(text), at)

    def adapt_families(self, families: dict[str, Family], errors: list, process_start: float | None,
                       at: float | None = None) -> Snapshot:
        """The Snapshot of a page already read into families (keyed by the
        family name without prefix, samples as (suffix, labels, value) in
        page order), as the parser would give them: the history reader
        builds these straight from query results. A reader that hands the
        same label dicts, and the same `layout` object for the same layout,
        from one call to the next gets the caches' speed."""
        snapshot = Snapshot(time=_time.time() if at is None else at, engines={}, parse_errors=errors,
                            families=KEY_FAMILIES, gates=GATES)
        snapshot.process_start = process_start
        if snapshot.process_start is not None and snapshot.process_start != self._process_start:
            if self._process_start is not None:
                self._folds.clear()  # a new process: every replica's count started again
            self._process_start = snapshot.process_start
        series = self._series
        series.trim()
        plan = self._page_plan(families) if self.page_plans else None
        if plan is None or len(plan.engine_keys) > self.max_series or not plan.apply(snapshot, families, self._folds):
            self._read_page(snapshot, families)
        self._read_info(snapshot, families)
        screen(snapshot, "vllm:")
        snapshot.counting = counting_caveats(families)
        return snapshot

    # Whether a page whose layout was seen on the poll before is read by its
    # _PagePlan. Off only in the tests that compare the plan with the reading
    # below, which stays the definition.
    page_plans = True

    def _page_plan(self, families: dict[str, Family]) -> _PagePlan | None:
        """The plan of a page with the same families, in the same layouts, as
        the poll before (made then on this second sight, so a layout seen once
        costs nothing more); None for any other page, or one that the plan
        cannot read (_PagePlan.of)."""
        series = self._series
        names = tuple(families)
        layouts = tuple(map(_LAYOUT, families.values()))
        seen = series.page
        if seen is not None and seen[0] == names and all(map(operator.is_, seen[1], layouts)):
            plan = seen[2]
            if plan is _UNPLANNED:
                plan = _PagePlan.of(families, series)
                series.page = (names, layouts, plan)
            return plan
        series.page = (names, layouts, _UNPLANNED)  # holds the layouts, so their ids are not reused
        return None

    def _read_page(self, snapshot: Snapshot, families: dict[str, Family]) -> None:
        """Every family but the cache configuration and LoRA, into the
        snapshot's engines and sources (and parse errors)."""
        engines = snapshot.engines
        series = self._series
        errors = snapshot.parse_errors
        # (model, engine, canonical key) -> (the engine, {series token: value}),
        # folded once the page is read.
        counter_parts: dict[tuple[str, str, str], tuple[EngineSnapshot, dict[tuple, float]]] = {}
        histogram_parts: dict[tuple[str, str, str], tuple[EngineSnapshot, dict[tuple, Histogram]]] = {}

        def add_part(parts: dict, engine: EngineSnapshot, key: str, token: tuple, value, family: str) -> None:
            entry = parts.get((engine.model, engine.engine, key))
            if entry is None:
                parts[(engine.model, engine.engine, key)] = (engine, {token: value})
                return
            found = entry[1]
            if token in found:
                errors.append(f"{family}: duplicate series {dict(token)} (value {value!r}; kept the first, "
                              f"{found[token]!r})")
            else:
                found[token] = value
        # Count each dropped (model, engine) pair once per poll, not once per
        # sample: the count must not depend on how many families it has.
        dropped: set[tuple[str, str]] = set()

        def engine_of(labels: dict[str, str]) -> EngineSnapshot | None:
            key = series.engine_key(labels)
            found = engines.get(key)
            if found is None:
                if len(engines) >= self.max_series:
                    dropped.add(key)
                    return None
                found = engines[key] = EngineSnapshot(*key)
            return found

        # `value == value` is False only for NaN, and cheaper than math.isnan.
        for key, aliases in GAUGES.items():
            family = _first_present(families, aliases, snapshot.sources, key)
            if family is None:
                continue
            seen: set[tuple] = set()
            for suffix, labels, value in family.samples:
                if suffix == "" and value == value:
                    engine = engine_of(labels)
                    if engine is not None:
                        token = series.other(labels)[1]
                        if token in seen:
                            errors.append(f"{family.name}: duplicate series {dict(token)} (value {value!r}; kept the first)")
                            continue
                        seen.add(token)
                        _fold_max(engine.gauges, key, value)

        for key, (name, dimension) in LABELLED_GAUGES.items():
            family = families.get(name)
            if family is None:
                continue
            snapshot.sources[key] = name
            for suffix, labels, value in family.samples:
                if suffix == "" and value == value:
                    engine = engine_of(labels)
                    if engine is not None:
                        _fold_max(engine.gauges, f"{key}/{labels.get(dimension, '')}", value)

        for key, aliases in COUNTERS.items():
            family = _first_present(families, aliases, snapshot.sources, key)
            if family is None:
                continue
            marks_restart = aliases[0] == RESTART_MARKER
            for suffix, labels, value in family.samples:
                if (suffix == "_total" or suffix == "") and value == value:
                    engine = engine_of(labels)
                    if engine is not None:
                        add_part(counter_parts, engine, key, series.other(labels)[1], value, family.name)
                elif suffix == "_created" and marks_restart:
                    engine = engine_of(labels)
                    if engine is not None:
                        engine.created = value if engine.created is None else min(engine.created, value)

        for key, (name, dimension) in LABELLED_COUNTERS.items():
            family = families.get(name)
            if family is None:
                continue
            snapshot.sources[key] = name
            for suffix, labels, value in family.samples:
                if (suffix == "_total" or suffix == "") and value == value:
                    engine = engine_of(labels)
                    if engine is not None:
                        add_part(counter_parts, engine, f"{key}/{labels.get(dimension, '')}",
                                 series.other(labels)[1], value, family.name)

        for key, (name, dimension, wanted) in COUNTER_FALLBACKS.items():
            if key in snapshot.sources:
                continue
            family = families.get(name)
            if family is None or not family.samples:
                continue
            snapshot.sources[key] = name
            for suffix, labels, value in family.samples:
                if (suffix == "_total" or suffix == "") and value == value and labels.get(dimension) == wanted:
                    engine = engine_of(labels)
                    if engine is not None:
                        add_part(counter_parts, engine, key, series.other(labels)[1], value, family.name)

        for key, aliases in HISTOGRAMS.items():
            family = _first_present(families, aliases, snapshot.sources, key)
            if family is not None:
                for token, labels, histogram in _histograms(family, errors, series):
                    engine = engine_of(labels)
                    if engine is not None:
                        add_part(histogram_parts, engine, key, token, histogram, family.name)

        for key, (name, dimension, wanted) in HISTOGRAM_FALLBACKS.items():
            if key in snapshot.sources:
                continue
            family = families.get(name)
            if family is None or not family.samples:
                continue
            snapshot.sources[key] = name
            for token, labels, histogram in _histograms(family, errors, series):
                if labels.get(dimension) == wanted:
                    engine = engine_of(labels)
                    if engine is not None:
                        add_part(histogram_parts, engine, key, token, histogram, family.name)

        folds = self._folds
        for fold_key, (engine, parts) in counter_parts.items():
            engine.counters[fold_key[2]] = folds.fold(fold_key, parts, _fell, operator.add)
        for fold_key, (engine, parts) in histogram_parts.items():
            engine.histograms[fold_key[2]] = folds.fold(fold_key + ("histogram",), parts,
                                                        _histogram_fell, _histogram_plus)
        folds.forget_unseen()

        for key, name in ENGINE_ONLY_GAUGES.items():
            family = families.get(name)
            if family is None or not family.samples:
                continue
            snapshot.sources[key] = name
            for suffix, labels, value in family.samples:
                if suffix == "" and value == value:
                    for engine in engines.values():
                        if engine.engine == labels.get("engine", "0"):
                            _fold_max(engine.gauges, key, value)

        for key, (name, dimension) in MODEL_ONLY_COUNTERS.items():
            family = families.get(name)
            if family is None or not family.samples:
                continue
            snapshot.sources[key] = name
            first_engine: dict[str, EngineSnapshot] = {}
            for engine in engines.values():
                held = first_engine.get(engine.model)
                if held is None or _engine_order(engine.engine) < _engine_order(held.engine):
                    first_engine[engine.model] = engine
            for suffix, labels, value in family.samples:
                if (suffix == "_total" or suffix == "") and value == value:
                    engine = first_engine.get(labels.get("model_name", "unknown"))
                    if engine is not None:
                        flat = f"{key}/{labels.get(dimension, '')}"
                        engine.counters[flat] = engine.counters.get(flat, 0.0) + value
        self.dropped_series += len(dropped)
        _nan_faults(snapshot, families, series)

    @staticmethod
    def _read_info(snapshot: Snapshot, families: dict[str, Family]) -> None:
        """The cache configuration and LoRA (their labels are their values)."""
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


# canonical key -> (its label, whether a counter) for the flattened families.
_FLAT = {**{key: (dimension, False) for key, (_n, dimension) in LABELLED_GAUGES.items()},
         **{key: (dimension, True) for key, (_n, dimension) in LABELLED_COUNTERS.items()},
         **{key: (dimension, True) for key, (_n, dimension) in MODEL_ONLY_COUNTERS.items()}}
_COUNTER_KEYS = frozenset(COUNTERS) | frozenset(COUNTER_FALLBACKS)


def _nan_faults(snapshot: Snapshot, families: dict[str, Family], series: "_SeriesCache") -> None:
    """The NaN gauges and counters the reading above skipped, described as
    faults of the source (kvwatch.engines.plausible): skipped silently, a counter
    that turned NaN looked like one that stopped. Only the slow path reads
    here; the page plan hands a page with a NaN to it."""
    for key, name in snapshot.sources.items():
        if key in HISTOGRAMS or key in HISTOGRAM_FALLBACKS:
            continue
        family = families.get(name)
        if family is None:
            continue
        dimension, counter = _FLAT.get(key, (None, key in _COUNTER_KEYS))
        for suffix, labels, value in family.samples:
            if value == value or suffix not in ("", "_total"):
                continue
            model, engine = series.engine_key(labels)
            flat = f"{key}/{labels.get(dimension, '')}" if dimension else key
            add_fault(snapshot, model, engine, flat,
                      family_name({flat: name}, flat, "vllm:", "counter" if counter else "gauge"), "not_finite",
                      value, "counter" if counter else "gauge")


def _process_start(text: str) -> float | None:
    """The page's process_start_time_seconds (prometheus_client's process
    collector; absent in multiprocess mode), or None."""
    name = "process_start_time_seconds "
    if text.startswith(name):
        at = 0
    else:
        at = text.find("\n" + name)
        if at < 0:
            return None
        at += 1
    end = text.find("\n", at)
    try:
        value = float(text[at + len(name):end if end >= 0 else None].split()[0])
    except (ValueError, IndexError):
        return None
    return value if math.isfinite(value) else None


def _fell(now: float, before: float) -> bool:
    return now < before - before * COUNTER_ROUNDING  # within rounding is no fall


def _histogram_fell(now: Histogram, before: Histogram) -> bool:
    return now.minus(before) is None


def _histogram_plus(total: Histogram, more: Histogram) -> Histogram:
    # Bounds that differ: the newer (the later added) win, as in the window.
    return total.plus(more) or more


class _Folds:
    """Counters and histograms summed over the series of several replicas
    (pid, Ray's WorkerId), kept monotonic: what a replica had counted when it
    went away, or before its own count went down (it restarted), is carried
    in the sum. A sum of one series is that series as it is, so its resets
    pass through to the window's per-series rule. Holds only the keys of the
    latest page."""

    def __init__(self) -> None:
        self.last: dict[tuple, dict[tuple, object]] = {}  # key -> {series token: value}
        self.carry: dict[tuple, object] = {}
        self.seen: set[tuple] = set()

    def fold(self, key: tuple, parts: dict, fell, plus):
        self.seen.add(key)
        last = self.last.get(key)
        if last is None and len(parts) == 1:
            return next(iter(parts.values()))
        carry = self.carry.get(key)
        for token, before in (last or {}).items():
            now = parts.get(token)
            if now is None or fell(now, before):
                carry = before if carry is None else plus(carry, before)
        self.last[key] = parts
        if carry is not None:
            self.carry[key] = carry
        total = carry
        for value in parts.values():
            total = value if total is None else plus(total, value)
        return total

    def forget_unseen(self) -> None:
        for key in [key for key in self.last if key not in self.seen]:
            del self.last[key]
            self.carry.pop(key, None)
        self.seen = set()

    def clear(self) -> None:
        self.last.clear()
        self.carry.clear()


def _first_present(families: dict[str, Family], aliases: tuple[str, ...], sources: dict[str, str], key: str) -> Family | None:
    for alias in aliases:
        family = families.get(alias)
        if family is not None and family.samples:
            sources[key] = alias
            return family
    return None


def _engine_order(engine: str) -> tuple[int, str]:
    return (int(engine), "") if engine.isdigit() else (1 << 30, engine)


def _fold_max(target: dict[str, float], key: str, value: float) -> None:
    previous = target.get(key)
    target[key] = value if previous is None else max(previous, value)


def _identity(labels: dict[str, str]) -> tuple[str, str]:
    return labels.get("model_name", "unknown"), labels.get("engine", "0")


class _SeriesCache:
    """What the adapter derives from a label set, computed once per label set.

    The parser hands out the same dict object for the same label block on
    every poll, so these are keyed by the dict's id; each entry holds the
    dict itself, so the id cannot be reused by another object while the
    entry lives. Bucket bounds are interned too: every poll, and every
    snapshot in the window, shares one bounds tuple per layout. Bounded:
    cleared between polls once it outgrows `limit` (a page with one label
    value per request would otherwise grow it forever)."""

    def __init__(self, limit: int = 50_000):
        self.limit = limit
        self.engine_keys: dict[int, tuple[dict[str, str], tuple[str, str]]] = {}
        # id(labels) -> (labels, identity token, its id, `le` or None, bound or None)
        self.buckets: dict[int, tuple[dict[str, str], tuple, int, str | None, float | None]] = {}
        # id(labels) -> (labels, identity token, its id) for _sum, _count and the rest
        self.others: dict[int, tuple[dict[str, str], tuple, int]] = {}
        # identity tuple -> the one tuple object standing for it (its token)
        self.tokens: dict[tuple, tuple] = {}
        # token -> (labels as a dict, (model_name, engine))
        self.token_labels: dict[tuple, tuple[dict[str, str], tuple[str, str]]] = {}
        # bounds in page order -> (sorted bounds, whether page order was sorted)
        self.bounds: dict[tuple[float, ...], tuple[tuple[float, ...], bool]] = {}
        # histogram family -> (the parser's layout of its samples, _HistogramPlan
        # for that layout or None where the family needs the general path)
        self.plans: dict[str, tuple[object, _HistogramPlan | None]] = {}
        # The last page's (family names, their layouts, its _PagePlan, None
        # where it has none, or _UNPLANNED before its second sight).
        self.page: tuple[tuple[str, ...], tuple[object, ...], object] | None = None

    def trim(self) -> None:
        if (len(self.engine_keys) + len(self.buckets) + len(self.others) + len(self.tokens)
                + len(self.bounds) > self.limit):
            self.clear()

    def clear(self) -> None:
        """Every entry dropped: with the parser's label cache (whose dicts
        these entries hold; keeping them would keep what the parser let go)."""
        for table in (self.engine_keys, self.buckets, self.others, self.tokens, self.token_labels, self.bounds,
                      self.plans):
            table.clear()
        self.page = None

    # Empty label sets are fresh dicts on every line (nothing to reuse), so
    # they are answered without an entry.

    def engine_key(self, labels: dict[str, str]) -> tuple[str, str]:
        if not labels:
            return _identity(labels)
        entry = self.engine_keys.get(id(labels))
        if entry is None:
            entry = self.engine_keys[id(labels)] = (labels, _identity(labels))
        return entry[1]

    def token(self, identity: tuple) -> tuple:
        return self.tokens.setdefault(identity, identity)

    def bucket(self, labels: dict[str, str]) -> tuple[dict[str, str], tuple, int, str | None, float | None]:
        if not labels:
            token = self.token(())
            return labels, token, id(token), None, None
        entry = self.buckets.get(id(labels))
        if entry is None:
            le = labels.get("le")
            token = self.token(tuple(sorted((k, v) for k, v in labels.items() if k != "le")))
            try:
                bound = float(le) if le is not None else None
            except ValueError:
                bound = None
            entry = self.buckets[id(labels)] = (labels, token, id(token), le, bound)
        return entry

    def other(self, labels: dict[str, str]) -> tuple[dict[str, str], tuple, int]:
        if not labels:
            token = self.token(())
            return labels, token, id(token)
        entry = self.others.get(id(labels))
        if entry is None:
            token = self.token(tuple(sorted(labels.items())))
            entry = self.others[id(labels)] = (labels, token, id(token))
        return entry

    def labels_of(self, token: tuple) -> tuple[dict[str, str], tuple[str, str]]:
        entry = self.token_labels.get(token)
        if entry is None:
            labels = dict(token)
            entry = self.token_labels[token] = (labels, _identity(labels))
        return entry

    def sorted_bounds(self, page_order: tuple[float, ...]) -> tuple[tuple[float, ...], bool]:
        entry = self.bounds.get(page_order)
        if entry is None:
            bounds = tuple(sorted(page_order))
            entry = self.bounds[page_order] = (bounds, bounds == page_order)
        return entry


class _HistogramPlan:
    """Where each histogram of a family sits in its samples, for a family in
    the plain shape: each series' buckets consecutive, bounds strictly
    increasing up to +Inf, at most one _sum and one _count per series, no
    other suffix, and no two series of one (model_name, engine). Then a
    histogram is its slice of the values; anything else (folded `pid`
    series, a missing +Inf, odd `le`) takes the general path every time."""

    __slots__ = ("histograms",)

    def __init__(self, histograms: list[tuple[dict[str, str], tuple[float, ...], int, int, int | None, int | None]]):
        self.histograms = histograms  # (token, labels, bounds, first bucket, end, _sum index, _count index)

    @staticmethod
    def of(family: Family, cache: _SeriesCache) -> _HistogramPlan | None:
        groups: dict[int, list] = {}  # id(token) -> [token, bounds, first, end, sum index, count index]
        for index, (suffix, labels, _value) in enumerate(family.samples):
            if suffix == "_bucket":
                _labels, token, token_id, le, bound = cache.bucket(labels)
                if le is None or bound is None or bound != bound:
                    return None
                group = groups.get(token_id)
                if group is None:
                    group = groups[token_id] = [token, [], index, index, None, None]
                elif group[3] != index or (group[1] and bound <= group[1][-1]):
                    return None  # not consecutive, or bounds not increasing
                group[1].append(bound)
                group[3] = index + 1
            elif suffix == "_sum" or suffix == "_count":
                _labels, token, token_id = cache.other(labels)
                group = groups.get(token_id)
                if group is None:
                    group = groups[token_id] = [token, [], None, None, None, None]
                slot = 4 if suffix == "_sum" else 5
                if group[slot] is not None:
                    return None
                group[slot] = index
            elif suffix not in _NOT_HISTOGRAM_SERIES:
                return None
        histograms = []
        keys = set()
        for token, bounds, first, end, total, count in groups.values():
            if not bounds or bounds[-1] != math.inf:
                return None
            interned, in_order = cache.sorted_bounds(tuple(bounds))
            labels, key = cache.labels_of(token)
            if not in_order or key in keys:
                return None
            keys.add(key)
            histograms.append((token, labels, interned, first, end, total, count))
        return _HistogramPlan(histograms)

    def apply(self, family: Family) -> list[tuple[tuple, dict[str, str], Histogram]]:
        values = list(map(_VALUE, family.samples))
        return [(token, labels, _histogram_at(values, bounds, first, end, total, count))
                for token, labels, bounds, first, end, total, count in self.histograms]


def _histogram_at(values: list[float], bounds: tuple[float, ...], first: int, end: int, total: int | None,
                  count: int | None) -> Histogram:
    """The histogram whose buckets are values[first:end] (bounds increasing),
    its _sum and _count at those indexes where it has them."""
    # `+ 0.0` as the general path's first addition into an empty bucket.
    cumulative = tuple(map(operator.add, values[first:end], _ZEROS))
    return Histogram(bounds, cumulative, (values[total] if total is not None else None) or 0.0,
                     values[count] if count is not None else cumulative[-1])


_VALUE = operator.itemgetter(2)
# Series a histogram family may carry that are not its buckets, sum or count:
# `_created`, and the OpenMetrics suffixes the parser files under the family
# (a gauge histogram's `_gcount`/`_gsum`, an info series) that kvwatch does
# not read as a histogram.
_NOT_HISTOGRAM_SERIES = frozenset(("_created", "_info", "_gcount", "_gsum"))
_ZEROS = itertools.repeat(0.0)


def _histograms(family: Family, errors: list, cache: _SeriesCache | None = None) -> list[tuple[tuple, dict[str, str], Histogram]]:
    """Group a histogram family's samples into one Histogram per label set
    (minus `le`): (its token, its labels, the histogram). Series that differ
    only in folded labels stay apart here; the adapter folds them."""
    if cache is None:
        cache = _SeriesCache()
    if family.layout is not None:
        # Same layout as a page seen before: same suffixes and label sets in
        # the same order, so the same plan (made on the first such page, which
        # itself takes the general path below).
        known = cache.plans.get(family.name)
        if known is not None and known[0] is family.layout:
            if known[1] is not None:
                return known[1].apply(family)
        else:
            cache.plans[family.name] = (family.layout, _HistogramPlan.of(family, cache))
    # Groups are keyed by the id of their interned identity tuple (an int
    # hashes faster than a tuple of pairs); the token itself keeps the id live.
    groups: dict[int, list] = {}  # id(token) -> [token, buckets, sum, count]
    # The caches' dicts are read inline: this loop runs once per bucket line.
    bucket_entries = cache.buckets
    other_entries = cache.others
    for suffix, labels, value in family.samples:
        if suffix == "_bucket":
            entry = bucket_entries.get(id(labels))
            if entry is None:
                entry = cache.bucket(labels)
            _labels, token, token_id, le, bound = entry
            if le is None:
                continue
            group = groups.get(token_id)
            if group is None:
                group = groups[token_id] = [token, {}, None, None]
            if bound is None:  # an `le` that is not a number
                continue
            buckets = group[1]
            if bound in buckets:
                errors.append(f"{family.name}: duplicate bucket le={le!r} of {dict(token)} (value {value!r}; "
                              f"kept the first, {buckets[bound]!r})")
                continue
            buckets[bound] = value + 0.0
        elif suffix in _NOT_HISTOGRAM_SERIES:
            continue
        else:
            entry = other_entries.get(id(labels))
            if entry is None:
                entry = cache.other(labels)
            _labels, token, token_id = entry
            group = groups.get(token_id)
            if group is None:
                group = groups[token_id] = [token, {}, None, None]
            slot = 2 if suffix == "_sum" else 3 if suffix == "_count" else None
            if slot is not None:
                if group[slot] is not None:
                    errors.append(f"{family.name}: duplicate {suffix} of {dict(token)} (value {value!r}; kept the "
                                  f"first, {group[slot]!r})")
                else:
                    group[slot] = value

    found = []
    for token, buckets, total, count in groups.values():
        if not buckets or math.inf not in buckets:
            errors.append(f"{family.name}: histogram without a +Inf bucket, ignored")
            continue
        bounds, in_order = cache.sorted_bounds(tuple(buckets))
        cumulative = tuple(buckets.values()) if in_order else tuple(buckets[b] for b in bounds)
        histogram = Histogram(bounds, cumulative, total or 0.0, count if count is not None else cumulative[-1])
        labels, _key = cache.labels_of(token)
        found.append((token, labels, histogram))
    return found


_LAYOUT = operator.attrgetter("layout")
_SAMPLES = operator.attrgetter("samples")
_UNPLANNED = object()  # a page seen once: its plan is made if the next page has its layout


class _NoPlan(Exception):
    """A page the plan does not read (it takes VllmAdapter._read_page)."""


class _PagePlan:
    """What VllmAdapter._read_page does with a page, worked out once for its
    layout: where each value it reads goes (which engine, which key, which
    fold). A page with the same families in the same layouts differs only in
    its values, so reading it is applying the plan to them; the steps below
    mirror _read_page's, in its order, so dicts fill in the same order.

    Made only for a page whose families all have a layout (the cache
    configuration and LoRA aside: _read_info reads them every time), whose
    histograms all have a _HistogramPlan, and whose reading adds no parse
    error (no duplicate series); applied only to values without NaN (the
    reading skips those, so engines and folds could differ) and where the
    adapter keeps every engine. Any other page takes _read_page."""

    __slots__ = ("read", "sources", "engine_keys", "gauges", "created", "counters", "histograms", "model_counters")

    @staticmethod
    def of(families: dict[str, Family], series: _SeriesCache) -> _PagePlan | None:
        try:
            return _PagePlan(families, series)
        except _NoPlan:
            return None

    def __init__(self, families: dict[str, Family], series: _SeriesCache):
        for name, family in families.items():
            if family.layout is None and name != CACHE_CONFIG and name != LORA:
                raise _NoPlan
        # The families whose values are read, concatenated in this order;
        # a sample's position is its index in that list.
        self.read: list[str] = []
        offsets: dict[str, int] = {}

        def samples(name: str):
            """(position, suffix, labels) of each sample of a family read."""
            if name not in offsets:
                offsets[name] = sum(len(families[read].samples) for read in self.read)
                self.read.append(name)
            base = offsets[name]
            return [(base + index, suffix, labels) for index, (suffix, labels, _value) in enumerate(families[name].samples)]

        sources: dict[str, str] = {}
        engines: dict[tuple[str, str], int] = {}  # engine key -> its index, in the order of creation

        def engine_of(labels: dict[str, str]) -> int:
            return engines.setdefault(series.engine_key(labels), len(engines))

        gauges: list[tuple[int, str, int, bool]] = []  # (engine, key, position, whether the key is new)
        touched: set[tuple[int, str]] = set()

        def gauge(engine: int, key: str, position: int) -> None:
            gauges.append((engine, key, position, (engine, key) not in touched))
            touched.add((engine, key))

        # (engine, key) -> [fold key, {series token: position or histogram}]
        counter_parts: dict[tuple[int, str], list] = {}
        histogram_parts: dict[tuple[int, str], list] = {}

        def add_part(parts: dict, engine: int, key: str, token: tuple, value) -> None:
            entry = parts.get((engine, key))
            if entry is None:
                entry = parts[(engine, key)] = [(*list(engines)[engine], key), {}]  # the fold's key, as _read_page's
            if token in entry[1]:
                raise _NoPlan  # a duplicate series: a parse error
            entry[1][token] = value

        created: list[tuple[int, int]] = []

        for key, aliases in GAUGES.items():
            if _first_present(families, aliases, sources, key) is None:
                continue
            seen: set[tuple] = set()
            for position, suffix, labels in samples(sources[key]):
                if suffix == "":
                    engine = engine_of(labels)
                    token = series.other(labels)[1]
                    if token in seen:
                        raise _NoPlan
                    seen.add(token)
                    gauge(engine, key, position)

        for key, (name, dimension) in LABELLED_GAUGES.items():
            if name not in families:
                continue
            sources[key] = name
            for position, suffix, labels in samples(name):
                if suffix == "":
                    gauge(engine_of(labels), f"{key}/{labels.get(dimension, '')}", position)

        for key, aliases in COUNTERS.items():
            if _first_present(families, aliases, sources, key) is None:
                continue
            marks_restart = aliases[0] == RESTART_MARKER
            for position, suffix, labels in samples(sources[key]):
                if suffix == "_total" or suffix == "":
                    add_part(counter_parts, engine_of(labels), key, series.other(labels)[1], position)
                elif suffix == "_created" and marks_restart:
                    created.append((engine_of(labels), position))

        for key, (name, dimension) in LABELLED_COUNTERS.items():
            if name not in families:
                continue
            sources[key] = name
            for position, suffix, labels in samples(name):
                if suffix == "_total" or suffix == "":
                    add_part(counter_parts, engine_of(labels), f"{key}/{labels.get(dimension, '')}",
                             series.other(labels)[1], position)

        for key, (name, dimension, wanted) in COUNTER_FALLBACKS.items():
            if key in sources or name not in families or not families[name].samples:
                continue
            sources[key] = name
            for position, suffix, labels in samples(name):
                if (suffix == "_total" or suffix == "") and labels.get(dimension) == wanted:
                    add_part(counter_parts, engine_of(labels), key, series.other(labels)[1], position)

        def histograms(key: str, name: str, wanted: tuple[str, str] | None) -> None:
            family = families[name]
            known = series.plans.get(family.name)  # as _histograms keeps it
            if known is None or known[0] is not family.layout:
                known = series.plans[family.name] = (family.layout, _HistogramPlan.of(family, series))
            if known[1] is None:
                raise _NoPlan  # a family _histograms reads apart (and may find errors in)
            samples(name)
            base = offsets[name]
            for token, labels, bounds, first, end, total, count in known[1].histograms:
                if wanted is None or labels.get(wanted[0]) == wanted[1]:
                    add_part(histogram_parts, engine_of(labels), key, token,
                             (bounds, base + first, base + end, None if total is None else base + total,
                              None if count is None else base + count))

        for key, aliases in HISTOGRAMS.items():
            if _first_present(families, aliases, sources, key) is not None:
                histograms(key, sources[key], None)

        for key, (name, dimension, wanted) in HISTOGRAM_FALLBACKS.items():
            if key in sources or name not in families or not families[name].samples:
                continue
            sources[key] = name
            histograms(key, name, (dimension, wanted))

        for key, name in ENGINE_ONLY_GAUGES.items():
            if name not in families or not families[name].samples:
                continue
            sources[key] = name
            for position, suffix, labels in samples(name):
                if suffix == "":
                    for engine, (_model, number) in enumerate(engines):
                        if number == labels.get("engine", "0"):
                            gauge(engine, key, position)

        model_counters: list[tuple[int, str, int]] = []
        for key, (name, dimension) in MODEL_ONLY_COUNTERS.items():
            if name not in families or not families[name].samples:
                continue
            sources[key] = name
            first_engine: dict[str, int] = {}
            for engine, (model, number) in enumerate(engines):
                held = first_engine.get(model)
                if held is None or _engine_order(number) < _engine_order(list(engines)[held][1]):
                    first_engine[model] = engine
            for position, suffix, labels in samples(name):
                if suffix == "_total" or suffix == "":
                    engine = first_engine.get(labels.get("model_name", "unknown"))
                    if engine is not None:
                        model_counters.append((engine, f"{key}/{labels.get(dimension, '')}", position))

        self.read = tuple(self.read)
        self.sources = sources
        self.engine_keys = tuple(engines)
        self.gauges = tuple(gauges)
        self.created = tuple(created)
        self.counters = tuple((engine, key, fold_key, tuple(parts.items()))
                              for (engine, key), (fold_key, parts) in counter_parts.items())
        self.histograms = tuple((engine, key, fold_key + ("histogram",), tuple(parts.items()))
                                for (engine, key), (fold_key, parts) in histogram_parts.items())
        self.model_counters = tuple(model_counters)

    def apply(self, snapshot: Snapshot, families: dict[str, Family], folds: _Folds) -> bool:
        """Reads the page into the snapshot as _read_page would; False,
        having changed nothing, where a value read is NaN (or not a number)."""
        values = list(map(_VALUE, itertools.chain.from_iterable(map(_SAMPLES, map(families.__getitem__, self.read)))))
        try:
            total = sum(values)  # NaN if any value is (or +Inf and -Inf are both there): one test in C
        except TypeError:
            return False
        if total != total:
            return False
        snapshot.sources.update(self.sources)
        engines = [EngineSnapshot(model, number) for model, number in self.engine_keys]
        snapshot.engines.update(zip(self.engine_keys, engines))
        for engine, key, position, new in self.gauges:
            gauges = engines[engine].gauges
            # As _fold_max.
            gauges[key] = values[position] if new else max(gauges[key], values[position])
        for engine, position in self.created:
            engine = engines[engine]
            engine.created = values[position] if engine.created is None else min(engine.created, values[position])
        # One series of a key the folds hold nothing for: fold would hand its
        # value back as it is (marking the key seen only matters to keys in
        # `last`), so the value is taken without building fold's dict.
        held = folds.last
        for engine, key, fold_key, parts in self.counters:
            if len(parts) == 1 and fold_key not in held:
                value = values[parts[0][1]]
            else:
                value = folds.fold(fold_key, {token: values[position] for token, position in parts},
                                   _fell, operator.add)
            engines[engine].counters[key] = value
        for engine, key, fold_key, parts in self.histograms:
            if len(parts) == 1 and fold_key not in held:
                value = _histogram_at(values, *parts[0][1])
            else:
                value = folds.fold(fold_key, {token: _histogram_at(values, *where) for token, where in parts},
                                   _histogram_fell, _histogram_plus)
            engines[engine].histograms[key] = value
        folds.forget_unseen()
        for engine, key, position in self.model_counters:
            counters = engines[engine].counters
            counters[key] = counters.get(key, 0.0) + values[position]
        return True
