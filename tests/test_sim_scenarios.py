"""Each shipped scenario, run on the simulated clock (no wall time), shows its
symptom in the raw metrics a scraper of the simulator would read."""

from __future__ import annotations

import pytest

from kvwatch.sim.scenario import ScenarioError, list_scenarios, load_scenario, parse_scenario
from kvwatch.sim.simulation import Simulation
from sim_support import observe, scrape, total

SHIPPED = {"healthy", "exhaustion", "long-requests", "prefix-change", "eviction-pressure", "queueing", "slow-prefill",
           "upstream-delay", "demo", "idle", "stuck", "routing"}


def simulation(name: str, seed: int = 0) -> Simulation:
    return Simulation(load_scenario(name), seed=seed, created_unix=1.8e9)


def test_every_symptom_ships_as_a_scenario():
    assert {name for name, _ in list_scenarios()} == SHIPPED
    for name in SHIPPED:
        scenario = load_scenario(name)
        assert scenario.phases and all(phase.duration > 0 for phase in scenario.phases)


def test_healthy_high_hit_ratio_and_no_preemptions():
    sim = simulation("healthy")
    sim.advance(60)  # warm the cache
    window = observe(sim, 300)
    assert window.hit_ratio > 0.75
    assert window.delta("vllm:num_preemptions_total") == 0
    assert max(window.waiting) <= 2
    assert max(window.usage) < 0.6
    assert window.hist_mean("vllm:time_to_first_token_seconds") < 0.2
    assert window.delta("vllm:request_success_total") > 500


def test_exhaustion_preempts_with_usage_near_one_and_waiting_for_capacity():
    sim = simulation("exhaustion")
    light = observe(sim, 60)
    assert light.delta("vllm:num_preemptions_total") == 0
    assert max(light.usage) < 0.5
    overload = observe(sim, 240)
    assert overload.delta("vllm:num_preemptions_total") >= 10
    assert max(overload.usage) > 0.95
    assert max(overload.waiting_capacity) > 0
    assert overload.mean_usage > 0.8
    assert total(overload.end, "vllm:request_num_preemptions_sum") > 0
    recovery = observe(sim, 420)
    assert recovery.end[("vllm:num_requests_waiting", frozenset({("engine", "0"), ("model_name", "tiny-llama")}))] == 0
    assert recovery.usage[-1] < 0.5


def test_prefix_change_drops_hits_per_query_while_usage_stays_moderate():
    sim = simulation("prefix-change")
    sim.advance(30)
    before = observe(sim, 180)
    sim.advance(20)  # let requests admitted before the change drain
    after = observe(sim, 360)
    assert before.hit_ratio > 0.8
    assert after.hit_ratio < before.hit_ratio / 4
    assert after.mean_usage < 0.4 and max(after.usage) < 0.8
    assert after.delta("vllm:num_preemptions_total") == 0
    assert max(after.waiting) <= 2
    # The prompts still hit their first shared blocks, as the templating comes after 32 tokens.
    assert after.delta("vllm:prefix_cache_hits_total") > 0


def test_eviction_pressure_high_usage_low_hits_although_prefixes_repeat():
    sim = simulation("eviction-pressure")
    sim.advance(20)
    few = observe(sim, 120)
    sim.advance(30)  # the few-tenant prompts leave the cache
    repeated_before = sim.repeat_prefix_tokens
    many = observe(sim, 360)
    repeated = sim.repeat_prefix_tokens - repeated_before
    queries = many.delta("vllm:prefix_cache_queries_total")
    assert few.hit_ratio > 0.75
    assert many.hit_ratio < 0.3
    # An unbounded cache would have served most of the prompt tokens: the
    # prefixes do repeat, the cache just evicts them before their next use.
    assert repeated / queries > 0.7
    assert many.mean_usage > 0.7
    assert many.mean_usage > few.mean_usage + 0.3
    assert many.delta("vllm:num_preemptions_total") == 0


def test_queueing_time_to_first_token_is_spent_in_the_queue():
    sim = simulation("queueing")
    sim.advance(90)
    window = observe(sim, 240)
    ttft = window.hist_mean("vllm:time_to_first_token_seconds")
    queue = window.hist_mean("vllm:request_queue_time_seconds")
    prefill = window.hist_mean("vllm:request_prefill_time_seconds")
    assert ttft > 5
    assert queue > 0.7 * ttft
    assert prefill < 0.1 * queue
    assert max(window.waiting_capacity) > 20
    assert window.mean_usage < 0.6
    assert window.delta("vllm:num_preemptions_total") == 0


