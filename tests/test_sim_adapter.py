"""The simulator's page and a real vLLM 0.32 capture, read by the same
adapter kvwatch uses on a real engine, have the same families, label names
and bucket bounds."""

from kvwatch.engines.vllm import VllmAdapter
from kvwatch.sim.render import render_metrics
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.simulation import Simulation


def shape(snapshot):
    (engine,) = snapshot.engines.values()
    return {
        "sources": snapshot.sources,
        "gauges": sorted(engine.gauges),
        "counters": sorted(engine.counters),
        "bounds": {key: h.bounds for key, h in engine.histograms.items()},
        "cache_config_labels": sorted(snapshot.cache_config["0"]),
        "restart_marker": engine.created is not None,
    }


def test_simulator_and_real_capture_look_the_same_to_the_adapter(fixtures_dir):
    real = VllmAdapter().adapt((fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text(), at=0)
    # `idle` is sized like the real CPU server (max_model_len 1024 sets the
    # token-count buckets); requests sent over HTTP make it busy.
    sim = Simulation(load_scenario("idle"), seed=0)
    simulated = VllmAdapter().adapt(render_metrics(sim.engines, sim.model_name, sim.created_unix), at=0)
    assert simulated.parse_errors == [] and real.parse_errors == []
    assert shape(simulated) == shape(real)


def test_a_busy_scenario_differs_only_in_token_buckets_that_follow_max_model_len(fixtures_dir):
    real = shape(VllmAdapter().adapt((fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text(), at=0))
    sim = Simulation(load_scenario("exhaustion"), seed=0)
    sim.advance(120)
    snapshot = VllmAdapter().adapt(render_metrics(sim.engines, sim.model_name, sim.created_unix), at=0)
    simulated = shape(snapshot)
    (engine,) = snapshot.engines.values()
    assert engine.counters["prompt_tokens"] > 0 and engine.histograms["ttft"].count > 0
    for key in ("prompt_len", "generation_len", "prefill_computed"):
        # vLLM's 1-2-5 series up to max_model_len (2048 here, 1024 in the capture)
        assert simulated["bounds"].pop(key)[:10] == real["bounds"].pop(key)[:10]
    assert simulated == real
