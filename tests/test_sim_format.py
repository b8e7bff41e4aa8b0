"""The simulator's /metrics page has the format of a real vLLM 0.32 page: same
families and types, label names, bucket bounds, HELP/TYPE lines and line order
as the capture in tests/fixtures/vllm-0.32-cpu/."""

from __future__ import annotations

import re

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.sim.render import HttpStats, render_app_metrics, render_metrics
from kvwatch.sim.scenario import parse_scenario
from kvwatch.sim.simulation import Simulation
from sim_support import parse_samples, total

# The capture's server: 128 blocks x 32 tokens, max_model_len 1024, 8 sequences.
CAPTURE_LIKE = {
    "engine": {"num_gpu_blocks": 128, "block_size": 32, "max_num_seqs": 8, "max_model_len": 1024},
    "workload": {
        "rate": 3.0,
        "prompt_tokens": {"dist": "uniform", "min": 16, "max": 400},
        "output_tokens": {"dist": "uniform", "min": 16, "max": 400},
        "prefix": {"share": 0.5, "tokens": 512},
    },
    "phases": [{"name": "load", "duration": "5m"}],
}


def loaded_sim(engines: int = 1, model_name: str = "tiny-llama", **changes) -> Simulation:
    spec = {**CAPTURE_LIKE, **changes}
    sim = Simulation(parse_scenario(spec, "inline"), seed=3, engines=engines, model_name=model_name)
    sim.advance(90)
    return sim


def page_of(sim: Simulation, http: HttpStats | None = None) -> str:
    return render_metrics(sim.engines, sim.model_name, sim.created_unix, http)


def shape(text: str) -> dict[str, dict]:
    """family -> {type, sample names -> set of label-name tuples, le bounds}."""
    out = {}
    for family in text_string_to_metric_families(text):
        entry = out.setdefault(family.name, {"type": family.type, "labels": {}, "le": set(), "help": family.documentation})
        for sample in family.samples:
            names = tuple(sorted(k for k in sample.labels if k != "le"))
            entry["labels"].setdefault(sample.name, set()).add(names)
            if "le" in sample.labels:
                entry["le"].add((sample.name, sample.labels["le"]))
    return out


@pytest.fixture(scope="module")
def capture(fixtures_dir) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()


def test_same_vllm_families_types_labels_and_buckets(capture):
    real = {name: v for name, v in shape(capture).items() if name.startswith("vllm:")}
    simulated = {name: v for name, v in shape(page_of(loaded_sim())).items() if name.startswith("vllm:")}
    assert set(simulated) == set(real)
    assert len([n for n in real if not n.endswith("_created")]) == 39
    for name, want in real.items():
        got = simulated[name]
        assert got["type"] == want["type"], name
        assert got["help"] == want["help"], name
        assert got["labels"] == want["labels"], name
        assert got["le"] == want["le"], name


def test_every_family_of_the_real_page_is_present(capture):
    http = HttpStats(1.8e9)
    http.record("/v1/models", "GET", 200, 0, 467, 0.001, 1.8e9)
    http.record("/v1/completions", "POST", 200, 3000, 500, 0.04, 1.8e9)
    real = shape(capture)
    simulated = shape(page_of(loaded_sim(), http))
    assert {(n, v["type"]) for n, v in simulated.items()} == {(n, v["type"]) for n, v in real.items()}
    for name in ("http_requests", "http_request_duration_seconds", "http_request_size_bytes",
                 "http_request_duration_highr_seconds"):
        assert simulated[name]["labels"] == real[name]["labels"], name
        assert simulated[name]["le"] == real[name]["le"], name


def _skeleton(text: str) -> list[str]:
    """Comment lines as they are, sample lines without their value."""
    lines = []
    for line in text.splitlines():
        if line.startswith(("process_", "python_", "# HELP process_", "# TYPE process_", "# HELP python_", "# TYPE python_")):
            continue
        lines.append(line if line.startswith("#") else line.rsplit(" ", 1)[0])
    return lines


def test_line_for_line_the_same_page_as_the_idle_capture(fixtures_dir):
    idle = (fixtures_dir / "vllm-0.32-cpu" / "metrics-idle.txt").read_text()
    http = HttpStats(1.8e9)
    http.record("/v1/models", "GET", 200, 0, 467, 0.001, 1.8e9)
    sim = Simulation(parse_scenario(CAPTURE_LIKE, "inline"), seed=0)
    # Cache sizing labels in the capture come from --kv-cache-memory-bytes 4194304:
    # 4096 tokens x 1024 bytes (2 layers x K,V x 2 heads x 32 dims x fp32).
    assert _skeleton(page_of(sim, http)) == _skeleton(idle)


def test_values_are_go_style_floats(capture):
    sim = loaded_sim()
    page = page_of(sim)
    value = re.compile(r"^(?:[-+]?\d+\.\d+(?:e[-+]\d+)?|\d\.\d+e\+\d\d|[-+]Inf|NaN|\d+(?:\.\d+)?e[-+]\d+)$")
    for line in page.splitlines():
        if not line.startswith("#"):
            assert value.match(line.rsplit(" ", 1)[1]), line
    for le in re.findall(r'le="([^"]+)"', page):
        assert le == "+Inf" or "." in le or "e+" in le, le


