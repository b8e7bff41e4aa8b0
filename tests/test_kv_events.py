"""The engine's KV-cache event stream (kvwatch/kvevents): vLLM's wire
format in its layouts, the block ledger's accounting and bounds, the ZMQ
source on loopback (gaps, a publisher that leaves and returns, a flood), and
the stream beside the page in the sidecar; hostile input costs one sentence
and a count each, never a crash or unbounded memory."""

from __future__ import annotations

import contextlib
import socket
import time

import msgspec
import pytest
import zmq
from fastapi.testclient import TestClient

from kvwatch.kvevents import wire
from kvwatch.kvevents.ledger import Ledger, bucket_lower, bucket_upper, distance_bucket
from kvwatch.kvevents.source import QUEUE_MESSAGES, KVEventSource
from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import SettingsError, load_settings
from pageserver import Answer, PageServer
from test_app import value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def stream_fed(pages: list[str], batches: list[list]):
    """kvwatch polling `pages` (served on loopback, one a poll) with its
    KV-event stream fed `batches` between its first two polls: yields
    (monitor, settings, client) after the second poll, and stops it."""
    with PageServer([Answer(page) for page in pages]) as server:
        settings = load_settings(overrides={"target": server.url, "poll_interval": "1s", "timeout": "1s",
                                            "kv_events": f"tcp://127.0.0.1:{free_port()}"}, environ={})
        monitor = Monitor(settings)
        client = TestClient(create_app(monitor, settings))
        try:
            monitor.poll_once()
            now = monitor.clock()
            for seq, events in enumerate(batches):
                monitor.kv_events.feed(seq, wire.encode_batch(now, events), now=now)
            monitor.poll_once()
            yield monitor, settings, client
        finally:
            monitor.stop()


def rotation(prefixes: int, blocks: int, cache: int, rounds: int, start: int = 0) -> list[list]:
    """Batches of an LRU cache of `cache` blocks serving `prefixes` prompts
    of `blocks` blocks each in rotation: (events) per request."""
    lru: list[int] = []
    out = []
    for r in range(rounds):
        for p in range(prefixes):
            hashes = [start + p * 1000 + i for i in range(blocks)]
            new = [h for h in hashes if h not in lru]
            for h in hashes:
                if h in lru:
                    lru.remove(h)
            events = []
            while len(lru) + len(new) > cache:
                events.append(wire.removed([lru.pop(0)]))
            if new:
                events.append(wire.stored(new, 16, token_ids=list(range(16 * len(new)))))
            lru.extend(hashes)
            out.append(events)
    return out


def feed_all(source: KVEventSource, batches, t0: float = 1000.0, step: float = 0.1, seq0: int = 0) -> float:
    t = t0
    for seq, events in enumerate(batches, start=seq0):
        source.feed(seq, wire.encode_batch(t, events), now=t)
        t += step
    return t


# --- the wire format -----------------------------------------------------

class _MapStored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    group_idx: int | None = None


class _MapRemoved(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[int]
    medium: str | None


class _MapBatch(msgspec.Struct):
    ts: float
    events: list
    data_parallel_rank: int | None = None


@pytest.mark.parametrize("layout", ["array/array", "map/map", "array/map", "map/array"])
def test_every_layout_of_vllms_releases_decodes_to_the_same_events(layout):
    outer, inner = layout.split("/")
    if inner == "array":
        events = [wire.stored([1, 2, 3], 16, token_ids=list(range(48)), lora_name="ad1"), wire.removed([4]),
                  wire.cleared()]
    else:
        events = [_MapStored([1, 2, 3], None, list(range(48)), 16, None, "GPU", "ad1", 0), _MapRemoved([4], "GPU"),
                  {"type": "AllBlocksCleared"}]
    if outer == "array":
        payload = msgspec.msgpack.encode([12.5, events, 0])
    else:
        payload = msgspec.msgpack.encode(_MapBatch(12.5, events, 0))
    batch = wire.Decoder().decode(payload)
    assert batch.ts == 12.5 and batch.rank == 0
    assert [(e.kind, list(e.hashes)) for e in batch.events] == [
        ("BlockStored", [1, 2, 3]), ("BlockRemoved", [4]), ("AllBlocksCleared", [])]
    assert batch.events[0].block_size == 16 and batch.events[0].lora == "ad1"


def test_an_event_type_of_a_newer_release_is_skipped_and_the_rest_read():
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [7], None, [], 16, None, "GPU"],
                                            ["BlockPinned", [7], "GPU"]]])
    batch = wire.Decoder().decode(payload)
    assert [(e.kind, e.hashes) for e in batch.events] == [("BlockStored", [7])]
    assert batch.skipped == 1


