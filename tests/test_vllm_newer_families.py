"""vLLM's newer KV-cache families: read, re-exported, derived, and said to be
absent (never 0) where the page lacks them.

Pages are the real 0.32 captures (tests/fixtures/vllm-0.32-cpu), which carry
prompt_tokens_by_source, request_num_preemptions, admission_rejections and
engine_sleep_state. Families the captures lack (the --kv-cache-metrics
residency histograms, OffloadingConnector and NIXL counters, engine_healthy,
prompt_tokens_recomputed) are appended as lines WRITTEN FROM vLLM'S SOURCE
(names, types, labels and buckets as vllm/v1/metrics/loggers.py, the
offloading and nixl connector metrics and the fault-tolerance collector
register them), not captured from a running engine; each such block says so.
"""

import pytest

from kvwatch.engines.vllm import VllmAdapter
from kvwatch.sidecar.report import dark_signals
from kvwatch.signals import evaluate_window
from kvwatch.window import Window

KEY = ("tiny-llama", "0")
RESIDENCY_BOUNDS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600,
                    1200, 1800)


def capture(fixtures_dir, name):
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def residency_lines(name, help_text, counts):
    """A --kv-cache-metrics histogram as loggers.py registers it (buckets from
    the kv_cache_residency family). WRITTEN FROM vLLM'S SOURCE, not captured.
    `counts` maps an upper bound to the observations in that bucket."""
    lines = [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} histogram"]
    total = 0.0
    weighted = 0.0
    for bound in RESIDENCY_BOUNDS + (float("inf"),):
        total += counts.get(bound, 0)
        weighted += counts.get(bound, 0) * (bound if bound != float("inf") else 1800)
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        lines.append(f'vllm:{name}_bucket{{engine="0",le="{le}",model_name="tiny-llama"}} {total}')
    lines.append(f'vllm:{name}_count{{engine="0",model_name="tiny-llama"}} {total}')
    lines.append(f'vllm:{name}_sum{{engine="0",model_name="tiny-llama"}} {weighted}')
    return "\n".join(lines) + "\n"


def residency(idle_counts, gap_counts):
    return (residency_lines("kv_block_lifetime_seconds", "Histogram of KV cache block lifetime from allocation to "
                            "eviction. Sampled metrics (controlled by --kv-cache-metrics-sample).", idle_counts)
            + residency_lines("kv_block_idle_before_evict_seconds", "Histogram of idle time before KV cache block "
                              "eviction. Sampled metrics (controlled by --kv-cache-metrics-sample).", idle_counts)
            + residency_lines("kv_block_reuse_gap_seconds", "Histogram of time gaps between consecutive KV cache "
                              "block accesses. Only the most recent accesses are recorded (ring buffer). Sampled "
                              "metrics (controlled by --kv-cache-metrics-sample).", gap_counts))


# OffloadingConnector counters, current and deprecated forms, and NIXL's
# failure counters. WRITTEN FROM vLLM'S SOURCE, not captured.
OFFLOAD_NEW = """# HELP vllm:kv_offload_load_bytes_total Number of bytes loaded
# TYPE vllm:kv_offload_load_bytes_total counter
vllm:kv_offload_load_bytes_total{engine="0",model_name="tiny-llama"} 1000.0
# HELP vllm:kv_offload_store_bytes_total Number of bytes stored
# TYPE vllm:kv_offload_store_bytes_total counter
vllm:kv_offload_store_bytes_total{engine="0",model_name="tiny-llama"} 5000.0
# HELP vllm:kv_offload_cpu_cache_usage_perc CPU cache usage
# TYPE vllm:kv_offload_cpu_cache_usage_perc gauge
vllm:kv_offload_cpu_cache_usage_perc{engine="0",model_name="tiny-llama"} 0.0
"""
OFFLOAD_DEPRECATED = """# HELP vllm:kv_offload_total_bytes_total Number of bytes offloaded by KV connector (deprecated)
# TYPE vllm:kv_offload_total_bytes_total counter
vllm:kv_offload_total_bytes_total{engine="0",model_name="tiny-llama",transfer_type="CPU_to_GPU"} 1000.0
vllm:kv_offload_total_bytes_total{engine="0",model_name="tiny-llama",transfer_type="GPU_to_CPU"} 5000.0
"""
NIXL = """# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers.
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny-llama"} 2.0
"""
# The fault-tolerance collector: labels `engine` only. WRITTEN FROM vLLM'S SOURCE.
HEALTHY = """# HELP vllm:engine_healthy Whether the engine reports healthy under fault tolerance.
# TYPE vllm:engine_healthy gauge
vllm:engine_healthy{engine="0"} 1.0
"""
# vLLM 0.16-0.19 only. WRITTEN FROM vLLM'S SOURCE.
RECOMPUTED = """# HELP vllm:prompt_tokens_recomputed_total Number of cached tokens recomputed for forward pass.
# TYPE vllm:prompt_tokens_recomputed_total counter
vllm:prompt_tokens_recomputed_total{engine="0",model_name="tiny-llama"} 3.0
"""


