"""The KV-event stream's report as the API serves it (/api/v1/diagnosis'
`kv_events`): a replay of a fixed event sequence (a rotation that evicts
before reuse, a LoRA tenant, a CPU tier, a clear and a pause) gives the same
bytes as the recorded JSON, so typing or reshaping how the report is built
cannot change what clients read."""

from __future__ import annotations

import json
from pathlib import Path

from kvwatch.kvevents import wire
from kvwatch.kvevents.source import KVEventSource
from kvwatch.present import clean
from kvwatch.sidecar.report import public_report
from test_kv_events import rotation

EXPECTED = Path(__file__).parent / "fixtures" / "kv-events" / "report-replay.json"


def replayed_reports() -> list:
    source = KVEventSource("tcp://127.0.0.1:1", window_seconds=120.0)
    at, seq, reports = 1000.0, 0, []
    batches = rotation(prefixes=6, blocks=4, cache=16, rounds=3)
    batches += [[wire.stored([90_000 + i], 16, medium="CPU", lora_name="tenant-a")] for i in range(5)]
    batches += [[wire.removed([90_000, 90_001], medium="CPU")], [wire.cleared()]]
    batches += rotation(prefixes=3, blocks=2, cache=8, rounds=2, start=50_000)
    for index, events in enumerate(batches):
        source.feed(seq, wire.encode_batch(at, events), now=at)
        seq += 1
        # A pause of 40 s in the stores half-way, then the rest.
        at += 40.0 if index == len(batches) // 2 else 1.5
        if index % 10 == 9:
            reports.append(source.report(at, bytes_per_block=2048.0, recent_seconds=30.0))
    reports.append(source.report(at + 5.0, bytes_per_block=2048.0, recent_seconds=30.0))
    return reports


def as_served(reports: list) -> str:
    return "\n".join(json.dumps(clean(public_report(report))) for report in reports) + "\n"


def test_a_replayed_stream_reports_the_recorded_json_byte_for_byte():
    text = as_served(replayed_reports())
    assert '"stored_again"' in text and '"tenant-a"' in text and '"CPU"' in text
    assert text == EXPECTED.read_text()


if __name__ == "__main__":  # records the expected JSON (only where the report's content is meant to change)
    EXPECTED.write_text(as_served(replayed_reports()))


def test_the_stream_families_read_keys_the_report_type_declares():
    """The catalogue names the report's keys as strings (mypy cannot see
    them): each is a key of the type the collector reads it from."""
    from kvwatch.signals import STREAM_SERIES, STREAM_SIGNALS
    from kvwatch.stream_report import KVEventsTotals, KVEventsWindow

    window_keys = KVEventsWindow.__required_keys__ | KVEventsWindow.__optional_keys__
    assert {signal.key for signal in STREAM_SIGNALS} <= window_keys, {s.key for s in STREAM_SIGNALS} - window_keys
    totals_keys = KVEventsTotals.__required_keys__
    assert {series.key for series in STREAM_SERIES} <= totals_keys, {s.key for s in STREAM_SERIES} - totals_keys
