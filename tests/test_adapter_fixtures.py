"""Every real capture through parser and adapter, against values read off the
captures by hand (grep the file for the family to check any of them)."""

import pytest

from kvwatch.engines.vllm import VllmAdapter

CPU = "vllm-0.32-cpu"


def adapt(fixtures_dir, name):
    return VllmAdapter().adapt((fixtures_dir / name).read_text(), at=0.0)


@pytest.mark.parametrize("name", ["idle", "prefix-load", "load", "long-load", "after"])
def test_every_032_capture_parses_without_errors_into_one_engine(fixtures_dir, name):
    snapshot = adapt(fixtures_dir, f"{CPU}/metrics-{name}.txt")
    assert snapshot.parse_errors == []
    assert list(snapshot.engines) == [("tiny-llama", "0")]
    # 128 blocks x 32 tokens (fixtures README), and kv_cache_size_tokens agrees.
    assert snapshot.capacity_tokens("0") == 4096
    assert snapshot.cache_config["0"]["enable_prefix_caching"] == "True"
    assert snapshot.sources["kv_usage"] == "kv_cache_usage_perc"


def test_032_burst_capture_values(fixtures_dir):
    engine = adapt(fixtures_dir, f"{CPU}/metrics-load.txt").engines[("tiny-llama", "0")]
    assert engine.gauges["kv_usage"] == pytest.approx(0.9921259842519685)
    assert engine.gauges["running"] == 6 and engine.gauges["waiting"] == 18
    assert engine.gauges["waiting_by_reason/capacity"] == 18 and engine.gauges["waiting_by_reason/deferred"] == 0
    assert engine.counters["prefix_queries"] == 7424 and engine.counters["prefix_hits"] == 3584
    assert engine.counters["prompt_tokens"] == 7424 and engine.counters["generation_tokens"] == 1856
    assert engine.counters["prompt_tokens_cached"] == 3584
    assert engine.counters["prompt_tokens_by_source/local_compute"] == 3840
    assert engine.counters["finished/length"] == 8 and engine.counters["finished/stop"] == 0
    ttft = engine.histograms["ttft"]
    assert ttft.count == 16 and ttft.sum == pytest.approx(0.4532139301300049)
    assert ttft.bounds[:3] == (0.001, 0.005, 0.01) and ttft.bounds[-2:] == (2560.0, float("inf"))
    assert ttft.cumulative[:7] == (0.0, 4.0, 7.0, 7.0, 9.0, 15.0, 16.0)
    assert engine.created == pytest.approx(1.796201452305294e09)


def test_long_load_capture_values(fixtures_dir):
    engine = adapt(fixtures_dir, f"{CPU}/metrics-long-load.txt").engines[("tiny-llama", "0")]
    assert engine.gauges["kv_usage"] == pytest.approx(0.9685039370078741)
    assert engine.counters["preemptions"] == 12 and engine.counters["prefix_queries"] == 17424
    assert engine.histograms["ttft"].count == 36


def test_vllm_0_11_capture(fixtures_dir):
    snapshot = adapt(fixtures_dir, "public/vllm-0.11.0.txt")
    engine = snapshot.engines[("Qwen/Qwen1.5-0.5B-Chat", "0")]
    assert snapshot.capacity_tokens("0") == 2452 * 16
    assert engine.gauges["kv_usage"] == 0.0
    assert snapshot.sources["inter_token_latency"] == "inter_token_latency_seconds"
    assert snapshot.sources["tpot"] == "request_time_per_output_token_seconds"


def test_vllm_0_25_deepseek_capture(fixtures_dir):
    snapshot = adapt(fixtures_dir, "public/vllm-0.25-deepseek-specdecode.txt")
    (key,) = snapshot.engines
    engine = snapshot.engines[key]
    # kv_cache_size_tokens is stated (group-aware) and wins over blocks x size.
    assert snapshot.capacity_tokens("0") == 1428520
    assert engine.counters["prefix_queries"] == 3675428 and engine.counters["prefix_hits"] == 3241216
    assert engine.counters["prompt_tokens_cached"] == 3241216