def window_of(pages, spacing=10.0):
    adapter = VllmAdapter()
    window = Window(3600)
    for i, page in enumerate(pages):
        window.add(adapter.adapt(page, at=1000 + i * spacing))
    return window


def values(window, engine=True):
    per_engine, per_model = evaluate_window(window)
    return (per_engine if engine else per_model)[0]


# --- reading ------------------------------------------------------------------


def test_real_032_capture_reads_by_source_rejections_sleep_and_preemptions(fixtures_dir):
    snapshot = VllmAdapter().adapt(capture(fixtures_dir, "after"))
    engine = snapshot.engines[KEY]
    assert engine.counters["prompt_tokens_by_source/local_cache_hit"] == 3584
    assert engine.counters["prompt_tokens_cached_by_source/device"] == 3584
    # admission_rejections has no engine label: booked on the model's engine
    assert engine.counters["admission_rejections/max_num_queued_reqs"] == 0
    assert engine.gauges["sleep_state/awake"] == 1
    assert engine.histograms["preemptions_per_request"].count == 38
    assert list(snapshot.engines) == [KEY]


def test_deprecated_offload_form_is_never_added_to_the_current_one(fixtures_dir):
    both = VllmAdapter().adapt(capture(fixtures_dir, "after") + OFFLOAD_NEW + OFFLOAD_DEPRECATED).engines[KEY]
    assert both.counters["offload_load_bytes"] == 1000  # not 2000
    assert both.counters["offload_store_bytes"] == 5000
    old_only = VllmAdapter().adapt(capture(fixtures_dir, "after") + OFFLOAD_DEPRECATED)
    assert old_only.engines[KEY].counters["offload_load_bytes"] == 1000
    assert old_only.sources["offload_load_bytes"] == "kv_offload_total_bytes"


def test_engine_only_and_model_only_families_invent_no_engine(fixtures_dir):
    page = capture(fixtures_dir, "after").replace('engine="0"', 'engine="2"') + HEALTHY.replace('"0"', '"2"')
    snapshot = VllmAdapter().adapt(page)
    assert list(snapshot.engines) == [("tiny-llama", "2")]
    engine = snapshot.engines[("tiny-llama", "2")]
    assert engine.gauges["engine_healthy"] == 1
    assert "admission_rejections/max_num_queued_tokens" in engine.counters


def test_rust_front_end_openmetrics_page_reads_like_the_python_one():
    """VLLM_USE_RUST_FRONTEND=1 serves OpenMetrics 1.0 without negotiation
    (the Rust prometheus-client crate): `# TYPE` names the counter without
    `_total`, labels in struct order (model_name, engine), a histogram's
    _sum and _count before its buckets, `# EOF` last. WRITTEN FROM vLLM'S
    SOURCE (the Rust front end's metric registrations), not captured."""
    page = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{model_name="m",engine="0"} 0.5
