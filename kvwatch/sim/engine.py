"""One simulated vLLM V1 engine core: scheduler, paged KV cache, timing model and
the statistics vLLM 0.32 exports. No wall clock, no I/O, no randomness: the
engine only moves when `run_until(t)` is called with a simulated time.

Scheduling follows vLLM's V1 scheduler with FCFS policy and chunked prefill:
every step first gives each running request its next tokens (1 for a decode,
up to the remaining token budget for a prefill chunk), allocating blocks as
needed; when no block is free it preempts the most recently admitted running
request (recompute: its blocks are freed, it goes back to the front of the
waiting queue). Only if nothing was preempted does it admit waiting requests,
while fewer than `max_num_seqs` run and the token budget lasts; a waiting
request first reuses its longest cached prefix of full blocks.

A step is planned at its start time and its outputs land at its end time:
    step_seconds = step_overhead_s
                   + decode_s_per_seq * decoding_requests
                   + prefill_s_per_token * prefill_tokens_computed
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

from kvwatch.sim.blocks import BlockPool
from kvwatch.sim.stats import EngineStats


class LMCacheTier(Protocol):
    """What the engine asks of its tier (kvwatch/sim/lmcache.py's LMCacheTier, which imports this module)."""

    stored_tokens: int

    def store(self, hashes: Sequence[Hashable]) -> None: ...

    def find(self, hashes: Sequence[Hashable], engine_blocks: int) -> int: ...

    def retrieve(self, hashes: Sequence[Hashable], engine_blocks: int, loaded: int, prompt_len: int) -> None: ...

WAITING, RUNNING, FINISHED = 0, 1, 2


@dataclass
class EngineConfig:
    """Engine settings. The defaults mirror the real vLLM 0.32 CPU capture
    (128 blocks of 32 tokens, 8 sequences, max_model_len 1024) with timings of a
    small GPU."""

    num_gpu_blocks: int = 128
    block_size: int = 32
    max_num_seqs: int = 8
    max_model_len: int = 1024
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    max_num_queued_reqs: int | None = None
    # Timing model, simulated seconds.
    step_overhead_s: float = 0.012
    decode_s_per_seq: float = 0.0004
    prefill_s_per_token: float = 0.0001
    # Time to load one token's KV back from the tier (kvwatch sim --lmcache):
    # recorded per load, overlapped with the step (HiCache loads layer by
    # layer beside the forward), so the step is not lengthened.
    tier_load_s_per_token: float = 0.00002
    # Only reported in cache_config_info.
    cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.92
    kv_bytes_per_token: int = 1024
    # A wedged engine (a hung collective, a KV transfer that never completes):
    # no step ends and none starts, so its requests and KV blocks stay held
    # and no token is counted, while its /metrics keeps answering.
    stalled: bool = False

    # Fields a scenario phase may change while the engine runs; the others would
    # need a restart of a real engine.
    RUNTIME_FIELDS = ("step_overhead_s", "decode_s_per_seq", "prefill_s_per_token", "max_num_queued_reqs",
                      "stalled")

    @property
    def kv_cache_size_tokens(self) -> int:
        return self.num_gpu_blocks * self.block_size

    def problems(self, where: str = "engine") -> list[str]:
        out = []
        for name in ("num_gpu_blocks", "block_size", "max_num_seqs", "max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                out.append(f"{where}.{name}: must be a positive integer, got {value!r}")
        for name in ("step_overhead_s",):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                out.append(f"{where}.{name}: must be a number > 0, got {value!r}")
        for name in ("decode_s_per_seq", "prefill_s_per_token", "tier_load_s_per_token"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
                out.append(f"{where}.{name}: must be a number >= 0, got {value!r}")
        if self.max_num_queued_reqs is not None and (
            not isinstance(self.max_num_queued_reqs, int) or self.max_num_queued_reqs < 1
        ):
            out.append(f"{where}.max_num_queued_reqs: must be a positive integer or null, got {self.max_num_queued_reqs!r}")
        for name in ("enable_prefix_caching", "stalled"):
            if not isinstance(getattr(self, name), bool):
                out.append(f"{where}.{name}: must be true or false, got {getattr(self, name)!r}")
        if not out:
            if self.num_gpu_blocks < 2:
                out.append(f"{where}.num_gpu_blocks: needs at least 2 blocks (one is reserved), got {self.num_gpu_blocks}")
            elif (self.num_gpu_blocks - 1) * self.block_size < self.max_model_len:
                out.append(
                    f"{where}: the KV cache ({self.num_gpu_blocks - 1} usable blocks x {self.block_size} tokens) "
                    f"cannot hold one request of max_model_len {self.max_model_len} tokens"
                )
        return out

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}


@dataclass(eq=False)
class Request:
    """A request as the engine sees it. `prompt_hashes[i]` identifies the content
    of prompt tokens [0, (i+1)*block_size), so equal hashes mean equal prefixes
    (the chained block hash of vLLM). Blocks past the prompt hash by (uid, i):
    only the request itself can reuse them, after a preemption."""

    uid: int
    prompt_len: int
    max_tokens: int
    output_len: int
    prompt_hashes: Sequence[Hashable]
    arrival: float
    sink: Callable[[Request, float], None] | None = None
    n: int = 1
    lora: str | None = None  # the adapter its blocks are published under (the simulator's tenant)
    # Engine-side state.
    state: int = WAITING
    engine_index: int = -1
    num_tokens: int = 0
    num_computed: int = 0
    num_output: int = 0
    num_published: int = 0
    num_cached_tokens: int = -1
    num_external_tokens: int = 0  # loaded from the LMCache tier at first admission
    num_preemptions: int = 0
    blocks: list[int] = field(default_factory=list)
    scheduled_ts: float = -1.0
    first_token_ts: float = -1.0
    last_token_ts: float = -1.0
    finish_reason: str | None = None
    finish_ts: float = -1.0

    def __post_init__(self) -> None:
        self.num_tokens = self.prompt_len

    def block_hashes(self, count: int) -> Sequence[Hashable]:
        prompt = self.prompt_hashes
        if count <= len(prompt):
            return prompt[:count]
        return list(prompt) + [(self.uid, i) for i in range(len(prompt), count)]

    def block_hash(self, index: int) -> Hashable:
        prompt = self.prompt_hashes
        return prompt[index] if index < len(prompt) else (self.uid, index)


class RequestRejected(Exception):
    """The engine refused a request (too long, or the waiting queue is full)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class Engine:
    def __init__(self, config: EngineConfig, index: int = 0) -> None:
        problems = config.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.config = config
        self.index = index
        self.pool = BlockPool(config.num_gpu_blocks)
        self.stats = EngineStats(config.max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.clock = 0.0
        self.steps = 0
        self.tier: LMCacheTier | None = None  # after attach_tier
        # (end_time, [(request, tokens)], prefill_tokens) of the step in flight.
        self._pending: tuple[float, list[tuple[Request, int]], int] | None = None

    def attach_tier(self, tier: LMCacheTier) -> None:
        """Keep what the GPU cache evicts in `tier` and load from it at admission."""
        self.tier = tier
        self.pool.on_evict = self._store_in_tier

    def _store_in_tier(self, hashes) -> None:
        tier = self.tier
        if tier is None:
            return
        before = tier.stored_tokens
        if self.pool.events is not None:
            self.pool.events.tier_stored([h for h in hashes if h not in tier.chunks])
        tier.store(hashes)
        self.stats.tier_backup_bytes += (tier.stored_tokens - before) * self.config.kv_bytes_per_token

    # -- requests in and out ------------------------------------------------

    def check(self, prompt_len: int, max_tokens: int) -> None:
        limit = self.config.max_model_len
        if prompt_len < 1:
            raise RequestRejected("the prompt must hold at least one token")
        if max_tokens < 1:
            raise RequestRejected("max_tokens must be at least 1")
        if prompt_len + max_tokens > limit:
            raise RequestRejected(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion)."
            )

    def add_request(self, request: Request) -> None:
        self.check(request.prompt_len, request.max_tokens)
        limit = self.config.max_num_queued_reqs
        if limit is not None and len(self.waiting) >= limit:
            self.stats.admission_rejections["max_num_queued_reqs"] += 1
            raise RequestRejected("the waiting queue is full (max_num_queued_reqs)", status=503)
        request.engine_index = self.index
        request.state = WAITING
        self.waiting.append(request)

    def abort(self, request: Request, now: float) -> None:
        if request.state == FINISHED:
            return
        if request.state == WAITING:
            self.waiting.remove(request)
        else:
            self.running.remove(request)
            self.pool.free(request.blocks)
            request.blocks = []
        request.state = FINISHED
        request.finish_reason = "abort"
        request.finish_ts = now
        self.stats.request_success["abort"] += 1
        if request.sink is not None:
            request.sink(request, now)

    # -- the clock ----------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def next_step_end(self) -> float | None:
        """When the step in flight ends (its outputs appear), if one is (never, while stalled)."""
        return self._pending[0] if self._pending is not None and not self.config.stalled else None

    def load(self) -> int:
        """What vLLM's DP coordinator balances on: waiting weighs 4x running."""
        return 4 * len(self.waiting) + len(self.running)

    def run_until(self, t: float) -> None:
        """Run every step that ends by simulated time t. A step that would end
        later stays in flight; its outputs appear in a later call. A
        stalled engine runs nothing: its clock moves, its step in flight
        never ends."""
        if self.config.stalled:
            if t > self.clock:
                self.clock = t
            return
        while True:
            pending = self._pending
            if pending is None:
                if not (self.running or self.waiting) or not self._schedule():
                    if t > self.clock:
                        self.clock = t
                    return
                pending = self._pending
                if pending is None:
                    return
            if pending[0] > t:
                return
            self.clock = pending[0]
            self._complete(pending)

    # -- one step -----------------------------------------------------------

    def _schedule(self) -> bool:
        config = self.config
        scheduled: list[tuple[Request, int]] = []
        # A decode is one new token of a request that has output already; the rest is prefill.
        budget, prefill_tokens, decodes, preempted = self._schedule_running(config.max_num_batched_tokens, scheduled)
        if not preempted:
            prefill_waiting, decodes_waiting = self._schedule_waiting(budget, scheduled)
            prefill_tokens += prefill_waiting
            decodes += decodes_waiting
        if not scheduled:
            return False
        duration = (
            config.step_overhead_s
            + config.decode_s_per_seq * decodes
            + config.prefill_s_per_token * prefill_tokens
        )
        self.stats.prefill_forward_seconds += config.prefill_s_per_token * prefill_tokens
        self._pending = (self.clock + duration, scheduled, prefill_tokens)
        return True

    def _schedule_running(self, budget: int, scheduled: list[tuple[Request, int]]) -> tuple[int, int, int, bool]:
        """The running requests' next tokens, in order, within the token budget;
        with no block left, the newest running request is preempted (vLLM's
        recompute). Returns the budget left, the prefill tokens and decodes
        scheduled, and whether any request was preempted."""
        block_size = self.config.block_size
        pool = self.pool
        running = self.running
        preempted = False
        prefill_tokens = decodes = 0
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            num_new = request.num_tokens - request.num_computed
            if num_new > budget:
                num_new = budget
            needed = -(-(request.num_computed + num_new) // block_size) - len(request.blocks)
            if needed > 0:
                new_blocks = pool.allocate(needed)
                while new_blocks is None:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is request:
                        break
                    new_blocks = pool.allocate(needed)
                if new_blocks is None:
                    break
                request.blocks.extend(new_blocks)
            scheduled.append((request, num_new))
            budget -= num_new
            if num_new == 1 and request.num_output:
                decodes += 1
            else:
                prefill_tokens += num_new
            index += 1
        return budget, prefill_tokens, decodes, preempted

    def _schedule_waiting(self, budget: int, scheduled: list[tuple[Request, int]]) -> tuple[int, int]:
        """Waiting requests admitted in order while the budget, the sequence
        limit and the free blocks (past their cached prefix) allow. Returns
        the prefill tokens and decodes scheduled."""
        config = self.config
        block_size = config.block_size
        pool = self.pool
        waiting = self.waiting
        running = self.running
        caching = config.enable_prefix_caching
        tier = self.tier if caching else None
        prefill_tokens = decodes = 0
        while waiting and budget > 0 and len(running) < config.max_num_seqs:
            request = waiting[0]
            num_tokens = request.num_tokens
            loaded = 0
            reusable: Sequence[Hashable] = []
            hit: list = []
            if caching:
                max_hit_blocks = (num_tokens - 1) // block_size
                reusable = request.block_hashes(max_hit_blocks)
                hit = pool.longest_cached_prefix(reusable, max_hit_blocks)
                if tier is not None:
                    loaded = tier.find(reusable, len(hit))
            num_cached = (len(hit) + loaded) * block_size
            num_new = num_tokens - num_cached
            if num_new > budget:
                num_new = budget
            needed = -(-(num_cached + num_new) // block_size) - len(hit)
            if needed + pool.count_evictable(hit) > pool.num_free:
                break
            pool.touch(hit)
            if pool.events is not None and request.scheduled_ts < 0:
                pool.events.admitted([pool.block_hash[block] for block in hit])
            if tier is not None:
                # Counted before the allocation, whose evictions the tier stores.
                tier.retrieve(reusable, len(hit), loaded, num_tokens)
                if loaded:
                    self.stats.tier_load_back.observe(loaded * block_size * config.tier_load_s_per_token)
                    self.stats.tier_load_back_bytes += loaded * block_size * config.kv_bytes_per_token
            request.blocks = hit + (pool.allocate(needed) or [])  # count_evictable checked room above
            request.num_computed = num_cached
            request.num_published = len(hit)
            request.state = RUNNING
            waiting.popleft()
            running.append(request)
            if request.scheduled_ts < 0:
                self._count_first_admission(request, hit, loaded)
            scheduled.append((request, num_new))
            budget -= num_new
            if num_new == 1 and request.num_output:
                decodes += 1
            else:
                prefill_tokens += num_new
        return prefill_tokens, decodes

    def _count_first_admission(self, request: Request, hit: list, loaded: int) -> None:
        """vLLM counts prefix-cache queries and hits for a request's first
        admission only; recomputation after a preemption is kept out of these
        counters."""
        block_size = self.config.block_size
        stats = self.stats
        request.scheduled_ts = self.clock
        request.num_cached_tokens = len(hit) * block_size
        request.num_external_tokens = loaded * block_size
        if self.config.enable_prefix_caching:
            stats.prefix_cache_queries += request.num_tokens
            stats.prefix_cache_hits += len(hit) * block_size
        if self.tier is not None and self.config.enable_prefix_caching:
            # vLLM counts a KV connector's lookups as external queries and hits.
            stats.external_prefix_cache_queries += request.num_tokens - len(hit) * block_size
            stats.external_prefix_cache_hits += loaded * block_size

    def _preempt(self, request: Request) -> None:
        self.pool.free(request.blocks)
        request.blocks = []
        request.num_computed = 0
        request.num_published = 0
        request.num_preemptions += 1
        request.state = WAITING
        self.stats.num_preemptions += 1
        self.stats.retracted_prompt_tokens += request.prompt_len
        self.stats.retracted_generation_tokens += request.num_output
        self.waiting.appendleft(request)

    def _complete(self, pending: tuple[float, list[tuple[Request, int]], int]) -> None:
        end, scheduled, prefill_tokens = pending
        self._pending = None
        self.steps += 1
        stats = self.stats
        pool = self.pool
        caching = self.config.enable_prefix_caching
        block_size = self.config.block_size
        generated = 0
        gaps: dict[float, int] = {}
        finished: list[Request] = []
        for request, num_new in scheduled:
            if request.state != RUNNING:
                continue  # aborted while the step ran
            request.num_computed += num_new
            if caching:
                full = request.num_computed // block_size
                if full > request.num_published:
                    blocks = request.blocks
                    for index in range(request.num_published, full):
                        pool.cache(blocks[index], request.block_hash(index), request.lora)
                    request.num_published = full
            if request.num_computed < request.num_tokens:
                continue  # a prefill chunk that does not finish the prompt
            request.num_output += 1
            request.num_tokens += 1
            generated += 1
            if request.first_token_ts < 0:
                request.first_token_ts = end
                stats.time_to_first_token.observe(end - request.arrival)
                stats.prompt_tokens += request.prompt_len
                stats.prompt_tokens_local_cache_hit += request.num_cached_tokens
                stats.prompt_tokens_external += request.num_external_tokens
                stats.prompt_tokens_local_compute += (request.prompt_len - request.num_cached_tokens
                                                      - request.num_external_tokens)
            else:
                gap = end - request.last_token_ts
                gaps[gap] = gaps.get(gap, 0) + 1
            request.last_token_ts = end
            if request.sink is not None:
                request.sink(request, end)
            if request.num_output >= request.output_len:
                finished.append(request)
        for gap, count in gaps.items():
            stats.inter_token_latency.observe(gap, count)
        stats.generation_tokens += generated
        stats.iteration_tokens.observe(prefill_tokens + generated)
        for request in finished:
            self._finish(request, end, "length" if request.output_len >= request.max_tokens else "stop")

    def _finish(self, request: Request, now: float, reason: str) -> None:
        self.running.remove(request)
        self.pool.free(request.blocks)
        request.blocks = []
        request.state = FINISHED
        request.finish_reason = reason
        request.finish_ts = now
        stats = self.stats
        stats.request_success[reason] += 1
        stats.e2e_request_latency.observe(now - request.arrival)
        stats.request_queue_time.observe(request.scheduled_ts - request.arrival)
        stats.request_prefill_time.observe(request.first_token_ts - request.scheduled_ts)
        decode_time = request.last_token_ts - request.first_token_ts
        stats.request_decode_time.observe(decode_time)
        stats.request_inference_time.observe(request.last_token_ts - request.scheduled_ts)
        stats.request_prompt_tokens.observe(request.prompt_len)
        stats.request_generation_tokens.observe(request.num_output)
        stats.request_max_num_generation_tokens.observe(request.max_tokens * request.n)
        stats.request_params_n.observe(request.n)
        stats.request_params_max_tokens.observe(request.max_tokens)
        stats.request_time_per_output_token.observe(
            decode_time / (request.num_output - 1) if request.num_output > 1 else 0.0
        )
        stats.request_num_preemptions.observe(request.num_preemptions)
        stats.request_prefill_kv_computed_tokens.observe(
            request.prompt_len - max(request.num_cached_tokens, 0) - request.num_external_tokens)
        if request.sink is not None:
            request.sink(request, now)
