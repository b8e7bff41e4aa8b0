"""The loads that provoke each cause kvwatch names, on the tier's real vLLM
(128 blocks x 32 tokens = 4,096 tokens of KV cache, --max-num-seqs 8).

Each returns a started `LoadRun` (harness.py). The tier tests and
`record_scenarios.py` (the captures under tests/fixtures/vllm-0.32-cpu-
scenarios/) use the same ones, so a capture replays what a tier test saw.

- `long_requests_load`: 5 requests of 200 prompt + 800 generated tokens, all
  admitted at once (5 x 7 blocks of prompt): nobody waits but a request
  vLLM preempted. Each ends at
  1,000 tokens (32 blocks), 5 x 32 = 160 > 127 usable blocks: the cache fills
  and vLLM preempts in every run, while a request's *average* footprint over
  its life is half its final one. (With 4, 4 x 32 = 128 against 127 usable
  blocks preempted in some runs only.)
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
- `stalled_front_end_load`: short distinct prompts while vLLM's API server
  process (the front end) alone is stopped and continued in a duty cycle
  (SIGSTOP for `pause_s`, SIGCONT for `run_s`). vLLM V1 stamps a request's
  arrival and its first token in the front end (`arrival_time`, and
  `IterationStats.iteration_timestamp` when the output handler takes the
  engine core's outputs), but its queue and prefill intervals from the engine
  core's own timestamps (`EngineCoreEvent` QUEUED/SCHEDULED,
  `EngineCoreOutputs.timestamp`): an output that waits for the stopped front
  end lengthens TTFT and neither part, as a busy or slow front end does.
- `reuse_then_flood_load`: 4 prefixes of 256 tokens reused every ~2 s while
  the cache has room (their blocks record reuse gaps of ~2 s), then distinct
  480-token prompts turn the free pool over in well under 2 s: with
  --kv-cache-metrics, blocks are evicted after less idle time than their
  reuse gap, and kvwatch says how many more blocks would keep the reuse.
"""

from __future__ import annotations

import itertools
import os
import random
import signal
import threading
import time

from .harness import MODEL_NAME, LoadRun, LoadStats, burst_load, prompt_suffix, prompt_text, prompt_words


def long_requests_load(base_url: str, duration: float = 20.0, concurrency: int = 5, prompt_tokens: int = 200,
                       output_tokens: int = 800, seed: int | None = None) -> LoadRun:
    words = prompt_words()
    run_seed = random.randrange(1 << 62) if seed is None else seed

    def make_prompt(index: int) -> str:
        return prompt_text(prompt_tokens, random.Random(f"{run_seed}-{index}"), words)

    return LoadRun("long-requests", base_url, make_prompt, output_tokens, concurrency, duration, 1000, 180.0)


def prefix_rotation_load(base_url: str, duration: float = 25.0, phases: tuple[tuple[float, int], ...] = ((0.0, 12),),
                         concurrency: int = 2, prefix_tokens: int = 512, suffix_tokens: int = 32,
                         output_tokens: int = 16, seed: int | None = None, max_requests: int = 5000,
                         extra_body=None) -> LoadRun:
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
                   60.0, extra_body=extra_body)


def changed_prefix_load(base_url: str, duration: float = 35.0, switch_after: float = 15.0, concurrency: int = 2,
                        prefix_tokens: int = 512, suffix_tokens: int = 32, output_tokens: int = 16,
                        seed: int | None = None, extra_body=None) -> LoadRun:
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
                   prime=True, extra_body=extra_body)


def distinct_load(base_url: str, duration: float = 25.0, concurrency: int = 2, prompt_tokens: int = 544,
                  output_tokens: int = 16, seed: int | None = None, model: str = MODEL_NAME,
                  extra_body=None) -> LoadRun:
    words = prompt_words()
    run_seed = random.randrange(1 << 62) if seed is None else seed

    def make_prompt(index: int) -> str:
        return prompt_text(prompt_tokens, random.Random(f"{run_seed}-{index}"), words)

    return LoadRun("distinct", base_url, make_prompt, output_tokens, concurrency, duration, 5000, 60.0,
                   model=model, extra_body=extra_body)


class StalledFrontEndRun(LoadRun):
    """A LoadRun during which the process `pid` is stopped for `pause_s` and
    continued for `run_s`, over and over; it is always continued at the end."""

    def __init__(self, pid: int, pause_s: float, run_s: float, *args, **kwargs):
        self.pid, self.pause_s, self.run_s = pid, pause_s, run_s
        self.pauses = 0
        super().__init__(*args, **kwargs)

    def _duty_cycle(self, done: threading.Event) -> None:
        while not done.is_set():
            os.kill(self.pid, signal.SIGSTOP)
            self.pauses += 1
            try:
                done.wait(self.pause_s)
            finally:
                os.kill(self.pid, signal.SIGCONT)
            done.wait(self.run_s)

    def _run(self) -> None:
        done = threading.Event()
        stalls = threading.Thread(target=self._duty_cycle, args=(done,), name=f"stall-{self.name}", daemon=True)
        stalls.start()
        try:
            super()._run()
        finally:
            done.set()
            stalls.join()
            os.kill(self.pid, signal.SIGCONT)


