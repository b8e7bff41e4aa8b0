"""Routing attribution (kvwatch/routing/): a router's page read beside the
engines', predicted against delivered per window, and the router's causes.
The simulated router in front of 4 simulated engines: each policy gives its
cause and no other."""

from __future__ import annotations

import pytest

from kvwatch.engines import make_adapter
from kvwatch.routing import RouterReading, attribute, judge_routing, read_router_page
from kvwatch.sim.render import render_metrics
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.simulation import Simulation

WARM, WINDOW = 60.0, 120.0


def _delivered(sim: Simulation) -> tuple[float, float]:
    """The engines' prefix-cache hits and queries, read from their vLLM page by kvwatch's adapter."""
    snapshot = make_adapter("vllm").adapt(render_metrics(sim.engines, sim.model_name, sim.created_unix))
    engines = [e for e in snapshot.engines.values() if e.model == sim.model_name]
    assert len(engines) == 4
    return (sum(e.counters["prefix_hits"] for e in engines), sum(e.counters["prefix_queries"] for e in engines))


def _window(policy: str, seed: int = 1):
    sim = Simulation(load_scenario("routing"), seed=seed, router=policy, created_unix=1.8e9)
    sim.advance(WARM)
    start, (hits0, queries0) = read_router_page(sim.router.render(sim.model_name)), _delivered(sim)
    sim.advance(WINDOW)
    end, (hits1, queries1) = read_router_page(sim.router.render(sim.model_name)), _delivered(sim)
    return attribute(sim.model_name, start, end, hits1 - hits0, queries1 - queries0)


@pytest.mark.parametrize("seed", [1, 2])
def test_prefix_aware_with_a_fresh_index_is_healthy(seed):
    window = _window("prefix", seed)
    # Requests routed near the window's edges are admitted in the next: the two differ by a few blocks.
    assert window.predicted_tokens and window.delivered_tokens == pytest.approx(window.predicted_tokens, rel=0.01)
    assert judge_routing(window) == []


@pytest.mark.parametrize("seed", [1, 2])
def test_round_robin_loses_affinity_and_nothing_else(seed):
    window = _window("round_robin", seed)
    [finding] = judge_routing(window)
    assert (finding.symptom, finding.cause) == ("fleet", "lost_prefix_affinity")
    assert finding.evidence["predicted_tokens"] < 0.6 * finding.evidence["available_tokens"]


@pytest.mark.parametrize("seed", [1, 2])
def test_stale_index_is_a_routing_miss_with_predicted_and_delivered_as_evidence(seed):
    window = _window("prefix_stale", seed)
    [finding] = judge_routing(window)
    assert (finding.symptom, finding.cause) == ("routing", "routing_miss")
    evidence = finding.evidence
    assert evidence["predicted_tokens"] == window.predicted_tokens > 0
    assert evidence["delivered_tokens"] == window.delivered_tokens < 0.8 * window.predicted_tokens
    assert f"{window.predicted_tokens:.0f}" in finding.summary and f"{window.delivered_tokens:.0f}" in finding.summary


def _reading(**values) -> RouterReading:
    return RouterReading(dialect="llm-d", **values)


def test_too_little_queried_says_nothing():
    start, end = _reading(requests=0, predicted_tokens=0, prompt_tokens=0), \
        _reading(requests=2, predicted_tokens=500, prompt_tokens=600)
    assert judge_routing(attribute("m", start, end, delivered_tokens=0, queried_tokens=600)) == []


def test_router_restart_counts_from_zero():
    start = _reading(requests=900, predicted_tokens=90_000, available_tokens=90_000, prompt_tokens=100_000)
    end = _reading(requests=10, predicted_tokens=5_000, available_tokens=5_000, prompt_tokens=8_000)
    window = attribute("m", start, end, delivered_tokens=5_000, queried_tokens=8_000)
    assert (window.requests, window.predicted_tokens, window.prompt_tokens) == (10, 5_000, 8_000)
    assert judge_routing(window) == []