def test_a_hash_sent_as_bytes_reads_as_the_integer_of_its_last_eight_bytes():
    payload = msgspec.msgpack.encode([1.0, [["BlockStored", [b"\x00" * 24 + (5).to_bytes(8, "big")], None, [], 16,
                                             None, "GPU"]]])
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, payload, now=1.0)
    source.feed(1, wire.encode_batch(2.0, [wire.removed([5])]), now=2.0)
    source.feed(2, wire.encode_batch(3.0, [wire.stored([5], 16)]), now=3.0)
    assert source.ledger.totals.again == 1


@pytest.mark.parametrize("payload, sentence", [
    (b"", "not a msgpack array or map"),
    (b"\xc1garbage", "not a msgpack array or map"),
    (msgspec.msgpack.encode([1.0]), "not a batch"),
    (msgspec.msgpack.encode(["soon", []]), "no timestamp"),
    (msgspec.msgpack.encode([1.0, [["BlockStored", "not a list"]]]), "block_hashes is not a list of integers"),
    (msgspec.msgpack.encode([1.0, [42]]), "neither a tagged array nor a tagged map"),
    (b"\x92\xcb" + b"\x00" * 8 + b"\xdd\xff\xff\xff\xff", "not valid msgpack"),  # claims 4 G events
    (b"\x91" * 100_000, "not"),  # nesting a hundred thousand deep
])
def test_malformed_batches_are_one_sentence_and_a_count(payload, sentence):
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, payload, now=1.0)
    source.feed(1, wire.encode_batch(2.0, [wire.stored([1], 16)]), now=2.0)
    assert source.malformed == 1
    assert sentence in source.last_malformed
    assert "\n" not in source.last_malformed and len(source.last_malformed) < 200
    assert source.ledger.totals.stored == 1  # the next batch is read


def test_an_absurd_block_count_is_refused_and_the_rest_of_the_batch_read(monkeypatch):
    from kvwatch.kvevents import source as module

    monkeypatch.setattr(module, "MAX_EVENT_BLOCKS", 1000)
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, wire.encode_batch(1.0, [wire.stored(list(range(5000)), 16), wire.stored([1, 2], 16)]), now=1.0)
    assert source.absurd_events == 1 and source.malformed == 1
    assert "5000 blocks" in source.last_malformed
    assert source.ledger.totals.stored == 2


def test_a_message_over_the_byte_cap_is_refused():
    source = KVEventSource("tcp://127.0.0.1:1", max_message_bytes=1000)
    source.feed(0, wire.encode_batch(1.0, [wire.stored(list(range(10**12, 10**12 + 400)), 16)]), now=1.0)
    assert source.malformed == 1 and "over the cap of 1000" in source.last_malformed
    assert source.ledger.totals.stored == 0


# --- the ledger ----------------------------------------------------------

def test_distance_buckets_hold_their_distances():
    for d in list(range(300)) + [10**6, 2**40 + 7]:
        index = distance_bucket(d)
        assert bucket_lower(index) <= d <= bucket_upper(index)


def test_a_rotation_over_more_prefixes_than_the_cache_holds_returns_blocks_after_eviction():
    # The reference's measurement on the real engine: 12 prefixes of 15 blocks,
    # 48 requests: 720 stores, 540 of them a block stored again after its removal.
    source = KVEventSource("tcp://127.0.0.1:1")
    end = feed_all(source, rotation(prefixes=12, blocks=15, cache=100, rounds=4))
    window = source.report(now=end)["window"]
    assert window["stored"] == 720
    assert window["stored_again"] == 540
    assert window["stored_again_ratio"] == pytest.approx(0.75)
    assert window["return_seconds_mean"] == pytest.approx(0.8, abs=0.3)  # 8 requests at 0.1 s apart, +- a bucket
    # 180 blocks in rotation through 100: each returned after 80 other stores,
    # so 80 more blocks would have kept them all and 40 none of them.
    sizing = source.report(now=end, checkpoint=False)["sizing"]
    kept = {p["extra_blocks"]: p["blocks_kept"] for p in sizing["points"]}
    assert kept[50] == 0 and kept[100] == 540


def test_distinct_prompts_never_return():
    source = KVEventSource("tcp://127.0.0.1:1")
    end = feed_all(source, rotation(prefixes=48, blocks=15, cache=100, rounds=1))
    window = source.report(now=end)["window"]
    assert window["stored"] == 720 and window["stored_again"] == 0
    assert window["stored_again_ratio"] == 0


