"""A whole simulated deployment on one simulated clock: N engines (data-parallel
ranks) behind one router, the scenario's workload feeding them, and the RAG
application stage whose `app_retrieval_seconds` histogram shows time spent
before the engine. `advance(seconds)` moves everything without wall time; the
HTTP server calls it from a clock thread and submits its own requests with
`submit`."""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable
from dataclasses import replace

from kvwatch.sim.engine import Engine, Request, RequestRejected
from kvwatch.sim.lmcache import LMCacheTier
from kvwatch.sim.router import SimRouter
from kvwatch.sim.scenario import Scenario
from kvwatch.sim.stats import APP_DEFAULT_BUCKETS, Histogram
from kvwatch.sim.workload import DrawnRequest, draw_request, symbolic_block_hashes

DEFAULT_MODEL_NAME = "tiny-llama"


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        seed: int = 0,
        engines: int | None = None,
        model_name: str = DEFAULT_MODEL_NAME,
        created_unix: float | None = None,
        lmcache_tokens: int | None = None,
        router: str | None = None,
    ) -> None:
        """`lmcache_tokens`: give the engines a simulated LMCache tier of that
        many tokens (kvwatch/sim/lmcache.py); None: none. `router`: put a
        simulated router with that policy (kvwatch/sim/router.py) in front of
        the engines; None: the least-loaded engine, as vLLM's DP coordinator."""
        self.scenario = scenario
        self.model_name = model_name
        self.seed = seed
        self.rng = random.Random(seed)
        count = engines if engines is not None else scenario.engines
        if count < 1:
            raise ValueError("need at least one engine")
        first = scenario.phases[0]
        self.engines = [Engine(replace(first.engine), index) for index in range(count)]
        self.lmcache: LMCacheTier | None = None
        if lmcache_tokens is not None:
            block_size = first.engine.block_size
            self.lmcache = LMCacheTier(max(1, lmcache_tokens // block_size), block_size,
                                       first.engine.kv_bytes_per_token)
            for engine in self.engines:
                engine.attach_tier(self.lmcache)
        self.router = SimRouter(self.engines, router) if router is not None else None
        self.created_unix = time.time() if created_unix is None else created_unix
        self.now = 0.0
        self.app_retrieval = Histogram(APP_DEFAULT_BUCKETS)
        self.app_requests = 0
        self._next_uid = 0
        # Shared-prefix tokens of requests whose prefix was seen before: what an
        # unbounded cache would have served. Compare with the hits.
        self.repeat_prefix_tokens = 0
        self._seen_prefixes: set = set()
        self._seq = 0
        # (release time, sequence, drawn request) of requests still in retrieval.
        self._retrieving: list[tuple[float, int, DrawnRequest]] = []
        self.phase_index = 0
        self.cycle = 0
        self._phase_end = first.duration
        self._next_arrival = self._draw_gap(first.workload.rate)

    # -- phases ----------------------------------------------------------------

    @property
    def phase(self):
        return self.scenario.phases[self.phase_index]

    def _draw_gap(self, rate: float) -> float:
        return self.now + self.rng.expovariate(rate) if rate > 0 else math.inf

    def _enter_next_phase(self) -> None:
        phases = self.scenario.phases
        if self.phase_index + 1 < len(phases):
            self.phase_index += 1
        elif self.scenario.loop:
            self.phase_index = 0
            self.cycle += 1
        else:
            self._phase_end = math.inf
            return
        phase = phases[self.phase_index]
        self._phase_end = self.now + phase.duration
        for engine in self.engines:
            for name in engine.config.RUNTIME_FIELDS:
                setattr(engine.config, name, getattr(phase.engine, name))
        # Poisson arrivals are memoryless: redrawing at the boundary is exact.
        self._next_arrival = self._draw_gap(phase.workload.rate)

    def phase_status(self) -> dict:
        """Where the scenario stands: the phase now, the one after it (None
        when a scenario without `loop` is in its last phase) and the simulated
        seconds until it starts, the cycle's length and how many loops ran."""
        phases = self.scenario.phases
        index = self.phase_index
        following = index + 1 if index + 1 < len(phases) else (0 if self.scenario.loop else None)
        return {
            "scenario": self.scenario.name,
            "phase": self.phase.name,
            "note": self.phase.note,
            "index": index + 1,
            "phases": len(phases),
            "next": phases[following].name if following is not None else None,
            "next_in_seconds": max(0.0, self._phase_end - self.now) if following is not None else None,
            "cycle_seconds": self.scenario.cycle_seconds,
            "loop": self.scenario.loop,
            "cycle": self.cycle,
        }

    # -- the clock -------------------------------------------------------------

    def advance(self, seconds: float) -> None:
        self.advance_to(self.now + seconds)

    def advance_to(self, t: float) -> None:
        engines = self.engines
        while True:
            release = self._retrieving[0][0] if self._retrieving else math.inf
            event = min(self._phase_end, self._next_arrival, release)
            if event > t:
                break
            for engine in engines:
                engine.run_until(event)
            self.now = event
            if event == self._phase_end:
                self._enter_next_phase()
            elif event == release:
                _, _, drawn = heapq.heappop(self._retrieving)
                self.app_retrieval.observe(drawn.retrieval_seconds)
                self._route(drawn)
            else:
                spec = self.phase.workload
                drawn = draw_request(spec, self.rng, engines[0].config.max_model_len)
                self._next_arrival = self._draw_gap(spec.rate)
                if spec.retrieval_seconds is not None:
                    self.app_requests += 1
                    self._seq += 1
                    heapq.heappush(self._retrieving, (event + drawn.retrieval_seconds, self._seq, drawn))
                else:
                    self._route(drawn)
        for engine in engines:
            engine.run_until(t)
        if t > self.now:
            self.now = t

    def next_event_time(self) -> float:
        """The next simulated time at which anything observable happens."""
        t = min(self._phase_end, self._next_arrival, self._retrieving[0][0] if self._retrieving else math.inf)
        for engine in self.engines:
            end = engine.next_step_end
            if end is not None and end < t:
                t = end
        return t

    # -- requests --------------------------------------------------------------

    def pick_engine(self, hashes: list | None = None, prompt_len: int = 0) -> Engine:
        if self.router is not None and hashes is not None:
            return self.router.pick(hashes, prompt_len)
        return min(self.engines, key=Engine.load)

    def _new_uid(self) -> int:
        self._next_uid += 1
        return self._next_uid

    def _route(self, drawn: DrawnRequest) -> None:
        if drawn.prefix_key is not None:
            if drawn.prefix_key in self._seen_prefixes:
                self.repeat_prefix_tokens += drawn.shared_len
            else:
                self._seen_prefixes.add(drawn.prefix_key)
        uid = self._new_uid()
        hashes = symbolic_block_hashes(uid, drawn, self.engines[0].config.block_size)
        engine = self.pick_engine(hashes, drawn.prompt_len)
        request = Request(uid, drawn.prompt_len, drawn.max_tokens, drawn.output_len, hashes, self.now,
                          lora=drawn.tenant)
        try:
            engine.add_request(request)
        except RequestRejected:
            pass  # over max_num_queued_reqs: the engine counted the rejection

    def submit(
        self,
        prompt_len: int,
        prompt_hashes: list,
        max_tokens: int,
        output_len: int | None = None,
        sink: Callable[[Request, float], None] | None = None,
    ) -> Request:
        """Hand an outside request (from the HTTP API) to the least-loaded engine
        at the current simulated time (the router's pick, where there is
        one). Raises RequestRejected."""
        engine = self.pick_engine(prompt_hashes, prompt_len)
        request = Request(
            self._new_uid(),
            prompt_len,
            max_tokens,
            max_tokens if output_len is None else max(1, min(output_len, max_tokens)),
            prompt_hashes,
            self.now,
            sink,
        )
        engine.add_request(request)
        return request

    def abort(self, request: Request) -> None:
        self.engines[request.engine_index].abort(request, self.now)

    # -- inspection ------------------------------------------------------------

    def summary(self) -> dict[str, float]:
        """Totals across engines, for reports and quick checks."""
        stats = [engine.stats for engine in self.engines]
        return {
            "time": self.now,
            "phase": self.phase.name,
            "kv_usage": max(engine.pool.usage() for engine in self.engines),
            "running": sum(engine.num_running for engine in self.engines),
            "waiting": sum(engine.num_waiting for engine in self.engines),
            "prefix_queries": sum(s.prefix_cache_queries for s in stats),
            "prefix_hits": sum(s.prefix_cache_hits for s in stats),
            "preemptions": sum(s.num_preemptions for s in stats),
            "finished": sum(sum(s.request_success.values()) for s in stats),
            "generation_tokens": sum(s.generation_tokens for s in stats),
            "ttft_sum": sum(s.time_to_first_token.sum for s in stats),
            "ttft_count": sum(s.time_to_first_token.count for s in stats),
            "queue_sum": sum(s.request_queue_time.sum for s in stats),
            "prefill_sum": sum(s.request_prefill_time.sum for s in stats),
            "phase_count": sum(s.request_queue_time.count for s in stats),
            "repeat_prefix_tokens": self.repeat_prefix_tokens,
            "app_retrieval_sum": self.app_retrieval.sum,
            "app_retrieval_count": self.app_retrieval.count,
        }
