"""vLLM's KV-cache event wire format (`vllm/distributed/kv_events.py`), read
and written by kvwatch's own types (the facts: docs/kv-events.md).

A message is three ZMQ frames: the topic, an 8-byte big-endian sequence
number, and a msgpack payload (vLLM encodes it with msgspec). The payload is
a batch `(ts, events, data_parallel_rank?)`; each event is a tagged struct,
`BlockStored`, `BlockRemoved` or `AllBlocksCleared`. vLLM's releases encode
both as msgpack arrays (`array_like`: the tag first, then the fields in
declaration order, trailing defaults omitted) or as maps (the tag under
`"type"`); kvwatch reads all four combinations: the batch's first byte says
array or map, and the events' layout that last decoded is tried first.

Decoding is typed (msgspec), so a stored event's `token_ids`, the largest
part of a batch and of no use here, is skipped without building one integer
of it. A batch the typed decoders refuse (an event type of a newer release,
a field of an unexpected type) is decoded generically and walked by hand;
what still makes no sense is counted as malformed, never raised.

Block hashes are 64-bit integers (vLLM's external block hashes); a hash sent
as bytes is read as the integer of its last 8 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Union

import msgspec

from kvwatch.labels import bounded_label

STORED = "BlockStored"
REMOVED = "BlockRemoved"
CLEARED = "AllBlocksCleared"

_Hash = Union[int, bytes]


# --- the array layout (array_like: tag first, fields in order) -------------

class _AStored(msgspec.Struct, array_like=True, tag=STORED):
    block_hashes: list[_Hash]
    parent_block_hash: Union[_Hash, None] = None
    token_ids: msgspec.Raw = msgspec.Raw(b"")  # never decoded
    block_size: Union[int, None] = None
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None
    # Newer releases' fields, in vLLM's order, kept as their raw bytes (never
    # decoded, whatever their type): `locality` (vLLM PR 48281) and `origin`
    # (NEW or REUSED, vLLM PR 51699, proposed: after `ownership`) are read
    # from theirs only when a short string (_word), so an engine sending a
    # large or nested value there costs no memory and no malformed batch.
    extra_keys: msgspec.Raw = msgspec.Raw(b"")
    group_idx: msgspec.Raw = msgspec.Raw(b"")
    kv_cache_spec_kind: msgspec.Raw = msgspec.Raw(b"")
    kv_cache_spec_sliding_window: msgspec.Raw = msgspec.Raw(b"")
    locality: msgspec.Raw = msgspec.Raw(b"")
    ownership: msgspec.Raw = msgspec.Raw(b"")
    origin: msgspec.Raw = msgspec.Raw(b"")


class _ARemoved(msgspec.Struct, array_like=True, tag=REMOVED):
    block_hashes: list[_Hash]
    medium: Union[str, None] = None


class _ACleared(msgspec.Struct, array_like=True, tag=CLEARED):
    pass


# --- the map layout (the tag under "type"; unknown fields skipped) ----------

class _MStored(msgspec.Struct, tag=STORED, tag_field="type"):
    block_hashes: list[_Hash]
    block_size: Union[int, None] = None
    lora_id: Union[int, None] = None
    medium: Union[str, None] = None
    lora_name: Union[str, None] = None
    # NEW or REUSED (vLLM PR 51699, proposed): how the block came to be stored.
    origin: Union[str, None] = None
    # LOCAL or REMOTE: a secondary tier's place relative to the engine (vLLM PR 48281).
    locality: Union[str, None] = None


class _MRemoved(msgspec.Struct, tag=REMOVED, tag_field="type"):
    block_hashes: list[_Hash]
    medium: Union[str, None] = None
    locality: Union[str, None] = None


class _MCleared(msgspec.Struct, tag=CLEARED, tag_field="type"):
    pass


_AEvent = Union[_AStored, _ARemoved, _ACleared]
_MEvent = Union[_MStored, _MRemoved, _MCleared]


class _ABatchA(msgspec.Struct, array_like=True):
    ts: float
    events: list[_AEvent]
    data_parallel_rank: Union[int, None] = None


class _ABatchM(msgspec.Struct, array_like=True):
    ts: float
    events: list[_MEvent]
    data_parallel_rank: Union[int, None] = None


class _MBatchA(msgspec.Struct):
    ts: float
    events: list[_AEvent]
    data_parallel_rank: Union[int, None] = None


class _MBatchM(msgspec.Struct):
    ts: float
    events: list[_MEvent]
    data_parallel_rank: Union[int, None] = None


_DECODERS: dict[tuple[str, str], msgspec.msgpack.Decoder[Any]] = {
    ("array", "array"): msgspec.msgpack.Decoder(_ABatchA),
    ("array", "map"): msgspec.msgpack.Decoder(_ABatchM),
    ("map", "array"): msgspec.msgpack.Decoder(_MBatchA),
    ("map", "map"): msgspec.msgpack.Decoder(_MBatchM),
}


class Malformed(ValueError):
    """A payload that is not a batch of KV-cache events; its text is one
    sentence for people (what was wrong, never the bytes)."""


@dataclass(slots=True)
class Event:
    """One event as kvwatch reads it: `kind` is STORED, REMOVED or CLEARED."""
    kind: str
    hashes: list
    block_size: int | None = None
    medium: str | None = None
    lora: str | None = None
    origin: str | None = None  # NEW, REUSED, or None (not said: the ledger tells)
    locality: str | None = None  # LOCAL, REMOTE, or None (not said)


@dataclass(slots=True)
class Batch:
    ts: float
    events: list[Event]
    rank: int | None = None
    skipped: int = 0  # events of a type kvwatch does not know (a newer release's)


def _outer(payload: bytes) -> str | None:
    if not payload:
        return None
    first = payload[0]
    if 0x90 <= first <= 0x9F or first in (0xDC, 0xDD):
        return "array"
    if 0x80 <= first <= 0x8F or first in (0xDE, 0xDF):
        return "map"
    return None


class Decoder:
    """Decodes payloads; remembers which event layout the engine sends so
    each batch is decoded once."""

    def __init__(self) -> None:
        self._events_layout = {"array": "array", "map": "map"}

    def decode(self, payload: bytes) -> Batch:
        outer = _outer(payload)
        if outer is None:
            raise Malformed("the payload is not a msgpack array or map")
        first = self._events_layout[outer]
        for layout in (first, "map" if first == "array" else "array"):
            try:
                raw = _DECODERS[(outer, layout)].decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            except RecursionError:  # msgspec's own depth limit, even in the skipped token ids
                raise Malformed("the payload is nested deeper than msgpack decoding allows") from None
            self._events_layout[outer] = layout
            return Batch(float(raw.ts), [_event(e) for e in raw.events], raw.data_parallel_rank)
        return _generic(payload, outer)


def _label(value: str | None) -> str | None:
    # A medium or LoRA name becomes a label value: bounded now, so a 2 MB name
    # is never held past its batch (kvwatch/labels.py).
    return None if value is None else bounded_label(value)


def _event(raw) -> Event:
    if isinstance(raw, (_AStored, _MStored)):
        return Event(STORED, raw.block_hashes, raw.block_size, _label(raw.medium),
                     _label(raw.lora_name) if raw.lora_name is not None else (str(raw.lora_id) if raw.lora_id else None),
                     _origin(_word(raw.origin)), _locality(_word(raw.locality)))
    if isinstance(raw, (_ARemoved, _MRemoved)):
        return Event(REMOVED, raw.block_hashes, None, _label(raw.medium),
                     locality=_locality(getattr(raw, "locality", None)))
    return Event(CLEARED, [])


# The longest msgpack string _word decodes (a one-byte header and 15 bytes):
# enough for every word of origin and locality.
WORD_MAX_BYTES = 16


def _word(value):
    """A field of the array layout kept raw (msgspec.Raw): the string it
    holds when a short one, else None; a map event's field as it is."""
    if not isinstance(value, msgspec.Raw):
        return value
    if not 1 < len(value) <= WORD_MAX_BYTES:
        return None
    try:
        return msgspec.msgpack.decode(value, type=str)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _origin(value) -> str | None:
    """NEW or REUSED where the event says so (any case); anything else is not said."""
    if isinstance(value, str) and value.upper() in ("NEW", "REUSED"):
        return value.upper()
    return None


