"""The simulator's LMCache tier (kvwatch/sim/lmcache.py, `kvwatch sim --lmcache`):
a bounded LRU store of what the simulated GPU cache evicts, served back at a
later admission, and a page in LMCache's names, types and labels (the
handwritten page tests/fixtures/handwritten/lmcache-a.txt is the reference)."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvwatch.pipeline.lmcache import LMCacheSource
from kvwatch.settings import Settings
from kvwatch.sim.engine import Engine, EngineConfig, Request
from kvwatch.sim.lmcache import LMCacheTier
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.server import start_background
from kvwatch.sim.simulation import Simulation

BLOCK = 32


def shape(text: str) -> dict[str, tuple[str, frozenset]]:
    """family -> (type, its sample names, the label names of its samples)."""
    return {family.name: (family.type, frozenset(sample.name for sample in family.samples),
                          frozenset(key for sample in family.samples for key in sample.labels))
            for family in text_string_to_metric_families(text)}


def test_the_page_has_the_fixtures_families_types_and_labels(fixtures_dir):
    reference = shape((fixtures_dir / "handwritten" / "lmcache-a.txt").read_text())
    # The multiprocess server's lookup counters beside them (its target_info series left out).
    reference_mp = {name: kind for name, kind in shape(
        (fixtures_dir / "handwritten" / "lmcache-mp-a.txt").read_text()).items() if name != "target_info"}
    sim = Simulation(load_scenario("exhaustion"), lmcache_tokens=4096)
    sim.advance(60)
    page = shape(sim.lmcache.render(sim.model_name))
    assert {name: kind for name, kind in page.items() if name.startswith("lmcache:")} == reference
    assert {name: kind for name, kind in page.items() if name.startswith("lmcache_mp")} == reference_mp


def run(engine: Engine, uid: int, hashes: list, until: float) -> Request:
    request = Request(uid, len(hashes) * BLOCK + 1, 1, 1, hashes, engine.clock)
    engine.add_request(request)
    engine.run_until(until)
    assert request.finish_reason is not None
    return request


def test_an_evicted_prefix_comes_back_from_the_tier_and_is_counted_as_lmcache_counts():
    # 9 usable blocks: a 4-block prefix, then 2 prompts of 4 other blocks evict it.
    engine = Engine(EngineConfig(num_gpu_blocks=10, block_size=BLOCK, max_model_len=256, max_num_seqs=1))
    tier = LMCacheTier(capacity_chunks=100, chunk_tokens=BLOCK)
    engine.attach_tier(tier)
    prefix = [("p", i) for i in range(4)]
    run(engine, 1, prefix, 10)
    run(engine, 2, [("x", i) for i in range(4)], 20)
    run(engine, 3, [("y", i) for i in range(4)], 30)
    assert tier.hit_tokens == 0 and tier.stored_tokens > 0
    assert not any(h in engine.pool.cached for h in prefix)
    stats = engine.stats
    hits_before, computed_before = stats.prefix_cache_hits, stats.prompt_tokens_local_compute
    # The prefix again, plus one block of its own: the GPU cache lost the
    # prefix, the tier has it.
    again = run(engine, 4, prefix + [("z", 0)], 40)
    assert stats.prefix_cache_hits == hits_before  # nothing from the GPU cache
    assert again.num_external_tokens == 4 * BLOCK
    assert tier.requested_tokens == tier.hit_tokens == 4 * BLOCK  # only what the lookup promised
    assert tier.retrieve_requests == 1 and tier.lookup_requests == 4
    assert tier.prompt_tokens == sum(n * BLOCK + 1 for n in (4, 4, 4, 5))
    assert stats.prompt_tokens_external == 4 * BLOCK
    assert stats.prompt_tokens_local_compute - computed_before == again.prompt_len - 4 * BLOCK
    assert stats.external_prefix_cache_hits == 4 * BLOCK
    # As the multiprocess server counts the same lookups: the 4-block prefix found (all L1's, one level),
    # out of the chunks past the engine's own the four prompts asked for.
    assert tier.mp_lookup_hit_tokens == tier.mp_lookup_hit_l1_tokens == 4 * BLOCK
    assert tier.mp_lookup_hit_l2_tokens == 0 and tier.mp_lookups == 4
    assert tier.mp_lookup_requested_tokens == sum(n * BLOCK for n in (4, 4, 4, 5))


def test_the_tier_is_bounded_and_evicts_least_recently_used_first():
    tier = LMCacheTier(capacity_chunks=3, chunk_tokens=BLOCK)
    tier.store(["a", "b", "c"])
    assert tier.find(["a"], 0) == 1  # finding does not count or refresh
    tier.retrieve(["a"], 0, 1, BLOCK)  # a retrieval refreshes "a"
    tier.store(["d"])
    assert list(tier.chunks) == ["c", "a", "d"] and tier.evictions == 1
    assert tier.find(["b"], 0) == 0


def test_kvwatch_reads_the_simulated_tier_page():
    with start_background("demo", speed=0, lmcache_tokens=16384) as sim:
        sim.advance(300)
        with urllib.request.urlopen(sim.lmcache_metrics_url, timeout=5) as response:
            text = response.read().decode()
        source = LMCacheSource(Settings(target=sim.metrics_url, lmcache_target=sim.lmcache_metrics_url), 300.0)
        first = source.ingest(text, 1000.0)
        sim.advance(120)
        second = source.ingest(sim.lmcache_metrics_text(), 1120.0)
    assert first["up"] and second["up"]
    (model,) = second["models"]
    assert model["model_name"] == sim.sim.model_name
    # The first worker's series, never the sum of the two workers.
    assert model["latest"]["hit_tokens"] == sim.sim.lmcache.hit_tokens > 0
    assert model["signals"]["kvwatch_lmcache_hit_ratio"] == 1.0


def test_without_the_tier_the_page_is_not_served():
    with start_background("healthy", speed=0) as sim:
        try:
            urllib.request.urlopen(sim.url + "/lmcache/metrics", timeout=5)
        except urllib.error.HTTPError as exc:
            assert exc.code == 404
        else:
            raise AssertionError("served an LMCache page without a tier")


def test_the_tier_size_is_checked_on_the_command_line(capsys):
    from kvwatch.cli import main

    assert main(["sim", "--lmcache-tokens", "0", "--port", "0"]) == 2
    assert "--lmcache-tokens must be >= 1" in capsys.readouterr().err