def shared_rotation(prefixes: int, own: int, shared: int, cache: int, rounds: int, full_every: int = 0,
                    origin: bool = False) -> list[list]:
    """rotation() whose prompts start with `shared` blocks every prompt shares
    (kept warm: hits) before their `own`: request i in vLLM's full report mode
    where full_every divides i + 1 (its hits announced as stored first, with
    origin REUSED where `origin`)."""
    lru: list[int] = []
    out = []
    for i in range(rounds * prefixes):
        p = i % prefixes
        hashes = [900_000 + b for b in range(shared)] + [p * 1000 + b for b in range(own)]
        hits = [h for h in hashes if h in lru]
        new = [h for h in hashes if h not in lru]
        for h in hits:
            lru.remove(h)
        events = []
        if hits and full_every and (i + 1) % full_every == 0:
            events.append(wire.stored(hits, 16, origin="REUSED" if origin else None))
        while len(lru) + len(new) > cache:
            events.append(wire.removed([lru.pop(0)], layout="map" if origin else "array"))
        if new:
            events.append(wire.stored(new, 16, origin="NEW" if origin else None))
        lru.extend(hashes)
        out.append(events)
    return out


def _counts(batches) -> dict:
    source = KVEventSource("tcp://127.0.0.1:1")
    end = feed_all(source, batches)
    report = source.report(now=end)
    window = report["window"]
    kept = [p["blocks_kept"] for p in report["sizing"]["points"]]
    return {"stored": window["stored"], "again": window["stored_again"], "ratio": window["stored_again_ratio"],
            "reused": window["reused"], "kept": kept}


@pytest.mark.parametrize("full_every, origin", [(1, False), (2, False), (3, False), (1, True), (2, True)])
def test_full_report_modes_hits_are_hits_and_the_rest_reads_as_in_incremental_mode(full_every, origin):
    # 12 prompts of 4 shared + 15 own blocks through 100: the shared blocks hit, the own ones return
    # after their eviction. Every request in full mode, or every second or third (one stream, mixed).
    incremental = _counts(shared_rotation(12, 15, 4, 100, 4))
    full = _counts(shared_rotation(12, 15, 4, 100, 4, full_every=full_every, origin=origin))
    hits = sum(1 for i in range(48) if (i + 1) % full_every == 0 and i > 0) * 4  # the first request hits nothing
    assert full["reused"] == hits and incremental["reused"] == 0
    assert {k: v for k, v in full.items() if k != "reused"} == {k: v for k, v in incremental.items() if k != "reused"}
    assert incremental["stored"] == 4 + 48 * 15 and incremental["again"] == 540


def test_a_warm_shared_prefix_in_full_mode_reads_as_hits_not_new_work_or_returns():
    # The reference's measurement on the real vLLM: a warm prefix of ~9 blocks + one own block a request,
    # every request in full mode: about 10 blocks announced per request where one is new.
    batches = shared_rotation(96, 1, 9, 1000, 1, full_every=1)
    announced = sum(len(e.block_hashes) for events in batches for e in events if isinstance(e, wire._WStored))
    counts = _counts(batches)
    assert announced == 9 + 96 + 95 * 9
    assert counts["stored"] == 9 + 96 and counts["reused"] == 95 * 9
    assert counts["again"] == 0 and counts["ratio"] == 0


def test_origin_says_what_the_ledger_cannot():
    source = KVEventSource("tcp://127.0.0.1:1")
    # Blocks cached before kvwatch listened: only origin tells their announcement is a hit.
    source.feed(0, _map_batch([wire.stored([1, 2], 16, origin="REUSED")]), now=1.0)
    # Origin NEW on a cached hash: another KV group's copy, stored (as before).
    source.feed(1, _map_batch([wire.stored([1], 16, origin="NEW")]), now=2.0)
    # Then the ledger knows 2 is cached: without origin its announcement is a hit.
    source.feed(2, wire.encode_batch(3.0, [wire.stored([2], 16)]), now=3.0)
    totals = source.report(now=3.0)["totals"]
    assert (totals["stored"], totals["reused"]) == (1, 3)


def _map_batch(events) -> bytes:
    return wire.encode_batch(1.0, events)


def test_all_blocks_cleared_is_a_change_and_what_returns_after_it_is_not_an_evictions_recomputation():
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, wire.encode_batch(1.0, [wire.stored([1, 2], 16), wire.removed([1])]), now=1.0)
    source.feed(1, wire.encode_batch(2.0, [wire.cleared()]), now=2.0)
    source.feed(2, wire.encode_batch(3.0, [wire.stored([1, 2], 16)]), now=3.0)
    report = source.report(now=3.0)
    assert report["window"]["stored_again"] == 0 and report["window"]["cleared"] == 1
    assert [c["detail"] for c in report["changes"]] == [
        "the engine cleared its prefix cache (AllBlocksCleared): every cached block is gone and reuse starts over"]
    assert source.take_changes() and not source.take_changes()