# HELP vllm:prompt_tokens_by_source Number of prompt tokens by source.
# TYPE vllm:prompt_tokens_by_source counter
vllm:prompt_tokens_by_source_total{model_name="m",engine="0",source="local_compute"} 30
vllm:prompt_tokens_by_source_total{model_name="m",engine="0",source="local_cache_hit"} 70
# HELP vllm:kv_block_reuse_gap_seconds Histogram of time gaps between consecutive KV cache block accesses.
# TYPE vllm:kv_block_reuse_gap_seconds histogram
vllm:kv_block_reuse_gap_seconds_sum{model_name="m",engine="0"} 7.0
vllm:kv_block_reuse_gap_seconds_count{model_name="m",engine="0"} 2
vllm:kv_block_reuse_gap_seconds_bucket{le="1.0",model_name="m",engine="0"} 0
vllm:kv_block_reuse_gap_seconds_bucket{le="5.0",model_name="m",engine="0"} 1
vllm:kv_block_reuse_gap_seconds_bucket{le="+Inf",model_name="m",engine="0"} 2
# EOF
"""
    # the page is valid OpenMetrics, as the reference parser reads it
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families
    assert {f.name for f in om_families(page)} >= {"vllm:prompt_tokens_by_source"}
    snapshot = VllmAdapter().adapt(page)
    assert snapshot.parse_errors == []
    engine = snapshot.engines[("m", "0")]
    assert engine.gauges["kv_usage"] == 0.5
    assert engine.counters["prompt_tokens_by_source/local_cache_hit"] == 70
    gap = engine.histograms["kv_block_reuse_gap"]
    assert (gap.bounds[:2], gap.cumulative, gap.count, gap.sum) == ((1.0, 5.0), (0.0, 1.0, 2.0), 2.0, 7.0)


# --- unknown is not zero --------------------------------------------------------


def test_sources_present_and_dark_signals_name_the_flag(fixtures_dir):
    real = VllmAdapter().adapt(capture(fixtures_dir, "after"))
    present = real.present()
    assert present["prompt_tokens_by_source"] is True
    assert present["kv_block_reuse_gap_seconds"] is False
    assert present["kv_offload_load_bytes"] is False
    dark = {d["signal"]: d for d in dark_signals(real)}
    assert dark["kvwatch_kv_cache_reuse_shortfall_blocks"]["lit_by"] == ["--kv-cache-metrics"]
    assert "kv_block_reuse_gap_seconds" in dark["kvwatch_kv_cache_reuse_shortfall_blocks"]["missing_families"]
    assert "OffloadingConnector" in dark["kvwatch_kv_offload_bytes_per_second"]["lit_by"][0]
    assert "kvwatch_prompt_tokens_from_cache_ratio" not in dark
    lit = VllmAdapter().adapt(capture(fixtures_dir, "after") + residency({1: 5}, {10: 5}) + OFFLOAD_NEW)
    dark = {d["signal"] for d in dark_signals(lit)}
    assert "kvwatch_kv_cache_reuse_shortfall_blocks" not in dark
    assert "kvwatch_kv_offload_bytes_per_second" not in dark


def test_gated_signals_are_absent_never_zero_and_the_exporter_says_which_families_were_there(fixtures_dir):
    from kvwatch.sidecar.collector import KvwatchCollector
    from kvwatch.pipeline.monitor import State

    window = window_of([capture(fixtures_dir, "load"), capture(fixtures_dir, "long-load")])
    row = values(window)
    for name in ("kvwatch_kv_cache_reuse_shortfall_blocks", "kvwatch_kv_cache_reuse_shortfall_bytes",
                 "kvwatch_kv_offload_bytes_per_second"):
        assert row.values[name] is None

    class Monitor:
        state = State(up=True, snapshot=window.latest, per_engine=(row,))

    text = "".join(
        f"{s.name}{s.labels} {s.value}\n" for family in KvwatchCollector(Monitor()).collect() for s in family.samples)
    assert "kvwatch_source_present{'family': 'kv_block_lifetime_seconds'} 0.0" in text
    assert "kvwatch_source_present{'family': 'prompt_tokens_by_source'} 1.0" in text
    assert "kvwatch_kv_cache_reuse_shortfall_blocks{" not in text
    assert "kvwatch_kv_cache_free_blocks{" in text


# --- derived signals on real captures ------------------------------------------


def test_whole_blocks_token_estimate_and_trend_on_the_burst(fixtures_dir):
    window = window_of([capture(fixtures_dir, n) for n in ("prefix-load", "load")])
    v = values(window).values
    # usage 0.99212598 = 126 / 127: one of the 128 blocks is vLLM's null block
    assert v["kvwatch_kv_cache_used_blocks"] == 126
    assert v["kvwatch_kv_cache_free_blocks"] == 1
    # 6 running, block 32: (126 x 32 - 6 x 31 / 2) / (127 x 32)
    assert v["kvwatch_kv_cache_token_usage_estimate_ratio"] == pytest.approx((126 * 32 - 6 * 15.5) / (127 * 32))
    # 6 running in 126 blocks: 21 blocks each, so 127 blocks hold 6 such requests
    assert v["kvwatch_kv_cache_requests_fit_now"] == 6
    # usage 0.14173 -> 0.99213 in 10 s: full in (1 - 0.99213) / 0.085039 s
    slope = (0.9921259842519685 - 0.1417322834645669) / 10
    assert v["kvwatch_kv_cache_exhaustion_eta_seconds"] == pytest.approx((1 - 0.9921259842519685) / slope)


def test_no_trend_once_the_cache_empties(fixtures_dir):
    v = values(window_of([capture(fixtures_dir, n) for n in ("load", "long-load", "after")])).values
    assert v["kvwatch_kv_cache_exhaustion_eta_seconds"] is None
    assert v["kvwatch_kv_cache_free_blocks"] == 127
    assert v["kvwatch_kv_cache_requests_fit_now"] is None  # nothing running: no footprint to divide


def test_lookup_hit_ratio_and_share_served_from_cache_are_two_numbers(fixtures_dir):
    v = values(window_of([capture(fixtures_dir, n) for n in ("idle", "prefix-load")])).values
    # by source: local_compute 592, local_cache_hit 2048, external 0
    assert v["kvwatch_prompt_tokens_from_cache_ratio"] == {"local": pytest.approx(2048 / 2640), "external": 0.0}


def test_preemption_repeat_share_from_request_num_preemptions(fixtures_dir):
    v = values(window_of([capture(fixtures_dir, n) for n in ("load", "long-load")])).values
    # 24 requests finished, 22 with at most one preemption, 2 with two or more;
    # 12 preemptions in all: at least 2 x 2 / 12 fell on the repeated ones
    assert v["kvwatch_preemptions_on_repeat_requests_ratio"] == pytest.approx(4 / 12)
    # no preemption among the finished requests: nothing to apportion
    v = values(window_of([capture(fixtures_dir, n) for n in ("idle", "prefix-load")])).values
    assert v["kvwatch_preemptions_on_repeat_requests_ratio"] is None
    assert v["kvwatch_admission_rejections_per_second"] == {"max_num_queued_reqs": 0.0, "max_num_queued_tokens": 0.0}
    assert v["kvwatch_engine_sleeping"] == 0.0


def test_reuse_shortfall_from_residency_histograms(fixtures_dir):
    # Residency WRITTEN FROM vLLM'S SOURCE on top of the real captures: blocks
    # evicted after ~1 s idle while reuses come ~10 s apart.
    first = capture(fixtures_dir, "prefix-load") + residency({}, {})
    second = capture(fixtures_dir, "load") + residency({1: 10}, {10: 10})
    v = values(window_of([first, second])).values
    # medians by interpolation: idle 0.5 + 0.5 x 0.5 = 0.75 s, gap 5 + 5 x 0.5 = 7.5 s;
    # free pool at the window's mean usage (0.14173 + 0.99213) / 2 of 127 blocks
    pool = 127 * (1 - (0.1417322834645669 + 0.9921259842519685) / 2)
    import math
    assert v["kvwatch_kv_cache_reuse_shortfall_blocks"] == math.ceil(pool * (7.5 / 0.75 - 1))
    # bytes per block: 4194304 / 128
    assert v["kvwatch_kv_cache_reuse_shortfall_bytes"] == math.ceil(pool * 9) * 4194304 / 128
    # blocks outliving the reuse gap: nothing lacking
    third = capture(fixtures_dir, "long-load") + residency({1: 10, 60: 30}, {10: 10, 1: 40})
    v = values(window_of([second, third])).values
    assert v["kvwatch_kv_cache_reuse_shortfall_blocks"] == 0.0


# --- answers in the diagnosis ----------------------------------------------------


def test_exhaustion_finding_says_broad_pressure_from_preemptions_per_request(fixtures_dir):
    from kvwatch.diagnose import diagnose

    window = window_of([capture(fixtures_dir, n) for n in ("idle", "prefix-load", "load", "long-load")])
    per_engine, _ = evaluate_window(window)
    findings = [f for f in diagnose(window, per_engine, (), {}) if f.symptom == "exhaustion"]
    assert findings
    evidence = findings[0].evidence
    # 32 finished, 30 with at most one preemption, 12 preemptions: >= 4/12 on repeats
    assert evidence["preemptions_on_repeat_requests_ratio_at_least"] == pytest.approx(4 / 12, abs=1e-4)
    assert evidence["preemption_shape"] == "broad_pressure"


class _Ctx:
    def __init__(self, histogram, block_size):
        self.cache_config = {"block_size": str(block_size)}
        self._histogram = histogram

    def histogram(self, key):
        return self._histogram if key == "prompt_len" else None


def test_block_floor_tells_a_prefix_shorter_than_a_block_from_no_shared_prefix(fixtures_dir):
    from kvwatch.diagnose.hit_rate import block_floor

    window = window_of([capture(fixtures_dir, n) for n in ("prefix-load", "load")])
    prompts = window.increase(KEY).histograms["prompt_len"]  # 5 prompts in (500, 1000]
    assert prompts.count == 5
    # block 32: no prompt within one block, so a 0 % ratio means no shared prefix
    assert block_floor(_Ctx(prompts, 32))["no_reuse_kind"] == "no_shared_prefix"
    # a 1024-token block: every prompt fits in one block, so no prefix can hit
    floor = block_floor(_Ctx(prompts, 1024))
    assert floor["prompts_within_one_block_ratio_at_least"] == 1.0
    assert floor["no_reuse_kind"] == "prefix_shorter_than_block"


def test_block_floor_inside_a_prompt_bucket_is_decided_by_the_mean_prompt():
    """vLLM's prompt-length buckets are 1, 2, 5, 10, 20, 50, 100, ... (the
    real 0.32 capture's bounds): block_size 32 lies inside (20, 50]. Prompts
    of 28 tokens all fit one block; spread uniformly over the bucket they
    would read as 27 % within it."""
    from kvwatch.diagnose.hit_rate import block_floor
    from kvwatch.snapshot import Histogram

    bounds = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, float("inf"))

    def prompts(lengths):
        return Histogram(bounds, tuple(float(sum(1 for n in lengths if n <= b)) for b in bounds),
                         float(sum(lengths)), float(len(lengths)))

    floor = block_floor(_Ctx(prompts([28] * 40), 32))
    assert floor["no_reuse_kind"] == "prefix_shorter_than_block"
    assert (floor["prompts_within_one_block_ratio_at_least"], floor["prompts_within_one_block_ratio_at_most"]) == (0, 1)
    assert floor["prompt_tokens_mean"] == 28
    assert "(20, 50]" in floor["prompt_buckets_around_block_size"]
    # prompts of 45 tokens share the bucket but not the block
    assert block_floor(_Ctx(prompts([45] * 40), 32))["no_reuse_kind"] == "no_shared_prefix"
    # a bound on the block size decides alone
    assert block_floor(_Ctx(prompts([18] * 30 + [600] * 10), 20))["no_reuse_kind"] == "prefix_shorter_than_block"


# --- offload size histograms and NIXL transfers ----------------------------------


def _histogram_lines(name, labels, bounds, observations, help_text):
    """A histogram as prometheus_client writes it, `observations` being the
    values observed. WRITTEN FROM vLLM'S SOURCE (names, bucket bounds and
    labels as the connectors register them), not captured."""
    lines = [f"# HELP vllm:{name} {help_text}", f"# TYPE vllm:{name} histogram"]
    for bound in tuple(bounds) + (float("inf"),):
        le = "+Inf" if bound == float("inf") else repr(float(bound))
        lines.append(f'vllm:{name}_bucket{{{labels},le="{le}"}} {float(sum(1 for o in observations if o <= bound))}')
    lines.append(f"vllm:{name}_count{{{labels}}} {float(len(observations))}")
    lines.append(f"vllm:{name}_sum{{{labels}}} {float(sum(observations))}")
    return "\n".join(lines) + "\n"


# offloading/metrics.py TRANSFER_SIZE_BUCKETS
OFFLOAD_SIZE_BOUNDS = (1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)
LABELS = 'engine="0",model_name="tiny-llama"'
OFFLOAD_SIZES_NEW = (
    _histogram_lines("kv_offload_load_size", LABELS, OFFLOAD_SIZE_BOUNDS, [3e6, 3e6],
                     "Histogram of KV offload load operation size, in bytes.")
    + _histogram_lines("kv_offload_store_size", LABELS, OFFLOAD_SIZE_BOUNDS, [30e6, 50e6, 70e6],
                       "Histogram of KV offload store operation size, in bytes."))
OFFLOAD_SIZES_DEPRECATED = (
    "# HELP vllm:kv_offload_size Histogram of KV offload transfer size, in bytes.\n"
    "# TYPE vllm:kv_offload_size histogram\n"
    + "".join(line + "\n" for line in _histogram_lines(
        "kv_offload_size", LABELS + ',transfer_type="CPU_to_GPU"', OFFLOAD_SIZE_BOUNDS, [3e6, 3e6], "").splitlines()[2:])
    + "".join(line + "\n" for line in _histogram_lines(
        "kv_offload_size", LABELS + ',transfer_type="GPU_to_CPU"', OFFLOAD_SIZE_BOUNDS, [30e6, 50e6, 70e6],
        "").splitlines()[2:]))
# nixl/stats.py NixlPromMetrics: xfer time buckets from 0.005, post time from
# 0.001, bytes 2^(10+i) for i = 1, 3, ..., 23, descriptors 10 ... 50000; the
# failure counters.
_NIXL_TIMES = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_TRANSFERS = (
    _histogram_lines("nixl_xfer_time_seconds", LABELS, _NIXL_TIMES[1:], [0.02, 0.04, 0.6],
                     "Histogram of transfer duration for NIXL KV Cache transfers.")
    + _histogram_lines("nixl_post_time_seconds", LABELS, _NIXL_TIMES, [0.002, 0.002, 0.003],
                       "Histogram of transfer post time for NIXL KV Cache transfers.")
    + _histogram_lines("nixl_bytes_transferred", LABELS, [2 ** (10 + i) for i in range(1, 25, 2)],
                       [2 ** 20, 2 ** 20, 2 ** 24], "Histogram of bytes transferred per NIXL KV Cache transfers.")
    + _histogram_lines("nixl_num_descriptors", LABELS,
                       (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000), [64, 64, 128],
                       "Histogram of number of descriptors per NIXL  KV Cache transfers.")
    + """# HELP vllm:nixl_num_failed_transfers_total Number of failed NIXL KV Cache transfers, including handshake and notification failures.
