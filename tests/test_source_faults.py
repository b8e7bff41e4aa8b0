"""Numbers that cannot be true (a KV usage below 0 or above 1, a counter that
is NaN or infinite, hits that rose more than their lookups) are a fault of
the engine's metrics: left out, never clamped, and shown as such on the page,
in the API and on /metrics. The pages are the real vLLM 0.32 captures and
the SGLang sample with one value changed."""

from __future__ import annotations

import json

import pytest
from page_support import Pages, with_value

from kvwatch.engines import make_adapter
from kvwatch.engines.plausible import screen
from kvwatch.sidecar.collector import make_registry
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sidecar.report import diagnosis_json, signals_json
from kvwatch.settings import load_settings
from kvwatch.sidecar.statuspage import render_status_page


def vllm_page(fixtures_dir, name: str) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()






def monitor_of(pages: list[str], engine: str = "vllm") -> Monitor:
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "engine": engine,
                                        "poll_interval": "1s", "window": "60s"}, environ={})
    times = iter(range(1000, 2000, 5))
    monitor = Monitor(settings, fetcher=Pages(pages), clock=lambda: float(next(times)))
    return monitor


def exported(monitor) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in make_registry(monitor).collect() for s in family.samples}


def named(samples: dict, name: str) -> dict[frozenset, float]:
    return {labels: value for (sample, labels), value in samples.items() if sample == name}


def test_negative_kv_usage_is_a_source_fault_not_zero(fixtures_dir):
    page = with_value(vllm_page(fixtures_dir, "load"), "vllm:kv_cache_usage_perc", "-0.39")
    monitor = monitor_of([vllm_page(fixtures_dir, "idle"), page])
    monitor.poll_once()
    state = monitor.poll_once()
    assert state.up
    [fault] = state.source_faults
    assert (fault.family, fault.fault, fault.value, fault.model, fault.engine) == (
        "vllm:kv_cache_usage_perc", "below_zero", -0.39, "tiny-llama", "0")
    # Not clamped to 0: the usage is unknown, so the signal is absent (not 0) ...
    [row] = state.per_engine
    assert row.values["kvwatch_kv_cache_usage_ratio"] is None
    assert row.values["kvwatch_kv_cache_free_tokens"] is None
    # ... and so is the re-exported engine series; the fault is on /metrics.
    samples = exported(monitor)
    assert named(samples, "kvwatch_engine_kv_cache_usage_ratio") == {}
    assert named(samples, "kvwatch_kv_cache_usage_ratio") == {}
    assert named(samples, "kvwatch_source_fault") == {
        frozenset({"family": "vllm:kv_cache_usage_perc", "fault": "below_zero", "model_name": "tiny-llama",
                   "engine": "0"}.items()): 1.0}
    assert named(samples, "kvwatch_source_faults_total")[frozenset({"fault": "below_zero"}.items())] == 1
    assert named(samples, "kvwatch_source_faults_total")[frozenset({"fault": "above_one"}.items())] == 0
    # The other signals of the page stand.
    assert row.values["kvwatch_prompt_tokens_per_second"] > 0


def test_the_fault_is_in_the_api_and_on_the_page(fixtures_dir):
    page = with_value(vllm_page(fixtures_dir, "load"), "vllm:kv_cache_usage_perc", "1.7")
    monitor = monitor_of([page])
    state = monitor.poll_once()
    body = signals_json(state, monitor.settings)
    [fault] = body["source_faults"]
    assert fault["fault"] == "above_one" and fault["value"] == 1.7
    assert "1.7" in fault["sentence"] and "cannot be true" in fault["sentence"]
    assert diagnosis_json(state, monitor.settings)["source_faults"] == body["source_faults"]
    json.dumps(body, allow_nan=False)  # the API stays strict JSON
    html = render_status_page(state, monitor.settings)
    assert '<div id="faults"></div>' in html  # drawn by the script from the API's source_faults
    noscript = html[html.index("<noscript>\n"):]
    assert 'data-fault="above_one"' in noscript and "vllm:kv_cache_usage_perc = 1.7" in noscript


def test_a_nan_counter_is_left_out_and_named(fixtures_dir):
    idle, load = vllm_page(fixtures_dir, "idle"), vllm_page(fixtures_dir, "load")
    broken = with_value(load, "vllm:generation_tokens_total", "NaN")
    monitor = monitor_of([idle, broken])
    monitor.poll_once()
    state = monitor.poll_once()
    [fault] = state.source_faults
    assert (fault.family, fault.fault) == ("vllm:generation_tokens_total", "not_finite")
    assert fault.json()["value"] == "NaN"
    [row] = state.per_engine
    assert row.values["kvwatch_generation_tokens_per_second"] is None
    assert row.values["kvwatch_prompt_tokens_per_second"] > 0
    assert named(exported(monitor), "kvwatch_engine_generation_tokens_total") == {}
    json.dumps(signals_json(state, monitor.settings), allow_nan=False)