def test_a_cpu_offload_copy_is_another_block_and_lora_adapters_are_counted_apart():
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, wire.encode_batch(1.0, [wire.stored([1], 16, lora_name="a"), wire.removed([1]),
                                           wire.stored([1], 16, medium="CPU")]), now=1.0)
    assert source.ledger.totals.again == 0  # the CPU copy is not the GPU block's return
    source.feed(1, wire.encode_batch(2.0, [wire.stored([2], 16, lora_name="a"), wire.removed([2]),
                                           wire.stored([2], 16, lora_name="a")]), now=2.0)
    rows = {(r["medium"], r["lora_name"]): r for r in source.report(now=2.0)["totals"]["by_label"]}
    assert rows[("GPU", "a")]["stored_again"] == 1 and rows[("CPU", "")]["stored_again"] == 0


def test_a_block_back_from_a_lower_tier_is_that_tiers_hit_not_recomputation():
    source = KVEventSource("tcp://127.0.0.1:1")
    events = [wire.stored([1, 2, 3], 16), wire.stored([1, 2], 16, medium="CPU"),  # offloaded to the CPU tier
              wire.stored([3], 16, medium="STORAGE", locality="REMOTE"),  # and 3 to remote storage
              wire.removed([1]), wire.removed([2]), wire.removed([3]),
              wire.removed([2], medium="CPU"),  # the CPU tier let 2 go
              wire.stored([9], 16),  # one other block between the evictions and the returns
              wire.stored([1, 2, 3], 16)]  # back on the GPU: 1 from the CPU, 3 from storage, 2 recomputed
    source.feed(0, wire.encode_batch(1.0, events), now=1.0)
    report = source.report(now=2.0)
    tiers = {(r["medium"], r["locality"]): r for r in report["totals"]["tiers"]}
    assert report["totals"]["stored_again"] == 1  # only 2 was recomputed
    assert tiers[("GPU", "")] == {"medium": "GPU", "locality": "", "stored": 7, "evicted": 3, "returned": 3,
                                  "store_only": False}
    assert not tiers[("CPU", "")]["store_only"] and tiers[("STORAGE", "REMOTE")]["store_only"]
    assert tiers[("CPU", "")]["returned"] == 1 and tiers[("CPU", "")]["evicted"] == 1
    assert tiers[("STORAGE", "REMOTE")]["returned"] == 1 and tiers[("STORAGE", "REMOTE")]["stored"] == 1
    # The curve per tier: the GPU cache that would have kept what each tier served (1 block stored between).
    sizing = report["sizing"]["tiers"]
    assert [p["blocks_kept"] for p in sizing["CPU"] if p["extra_blocks"] >= 2][:1] == [1]


def test_the_table_stays_within_its_bytes_and_samples_with_a_small_error():
    # 40,000 blocks in rotation through a cache of 20,000, the table capped at
    # 2,000 entries: the ledger samples the hash space and scales.
    exact = Ledger(max_bytes=1 << 30)
    small = Ledger(max_bytes=2_000 * 110)
    t = 0.0
    hashes = [(i * 0x2545F4914F6CDD1D) % (1 << 64) for i in range(40_000)]
    chunks = [hashes[start:start + 100] for start in range(0, len(hashes), 100)] * 3
    for index, chunk in enumerate(chunks):
        for ledger in (exact, small):
            ledger.stored(chunk, t)
            if index >= 200:  # the cache holds 200 chunks: the oldest goes
                ledger.removed(chunks[index - 200], t)
        t += 0.01
        assert small.entries() <= small.capacity
    assert exact.totals.again == 80_000
    assert small.rate < 1
    assert small.totals.again == pytest.approx(80_000, rel=0.15)
    assert small.totals.stored == exact.totals.stored  # counts of every event never sample


# --- the ZMQ source ------------------------------------------------------

def _publisher(ctx, endpoint):
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(endpoint)
    return pub