# TYPE vllm:nixl_num_failed_transfers_total counter
vllm:nixl_num_failed_transfers_total{engine="0",model_name="tiny-llama"} 3.0
# HELP vllm:nixl_num_failed_notifications_total Number of failed NIXL KV Cache notifications.
# TYPE vllm:nixl_num_failed_notifications_total counter
vllm:nixl_num_failed_notifications_total{engine="0",model_name="tiny-llama"} 1.0
# HELP vllm:nixl_num_kv_expired_reqs_total Number of requests that had their KV expire.
# TYPE vllm:nixl_num_kv_expired_reqs_total counter
vllm:nixl_num_kv_expired_reqs_total{engine="0",model_name="tiny-llama"} 4.0
# HELP vllm:nixl_num_notifications_after_expiry_total Number of completion notifications for requests that were no longer tracked.
# TYPE vllm:nixl_num_notifications_after_expiry_total counter
vllm:nixl_num_notifications_after_expiry_total{engine="0",model_name="tiny-llama"} 2.0
""")


def test_offload_size_histograms_read_the_current_form_and_never_add_the_deprecated_one(fixtures_dir):
    base = capture(fixtures_dir, "after")
    both = VllmAdapter().adapt(base + OFFLOAD_SIZES_NEW + OFFLOAD_SIZES_DEPRECATED)
    assert both.parse_errors == []
    engine = both.engines[KEY]
    load, store = engine.histograms["offload_load_size"], engine.histograms["offload_store_size"]
    assert (load.count, load.sum) == (2, 6e6)  # not 4 and 12e6
    assert (store.count, store.sum) == (3, 150e6)
    assert load.bounds[:10] == OFFLOAD_SIZE_BOUNDS
    assert both.sources["offload_load_size"] == "kv_offload_load_size"
    # the deprecated form alone: split by transfer_type, never summed across it
    old = VllmAdapter().adapt(base + OFFLOAD_SIZES_DEPRECATED)
    engine = old.engines[KEY]
    assert (engine.histograms["offload_load_size"].count, engine.histograms["offload_load_size"].sum) == (2, 6e6)
    assert (engine.histograms["offload_store_size"].count, engine.histograms["offload_store_size"].sum) == (3, 150e6)
    assert old.sources["offload_store_size"] == "kv_offload_size"


def test_nixl_transfer_histograms_and_failure_counters_are_read(fixtures_dir):
    snapshot = VllmAdapter().adapt(capture(fixtures_dir, "after") + NIXL_TRANSFERS)
    assert snapshot.parse_errors == []
    engine = snapshot.engines[KEY]
    assert engine.histograms["nixl_transfer_time"].count == 3
    assert engine.histograms["nixl_transfer_time"].bounds[0] == 0.005
    assert engine.histograms["nixl_post_time"].bounds[0] == 0.001
    assert engine.histograms["nixl_transfer_bytes"].sum == 2 * 2 ** 20 + 2 ** 24
    assert engine.histograms["nixl_descriptors"].count == 3
    assert engine.counters["nixl_failed_transfers"] == 3
    assert engine.counters["nixl_failed_notifications"] == 1
    assert engine.counters["nixl_expired_requests"] == 4
    assert engine.counters["nixl_notifications_after_expiry"] == 2
    present = snapshot.present()
    assert present["nixl_xfer_time_seconds"] and present["nixl_num_notifications_after_expiry"]


def test_offload_and_nixl_histograms_are_re_exported_with_the_flag_that_lights_them(fixtures_dir):
    from prometheus_client.parser import text_string_to_metric_families

    from kvwatch.sidecar.collector import KvwatchCollector
    from kvwatch.pipeline.monitor import State

    page = capture(fixtures_dir, "after") + OFFLOAD_SIZES_DEPRECATED + NIXL_TRANSFERS
    window = window_of([page, page])
    row = values(window)

    class Monitor:
        state = State(up=True, snapshot=window.latest, per_engine=(row,))

    from prometheus_client import CollectorRegistry, generate_latest
    registry = CollectorRegistry()
    registry.register(KvwatchCollector(Monitor()))
    exported = {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(generate_latest(registry).decode())
                for s in family.samples}
    ident = (("engine", "0"), ("model_name", "tiny-llama"))
    assert exported[("kvwatch_engine_kv_offload_load_size_bytes_count", ident)] == 2
    assert exported[("kvwatch_engine_kv_offload_store_size_bytes_sum", ident)] == 150e6
    assert exported[("kvwatch_engine_kv_offload_store_size_bytes_bucket", (("engine", "0"), ("le", "60000000.0"), ("model_name", "tiny-llama")))] == 2
    assert exported[("kvwatch_engine_nixl_transfer_seconds_count", ident)] == 3
    assert exported[("kvwatch_engine_nixl_transfer_bytes_sum", ident)] == 2 * 2 ** 20 + 2 ** 24
    assert exported[("kvwatch_engine_nixl_descriptors_count", ident)] == 3
    assert exported[("kvwatch_engine_nixl_post_seconds_count", ident)] == 3
    assert exported[("kvwatch_engine_nixl_notifications_after_expiry_total", ident)] == 2
    assert exported[("kvwatch_source_present", (("family", "nixl_bytes_transferred"),))] == 1
    assert exported[("kvwatch_source_present", (("family", "nixl_xfer_time_seconds"),))] == 1
    # on a page without a connector, the families are absent and say which flag lights them
    from kvwatch.engines.vllm import GATES
    assert "NixlConnector" in GATES["nixl_transfer_time"] and "OffloadingConnector" in GATES["offload_store_size"]


# --- hybrid models: cache_config_info's mamba_* labels -----------------------------


def _hybrid(page):
    """The real capture's cache_config_info as vLLM 0.32 writes it for a
    hybrid (attention + Mamba) model with prefix caching: MambaModelConfig
    sets mamba_cache_mode "align" and mamba_block_size; block_size is the
    smallest over the KV groups, so blocks x block_size is not the stated
    capacity. WRITTEN FROM vLLM'S SOURCE (vllm/model_executor/models/config.py),
    not captured: the tier's tiny model has no Mamba layers."""
    return (page.replace('mamba_block_size="None"', 'mamba_block_size="64"')
            .replace('mamba_cache_mode="none"', 'mamba_cache_mode="align"')
            .replace('mamba_page_size_padded="None"', 'mamba_page_size_padded="65536"')
            .replace('kv_cache_size_tokens="4096"', 'kv_cache_size_tokens="8192"'))