def test_slow_prefill_time_to_first_token_is_spent_in_prefill():
    sim = simulation("slow-prefill")
    sim.advance(90)
    window = observe(sim, 300)
    ttft = window.hist_mean("vllm:time_to_first_token_seconds")
    queue = window.hist_mean("vllm:request_queue_time_seconds")
    prefill = window.hist_mean("vllm:request_prefill_time_seconds")
    assert ttft > 1.0
    assert prefill > 0.6 * ttft
    assert prefill > 2 * queue
    assert window.hit_ratio < 0.05
    assert window.mean_usage < 0.6
    assert window.delta("vllm:num_preemptions_total") == 0


def test_upstream_delay_app_retrieval_grows_and_dominates():
    sim = simulation("upstream-delay")
    sim.advance(20)
    fast = observe(sim, 120)
    sim.advance(20)
    slow = observe(sim, 360)
    fast_retrieval = fast.hist_mean("app_retrieval_seconds")
    slow_retrieval = slow.hist_mean("app_retrieval_seconds")
    engine_ttft = slow.hist_mean("vllm:time_to_first_token_seconds")
    assert slow_retrieval > 10 * fast_retrieval
    assert slow_retrieval > 1.0
    assert slow_retrieval > 5 * engine_ttft
    assert engine_ttft < 0.5
    assert abs(engine_ttft - fast.hist_mean("vllm:time_to_first_token_seconds")) < 0.1
    assert slow.delta("app_retrieval_seconds_count") > 300


def test_idle_serves_only_what_is_sent():
    sim = simulation("idle")
    sim.advance(600)
    assert total(scrape(sim), "vllm:request_success_total") == 0
    assert sim.engines[0].config.kv_cache_size_tokens == 4096


def test_demo_visits_every_phase_and_loops():
    scenario = load_scenario("demo")
    assert scenario.loop
    sim = Simulation(scenario, seed=0)
    seen = []
    for phase in scenario.phases:
        seen.append(sim.phase.name)
        sim.advance(phase.duration)
    assert seen == [phase.name for phase in scenario.phases]
    assert sim.phase_index == 0 and sim.cycle == 1
    # Each symptom holds three minutes; the healthy start is short, so that the
    # first symptom shows within the first minute (tests/test_demo.py).
    assert 3 * 60 <= min(p.duration for p in scenario.phases if p.name != "healthy" and not p.name.startswith("recovery"))
    assert scenario.phases[0].name == "healthy" and scenario.phases[0].duration == 30


def test_same_seed_same_metrics_and_another_seed_differs():
    pages = []
    for seed in (7, 7, 8):
        sim = simulation("healthy", seed=seed)
        sim.advance(120)
        pages.append(scrape(sim))
    assert pages[0] == pages[1]
    assert pages[0] != pages[2]


def test_bad_scenario_names_every_problem(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text(
        """
name: broken
colour: blue
engine: {num_gpu_blocks: 4, block_size: 16, max_model_len: 4096, warp: 9}
workload:
  rate: -1
  prompt_tokens: {dist: lognormal, mean: 100}
  output_tokens: 10
  prefix: {share: 1.5, tokens: 64}
phases:
  - name: one
    duration: soon
  - name: two
    duration: 1m
    engine: {num_gpu_blocks: 64}
    workload: {retrieval_seconds: {dist: uniform, min: 3, max: 1}}
"""
    )
    with pytest.raises(ScenarioError) as caught:
        load_scenario(path)
    message = str(caught.value)
    for needle in (
        "colour", "engine.warp", "cannot hold one request", "rate", "sigma", "prefix.share",
        "phases[0] (one).duration", "phases[1] (two).engine.num_gpu_blocks: cannot change", "min <= max",
    ):
        assert needle in message, f"{needle!r} missing from:\n{message}"
    assert str(path) in message


def test_unknown_scenario_lists_the_shipped_ones():
    with pytest.raises(ScenarioError) as caught:
        load_scenario("no-such-scenario")
    assert "healthy" in str(caught.value) and "exhaustion" in str(caught.value)


def test_phases_inherit_and_override_the_workload():
    scenario = parse_scenario(
        {
            "workload": {"rate": 1, "prompt_tokens": 100, "output_tokens": 10, "prefix": {"share": 0.5, "tokens": 64}},
            "phases": [
                {"name": "a", "duration": "1m"},
                {"name": "b", "duration": "90s", "workload": {"prefix": {"version": 2}}},
                {"name": "c", "duration": 5, "workload": {"rate": 3}, "engine": {"prefill_s_per_token": 0.001}},
            ],
        },
        "inline",
    )
    a, b, c = scenario.phases
    assert (a.duration, b.duration, c.duration) == (60, 90, 5)
    assert b.workload.prefix.version == 2 and b.workload.prefix.share == 0.5
    assert c.workload.prefix.version == 2 and c.workload.rate == 3
    assert c.engine.prefill_s_per_token == 0.001 and a.engine.prefill_s_per_token != 0.001