def _wait(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _send_until_seen(pub, source, frames_for, first_seq):
    """PUB/SUB drops what is sent before the subscription reaches the
    publisher: send a probe until one arrives, then the sequence."""
    seq = first_seq
    while True:
        pub.send_multipart(frames_for(seq))
        seq += 1
        if _wait(lambda: source.messages > 0, 0.2):
            return seq


def test_kvwatch_binds_the_engine_connects_and_gaps_and_restarts_are_counted():
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    source = KVEventSource(endpoint)
    source.start()
    ctx = zmq.Context()
    try:
        assert source.listen_error is None
        pub = _publisher(ctx, endpoint)
        frame = lambda seq: [b"kv", seq.to_bytes(8, "big"), wire.encode_batch(1.0, [wire.stored([seq], 16)])]
        seq = _send_until_seen(pub, source, frame, 0)
        pub.send_multipart(frame(seq + 5))  # five never sent: a gap
        assert _wait(lambda: source.missed == 5)
        pub.send_multipart([b"kv", b"short", b"x"])
        assert _wait(lambda: source.malformed == 1)
        # The publisher disappears and a new one (an engine restart) starts over at 0.
        pub.close(0)
        pub = _publisher(ctx, endpoint)
        before = source.messages
        deadline = time.monotonic() + 10
        seq = 0
        while source.messages == before and time.monotonic() < deadline:
            pub.send_multipart(frame(seq))
            seq += 1
            time.sleep(0.05)
        assert _wait(lambda: source.restarts == 1)
        report = source.report()
        assert report["up"] and report["intake"]["missed"] == 5 and report["intake"]["restarts"] == 1
        pub.close(0)
    finally:
        ctx.term()
        source.stop()


def test_a_publishers_handshake_is_counted_before_any_message_and_its_leaving_too():
    # An idle engine connects and sends nothing: its handshake tells it from no publisher at all.
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    source = KVEventSource(endpoint)
    source.start()
    ctx = zmq.Context()
    try:
        assert source.report()["intake"]["connections"] == 0
        pub = _publisher(ctx, endpoint)
        assert _wait(lambda: source.connections == 1 and source.publishers == 1)
        second = _publisher(ctx, endpoint)
        assert _wait(lambda: source.connections == 2 and source.publishers == 2)
        second.close(0)
        assert _wait(lambda: source.publishers == 1)
        report = source.report()
        assert report["intake"]["connections"] == 2 and report["intake"]["messages"] == 0
        pub.close(0)
    finally:
        ctx.term()
        source.stop()


def test_an_endpoint_kvwatch_cannot_bind_is_one_sentence():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        endpoint = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        source = KVEventSource(endpoint)
        source.start()
        try:
            report = source.report()
            assert not report["up"] and report["reason"] == "listen"
            assert report["detail"].startswith(f"kvwatch cannot listen on {endpoint} for KV-cache events")
        finally:
            source.stop()


def test_a_flood_is_dropped_and_counted_never_queued_without_bound():
    source = KVEventSource("tcp://127.0.0.1:1", queue_bytes=1 << 20)  # no accountant runs: nothing drains
    payload = wire.encode_batch(1.0, [wire.stored(list(range(64)), 16, token_ids=list(range(1024)))])
    for seq in range(20_000):
        source.intake([b"kv", seq.to_bytes(8, "big"), payload], 1.0)
    assert source._queued_bytes <= 1 << 20 and len(source._queue) <= QUEUE_MESSAGES
    assert source.dropped == 20_000 - len(source._queue)
    assert source.messages == 20_000 and source.missed == 0


# --- beside the page -------------------------------------------------------

def test_settings_read_the_endpoint_and_refuse_what_is_not_one():
    settings = load_settings(overrides={"kv_events": "tcp://127.0.0.1:5557"}, environ={})
    assert settings.kv_events == "tcp://127.0.0.1:5557" and not settings.kv_events_connect
    with pytest.raises(SettingsError, match="is not a ZMQ endpoint"):
        load_settings(overrides={"kv_events": "http://127.0.0.1:5557"}, environ={})
    with pytest.raises(SettingsError, match="has no host and port"):
        load_settings(overrides={"kv_events": "tcp://127.0.0.1"}, environ={})


def test_the_sidecar_exports_the_stream_beside_the_page_and_the_page_is_unaffected(fixtures_dir):
    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(page), Answer(page)]) as server:
        settings = load_settings(overrides={"target": server.url, "poll_interval": "1s", "timeout": "1s",
                                            "kv_events": f"tcp://127.0.0.1:{free_port()}"}, environ={})
        monitor = Monitor(settings)
        client = TestClient(create_app(monitor, settings))
        try:
            state = monitor.poll_once()
            assert state.up and state.kv_events["reason"] == "no_events"
            body = client.get("/metrics").text
            assert value(body, "kvwatch_kv_events_up") == 0
            # Nothing ever connected (the stream is fed by hand here) and nothing is silent yet.
            assert value(body, "kvwatch_kv_events_connections_total") == 0
            assert value(body, "kvwatch_kv_events_publishers") == 0
            assert value(body, "kvwatch_kv_events_silent_blocks") == 0
            assert value(body, "kvwatch_kv_events_blocks_stored_total", medium="GPU", lora_name="") is None
            source = monitor.kv_events
            now = monitor.clock()
            for seq, events in enumerate(rotation(prefixes=12, blocks=15, cache=100, rounds=4)):
                source.feed(seq, wire.encode_batch(now, events), now=now)
            source.feed(48, b"\xc1", now=now)  # one malformed: counted, nothing else changes
            state = monitor.poll_once()
            assert state.up and state.kv_events["up"]
            body = client.get("/metrics").text
            assert value(body, "kvwatch_up") == 1
            assert value(body, "kvwatch_kv_events_up") == 1
            assert value(body, "kvwatch_kv_events_blocks_stored_total", medium="GPU", lora_name="") == 720
            assert value(body, "kvwatch_kv_events_blocks_stored_again_total", medium="GPU", lora_name="") == 540
            assert value(body, "kvwatch_kv_events_stored_again_ratio") == pytest.approx(0.75)
            assert value(body, "kvwatch_kv_events_malformed_messages_total") == 1
            assert value(body, "kvwatch_kv_events_sampling_ratio") == 1
            # The page's engine states its cache (num_gpu_blocks): the curve reads in its multiples.
            assert value(body, "kvwatch_kv_events_sizing_recomputation_avoided_ratio", extra_cache="8") == 1
            page = client.get("/").text  # the page without scripts says it too
            assert "<h2>KV-cache events</h2>" in page and "stored again after their eviction 75" in page
            assert client.get("/api/v1/signals").json()["kv_events"]["up"] is True
        finally:
            monitor.stop()


