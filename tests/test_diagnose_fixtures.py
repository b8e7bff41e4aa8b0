"""Diagnosis over the real vLLM 0.32 captures, in the order they were taken,
through the adapter (synthetic timestamps) and through the whole monitor,
exporter and API."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from kvwatch.sidecar.app import create_app
from kvwatch.sidecar.collector import make_registry
from kvwatch.diagnose import diagnose
from kvwatch.engines.vllm import VllmAdapter
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.signals import evaluate_window
from kvwatch.window import Window
from pageserver import Answer, PageServer

ORDER = ("idle", "prefix-load", "load", "long-load", "after")


def page(fixtures_dir, name: str) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def replay(fixtures_dir, thresholds=None, interval=10.0):
    """Findings after each capture, fed in order 10 s apart."""
    adapter = VllmAdapter()
    window = Window(300)
    results = {}
    for index, name in enumerate(ORDER):
        window.add(adapter.adapt(page(fixtures_dir, name), at=1000.0 + interval * index))
        per_engine, per_model = evaluate_window(window)
        results[name] = diagnose(window, per_engine, (), thresholds or {})
    return results


def pairs(findings):
    return {(f.symptom, f.cause) for f in findings}


def test_exhaustion_named_at_the_burst_and_not_at_idle(fixtures_dir):
    results = replay(fixtures_dir)
    assert results["idle"] == []
    assert results["prefix-load"] == []
    load = results["load"]
    assert ("exhaustion", "concurrency_beyond_capacity") in pairs(load)
    burst = next(f for f in load if f.cause == "concurrency_beyond_capacity")
    # The capture: usage 0.99 with 6 running and 18 waiting for capacity.
    assert burst.evidence["kv_usage_at_peak"] == pytest.approx(0.9921, abs=1e-4)
    assert burst.evidence["running_at_peak"] == 6 and burst.evidence["waiting_for_capacity_at_peak"] == 18
    assert burst.evidence["kv_cache_capacity_tokens"] == 4096
    # 24 requests of 400+400 tokens are many ordinary requests, not a few long ones.
    assert ("exhaustion", "long_requests") not in pairs(load)
    assert not any(f.cause == "queueing_compute_bound" for f in load)
    # The burst's distinct prompts pull the ratio down from the shared-prefix
    # load's 78 % as the cache fills. Evicted prefixes or prompts that no
    # longer share one (here: the latter, a different load) read the same in
    # the counters, so no low-hit-rate cause is named at any capture; the
    # exhaustion finding carries the ratio and says why.
    assert not [f for findings in results.values() for f in findings if f.symptom == "low_hit_rate"]
    assert burst.evidence["prefix_cache_hit_ratio"] == pytest.approx(0.4828, abs=1e-4)
    assert "fell from 78% to 32%" in burst.evidence["hit_ratio_note"]


def after_idle(fixtures_dir, name: str, thresholds=None):
    """Findings over a window of two polls: idle, then the named capture."""
    adapter = VllmAdapter()
    window = Window(300)
    window.add(adapter.adapt(page(fixtures_dir, "idle"), at=1000.0))
    window.add(adapter.adapt(page(fixtures_dir, name), at=1010.0))
    per_engine, per_model = evaluate_window(window)
    return diagnose(window, per_engine, (), thresholds or {})


def test_long_prompts_read_as_long_requests(fixtures_dir):
    long_load = after_idle(fixtures_dir, "long-load")
    long = next(f for f in long_load if f.cause == "long_requests")
    # 4 running requests at usage 0.97 (window means with the idle poll:
    # 0.485 / 2): about 990 tokens, 24 % of the cache each, 2 waiting.
    assert long.evidence["running_at_peak"] == 4
    assert long.evidence["capacity_share_per_running_request"] == pytest.approx(0.2425, abs=0.0005)
    assert long.evidence["waiting_mean"] <= long.evidence["running_mean"]
    assert long.severity == "critical"  # preemptions rose to 12
    causes = pairs(long_load)
    assert ("exhaustion", "concurrency_beyond_capacity") not in causes
    # Its queue is KV-bound, never compute-bound.
    assert ("slow_first_token", "queueing_kv_bound") in causes
    assert ("slow_first_token", "queueing_compute_bound") not in causes


def test_a_window_holding_the_burst_and_the_long_prompts_names_one_cause(fixtures_dir):
    # In capture order the long prompts follow the burst 10 s later, and the
    # window holds both. Like the alert over its rate window, kvwatch judges
    # the window's means and names one cause: the burst's queue (18 waiting
    # for 6 running) makes it too many requests.
    long_load = replay(fixtures_dir)["long-load"]
    exhaustion = {f.cause for f in long_load if f.symptom == "exhaustion"}
    assert exhaustion - {"capacity_below_max_num_seqs"} == {"concurrency_beyond_capacity"}
    finding = next(f for f in long_load if f.cause == "concurrency_beyond_capacity")
    assert finding.evidence["waiting_mean"] > finding.evidence["running_mean"]


def test_configured_max_num_seqs_of_the_capture(fixtures_dir):
    # The capture ran with --max-num-seqs 8; at the burst's mean lengths the
    # cache held 7 requests.
    load = replay(fixtures_dir, {"max_num_seqs": 8})["load"]
    # More requests than fit is the story; the setting rides on it as a contributing factor.
    primary = next(f for f in load if f.symptom == "exhaustion")
    assert primary.cause == "concurrency_beyond_capacity"
    factor = next(c for c in primary.contributing if c["cause"] == "capacity_below_max_num_seqs")
    assert factor["evidence"]["max_num_seqs"] == 8 and factor["evidence"]["kv_cache_capacity_requests"] == 7


def test_each_capture_alone_after_idle(fixtures_dir):
    # Two polls only (idle, then one capture): the burst alone still reads as exhaustion.
    for name, expected in (("prefix-load", False), ("load", True), ("long-load", True), ("after", False)):
        found = any(f.symptom == "exhaustion" for f in after_idle(fixtures_dir, name))
        # "after" alone shows preemptions in its counters since idle: exhaustion happened in between.
        if name == "after":
            assert found
        else:
            assert found is expected, name


def test_monitor_exports_findings_and_api_serves_them(fixtures_dir):
    answers = [Answer(page(fixtures_dir, name)) for name in ("idle", "prefix-load", "load")]
    with PageServer(answers) as server:
        settings = load_settings(overrides={"target": server.url}, environ={})
        monitor = Monitor(settings)
        monitor.poll_once()
        registry = make_registry(monitor)
        labels = {"symptom": "exhaustion", "cause": "concurrency_beyond_capacity", "severity": "warning",
                  "model_name": "tiny-llama", "engine": "0"}
        assert registry.get_sample_value("kvwatch_finding", labels) is None
        monitor.poll_once()
        monitor.poll_once()
        assert registry.get_sample_value("kvwatch_finding", labels) == 1.0

        client = TestClient(create_app(monitor, settings))
        body = client.get("/api/v1/diagnosis").json()
        finding = next(f for f in body["findings"] if f["cause"] == "concurrency_beyond_capacity")
        assert finding["symptom"] == "exhaustion"
        assert finding["evidence"]["waiting_at_peak"] == 18
        assert finding["next_check"]