def test_hybrid_model_mamba_labels_in_capacity_and_dark_whole_block_signals(fixtures_dir):
    from kvwatch.capacity.live import read_live_capacity
    from kvwatch.snapshot import hybrid_cache

    page = capture(fixtures_dir, "load")
    assert hybrid_cache(VllmAdapter().adapt(page).cache_config["0"]) is None  # defaults on an attention-only model
    assert read_live_capacity(page)["engines"][0]["hybrid"] is None
    hybrid = _hybrid(page)
    engine = read_live_capacity(hybrid)["engines"][0]
    assert engine["hybrid"] == {"mamba_block_size": 64.0, "mamba_cache_mode": "align", "mamba_cache_dtype": "auto",
                                "mamba_ssm_cache_dtype": "float32", "mamba_page_size_padded": 65536.0}
    window = window_of([_hybrid(capture(fixtures_dir, "prefix-load")), hybrid])
    assert values(window).values["kvwatch_kv_cache_used_blocks"] is None
    dark = {d["signal"]: d for d in dark_signals(window.latest)}
    assert "mamba_block_size=64" in dark["kvwatch_kv_cache_free_blocks"]["why"]
    assert "mamba_cache_mode=align" in dark["kvwatch_kv_cache_token_usage_estimate_ratio"]["why"]
    assert "kvwatch_kv_cache_free_blocks" not in {d["signal"] for d in dark_signals(VllmAdapter().adapt(page))}