def test_the_api_serves_the_sizing_curve_and_kvwatch_capacity_prints_it(fixtures_dir, capsys):
    import argparse
    import json

    from kvwatch.commands import capacity

    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with stream_fed([page, page], rotation(prefixes=12, blocks=15, cache=100, rounds=4)) as (_, _, client):
        diagnosis = client.get("/api/v1/diagnosis").json()
    stream = diagnosis["kv_events"]
    assert stream["up"] and stream["window"]["stored_again"] == 540 and "distance" not in stream["window"]
    points = stream["sizing"]["points"]
    # The page's engine: 128 blocks of 32 tokens (num_gpu_blocks - 1 usable), its bytes per block.
    assert [p["extra_cache"] for p in points] == [0.125, 0.25, 0.5, 1, 2, 4, 8]
    assert all(p["extra_bytes"] > 0 for p in points)
    assert points[-1]["recomputation_avoided_ratio"] == 1
    with PageServer([Answer(json.dumps(diagnosis), headers={"Content-Type": "application/json"})]) as served:
        args = argparse.Namespace(kvwatch=served.base_url, json=False)
        report = capacity.build_report(args)
    assert report["mode"] == "kv-events" and report["sizing"]["points"] == points
    text = capacity.render_table(report)
    assert "extra cache" in text and "recomputation avoided" in text and "x8" in text and "blocks. An estimate: " in text
    with PageServer([Answer(json.dumps({"findings": []}), headers={"Content-Type": "application/json"})]) as served:
        with pytest.raises(capacity.CapacityInputError, match="does not read KV-cache events"):
            capacity.build_report(argparse.Namespace(kvwatch=served.base_url, json=False))


def _fixture_batch(fixtures_dir, name: str) -> bytes:
    """A fixture batch (tests/fixtures/kv-events, JSON of the publisher's msgpack) as its bytes."""
    import json

    return msgspec.msgpack.encode(json.loads((fixtures_dir / "kv-events" / name).read_text()))


def test_tensorrt_llms_streaming_batches_read_as_vllms(fixtures_dir):
    # Positional envelope, map events tagged "type", token ids that may be strings, mm_keys: all skipped.
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, _fixture_batch(fixtures_dir, "trtllm-streaming-batch.json"), now=1.0)
    report = source.report(now=1.0)
    assert report["intake"]["malformed"] == 0 and source.ranks == {1} and source.block_size == 32
    totals = report["totals"]
    assert (totals["stored"], totals["evicted"], totals["stored_again"], totals["cleared"]) == (5, 1, 1, 1)


def test_lmcaches_store_only_tier_is_counted_and_its_hits_an_upper_bound(fixtures_dir):
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, _fixture_batch(fixtures_dir, "lmcache-mp-store-only-batch.json"), now=1.0)
    report = source.report(now=1.0)
    tiers = {r["medium"]: r for r in report["totals"]["tiers"]}
    # Both blocks came back from the CPU tier LMCache stored them in: its hits, not recomputation.
    assert report["totals"]["stored_again"] == 0 and tiers["CPU"]["returned"] == 2
    # It never said what it let go: store-only, so those hits are an upper bound.
    assert tiers["CPU"]["store_only"] and tiers["CPU"]["evicted"] == 0


def test_sglangs_fixture_batch_reads_as_vllms(fixtures_dir):
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, _fixture_batch(fixtures_dir, "sglang-batch.json"), now=1.0)
    totals = source.report(now=1.0)["totals"]
    assert source.ranks == set() and (totals["stored"], totals["stored_again"], totals["cleared"]) == (3, 1, 1)