def api_server_pid(server_pid: int) -> int:
    """The pid of vLLM's API server (its front end): with one API server it is
    the `vllm serve` process itself, and the engine core runs in a child
    process (`VLLM::EngineCore`) whose timestamps the stops leave alone. Fails
    unless the process tree is that."""
    def cmdline(pid: int) -> str:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return handle.read().replace(b"\0", b" ").decode(errors="replace")

    def children(pid: int) -> list[int]:
        found = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += [int(c) for c in handle.read().split()]
        return found

    command = cmdline(server_pid)
    if " serve " not in f"{command} ":
        raise AssertionError(f"process {server_pid} is not vllm serve: {command!r}")
    engines = [c for c in children(server_pid) if "EngineCore" in cmdline(c)]
    if not engines:
        raise AssertionError(f"vllm serve ({server_pid}) has no EngineCore child: "
                             f"{[cmdline(c)[:60] for c in children(server_pid)]}")
    return server_pid


def stalled_front_end_load(base_url: str, server_pid: int, duration: float = 15.0, pause_s: float = 0.3,
                           run_s: float = 0.1, concurrency: int = 4, prompt_tokens: int = 64, output_tokens: int = 8,
                           seed: int | None = None) -> StalledFrontEndRun:
    words = prompt_words()
    run_seed = random.randrange(1 << 62) if seed is None else seed

    def make_prompt(index: int) -> str:
        return prompt_text(prompt_tokens, random.Random(f"{run_seed}-{index}"), words)

    return StalledFrontEndRun(api_server_pid(server_pid), pause_s, run_s, "stalled-front-end", base_url, make_prompt,
                              output_tokens, concurrency, duration, 5000, 60.0)


def paced_load(name: str, base_url: str, prompts, output_tokens: int, duration: float, pace_s: float,
               concurrency: int = 1) -> LoadRun:
    """A load whose workers send `prompts(i)` one after another, starting one
    at most every `pace_s` s (LoadRun's workers call make_prompt before each
    request; the pause is taken there)."""
    lock = threading.Lock()
    last = [0.0]

    def make_prompt(index: int) -> str:
        with lock:
            wait = last[0] + pace_s - time.monotonic()
            last[0] = max(time.monotonic(), last[0] + pace_s)
        if wait > 0:
            time.sleep(wait)
        return prompts(index)

    return LoadRun(name, base_url, make_prompt, output_tokens, concurrency, duration, 10_000, 60.0)


def hot_prefixes_load(base_url: str, duration: float = 14.0, seed: int = 23) -> LoadRun:
    """4 prefixes of 256 tokens (8 blocks) + 8 tokens of each request's own,
    one request every 0.5 s in rotation: each prefix is reused every ~2 s."""
    words = prompt_words()
    rng = random.Random(seed)
    hot = [prompt_text(256, rng, words) for _ in range(4)]
    suffixes = random.Random(rng.random())
    return paced_load("hot-prefixes", base_url, lambda i: hot[i % 4] + prompt_suffix(8, suffixes, words), 2,
                      duration, 0.5)


def flood_load(base_url: str, duration: float = 8.0) -> LoadRun:
    """Distinct 480-token prompts, 2 in flight, 2 tokens each: the free pool
    turns over in well under the hot prefixes' 2 s reuse gap."""
    return burst_load(base_url, concurrency=2, prompt_tokens=480, output_tokens=2, duration=duration)


def reuse_then_flood_load(base_url: str, calm: float = 14.0, flood: float = 8.0) -> "RunsInTurn":
    return RunsInTurn(base_url, calm, flood)


class RunsInTurn:
    """hot_prefixes_load, then flood_load, as one run (the recorder's shape:
    running, stop(), wait() -> the two runs' stats summed)."""

    def __init__(self, base_url: str, calm: float, flood: float):
        self._stop = threading.Event()
        self._runs: list[LoadRun] = []
        self._thread = threading.Thread(target=self._run, args=(base_url, calm, flood), daemon=True)
        self._thread.start()

    def _run(self, base_url: str, calm: float, flood: float) -> None:
        for start in (lambda: hot_prefixes_load(base_url, calm), lambda: flood_load(base_url, flood)):
            if self._stop.is_set():
                return
            run = start()
            self._runs.append(run)
            run.wait()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self._stop.set()
        for run in list(self._runs):
            run.stop()

    def wait(self) -> LoadStats:
        self._thread.join(120.0)
        stats = LoadStats()
        for run in self._runs:
            stats.completed += run.stats.completed
            stats.failed += run.stats.failed
            stats.errors += run.stats.errors
        return stats
