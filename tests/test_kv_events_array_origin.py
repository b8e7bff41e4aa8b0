"""`origin` (NEW or REUSED, vLLM PR 51699) in the array layout: read by
msgspec's typed decoder at its place after `ownership`, from its raw bytes
only when a short string, so whatever an engine sends there is bounded."""

from __future__ import annotations

import json

import msgspec
import pytest

from kvwatch.kvevents import wire
from kvwatch.kvevents.source import KVEventSource

FIXTURE = "vllm-origin-array-batch.json"


def fixture_events(fixtures_dir) -> list:
    return json.loads((fixtures_dir / "kv-events" / FIXTURE).read_text())


def test_the_fixture_batch_names_each_blocks_origin_and_hits_are_told_apart(fixtures_dir):
    payload = msgspec.msgpack.encode(fixture_events(fixtures_dir))
    batch = wire.Decoder().decode(payload)
    assert [(e.kind, list(e.hashes), e.origin) for e in batch.events] == [
        ("BlockStored", [21, 22], "NEW"), ("BlockStored", [21], "REUSED"), ("BlockStored", [31], "REUSED"),
        ("BlockRemoved", [22], None), ("BlockStored", [22], "NEW")]
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, payload, now=1.0)
    totals = source.report(now=1.0)["totals"]
    # 31 was cached before kvwatch listened: only its origin says its announcement is a hit.
    assert source.malformed == 0 and totals["stored"] == 3 and totals["stored_again"] == 1
    assert totals["reused"] == 2


def test_origin_in_a_batch_too_large_for_the_generic_path_is_read_by_the_typed_decoder(fixtures_dir):
    ts, events, rank = fixture_events(fixtures_dir)
    # One event's token ids past the generic path's bound: only msgspec's typed decoding reads it.
    events[1][3] = list(range(wire.GENERIC_MAX_BYTES // 2))
    payload = msgspec.msgpack.encode([ts, events, rank])
    assert len(payload) > wire.GENERIC_MAX_BYTES
    assert [e.origin for e in wire.Decoder().decode(payload).events] == ["NEW", "REUSED", "REUSED", None, "NEW"]


@pytest.mark.parametrize("value", ["x" * 1_000_000, [[[]]] * 10_000, 7, "BORROWED", None, {"origin": "REUSED"}])
def test_an_origin_that_is_no_short_word_is_not_said_and_the_batch_still_reads(fixtures_dir, value):
    ts, events, rank = fixture_events(fixtures_dir)
    events[1][-1] = value
    batch = wire.Decoder().decode(msgspec.msgpack.encode([ts, events, rank]))
    assert [e.origin for e in batch.events] == ["NEW", None, "REUSED", None, "NEW"]


def test_the_writer_puts_origin_where_the_reader_finds_it_in_the_array_layout():
    payload = wire.encode_batch(1.0, [wire.stored([5], 16, origin="REUSED", layout="array"),
                                      wire.stored([6], 16, locality="REMOTE", medium="STORAGE", layout="array")])
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0][0] == "BlockStored" and raw[1][0][14] == "REUSED"  # the tag, 13 fields, then origin
    assert [(e.origin, e.locality) for e in wire.Decoder().decode(payload).events] == [("REUSED", None),
                                                                                       (None, "REMOTE")]