def test_slow_poll_against_the_staleness_bound_is_stale_router_metrics():
    # llm-d-router issue 2514: a 15 s poll against a 200 ms bound, stale 98.7 % of each cycle.
    start, end = _reading(), _reading()
    window = attribute("m", start, end, None, None, poll_interval_s=15.0, staleness_bound_s=0.2)
    [finding] = judge_routing(window)
    assert (finding.symptom, finding.cause) == ("routing", "stale_router_metrics")
    assert finding.evidence["stale_share"] == pytest.approx(0.9867, abs=1e-4)
    assert "98.7%" in finding.summary
    fast = attribute("m", start, end, None, None, poll_interval_s=0.05, staleness_bound_s=0.2)
    assert judge_routing(fast) == []


def test_stale_endpoints_on_the_page_are_stale_router_metrics():
    page = ("# TYPE llm_d_epp_flow_control_stale_endpoints gauge\n"
            'llm_d_epp_flow_control_stale_endpoints{detector="utilization"} 3\n')
    reading = read_router_page(page)
    assert reading.stale_endpoints == 3
    [finding] = judge_routing(attribute("m", reading, reading, None, None))
    assert finding.cause == "stale_router_metrics" and finding.evidence["stale_endpoints"] == 3


@pytest.fixture
def router_page(fixtures_dir):
    return lambda name: (fixtures_dir / "handwritten" / f"router-{name}.txt").read_text()


def test_llm_d_current_names_read_in_tokens(router_page):
    reading = read_router_page(router_page("llm-d"))
    assert (reading.dialect, reading.basis, reading.spelling, reading.role) == ("llm-d", "tokens", "llm_d_epp_",
                                                                                 "decode")
    assert (reading.requests, reading.predicted_tokens, reading.available_tokens, reading.prompt_tokens) == \
        (100, 40_000, 45_000, 80_000)
    assert reading.stale_endpoints == 0 and reading.models == ["tiny-llama"]


def test_llm_d_before_the_rename_reads_the_same():
    # The `llm_d_router_epp_` spelling of the same subsystem.
    reading = read_router_page("".join(line.replace("llm_d_epp_", "llm_d_router_epp_") + "\n"
                                       for line in _LLM_D_LINES))
    assert (reading.dialect, reading.predicted_tokens, reading.prompt_tokens) == ("llm-d", 400, 1000)
    assert reading.spelling == "llm_d_router_epp_"


_LLM_D_LINES = (
    "# TYPE llm_d_epp_prefix_predicted_cached_tokens histogram",
    'llm_d_epp_prefix_predicted_cached_tokens_sum{endpoint_role="decode"} 400',
    'llm_d_epp_prefix_predicted_cached_tokens_count{endpoint_role="decode"} 4',
    "# TYPE llm_d_epp_prefix_prompt_tokens histogram",
    'llm_d_epp_prefix_prompt_tokens_sum{endpoint_role="decode"} 1000',
    'llm_d_epp_prefix_prompt_tokens_count{endpoint_role="decode"} 4',
)


def test_legacy_epp_reads_a_mean_of_ratios(router_page):
    reading = read_router_page(router_page("llm-d-legacy"))
    assert (reading.dialect, reading.basis, reading.ratio_sum, reading.requests) == ("llm-d-legacy", "mean_ratio",
                                                                                      48, 80)


def test_dynamo_router_that_applied_no_event_while_routing_is_stale(router_page):
    start = read_router_page(router_page("dynamo"))
    assert (start.dialect, start.events_applied, start.ratio_sum, start.requests) == ("dynamo", 0, 35, 50)
    end = read_router_page(router_page("dynamo").replace("_sum{dynamo_component=\"router\",dynamo_namespace="
                                                         "\"dynamo\"} 35", "_sum{dynamo_component=\"router\","
                                                         "dynamo_namespace=\"dynamo\"} 70")
                           .replace("_count{dynamo_component=\"router\",dynamo_namespace=\"dynamo\"} 50",
                                    "_count{dynamo_component=\"router\",dynamo_namespace=\"dynamo\"} 100"))
    window = attribute("m", start, end, delivered_tokens=30_000, queried_tokens=100_000)
    assert window.predicted_ratio == pytest.approx(0.7)
    causes = {f.cause for f in judge_routing(window)}
    # A mean predicted ratio of 70 % against 30 % delivered, and an index that heard nothing.
    assert causes == {"stale_router_metrics", "routing_miss"}


