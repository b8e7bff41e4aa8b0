"""The real-vLLM tier's own checks: the server and the load drivers do what later tests rely on.

These read vLLM's /metrics directly (harness.read_metrics), not through kvwatch.
"""

import random

import pytest

from .harness import (
    burst_load,
    count_prompt_tokens,
    long_prompt_load,
    prompt_suffix,
    prompt_text,
    read_metrics,
    shared_prefix_load,
    wait_until_idle,
    watch,
)

pytestmark = pytest.mark.vllm

USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
PREEMPTIONS = "vllm:num_preemptions_total"
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"


def test_server_exports_kv_cache_metrics_for_128_blocks_of_32(real_vllm):
    metrics = read_metrics(real_vllm.metrics_url)

    assert USAGE in metrics
    cache_config = metrics.labels("vllm:cache_config_info")
    assert cache_config["num_gpu_blocks"] == "128"
    assert cache_config["block_size"] == "32"
    assert cache_config["enable_prefix_caching"] == "True"


def test_prompts_encode_to_the_token_count_asked_for(real_vllm):
    rng = random.Random(3)
    prefix = prompt_text(512, rng)

    assert count_prompt_tokens(real_vllm.base_url, prefix) == 512
    assert count_prompt_tokens(real_vllm.base_url, prefix + prompt_suffix(64, rng)) == 576


def test_burst_fills_the_cache_and_preempts_then_clears(real_vllm):
    before = wait_until_idle(real_vllm.metrics_url)

    # 10 s: the first of the 24 requests (400 generated tokens each, preempted
    # in turn) can take over 6 s to finish on a busy machine, and only a
    # finished request is replaced (completed > 24 below).
    run = burst_load(real_vllm.base_url, duration=10.0)
    peak_usage = max((m.value(USAGE) for m in watch(run, real_vllm.metrics_url)), default=0.0)
    stats = run.wait()
    after = wait_until_idle(real_vllm.metrics_url)

    assert stats.failed == 0, stats.errors
    assert stats.completed > 24
    # Preemptions prove the cache ran full (vLLM preempts only when it cannot
    # allocate a block). The sampled usage shows it filling but can miss the
    # peak: a preempted request's blocks are freed at once, and on a busy
    # machine samples every 0.25 s saw at most 0.88.
    assert after.value(PREEMPTIONS) > before.value(PREEMPTIONS)
    assert peak_usage > 0.75
    # Every burst prompt is its own: nothing for the prefix cache to hit.
    assert after.value(HITS) == before.value(HITS)
    assert after.value(USAGE) == 0.0


def test_shared_prefix_hits_the_prefix_of_every_request_after_the_first(real_vllm):
    before = wait_until_idle(real_vllm.metrics_url)

    stats = shared_prefix_load(real_vllm.base_url, duration=3.0, prefix_tokens=512,
                               suffix_tokens=64).wait()
    after = wait_until_idle(real_vllm.metrics_url)

    assert stats.failed == 0, stats.errors
    assert stats.completed > 8
    # Token counts line up with the server's own counters ...
    assert after.value(PROMPT_TOKENS) - before.value(PROMPT_TOKENS) == stats.completed * 576
    assert after.value(QUERIES) - before.value(QUERIES) == stats.completed * 576
    # ... and the first request caches the 16 prefix blocks that all the others hit.
    assert after.value(HITS) - before.value(HITS) == (stats.completed - 1) * 512


def test_long_prompts_fill_the_cache_and_queue(real_vllm):
    wait_until_idle(real_vllm.metrics_url)

    run = long_prompt_load(real_vllm.base_url, duration=4.0)
    scrapes = list(watch(run, real_vllm.metrics_url))
    stats = run.wait()

    assert stats.failed == 0, stats.errors
    assert stats.prompt_tokens == stats.completed * 900
    # Four 900-token prompts fill 120 of the 128 blocks; the other two must wait.
    assert max((m.value(USAGE) for m in scrapes), default=0.0) > 0.9
    assert max((m.value(WAITING) for m in scrapes), default=0.0) >= 1