def _locality(value) -> str | None:
    """LOCAL or REMOTE where the event says so; anything else is not said."""
    if isinstance(value, str) and value.upper() in ("LOCAL", "REMOTE"):
        return value.upper()
    return None


# Positions of the fields in the array layout (after the tag).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                  "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "locality",
                  "ownership", "origin")
_REMOVED_FIELDS = ("block_hashes", "medium")


# The most of a batch the slow path decodes generically: every msgpack byte
# may become a Python object (an empty array is one byte and a 56-byte
# list), so a 4 MiB message of an unknown event type holding 4 M empty
# arrays took 257 MB to decode; 256 KiB takes at most 16 MB. vLLM's
# batches the typed decoders read have no such bound and need none (their
# hashes are typed, their token ids never decoded).
GENERIC_MAX_BYTES = 256 * 1024


def _generic(payload: bytes, outer: str) -> Batch:
    """The slow path: a batch the typed decoders refused, walked by hand."""
    if len(payload) > GENERIC_MAX_BYTES:
        raise Malformed(f"a batch of {len(payload):,} bytes that is not in vLLM's known layouts (kvwatch reads such "
                        f"batches only up to {GENERIC_MAX_BYTES:,} bytes)")
    try:
        raw = msgspec.msgpack.decode(payload)
    except (msgspec.DecodeError, RecursionError):
        raise Malformed("the payload is not valid msgpack") from None
    if isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise Malformed("the payload is not a batch (timestamp, events)")
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or not isinstance(events, list):
        raise Malformed("the batch has no timestamp or no list of events")
    out: list[Event] = []
    skipped = 0
    for item in events:
        if isinstance(item, list) and item and isinstance(item[0], str):
            fields = dict(zip(_STORED_FIELDS if item[0] == STORED else _REMOVED_FIELDS, item[1:]))
            kind = item[0]
        elif isinstance(item, dict) and isinstance(item.get("type"), str):
            fields, kind = item, item["type"]
        else:
            raise Malformed("an event is neither a tagged array nor a tagged map")
        if kind == CLEARED:
            out.append(Event(CLEARED, []))
            continue
        if kind not in (STORED, REMOVED):
            skipped += 1
            continue
        hashes = fields.get("block_hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, (int, bytes)) and not isinstance(h, bool)
                                                   for h in hashes):
            raise Malformed(f"a {kind} event's block_hashes is not a list of integers")
        size = fields.get("block_size")
        medium = fields.get("medium")
        lora = fields.get("lora_name")
        out.append(Event(kind, hashes, size if isinstance(size, int) and not isinstance(size, bool) else None,
                         _label(medium) if isinstance(medium, str) else None,
                         _label(lora) if isinstance(lora, str) else None, _origin(fields.get("origin")),
                         _locality(fields.get("locality"))))
    return Batch(float(ts), out, rank if isinstance(rank, int) and not isinstance(rank, bool) else None, skipped)


