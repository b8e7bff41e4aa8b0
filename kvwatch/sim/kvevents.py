"""The simulated engines' KV-cache events, published as vLLM publishes them
(kvwatch/kvevents/wire.py: topic, 8-byte sequence number, msgpack batch), so
`kvwatch serve --kv-events` reads the simulator as it reads vLLM.

Each engine's block pool reports the blocks it publishes in its prefix cache
and those an allocation evicts to its EventRecorder; the publisher thread
sends what the recorders hold every PUBLISH_SECONDS of wall time. Like vLLM's
publisher it binds a wildcard endpoint (tcp://*:N) and connects to any other
(kvwatch then binds it), and engine i publishes on the endpoint's port + i
(vLLM's data-parallel ranks)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable

import msgspec

from kvwatch.kvevents import wire

log = logging.getLogger("kvwatch.sim")

PUBLISH_SECONDS = 0.05
MAX_PENDING_BLOCKS = 200_000  # a recorder no publisher drains keeps at most this many; the rest are dropped
_MASK = (1 << 63) - 1


def block_hash(content: Hashable) -> int:
    """A simulated content hash as a 63-bit integer (as vLLM's external
    block hashes are integers)."""
    return (content if isinstance(content, int) else hash(content)) & _MASK


class Stored(list):
    """A BlockStored's hashes, and the adapter (LoRA name) of the request that stored them."""

    lora: str | None = None


class EventRecorder:
    """`full_share`: the share of requests that ask for vLLM's full report
    mode (kv_cache_report_mode "full": their reused blocks announced as
    stored too, at their first schedule), every 1/share-th request;
    `origin`: events name NEW or REUSED (vLLM PR 51699, in the map layout)."""

    def __init__(self, block_size: int, full_share: float = 0.0, origin: bool = False,
                 layout: str = "vllm") -> None:
        self.block_size = block_size
        self.full_share = full_share
        self.origin = origin
        self.layout = layout  # LAYOUTS: whose publisher the batches look like
        self._credit = 0.0
        self.events: list = []
        self.pending_blocks = 0
        self.dropped_blocks = 0
        self._last_stored: Stored | None = None

    def admitted(self, reused_contents) -> None:
        """A request's first schedule, with the cached blocks it reuses: a
        request in full report mode announces them (one BlockStored)."""
        self._credit += self.full_share
        if self._credit < 1.0 - 1e-9:
            return
        self._credit -= 1.0
        if not reused_contents or self.pending_blocks + len(reused_contents) > MAX_PENDING_BLOCKS:
            self.dropped_blocks += len(reused_contents)
            return
        self.pending_blocks += len(reused_contents)
        self.events.append(("reused", [block_hash(c) for c in reused_contents]))
        self._last_stored = None

    def stored(self, content: Hashable, lora: str | None = None) -> None:
        if self.pending_blocks >= MAX_PENDING_BLOCKS:
            self.dropped_blocks += 1
            return
        self.pending_blocks += 1
        if self._last_stored is None or self._last_stored.lora != lora:
            # One event per run of blocks of one adapter, as vLLM's is per request.
            self._last_stored = Stored()
            self._last_stored.lora = lora
            self.events.append(("stored", self._last_stored))
        self._last_stored.append(block_hash(content))

    def removed(self, contents) -> None:
        for content in contents:
            if self.pending_blocks >= MAX_PENDING_BLOCKS:
                self.dropped_blocks += 1
                continue
            self.pending_blocks += 1
            self.events.append(("removed", [block_hash(content)]))  # vLLM: one event per evicted block
        self._last_stored = None

    def tier_stored(self, contents) -> None:
        """Blocks the engine's lower tier (the simulated LMCache) kept: LMCache's
        multiprocess connector publishes them as medium CPU, store-only (it
        never says what it lets go: LMCache PR 5076)."""
        if not contents or self.pending_blocks + len(contents) > MAX_PENDING_BLOCKS:
            self.dropped_blocks += len(contents)
            return
        self.pending_blocks += len(contents)
        self.events.append(("tier", [block_hash(c) for c in contents]))
        self._last_stored = None

    def take(self) -> list:
        """The events recorded since the last call, as (kind, hashes)."""
        events, self.events = self.events, []
        self._last_stored = None
        self.pending_blocks = 0
        return events

    def payload(self, ts: float, events: list, rank: int) -> bytes:
        """A batch of `events` (take()'s) as the layout's publisher writes it."""
        if self.layout == "sglang":
            # No medium in its layout: a lower tier's stores would read as the GPU's, so none are sent.
            return msgspec.msgpack.encode([ts, [["BlockRemoved", h] if kind == "removed"
                                                else ["BlockStored", h, None, [], self.block_size, None]
                                                for kind, h in events if kind != "tier"]])
        if self.layout == "trtllm":
            return msgspec.msgpack.encode([ts, [_trtllm(kind, h, self.block_size) for kind, h in events], rank])
        return wire.encode_batch(ts, self._vllm(events), rank)

    def _vllm(self, events: list) -> list:
        medium = {"tier": "CPU"}
        if not self.origin:
            return [wire.removed(hashes) if kind == "removed"
                    else wire.stored(hashes, self.block_size, medium=medium.get(kind, "GPU"),
                                     lora_name=getattr(hashes, "lora", None))
                    for kind, hashes in events]
        return [wire.removed(hashes, layout="map") if kind == "removed"
                else wire.stored(hashes, self.block_size, medium=medium.get(kind, "GPU"),
                                 lora_name=getattr(hashes, "lora", None),
                                 origin="REUSED" if kind == "reused" else "NEW")
                for kind, hashes in events]


