"""The loads that provoke each cause kvwatch names, on the tier's real vLLM
(128 blocks x 32 tokens = 4,096 tokens of KV cache, --max-num-seqs 8).

Each returns a started `LoadRun` (harness.py). The tier tests and
`record_scenarios.py` (the captures under tests/fixtures/vllm-0.32-cpu-
scenarios/) use the same ones, so a capture replays what a tier test saw.

- `long_requests_load`: 4 requests of 200 prompt + 800 generated tokens. Each
  ends at about 1,000 tokens (31 blocks), 4 x 31 > 128: the cache fills and
  vLLM preempts with nobody waiting, while a request's *average* footprint
  over its life is half its final one.
- `prefix_rotation_load`: a round robin over `prefixes` prompts of
  `prefix_tokens` tokens. 12 x 512 tokens (192 blocks) is more than the cache
  holds, so least-recently-used eviction throws every prefix out just before
  its turn comes again; yet only the running requests' blocks count as used,
  so `kv_cache_usage_perc` stays near 0.27. `phases` switches the working set
  during the run (e.g. 4 prefixes that fit, then 12 that do not).
- `changed_prefix_load`: requests sharing one prefix, then (after
  `switch_after` s) each request puts its own header before it, so no two
  share a first block any more: the prefix stopped being shared.
- `distinct_load`: prompts that share nothing (no reuse).
"""

from __future__ import annotations

import itertools
import random
import threading
import time

from .harness import LoadRun, prompt_suffix, prompt_text, prompt_words


def long_requests_load(base_url: str, duration: float = 20.0, concurrency: int = 4, prompt_tokens: int = 200,
                       output_tokens: int = 800, seed: int | None = None) -> LoadRun:
    words = prompt_words()
    run_seed = random.randrange(1 << 62) if seed is None else seed

    def make_prompt(index: int) -> str:
        return prompt_text(prompt_tokens, random.Random(f"{run_seed}-{index}"), words)

    return LoadRun("long-requests", base_url, make_prompt, output_tokens, concurrency, duration, 1000, 180.0)


def prefix_rotation_load(base_url: str, duration: float = 25.0, phases: tuple[tuple[float, int], ...] = ((0.0, 12),),
                         concurrency: int = 2, prefix_tokens: int = 512, suffix_tokens: int = 32,
                         output_tokens: int = 16, seed: int | None = None, max_requests: int = 5000) -> LoadRun:
    """Round robin over a working set of prefixes; `phases` is ((start_s, size), ...):
    from start_s on, the rotation runs over the first `size` prefixes."""
    words = prompt_words()
    rng = random.Random(random.randrange(1 << 62) if seed is None else seed)
    most = max(size for _, size in phases)
    prefixes = [prompt_text(prefix_tokens, rng, words) for _ in range(most)]
    suffixes = random.Random(rng.random())
    lock = threading.Lock()
    started = time.monotonic()
    turn = itertools.count()

    def make_prompt(_index: int) -> str:
        elapsed = time.monotonic() - started
        size = [size for start, size in phases if start <= elapsed][-1]
        with lock:
            return prefixes[next(turn) % size] + prompt_suffix(suffix_tokens, suffixes, words)

    return LoadRun("prefix-rotation", base_url, make_prompt, output_tokens, concurrency, duration, max_requests,
                   60.0)


def changed_prefix_load(base_url: str, duration: float = 35.0, switch_after: float = 15.0, concurrency: int = 2,
                        prefix_tokens: int = 512, suffix_tokens: int = 32, output_tokens: int = 16,
                        seed: int | None = None) -> LoadRun:
    words = prompt_words()
    rng = random.Random(random.randrange(1 << 62) if seed is None else seed)
    prefix = prompt_text(prefix_tokens, rng, words)
    headers = random.Random(rng.random())
    lock = threading.Lock()
    started = time.monotonic()

    def make_prompt(_index: int) -> str:
        with lock:
            suffix = prompt_suffix(suffix_tokens, headers, words)
            if time.monotonic() - started < switch_after:
                return prefix + suffix
            # A per-request header first (a request id, a timestamp): the same
            # text follows, but no block of it is shared any more.
            return prompt_text(32, headers, words) + " " + prefix + suffix

    return LoadRun("changed-prefix", base_url, make_prompt, output_tokens, concurrency, duration, 5000, 60.0,
                   prime=True)


def distinct_load(base_url: str, duration: float = 25.0, concurrency: int = 2, prompt_tokens: int = 544,
                  output_tokens: int = 16, seed: int | None = None) -> LoadRun:
    words = prompt_words()
    run_seed = random.randrange(1 << 62) if seed is None else seed

    def make_prompt(index: int) -> str:
        return prompt_text(prompt_tokens, random.Random(f"{run_seed}-{index}"), words)

    return LoadRun("distinct", base_url, make_prompt, output_tokens, concurrency, duration, 5000, 60.0)