def test_infinite_and_negative_counters_are_faults(fixtures_dir):
    page = with_value(vllm_page(fixtures_dir, "load"), "vllm:num_preemptions_total", "+Inf")
    page = with_value(page, "vllm:prompt_tokens_total", "-5")
    snapshot = make_adapter("vllm").adapt(page, at=0.0)
    faults = {(f.family, f.fault) for f in snapshot.faults}
    assert faults == {("vllm:num_preemptions_total", "not_finite"), ("vllm:prompt_tokens_total", "below_zero")}
    [engine] = snapshot.engines.values()
    assert "preemptions" not in engine.counters and "prompt_tokens" not in engine.counters


def test_hits_that_outgrow_their_lookups_are_a_fault_of_the_window(fixtures_dir):
    idle, load = vllm_page(fixtures_dir, "idle"), vllm_page(fixtures_dir, "load")
    # 3584 hits of 7424 queried tokens on the real page; here the hits rose by more than the queries.
    broken = with_value(load, "vllm:prefix_cache_hits_total", "9000.0")
    monitor = monitor_of([idle, broken])
    monitor.poll_once()
    state = monitor.poll_once()
    [fault] = state.source_faults
    assert (fault.family, fault.fault) == ("vllm:prefix_cache_hits_total", "part_above_whole")
    assert fault.value == pytest.approx(9000 / 7424)
    assert "rose by 9000" in fault.sentence and "vllm:prefix_cache_queries_total rose by 7424" in fault.sentence
    [row] = state.per_engine
    assert row.values["kvwatch_prefix_cache_hit_ratio"] is None  # unknown, never 1.21 nor 1
    # The same pair with the real value is no fault, and the ratio is there.
    monitor = monitor_of([idle, load])
    monitor.poll_once()
    state = monitor.poll_once()
    assert state.source_faults == ()
    assert state.per_engine[0].values["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(3584 / 7424)


def test_sglang_usage_out_of_range_is_a_fault_under_its_own_name(fixtures_dir):
    page = (fixtures_dir / "public" / "sglang-0.5.10-trimmed.txt").read_text()
    broken = with_value(page, "sglang:token_usage", "-0.25")
    snapshot = make_adapter("sglang").adapt(broken, at=0.0)
    [fault] = snapshot.faults
    assert (fault.family, fault.fault, fault.value) == ("sglang:token_usage", "below_zero", -0.25)
    assert all("kv_usage" not in engine.gauges for engine in snapshot.engines.values())


def test_no_real_capture_has_a_fault(fixtures_dir):
    """The screen does not cry wolf: every recorded page of every engine is sane."""
    from kvwatch.engines import recognize

    pages = [path for path in sorted(fixtures_dir.rglob("*.txt")) if path.stat().st_size < 4 << 20]
    read = 0
    for path in pages:
        text = path.read_text(errors="replace")
        engine = recognize(text)
        if engine is None:
            continue
        snapshot = make_adapter(engine).adapt(text, at=0.0)
        assert snapshot.faults == [], (path, [f.sentence for f in snapshot.faults])
        read += 1
    assert read >= 15  # the 0.32 pages, the public captures, the llama.cpp and hand-written engines' pages


@pytest.mark.parametrize("scenario", ["restart", "concurrency", "eviction-rotation", "residency-prefix-changed",
                                      "front-end", "changes"])
def test_no_recorded_poll_has_a_fault(fixtures_dir, scenario):
    """Nor does the window's check: over recorded runs of the real engine
    (a restart among them, whose counters fell), no poll has a fault."""
    from kvwatch.capture.bundle import Capture
    from kvwatch.capture.replay import replay

    settings = load_settings(overrides={"poll_interval": "1s", "window": "60s"}, environ={})
    states = []
    replay(Capture(fixtures_dir / "vllm-0.32-cpu-scenarios" / scenario / "capture.tar.gz"),
           lambda source: Monitor(settings, fetcher=source, clock=source.now),
           on_state=lambda state: states.append(state) if state.up else None)
    assert len(states) >= 20
    assert [f.sentence for state in states for f in state.source_faults] == []


def test_the_v0_no_data_sentinel_is_no_fault():
    from kvwatch.snapshot import EngineSnapshot, Snapshot

    snapshot = Snapshot(0.0, {("m", "0"): EngineSnapshot("m", "0", gauges={"v0_prefix_hit_rate": -1.0,
                                                                             "kv_usage": 1.0, "running": 0.0})})
    screen(snapshot, "vllm:")
    assert snapshot.faults == []
    snapshot.engines[("m", "0")].gauges["v0_prefix_hit_rate"] = -0.5
    screen(snapshot, "vllm:")
    assert [f.fault for f in snapshot.faults] == ["below_zero"]