def test_sglangs_batches_read_as_vllms():
    # SGLang's publisher (python/sglang/srt/disaggregation/kv_events.py) sends
    # the array layout without data_parallel_rank, medium or lora_name.
    payload = msgspec.msgpack.encode([3.5, [["BlockStored", [11, 12], None, list(range(32)), 16, None],
                                            ["BlockRemoved", [11]], ["AllBlocksCleared"]]])
    batch = wire.Decoder().decode(payload)
    assert batch.rank is None and batch.skipped == 0
    assert [(e.kind, list(e.hashes), e.block_size, e.medium) for e in batch.events] == [
        ("BlockStored", [11, 12], 16, None), ("BlockRemoved", [11], None, None), ("AllBlocksCleared", [], None, None)]


# --- captures and replays ------------------------------------------------------

@pytest.mark.parametrize("suffix", ["", ".tar.gz"])
def test_a_capture_keeps_the_stream_and_a_replay_feeds_it_at_recorded_times(fixtures_dir, tmp_path, suffix):
    from kvwatch.capture.bundle import Capture, CaptureWriter
    from kvwatch.capture.record import manifest_for
    from kvwatch.capture.replay import replay
    from kvwatch.commands.diagnose import replay_settings

    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    out = tmp_path / f"capture{suffix}"
    writer = CaptureWriter(out, {**manifest_for("http://127.0.0.1:8000/metrics", 5.0, 60.0), "kv_events": "tcp://x:1"})
    batches = rotation(prefixes=12, blocks=15, cache=100, rounds=4)
    t = 1_700_000_000.0
    for poll in range(6):
        for seq in range(poll * 8, poll * 8 + 8):  # 8 batches before each page
            assert writer.add_event(t + seq * 0.5, seq, wire.encode_batch(t, batches[seq]))
        writer.add(t + poll * 5.0 + 4.0, 0.01, page)
    writer.close(ended_at=t + 30, interrupted=False)
    captured = Capture(out)
    assert len(captured.events) == 48 and captured.manifest["kv_events_messages"] == 48
    states = []
    replay(captured, lambda source: Monitor(replay_settings(captured, None, "5m"), fetcher=source,
                                            clock=source.now), on_state=states.append)
    assert [s.kv_events["totals"]["stored"] for s in states] == sorted(s.kv_events["totals"]["stored"] for s in states)
    last = states[-1].kv_events
    assert last["up"] and last["totals"]["stored"] == 720 and last["totals"]["stored_again"] == 540
    assert last["intake"]["missed"] == 0


def test_a_damaged_event_record_in_a_capture_is_one_sentence(tmp_path):
    from kvwatch.capture.bundle import EVENTS, Capture, CaptureError, CaptureWriter
    from kvwatch.capture.record import manifest_for

    out = tmp_path / "capture"
    writer = CaptureWriter(out, manifest_for("http://127.0.0.1:8000/metrics", 5.0, 60.0))
    writer.add_event(1.0, 0, b"\x90")
    writer.close(ended_at=2.0, interrupted=False)
    data = (out / EVENTS).read_bytes()
    (out / EVENTS).write_bytes(data[:-1] + data[:8])  # a record cut short, then part of a header
    with pytest.raises(CaptureError, match="events.bin"):
        Capture(out)


def test_kvwatch_capture_records_the_stream_beside_the_pages(fixtures_dir, tmp_path, capsys):
    import threading

    from kvwatch.capture.bundle import Capture
    from kvwatch.cli import main

    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    out = tmp_path / "capture.tar.gz"
    stop = threading.Event()

    def publish():
        ctx = zmq.Context()
        pub = _publisher(ctx, endpoint)
        seq = 0
        while not stop.is_set():
            pub.send_multipart([b"kv", seq.to_bytes(8, "big"), wire.encode_batch(1.0, [wire.stored([seq], 16)])])
            seq += 1
            time.sleep(0.01)
        pub.close(0)
        ctx.term()

    with PageServer([Answer(page)] * 60) as server:
        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        try:
            assert main(["capture", "--target", server.url, "--interval", "0.05s", "--duration", "10m",
                         "--count", "40", "--out", str(out), "--kv-events", endpoint]) == 0
        finally:
            stop.set()
            thread.join(5)
    captured = Capture(out)
    assert captured.manifest["kv_events"] == endpoint
    assert len(captured.events) == captured.manifest["kv_events_messages"] > 0
    seqs = [seq for _, seq, _ in captured.events]
    assert seqs == sorted(seqs)
    assert "KV-cache event messages" in capsys.readouterr().err