def test_hybrid_model_exhaustion_evidence_and_block_floor_in_mamba_blocks(fixtures_dir):
    from kvwatch.diagnose import diagnose
    from kvwatch.diagnose.hit_rate import block_floor
    from kvwatch.snapshot import Histogram

    window = window_of([_hybrid(capture(fixtures_dir, n)) for n in ("idle", "prefix-load", "load", "long-load")])
    per_engine, _ = evaluate_window(window)
    findings = [f for f in diagnose(window, per_engine, (), {}) if f.symptom == "exhaustion"]
    assert findings and findings[0].evidence["mamba_cache_mode"] == "align"
    assert findings[0].evidence["mamba_block_size"] == 64
    assert "fixed-size Mamba state" in findings[0].evidence["hybrid_model"]
    # prompts of 50 tokens: past one attention block of 32, within one Mamba block of 64
    bounds = (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, float("inf"))
    prompts = Histogram(bounds, (0, 0, 0, 0, 0, 40, 40, 40), 2000.0, 40.0)

    class Ctx(_Ctx):
        def __init__(self, mode):
            super().__init__(prompts, 32)
            self.cache_config.update(mamba_block_size="64", mamba_cache_mode=mode)

    floor = block_floor(Ctx("align"))
    assert floor["no_reuse_kind"] == "prefix_shorter_than_block" and floor["block_floor_tokens"] == 64
    assert "mamba_cache_mode align" in floor["block_floor_unit"]
    assert block_floor(Ctx("none"))["no_reuse_kind"] == "no_shared_prefix"
