"""The simulated router (kvwatch/sim/router.py): each policy's pick and
prediction, and its page in llm-d EPP's names."""

from __future__ import annotations

import pytest

from kvwatch.exposition import FamilySelector
from kvwatch.sim.engine import Engine, EngineConfig, Request
from kvwatch.sim.router import SimRouter
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.simulation import Simulation

BLOCK = 16


def _engines(count: int = 4, blocks: int = 64) -> list[Engine]:
    config = EngineConfig(num_gpu_blocks=blocks, block_size=BLOCK, max_model_len=(blocks - 1) * BLOCK)
    return [Engine(EngineConfig(**{f: getattr(config, f) for f in config.field_names()}), i) for i in range(count)]


def _serve(engine: Engine, hashes: list, uid: int, prompt_len: int, at: float) -> None:
    """Run one request of `prompt_len` tokens through `engine` to the end, so its blocks stay cached."""
    engine.add_request(Request(uid, prompt_len, 1, 1, hashes, at))
    engine.run_until(at + 5.0)


def _prompt(prefix: str, blocks: int = 8) -> list:
    return [(prefix, i) for i in range(blocks)]


def test_round_robin_takes_turns_and_predicts_what_the_chosen_engine_holds():
    engines = _engines()
    router = SimRouter(engines, "round_robin")
    _serve(engines[2], _prompt("a"), 1, 8 * BLOCK + 1, 0.0)
    chosen = [router.pick(_prompt("a"), 8 * BLOCK + 1).index for _ in range(4)]
    assert chosen == [0, 1, 2, 3]
    # Predicted: only the third request's engine held the prompt; the best held it every time.
    assert router.predicted.sum == 8 * BLOCK
    assert router.best_available.sum == 4 * 8 * BLOCK
    assert router.prompt.sum == 4 * (8 * BLOCK + 1)


def test_prefix_policy_picks_the_holder_and_never_the_last_token():
    engines = _engines()
    router = SimRouter(engines, "prefix")
    _serve(engines[3], _prompt("a"), 1, 8 * BLOCK + 1, 0.0)
    assert router.pick(_prompt("a"), 8 * BLOCK + 1).index == 3
    # A prompt of exactly 8 blocks can reuse 7: vLLM computes the last token.
    assert router.pick(_prompt("a"), 8 * BLOCK).index == 3
    assert router.predicted.sum == 8 * BLOCK + 7 * BLOCK


def test_stale_index_keeps_predicting_what_an_engine_evicted():
    engines = _engines(count=2, blocks=12)
    fresh, stale = SimRouter(engines, "prefix"), SimRouter(engines, "prefix_stale")
    target = stale.pick(_prompt("a"), 8 * BLOCK + 1)
    _serve(target, _prompt("a"), 1, 8 * BLOCK + 1, 0.0)
    # Another prompt fills the small cache: the first one's blocks are evicted.
    _serve(target, _prompt("b", 10), 2, 10 * BLOCK + 1, 10.0)
    assert target.pool.longest_cached_prefix(_prompt("a"), 8) == []
    before = stale.predicted.sum
    assert stale.pick(_prompt("a"), 8 * BLOCK + 1) is target
    assert stale.predicted.sum - before == 8 * BLOCK  # the stale index still believes it
    fresh.pick(_prompt("a"), 8 * BLOCK + 1)
    assert fresh.predicted.sum == 0  # the engines' caches say nothing holds it


def test_unknown_policy_is_one_sentence():
    with pytest.raises(ValueError, match="unknown router policy 'sticky'"):
        SimRouter(_engines(), "sticky")


def test_page_is_llm_d_epp_names_and_parses():
    sim = Simulation(load_scenario("routing"), seed=1, router="prefix")
    sim.advance(30)
    text = sim.router.render(sim.model_name)
    names = ("prefix_predicted_cached_tokens", "prefix_best_available_cached_tokens", "prefix_prompt_tokens",
             "request_total")
    page = FamilySelector(names, ("llm_d_epp_",)).parse(text)
    assert not page.errors
    predicted = {s: v for s, labels, v in page.families["prefix_predicted_cached_tokens"].samples
                 if s in ("_sum", "_count")}
    assert predicted["_count"] == sim.router.requests > 0
    assert predicted["_sum"] == sim.router.predicted.sum
    [(suffix, labels, value)] = page.families["request_total"].samples
    assert labels["model_name"] == sim.model_name and value == sim.router.requests


def test_server_serves_the_router_page_only_with_a_router():
    import requests

    from kvwatch.sim.server import start_background

    with start_background("routing", speed=0, router="round_robin") as handle:
        handle.advance(20)
        answer = requests.get(handle.router_metrics_url, timeout=10)
        assert answer.status_code == 200
        assert "llm_d_epp_prefix_predicted_cached_tokens_sum" in answer.text
    with start_background("healthy", speed=0) as handle:
        assert requests.get(handle.router_metrics_url, timeout=10).status_code == 404