def test_v0_capture_without_engine_label_and_with_old_names(fixtures_dir):
    snapshot = adapt(fixtures_dir, "public/vllm-v0-0.5.txt")
    engine = snapshot.engines[("facebook/opt-125m", "0")]  # missing engine -> "0"
    assert snapshot.sources["kv_usage"] == "gpu_cache_usage_perc"
    assert snapshot.sources["inter_token_latency"] == "time_per_output_token_seconds"
    assert engine.counters["prompt_tokens"] == 5 and engine.counters["generation_tokens"] == 7
    assert engine.counters["finished/length"] == 1
    assert engine.histograms["ttft"].count == 1
    # V0 cache_config_info has no engine label: it belongs to engine "0".
    assert snapshot.capacity_tokens("0") == 7281 * 16
    assert snapshot.cache_config["0"]["enable_prefix_caching"] == "False"


def test_sglang_page_yields_no_vllm_engine(fixtures_dir):
    assert adapt(fixtures_dir, "public/sglang-0.5.10-trimmed.txt").engines == {}


def test_new_name_wins_when_both_are_emitted_and_old_name_alone_is_read():
    both = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
        'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
    )
    assert VllmAdapter().adapt(both, 0).engines[("m", "0")].gauges["kv_usage"] == 0.5
    old = 'vllm:gpu_prefix_cache_queries_total{model_name="m"} 10\nvllm:gpu_prefix_cache_hits_total{model_name="m"} 4\n'
    engine = VllmAdapter().adapt(old, 0).engines[("m", "0")]
    assert engine.counters["prefix_queries"] == 10 and engine.counters["prefix_hits"] == 4


def test_ray_prefix_and_underscore_spelling():
    text = (
        'ray_vllm:num_requests_running{WorkerId="a",model_name="m"} 2\n'
        'ray_vllm:num_requests_running{WorkerId="b",model_name="m"} 3\n'
        'vllm_num_preemptions_total{engine="1",model_name="m"} 7\n'
    )
    snapshot = VllmAdapter().adapt(text, 0)
    assert snapshot.engines[("m", "0")].gauges["running"] == 3  # gauges fold by max
    assert snapshot.engines[("m", "1")].counters["preemptions"] == 7


def test_pid_label_is_folded_by_metric_type():
    text = (
        'vllm:kv_cache_usage_perc{engine="0",model_name="m",pid="11"} 0.4\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m",pid="12"} 0.7\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m",pid="11"} 100\n'
        'vllm:prompt_tokens_total{engine="0",model_name="m",pid="12"} 50\n'
        'vllm:request_queue_time_seconds_bucket{engine="0",le="1.0",model_name="m",pid="11"} 1\n'
        'vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m",pid="11"} 2\n'
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m",pid="11"} 2\n'
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m",pid="11"} 3\n'
        'vllm:request_queue_time_seconds_bucket{engine="0",le="1.0",model_name="m",pid="12"} 4\n'
        'vllm:request_queue_time_seconds_bucket{engine="0",le="+Inf",model_name="m",pid="12"} 4\n'
        'vllm:request_queue_time_seconds_count{engine="0",model_name="m",pid="12"} 4\n'
        'vllm:request_queue_time_seconds_sum{engine="0",model_name="m",pid="12"} 1\n'
    )
    engine = VllmAdapter().adapt(text, 0).engines[("m", "0")]
    assert engine.gauges["kv_usage"] == 0.7
    assert engine.counters["prompt_tokens"] == 150
    queue = engine.histograms["queue_time"]
    assert queue.cumulative == (5.0, 6.0) and queue.count == 6 and queue.sum == 4


def test_custom_buckets_are_kept_as_scraped():
    text = (
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.05",model_name="m"} 1\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="1e+06",model_name="m"} 3\n'
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 3\n'
        'vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 3\n'
        'vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 2\n'
    )
    ttft = VllmAdapter().adapt(text, 0).engines[("m", "0")].histograms["ttft"]
    assert ttft.bounds == (0.05, 1e6, float("inf"))


def test_histogram_without_inf_bucket_is_reported_not_used():
    text = 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.05",model_name="m"} 1\nvllm:num_requests_running{model_name="m"} 1\n'
    snapshot = VllmAdapter().adapt(text, 0)
    assert "ttft" not in snapshot.engines[("m", "0")].histograms
    assert any("+Inf" in str(e) for e in snapshot.parse_errors)


def test_max_series_caps_engines_and_counts_the_rest():
    text = "".join(f'vllm:num_requests_running{{model_name="m{i}"}} 1\n' for i in range(50))
    adapter = VllmAdapter(max_series=10)
    snapshot = adapter.adapt(text, 0)
    assert len(snapshot.engines) == 10 and adapter.dropped_series == 40
