"""Query results written back as pages for the engine adapter: the sidecars'
kvwatch_engine_* series read as the vLLM series they re-export, vLLM's own
series under any version's spelling, and the chunk planner's bounds."""

from kvwatch.engines import make_adapter
from kvwatch.history.pages import Pages
from kvwatch.history.query import MAX_POINTS, PrometheusClient, choose_step, merge_selector

TARGET = {"job": "kvwatch", "instance": "10.0.0.1:9400", "model_name": "m", "engine": "0"}


def matrix(name, value, **labels):
    return {"metric": {"__name__": name, **TARGET, **labels}, "values": [[100.0, str(value)], [130.0, str(value * 2)]]}


def test_kvwatch_engine_series_read_back_as_the_vllm_series_they_carry():
    pages = Pages(100.0, 30.0, 2, "kvwatch")
    pages.add([matrix("kvwatch_engine_kv_cache_usage_ratio", 0.25),
               matrix("kvwatch_engine_prefix_cache_queries_total", 1000),
               matrix("kvwatch_engine_prefix_cache_hits_total", 400),
               matrix("kvwatch_engine_requests_waiting_by_reason", 2, reason="capacity"),
               matrix("kvwatch_engine_info", 1, block_size="16", num_gpu_blocks="100"),
               matrix("kvwatch_engine_time_to_first_token_seconds_bucket", 3, le="0.5"),
               matrix("kvwatch_engine_time_to_first_token_seconds_bucket", 5, le="+Inf"),
               matrix("kvwatch_engine_time_to_first_token_seconds_sum", 1.5),
               matrix("kvwatch_engine_time_to_first_token_seconds_count", 5)])
    (replica,) = pages.replicas.values()
    assert replica.labels == {"job": "kvwatch", "instance": "10.0.0.1:9400"}
    snapshot = make_adapter().adapt(replica.page(1), at=130.0)
    engine = snapshot.engines[("m", "0")]
    assert engine.gauges["kv_usage"] == 0.5
    assert engine.gauges["waiting_by_reason/capacity"] == 4
    assert engine.counters["prefix_queries"] == 2000 and engine.counters["prefix_hits"] == 800
    assert engine.histograms["ttft"].bounds == (0.5, float("inf"))
    assert engine.histograms["ttft"].cumulative == (6.0, 10.0)
    assert snapshot.capacity_tokens("0") == 1600


def test_old_vllm_spelling_and_missing_steps():
    pages = Pages(100.0, 30.0, 3, "vllm")
    pages.add([matrix("vllm:gpu_cache_usage_perc", 0.5), matrix("vllm:gpu_prefix_cache_queries_total", 10)])
    (replica,) = pages.replicas.values()
    assert replica.page(2) is None  # no sample at the third step: no poll there
    snapshot = make_adapter().adapt(replica.page(0), at=100.0)
    assert snapshot.engines[("m", "0")].gauges["kv_usage"] == 0.5
    assert snapshot.sources["prefix_queries"] == "gpu_prefix_cache_queries"


def test_reads_are_planned_within_the_store_limits():
    client = PrometheusClient("http://127.0.0.1:9", max_samples=1_000)
    chunks = client.plan(0.0, 2879 * 30.0, 30.0, series=10)
    assert all(round((b - a) / 30.0) + 1 <= 100 for a, b in chunks)  # 10 series x 100 points = 1,000 samples
    assert chunks[0][0] == 0.0 and chunks[-1][1] == 2879 * 30.0 and len(chunks) == 29
    assert all(round((b - a) / 30.0) + 1 <= MAX_POINTS
               for a, b in PrometheusClient("http://x", max_samples=10**9).plan(0.0, 86400 * 7, 15.0, 1))
    assert choose_step(0.0, 6 * 3600.0) == 15.0 and choose_step(0.0, 86400.0) == 30.0
    assert merge_selector('{namespace="llm"}', '__name__="x"') == '{__name__="x",namespace="llm"}'