def test_sglang_router_counts_requests_and_decides_no_token_cause(router_page):
    reading = read_router_page(router_page("sglang"))
    assert (reading.dialect, reading.basis, reading.cache_hits, reading.cache_misses) == ("sglang", "requests",
                                                                                           70, 30)
    later = RouterReading(dialect="sglang", cache_hits=140, cache_misses=60, requests=200)
    assert judge_routing(attribute("m", reading, later, delivered_tokens=0, queried_tokens=50_000)) == []


def test_a_page_of_no_router_is_no_reading():
    assert read_router_page("vllm:num_requests_running 1\n").dialect is None
    assert read_router_page("not a metrics page at all {{{\n").dialect is None


def _monitor_findings(policy: str, **overrides) -> tuple[set, object]:
    """kvwatch's poll loop over the simulator's 4 engines with the simulated router beside them."""
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings
    from kvwatch.sim.server import start_background

    with start_background("routing", speed=0, seed=1, router=policy) as sim:
        settings = load_settings(overrides={"target": sim.metrics_url, "router_target": sim.router_metrics_url,
                                            "poll_interval": "1s", "timeout": "0.5s", **overrides}, environ={})
        monitor = Monitor(settings)
        sim.advance(WARM)
        monitor.poll_once()
        sim.advance(WINDOW)
        monitor.poll_once()
    routing = {(f.symptom, f.cause) for f in monitor.state.findings
               if f.symptom == "routing" or f.cause == "lost_prefix_affinity"}
    return routing, monitor


@pytest.mark.parametrize("policy, expected", [
    ("prefix", set()),
    ("round_robin", {("fleet", "lost_prefix_affinity")}),
    ("prefix_stale", {("routing", "routing_miss")}),
])
def test_the_poll_loop_names_each_policys_cause_and_no_other(policy, expected):
    routing, monitor = _monitor_findings(policy)
    assert routing == expected
    assert monitor.router.last["up"] and monitor.router.last["router"] == "llm-d"
    # Every surface shows the finding: the status page, the diagnosis JSON.
    from kvwatch.sidecar.report import diagnosis_json
    from kvwatch.sidecar.statuspage import render_status_page

    html = render_status_page(monitor.state, monitor.settings)
    listed = {(f["symptom"], f["cause"]) for f in diagnosis_json(monitor.state, monitor.settings)["findings"]}
    assert expected <= listed
    assert all(cause in html for _symptom, cause in expected)


def test_the_poll_loop_names_a_router_polling_slower_than_its_staleness_bound():
    routing, _monitor = _monitor_findings("prefix", router_refresh_interval="15s", router_staleness_bound="200ms")
    assert routing == {("routing", "stale_router_metrics")}


def test_a_router_that_does_not_answer_leaves_the_engine_alone():
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings
    from kvwatch.sim.server import start_background

    with start_background("routing", speed=0, seed=1) as sim:
        settings = load_settings(overrides={"target": sim.metrics_url, "router_target": "http://127.0.0.1:9/metrics",
                                            "poll_interval": "1s", "timeout": "0.5s"}, environ={})
        monitor = Monitor(settings)
        monitor.poll_once()
    assert monitor.state.up and not monitor.router.last["up"]


def test_the_exporter_gives_predicted_delivered_and_available_per_model_and_documents_them():
    from kvwatch.mixin.metrics_doc import render
    from kvwatch.sidecar.collector import make_registry

    _routing, monitor = _monitor_findings("prefix_stale")
    found = {(s.name, tuple(sorted(s.labels.items()))): s.value
             for family in make_registry(monitor).collect() for s in family.samples}
    model = (("model_name", "tiny-llama"),)
    window = monitor.router.last["windows"][0]
    assert found[("kvwatch_router_up", ())] == 1.0
    assert found[("kvwatch_router_predicted_hit_ratio", model)] == pytest.approx(window.predicted_ratio)
    assert found[("kvwatch_router_delivered_hit_ratio", model)] == pytest.approx(window.delivered_ratio)
    assert found[("kvwatch_router_available_hit_ratio", model)] == pytest.approx(window.available_ratio)
    assert window.delivered_ratio < 0.8 * window.predicted_ratio  # the stale index's miss, as exported
    documented = render()
    assert all(f"`{name}`" in documented for name, _ in found if name.startswith("kvwatch_router_"))
