"""The engine model behind the simulator: block accounting, the prefix cache and
its LRU eviction, preemption, admission, counting as vLLM 0.32 counts, and the
timing equations."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.sim.blocks import BlockPool
from kvwatch.sim.engine import FINISHED, Engine, EngineConfig, Request, RequestRejected
from kvwatch.sim.workload import token_block_hashes

_uids = iter(range(1, 10**9))


def make_request(tokens: list, max_tokens: int, arrival: float = 0.0, block_size: int = 32,
                 output_len: int | None = None) -> Request:
    return Request(next(_uids), len(tokens), max_tokens, output_len or max_tokens,
                   token_block_hashes(tokens, block_size), arrival)


def words(tag: str, count: int) -> list[str]:
    return [f"{tag}{i}" for i in range(count)]


def check_invariants(engine: Engine) -> None:
    pool = engine.pool
    accounting = pool.accounting()
    assert accounting["used"] + accounting["free_cached"] + accounting["free_uncached"] == accounting["usable"]
    assert min(pool.ref_count) >= 0
    holders = Counter(block for request in engine.running for block in request.blocks)
    for block in range(1, pool.num_blocks):
        assert pool.ref_count[block] == holders.get(block, 0), block
    assert set(pool.free_queue) == {b for b in range(1, pool.num_blocks) if pool.ref_count[b] == 0}
    assert 0 not in pool.free_queue and pool.ref_count[0] == 0 and 0 not in holders
    for content, block in pool.cached.items():
        assert pool.block_hash[block] == content
    assert pool.usage() == pytest.approx(accounting["used"] / accounting["usable"])
    assert all(not request.blocks for request in engine.waiting)
    assert len(engine.running) <= engine.config.max_num_seqs


def test_reproduces_the_prefix_capture_counts():
    """The 0.32 capture: 8 requests of a 512-token shared prefix plus 16 tokens
    each, 16 generated tokens, on 128 blocks of 32 tokens."""
    engine = Engine(EngineConfig())
    prefix = words("system", 512)
    engine.add_request(make_request(prefix + words("user0-", 16), 16))
    engine.run_until(5.0)
    for i in range(1, 8):
        engine.add_request(make_request(prefix + words(f"user{i}-", 16), 16, arrival=5.0))
    engine.run_until(60.0)
    stats = engine.stats
    assert stats.prefix_cache_hits == 7 * 512 == 3584
    assert stats.prefix_cache_queries == 8 * 528
    assert stats.prompt_tokens == stats.request_prompt_tokens.sum == 4224
    assert stats.prompt_tokens_local_cache_hit == 3584
    assert stats.prompt_tokens_local_compute == 4224 - 3584
    assert stats.generation_tokens == stats.request_generation_tokens.sum == 128
    assert stats.request_prefill_kv_computed_tokens.sum == 528 + 7 * 16 == 640
    assert stats.request_success["length"] == 8
    assert stats.inter_token_latency.count == 128 - 8
    assert engine.pool.usage() == 0  # finished requests' cached blocks count as free
    assert len(engine.pool.cached) == 16  # the prefix's blocks; each request's 543 tokens end in a partial 17th


def test_only_full_blocks_hit_and_the_last_token_is_always_computed():
    engine = Engine(EngineConfig())
    prefix = words("p", 500)  # 15 full blocks of 32 and 20 tokens
    engine.add_request(make_request(prefix + words("a", 40), 4))
    engine.run_until(5)
    engine.add_request(make_request(prefix + words("b", 40), 4, arrival=5))
    engine.run_until(10)
    assert engine.stats.prefix_cache_hits == 15 * 32
    same = words("same", 64)  # exactly two blocks
    engine.add_request(make_request(same, 4, arrival=10))
    engine.run_until(15)
    hits = engine.stats.prefix_cache_hits
    engine.add_request(make_request(same, 4, arrival=15))
    engine.run_until(20)
    assert engine.stats.prefix_cache_hits - hits == 32  # not 64: the last block is recomputed


def test_usage_counts_referenced_blocks_over_usable_blocks():
    engine = Engine(EngineConfig(num_gpu_blocks=128, block_size=32))
    request = make_request(words("x", 100), 200)
    engine.add_request(request)
    engine.run_until(0.001)  # the first step is planned: 4 blocks for 100 tokens
    assert request.blocks and len(request.blocks) == 4
    assert engine.pool.usage() == pytest.approx(4 / 127)
    engine.run_until(60)
    assert request.state == FINISHED
    assert engine.pool.usage() == 0
    assert engine.pool.accounting()["free_cached"] == 9  # (100 + 199) // 32 full blocks stay cached


def test_least_recently_used_free_blocks_are_evicted_first_tail_first():
    config = EngineConfig(num_gpu_blocks=9, block_size=16, max_model_len=128, max_num_seqs=1)
    engine = Engine(config)
    prompt_a, prompt_b = words("a", 64), words("b", 64)
    for t, prompt in ((0, prompt_a), (1, prompt_b)):
        engine.add_request(make_request(prompt, 1, arrival=t, block_size=16))
        engine.run_until(t + 0.5)
    assert engine.pool.accounting()["free_cached"] == 8
    # A 32-token newcomer takes the two oldest free blocks: the last two of A.
    engine.add_request(make_request(words("c", 31), 1, arrival=2, block_size=16))
    engine.run_until(2.5)
    hits = engine.stats.prefix_cache_hits
    engine.add_request(make_request(prompt_a, 1, arrival=3, block_size=16))
    engine.run_until(3.5)
    assert engine.stats.prefix_cache_hits - hits == 32  # A kept its first two blocks only
    # A's two missing blocks came from the front of the free queue: B's tail.
    hits = engine.stats.prefix_cache_hits
    engine.add_request(make_request(prompt_b, 1, arrival=4, block_size=16))
    engine.run_until(4.5)
    assert engine.stats.prefix_cache_hits - hits == 32
    assert engine.pool.evictions >= 2
    check_invariants(engine)


def test_preemption_recomputes_and_is_counted_once_per_event():
    config = EngineConfig(num_gpu_blocks=17, block_size=16, max_model_len=256, max_num_seqs=4)
    engine = Engine(config)
    requests = [make_request(words(f"r{i}-", 64), 150, block_size=16) for i in range(2)]
    for request in requests:
        engine.add_request(request)
    seen_waiting = False
    t = 0.0
    while not all(r.state == FINISHED for r in requests):
        t += 0.05
        engine.run_until(t)
        check_invariants(engine)
        seen_waiting |= engine.num_waiting > 0
        assert t < 120, "requests never finished"
    stats = engine.stats
    assert stats.num_preemptions >= 1
    assert seen_waiting
    assert stats.request_num_preemptions.sum == stats.num_preemptions
    assert stats.request_success["length"] == 2
    assert stats.generation_tokens == 300
    # Recomputation after a preemption is not a prefix-cache query (vLLM PR #25787).
    assert stats.prefix_cache_queries == 128
    assert stats.prompt_tokens == 128


def test_waiting_queue_and_max_num_seqs():
    engine = Engine(EngineConfig(max_num_seqs=4))
    for i in range(10):
        engine.add_request(make_request(words(f"q{i}-", 40), 50))
    engine.run_until(0.001)
    assert engine.num_running == 4 and engine.num_waiting == 6
    engine.run_until(300)
    assert engine.num_running == engine.num_waiting == 0
    assert engine.stats.request_success["length"] == 10
    # Later requests waited for a sequence slot.
    assert engine.stats.request_queue_time.sum > 0


def test_prefill_time_is_proportional_to_uncached_tokens():
    config = EngineConfig(num_gpu_blocks=200, block_size=32, max_model_len=2048, step_overhead_s=0.01,
                          decode_s_per_seq=0.0, prefill_s_per_token=0.001)
    engine = Engine(config)
    prompt = words("doc", 1000)
    first = make_request(prompt, 2)
    engine.add_request(first)
    engine.run_until(10)
    assert first.first_token_ts - first.scheduled_ts == pytest.approx(0.01 + 1000 * 0.001)
    second = make_request(prompt, 2, arrival=10)
    engine.add_request(second)
    engine.run_until(20)
    assert second.num_cached_tokens == 992  # 31 full blocks; 8 tokens recomputed
    assert second.first_token_ts - second.scheduled_ts == pytest.approx(0.01 + 8 * 0.001)


def test_decode_step_grows_mildly_with_the_batch():
    def itl(batch: int) -> float:
        config = EngineConfig(num_gpu_blocks=400, max_num_seqs=16, step_overhead_s=0.01, decode_s_per_seq=0.001)
        engine = Engine(config)
        for i in range(batch):
            engine.add_request(make_request(words(f"b{i}-", 20), 20))
        engine.run_until(30)
        return engine.stats.inter_token_latency.mean()

    assert itl(1) == pytest.approx(0.011)
    assert itl(8) == pytest.approx(0.018)


def test_timing_identities_hold_for_every_request():
    engine = Engine(EngineConfig(num_gpu_blocks=128, max_num_seqs=6))
    requests = [make_request(words(f"t{i}-", 100 + 37 * i), 60, arrival=0.3 * i) for i in range(12)]
    for request in requests:
        engine.run_until(request.arrival)
        engine.add_request(request)
    engine.run_until(600)
    stats = engine.stats
    assert all(r.state == FINISHED for r in requests)
    assert stats.e2e_request_latency.sum == pytest.approx(stats.request_queue_time.sum + stats.request_inference_time.sum)
    assert stats.time_to_first_token.sum == pytest.approx(stats.request_queue_time.sum + stats.request_prefill_time.sum)
    assert stats.request_inference_time.sum == pytest.approx(stats.request_prefill_time.sum + stats.request_decode_time.sum)
    # Tokens per step: prompt tokens computed (not the cached ones) plus tokens generated.
    assert stats.num_preemptions == 0
    assert stats.iteration_tokens.sum == stats.prompt_tokens_local_compute + stats.generation_tokens


def test_rejections():
    engine = Engine(EngineConfig(max_num_queued_reqs=2, max_num_seqs=1))
    with pytest.raises(RequestRejected) as too_long:
        engine.add_request(make_request(words("l", 1000), 100))
    assert too_long.value.status == 400 and "maximum context length is 1024" in str(too_long.value)
    for i in range(2):
        engine.add_request(make_request(words(f"w{i}", 10), 5))
    with pytest.raises(RequestRejected) as full:
        engine.add_request(make_request(words("w3", 10), 5))
    assert full.value.status == 503
    assert engine.stats.admission_rejections["max_num_queued_reqs"] == 1


def test_abort_frees_blocks_and_counts_the_reason():
    engine = Engine(EngineConfig())
    request = make_request(words("abort", 200), 500)
    engine.add_request(request)
    engine.run_until(1.0)
    assert engine.pool.usage() > 0
    engine.abort(request, 1.0)
    engine.run_until(2.0)
    assert engine.pool.usage() == 0
    assert engine.stats.request_success["abort"] == 1
    check_invariants(engine)


def test_block_pool_rejects_what_it_cannot_give():
    pool = BlockPool(5)
    assert pool.allocate(5) is None and pool.num_free == 4
    taken = pool.allocate(4)
    assert sorted(taken) == [1, 2, 3, 4] and pool.usage() == 1.0
    pool.free(taken)
    assert pool.usage() == 0.0


@settings(max_examples=40, deadline=None)
@given(
    blocks=st.integers(min_value=33, max_value=80),
    max_num_seqs=st.integers(min_value=1, max_value=8),
    arrivals=st.lists(
        st.tuples(
            st.floats(min_value=0, max_value=0.5),  # gap before this request
            st.integers(min_value=0, max_value=3),  # which shared prefix (3 = none)
            st.integers(min_value=1, max_value=300),  # own prompt tokens
            st.integers(min_value=1, max_value=400),  # output tokens
        ),
        min_size=1,
        max_size=25,
    ),
)
def test_block_accounting_invariants_under_any_load(blocks, max_num_seqs, arrivals):
    config = EngineConfig(num_gpu_blocks=blocks, block_size=16, max_model_len=512, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=256)
    engine = Engine(config)
    prefixes = [words(f"prefix{k}-", 48 + 40 * k) for k in range(3)]
    t = 0.0
    requests = []
    for gap, prefix, own, output in arrivals:
        t += gap
        engine.run_until(t)
        check_invariants(engine)
        tokens = (prefixes[prefix] if prefix < 3 else []) + words(f"u{len(requests)}-", own)
        tokens = tokens[: 512 - output]
        request = make_request(tokens, output, arrival=t, block_size=16)
        engine.add_request(request)
        requests.append(request)
    end = t
    while not all(r.state == FINISHED for r in requests):
        end += 0.25
        engine.run_until(end)
        check_invariants(engine)
        assert end < t + 3600, "the engine stalled"
    assert engine.pool.usage() == 0
    stats = engine.stats
    assert stats.prefix_cache_hits <= stats.prefix_cache_queries == sum(r.prompt_len for r in requests)
    assert stats.generation_tokens == sum(r.output_len for r in requests)
    assert stats.num_preemptions == sum(r.num_preemptions for r in requests)