def hash_int(value: Any) -> int:
    """A block hash as an integer: bytes are read as their last 8 bytes."""
    if isinstance(value, int):
        return value
    return int.from_bytes(value[-8:], "big")


# --- writing (the simulator and the tests publish what vLLM publishes) -----

class _WStored(msgspec.Struct, array_like=True, omit_defaults=True, tag=STORED):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None] = None
    extra_keys: None = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None
    locality: Union[str, None] = None
    ownership: Union[str, None] = None
    origin: Union[str, None] = None


class _WRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag=REMOVED):
    block_hashes: list[int]
    medium: Union[str, None]


class _WCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag=CLEARED):
    pass


class _WBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[_WStored, _WRemoved, _WCleared]]
    data_parallel_rank: Union[int, None] = None


class _WMStored(msgspec.Struct, omit_defaults=True, tag=STORED, tag_field="type"):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None] = None
    origin: Union[str, None] = None
    locality: Union[str, None] = None


class _WMRemoved(msgspec.Struct, omit_defaults=True, tag=REMOVED, tag_field="type"):
    block_hashes: list[int]
    medium: Union[str, None]
    locality: Union[str, None] = None


class _WMBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[_WMStored, _WMRemoved]]
    data_parallel_rank: Union[int, None] = None


_ENCODER = msgspec.msgpack.Encoder()


def stored(hashes: list[int], block_size: int, token_ids: list[int] | None = None, parent: int | None = None,
           medium: str | None = "GPU", lora_name: str | None = None, origin: str | None = None,
           locality: str | None = None, layout: str | None = None):
    """A BlockStored, in the array layout, or in the map layout where `layout`
    says so or (no layout) where it names `origin` (NEW or REUSED) or `locality`."""
    if layout == "map" or (layout is None and (origin is not None or locality is not None)):
        return _WMStored(list(hashes), parent, list(token_ids or ()), block_size, None, medium, lora_name, origin,
                         locality)
    return _WStored(list(hashes), parent, list(token_ids or ()), block_size, None, medium, lora_name,
                    locality=locality, origin=origin)


def removed(hashes: list[int], medium: str | None = "GPU", layout: str = "array", locality: str | None = None):
    if layout == "map" or locality is not None:
        return _WMRemoved(list(hashes), medium, locality)
    return _WRemoved(list(hashes), medium)


def cleared() -> _WCleared:
    return _WCleared()


def encode_batch(ts: float, events: list, rank: int | None = 0) -> bytes:
    """A payload as vLLM's publisher writes it: the array layout, or the map
    layout where the events are maps (newer releases; `origin`)."""
    if events and all(isinstance(e, (_WMStored, _WMRemoved)) for e in events):
        return _ENCODER.encode(_WMBatch(ts, events, rank))
    return _ENCODER.encode(_WBatch(ts, events, rank))


def sequence_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)