def test_kvwatch_diagnose_prints_the_stream(fixtures_dir):
    import io

    from kvwatch.commands.diagnose import print_report
    from kvwatch.sidecar.report import diagnosis_json, signals_json

    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(page), Answer(page)]) as server:
        settings = load_settings(overrides={"target": server.url, "kv_events": "tcp://127.0.0.1:1"}, environ={})
        monitor = Monitor(settings)
        monitor.poll_once()
        now = monitor.clock()
        for seq, events in enumerate(rotation(prefixes=12, blocks=15, cache=100, rounds=4)):
            monitor.kv_events.feed(seq, wire.encode_batch(now, events), now=now)
        state = monitor.poll_once()
    out = io.StringIO()
    print_report(out, signals_json(state, settings), diagnosis_json(state, settings), 2, state)
    text = out.getvalue()
    assert "KV-CACHE EVENTS tcp://127.0.0.1:1: blocks stored" in text
    assert "stored again after their eviction 75" in text
    assert "x8 more cache (1016 blocks): 100.0% of the recomputation avoided (estimate)" in text


def test_a_gap_is_asked_of_the_engines_replay_socket_and_what_it_lost_accounted():
    """vLLM's publisher keeps its recent batches behind a ROUTER socket
    (replay_endpoint): a consumer sends the first sequence it lacks and gets
    every kept batch from there, then sequence -1."""
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    source = KVEventSource(endpoint, replay=replay)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(replay)
    source.start()
    payloads = {seq: wire.encode_batch(1.0, [wire.stored([1000 + seq], 16)]) for seq in range(8)}
    try:
        pub = _publisher(ctx, endpoint)
        frame = lambda seq: [b"kv", seq.to_bytes(8, "big"), payloads[seq]]
        deadline = time.monotonic() + 10
        while source.messages == 0:  # the subscription reaches the publisher
            assert time.monotonic() < deadline
            pub.send_multipart(frame(0))
            time.sleep(0.05)
        sent_first = source.messages
        pub.send_multipart(frame(1))
        pub.send_multipart(frame(5))  # 2, 3 and 4 lost on the way
        assert _wait(lambda: source.missed == 3 or source.replay_requests == 1)
        assert router.poll(5000)
        client, empty, start = router.recv_multipart()
        assert empty == b"" and int.from_bytes(start, "big") == 2
        for seq in range(2, 8):  # everything kept from 2 on, beyond the gap too
            router.send_multipart([client, b"", seq.to_bytes(8, "big"), payloads[seq]])
        router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])
        assert _wait(lambda: source.recovered == 3)
        assert _wait(lambda: source.ledger.totals.stored == sent_first + 5)  # 0 (as often as sent), 1, 2, 3, 4, 5
        report = source.report()
        assert report["intake"]["missed"] == 0 and report["intake"]["recovered"] == 3
        assert report["intake"]["replay_requests"] == 1
        pub.close(0)
    finally:
        router.close(0)
        source.stop()
        ctx.term()


def test_all_blocks_cleared_is_a_change_finding_of_the_streams_engine(fixtures_dir):
    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(page), Answer(page)]) as server:
        monitor = Monitor(load_settings(overrides={"target": server.url, "kv_events": "tcp://127.0.0.1:1"},
                                        environ={}))
        monitor.poll_once()
        now = monitor.clock()
        monitor.kv_events.feed(0, wire.encode_batch(now, [wire.stored([1, 2, 3], 16)]), now=now)
        monitor.kv_events.feed(1, wire.encode_batch(now, [wire.cleared()]), now=now)
        state = monitor.poll_once()
    cleared = [f for f in state.findings if f.cause == "prefix_cache_cleared"]
    assert [(f.symptom, f.model, f.engine, f.severity) for f in cleared] == [("change", "tiny-llama", "0", "info")]
    assert "AllBlocksCleared" in cleared[0].summary
    assert [e.kind for e in state.events if e.kind.startswith("kv_")] == ["kv_cache_cleared"]


def test_the_report_names_the_latest_pause_in_the_stores_as_long_as_the_judged_part():
    source = KVEventSource("tcp://127.0.0.1:1", window_seconds=300.0)
    for seq, t in enumerate((1000.0, 1003.0, 1010.0, 1050.0, 1052.0)):  # pauses of 7 s and 40 s
        source.feed(seq, wire.encode_batch(t, [wire.stored([seq], 16)]), now=t)
    assert source.report(now=1060.0, recent_seconds=30.0)["pause"] == {"seconds": 40.0, "ended_seconds_ago": 10.0}
    assert source.report(now=1060.0, recent_seconds=5.0)["pause"]["seconds"] == 40.0  # the latest one long enough
    assert source.report(now=1060.0, recent_seconds=60.0)["pause"] is None
    source.feed(5, wire.encode_batch(1060.0, [wire.removed([4])]), now=1060.0)  # an eviction is no store
    assert source.report(now=1061.0, recent_seconds=30.0)["pause"]["ended_seconds_ago"] == 11.0