def test_cache_config_info_reports_the_simulated_cache():
    sim = loaded_sim(engine={"num_gpu_blocks": 1000, "block_size": 16, "max_num_seqs": 8, "max_model_len": 4000,
                             "cache_dtype": "fp8", "enable_prefix_caching": False})
    samples = parse_samples(page_of(sim))
    (labels,) = [dict(pairs) for (name, pairs) in samples if name == "vllm:cache_config_info"]
    assert labels["num_gpu_blocks"] == "1000"
    assert labels["block_size"] == "16"
    assert labels["kv_cache_size_tokens"] == "16000"
    assert labels["kv_cache_max_concurrency"] == "4.0"
    assert labels["cache_dtype"] == "fp8"
    assert labels["enable_prefix_caching"] == "False"
    # Without prefix caching nothing is queried, as in vLLM.
    assert total(samples, "vllm:prefix_cache_queries_total") == 0
    assert total(samples, "vllm:prompt_tokens_total") > 0


def test_token_buckets_follow_max_model_len():
    sim = loaded_sim(engine={"num_gpu_blocks": 4096, "block_size": 16, "max_model_len": 32768})
    les = {dict(pairs)["le"] for (name, pairs) in parse_samples(page_of(sim))
           if name == "vllm:request_prompt_tokens_bucket"}
    assert les == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0", "1000.0", "2000.0",
                   "5000.0", "10000.0", "20000.0", "+Inf"}


def test_several_engines_each_have_their_series():
    sim = loaded_sim(engines=3)
    page = page_of(sim)
    samples = parse_samples(page)
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:prefix_cache_queries_total",
                 "vllm:time_to_first_token_seconds_count", "vllm:cache_config_info"):
        engines = sorted(dict(pairs)["engine"] for (sample, pairs) in samples if sample == name)
        assert engines == ["0", "1", "2"], name
    rejections = [dict(pairs) for (sample, pairs) in samples if sample == "vllm:admission_rejections_total"]
    assert len(rejections) == 2 and all("engine" not in labels for labels in rejections)
    # The router spread the load: every engine served requests.
    for engine in ("0", "1", "2"):
        assert total(samples, "vllm:request_success_total", engine=engine) > 0
    shape(page)  # parses


def test_model_name_with_quotes_is_escaped():
    sim = loaded_sim(model_name='org/m"odel\\x')
    names = {dict(pairs)["model_name"] for (_, pairs) in parse_samples(page_of(sim)) if ("model_name", 'org/m\\"odel\\\\x') in pairs}
    assert names
    families = shape(page_of(sim))
    assert "vllm:kv_cache_usage_perc" in families


def test_counters_agree_with_each_other():
    samples = parse_samples(page_of(loaded_sim()))
    prompt = total(samples, "vllm:prompt_tokens_total")
    assert prompt == total(samples, "vllm:prompt_tokens_by_source_total")
    assert total(samples, "vllm:prompt_tokens_cached_total") == total(
        samples, "vllm:prompt_tokens_by_source_total", source="local_cache_hit")
    assert total(samples, "vllm:prompt_tokens_cached_by_source_total") == total(
        samples, "vllm:prompt_tokens_cached_total")
    waiting = total(samples, "vllm:num_requests_waiting")
    assert waiting == total(samples, "vllm:num_requests_waiting_by_reason")
    finished = total(samples, "vllm:request_success_total")
    for histogram in ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
                      "vllm:request_prompt_tokens", "vllm:request_num_preemptions"):
        assert total(samples, f"{histogram}_count") == finished, histogram
    assert total(samples, "vllm:time_to_first_token_seconds_count") >= finished
    # One inter-token latency per generated token but each request's first.
    assert total(samples, "vllm:inter_token_latency_seconds_count") == (
        total(samples, "vllm:generation_tokens_total") - total(samples, "vllm:time_to_first_token_seconds_count"))
    assert 0 <= total(samples, "vllm:kv_cache_usage_perc") <= 1


def test_app_metrics_page_is_a_histogram_of_its_own():
    spec = {**CAPTURE_LIKE, "workload": {**CAPTURE_LIKE["workload"], "retrieval_seconds": 0.3}}
    sim = Simulation(parse_scenario(spec, "inline"), seed=0)
    sim.advance(30)
    text = render_app_metrics(sim.app_retrieval, sim.created_unix)
    (family, created) = list(text_string_to_metric_families(text))
    assert family.name == "app_retrieval_seconds" and family.type == "histogram"
    assert created.name == "app_retrieval_seconds_created"
    samples = parse_samples(text)
    count = total(samples, "app_retrieval_seconds_count")
    assert count > 50
    assert total(samples, "app_retrieval_seconds_sum") == pytest.approx(0.3 * count)
    assert total(samples, "app_retrieval_seconds_bucket", le="0.25") == 0
    assert total(samples, "app_retrieval_seconds_bucket", le="0.5") == count