# Whose publisher the simulator's batches look like: vLLM's (array events,
# or maps where they name their origin), SGLang's (array events without
# medium, no rank) and TensorRT-LLM's streaming publisher (map events).
LAYOUTS = ("vllm", "sglang", "trtllm")


def _trtllm(kind: str, hashes: list[int], block_size: int) -> dict:
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None, "token_ids": [],
            "block_size": block_size, "lora_id": None, "medium": "CPU" if kind == "tier" else "GPU",
            "lora_name": None}


def rank_endpoint(endpoint: str, rank: int) -> str:
    if rank == 0 or not endpoint.startswith("tcp://"):
        return endpoint if rank == 0 else f"{endpoint}_dp{rank}"
    base, _, port = endpoint.rpartition(":")
    return f"{base}:{int(port) + rank}"


class EventPublisher:
    """Publishes the recorders of `engines` (each engine's `pool.events`);
    `lock` is the simulation's (the clock thread advances it under it)."""

    def __init__(self, engines, endpoint: str, lock, topic: str = "kv") -> None:
        import zmq

        self.engines = engines
        self.lock = lock
        self.topic = topic.encode()
        self.context = zmq.Context()
        self.sockets = []
        self.sequences = [0] * len(engines)
        for engine in engines:
            sock = self.context.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            where = rank_endpoint(endpoint, engine.index)
            if "*" in where or "::" in where or where.startswith("ipc://"):
                sock.bind(where)
            else:
                sock.connect(where)
            self.sockets.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvwatch-sim-kv-events", daemon=True)

    def start(self) -> "EventPublisher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in self.sockets:
            sock.close(0)
        self.context.term()

    def publish_once(self) -> int:
        sent = 0
        with self.lock:
            batches = [engine.pool.events.take() if engine.pool.events is not None else [] for engine in self.engines]
        now = time.time()
        for rank, (sock, events, engine) in enumerate(zip(self.sockets, batches, self.engines)):
            if not events:
                continue
            payload = engine.pool.events.payload(now, events, rank)
            sock.send_multipart([self.topic, wire.sequence_bytes(self.sequences[rank]), payload])
            self.sequences[rank] += 1
            sent += 1
        return sent

    def _run(self) -> None:
        while not self._stop.wait(PUBLISH_SECONDS):
            try:
                self.publish_once()
            except Exception:  # pragma: no cover - the simulator keeps serving its page
                log.exception("publishing KV-cache events failed")


def attach(engines, full_share: float = 0.0, origin: bool = False, layout: str = "vllm") -> None:
    """Give each engine's pool a recorder (prefix caching on or off alike:
    with it off nothing is ever published)."""
    for engine in engines:
        engine.pool.events = EventRecorder(engine.config.block_size, full_share, origin, layout)
