"""Hostile KV-cache event streams and captures (kvwatch/kvevents): label
strings bounded in bytes by the shared rule (kvwatch/labels.py) and budgeted,
replays read once per sequence, impossible sequence jumps read as another
publisher, threads that outlive any input, a log that says each malformed
kind once a minute, and ipc:// paths that are not sockets left alone."""

from __future__ import annotations

import json
import logging
import threading

import pytest
import zmq

from kvwatch.kvevents import wire
from kvwatch.kvevents.ledger import MAX_LABELS
from kvwatch.kvevents.source import KVEventSource
from kvwatch.labels import LABEL_VALUE_MAX_BYTES, OTHER, LabelBudget, bounded_label
from test_kv_events import _publisher, _wait, free_port, rotation


def _label_values(report: dict) -> list[str]:
    values = [v for row in report["totals"]["by_label"] for v in (row["medium"], row["lora_name"])]
    return values + list(report["totals"]["evicted_by_medium"])


# --- the shared rule ---------------------------------------------------------

def test_a_long_label_value_is_kept_as_its_start_and_a_digest_of_the_whole():
    assert bounded_label("GPU") == "GPU"
    short = "é" * (LABEL_VALUE_MAX_BYTES // 2)  # 256 bytes exactly: kept whole
    assert bounded_label(short) == short
    long_a, long_b = "x" * 1_000_000 + "a", "x" * 1_000_000 + "b"
    label = bounded_label(long_a)
    assert label.startswith("x" * 64) and len(label.encode()) <= LABEL_VALUE_MAX_BYTES
    assert bounded_label(long_a) == label != bounded_label(long_b)  # the digest is of the whole
    emoji = bounded_label("😀" * 100)  # a character cut in two at the start's end is left out
    assert emoji.startswith("😀" * 16 + "...") and len(emoji.encode()) <= LABEL_VALUE_MAX_BYTES


def test_a_budget_folds_values_past_it_into_other_and_says_so_once(caplog):
    budget = LabelBudget("a source", max_values=3)
    with caplog.at_level(logging.WARNING, logger="kvwatch"):
        assert [budget.admit(v) for v in ("a", "b", "c", "a", "d", "e", "c")] == ["a", "b", "c", "a", OTHER, OTHER, "c"]
    assert budget.folded == 2 and budget.sentence and "a source" in budget.sentence
    assert [r.getMessage() for r in caplog.records] == [budget.sentence]


# --- the stream's strings ----------------------------------------------------------

def _long_named_batch(n: int, size: int) -> bytes:
    return wire.encode_batch(1.0, [
        wire.stored([n * 10 + 1], 16, medium=f"medium-{n}-" + "m" * size, lora_name=f"lora-{n}-" + "l" * size),
        wire.removed([n * 10 + 1], medium=f"medium-{n}-" + "m" * size)])


def test_long_media_and_lora_names_are_bounded_in_bytes_and_counted_against_one_budget(caplog):
    """BlockStored events naming a new 1 MB medium and LoRA name in every
    message: each a label value of /metrics and the API. They are kept as a
    start and a digest, at most MAX_LABELS of them, the rest under "other",
    said once."""
    source = KVEventSource("tcp://127.0.0.1:1")
    source.feed(0, wire.encode_batch(1.0, [wire.stored([1], 16, medium="CPU", lora_name="adapter-a")]), now=1.0)
    with caplog.at_level(logging.INFO, logger="kvwatch"):
        for seq in range(1, 100):
            source.feed(seq, _long_named_batch(seq, 1_000_000), now=1.0 + seq * 0.01)
    report = source.report(now=5.0)
    values = _label_values(report)
    assert all(len(v.encode()) <= LABEL_VALUE_MAX_BYTES for v in values)
    assert {"CPU", "adapter-a", OTHER} <= set(values)  # short names kept whole
    assert len({v for row in report["totals"]["by_label"] for v in (row["medium"], row["lora_name"])}) <= MAX_LABELS + 2
    assert report["totals"]["stored"] == 100 and report["totals"]["evicted"] == 99  # every block still counted
    assert report["intake"]["labels_folded"] > 0 and "counted under \"other\"" in report["labels_note"]
    assert len(json.dumps(report)) < 200_000  # 400 MB of names before
    assert sum("counted under" in r.getMessage() for r in caplog.records) == 1


def test_a_capture_of_long_stream_strings_replays_bounded(fixtures_dir, tmp_path):
    from kvwatch.capture.bundle import Capture, CaptureWriter
    from kvwatch.capture.record import manifest_for
    from kvwatch.capture.replay import replay
    from kvwatch.commands.diagnose import replay_settings
    from kvwatch.pipeline.monitor import Monitor

    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    out = tmp_path / "capture.tar.gz"
    writer = CaptureWriter(out, {**manifest_for("http://127.0.0.1:8000/metrics", 5.0, 60.0), "kv_events": "tcp://x:1"})
    t = 1_700_000_000.0
    for poll in range(3):
        for seq in range(poll * 30, poll * 30 + 30):
            assert writer.add_event(t + seq * 0.1, seq, _long_named_batch(seq, 100_000))
        writer.add(t + poll * 5.0 + 4.0, 0.01, page)
    writer.close(ended_at=t + 15, interrupted=False)
    assert out.stat().st_size < 1_000_000  # the names compress to nothing
    states = []
    captured = Capture(out)
    replay(captured, lambda source: Monitor(replay_settings(captured, None, "5m"), fetcher=source,
                                            clock=source.now), on_state=states.append)
    last = states[-1].kv_events
    assert last["totals"]["stored"] == 90
    assert all(len(v.encode()) <= LABEL_VALUE_MAX_BYTES for v in _label_values(last))
    assert len(json.dumps(last)) < 200_000


# --- sequence numbers ----------------------------------------------------------

def test_a_replay_answering_one_gap_thousands_of_times_is_read_once():
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    source = KVEventSource("tcp://127.0.0.1:1", replay=replay_endpoint)
    batches = rotation(prefixes=12, blocks=15, cache=100, rounds=4)
    payloads = [wire.encode_batch(1.0, events) for events in batches]
    for seq, payload in enumerate(payloads):
        if seq != 20:  # lost on the way
            source.feed(seq, payload, now=1.0 + seq * 0.01)
    assert source.missed == 1 and list(source._gaps) == [(20, 20)]
    source._context = zmq.Context()
    router = source._context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)
    router.bind(replay_endpoint)

    def answer() -> None:
        if router.poll(5000):
            client, _, start = router.recv_multipart()
            for _ in range(5_000):
                router.send_multipart([client, b"", start, payloads[20]])
            router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    replier = threading.Thread(target=answer)
    replier.start()
    try:
        source._replay_gap(zmq, 20, 20)
    finally:
        replier.join(10)
        router.close(0)
        source._context.term()
    while source._queue:
        source.account(source._queue.popleft(), 2.0)
    stored = sum(len(e.block_hashes) for events in batches for e in events if isinstance(e, wire._WStored))
    report = source.report(now=3.0)
    assert source.recovered == 1 and report["intake"]["missed"] == 0
    # Exported as counters that never go back: found missing 1, recovered 1 (what stays lost: 0).
    assert report["intake"]["gaps"] == 1
    # Each announced block counted once, as new work or as a hit: the lost message held an eviction, so
    # until the replay the ledger held those blocks cached and their next store read as reused.
    assert report["totals"]["stored"] + report["totals"]["reused"] == stored
    assert report["window"]["stored_again_ratio"] < 1.0


def test_impossible_sequence_jumps_are_another_publisher_not_lost_messages():
    source = KVEventSource("tcp://127.0.0.1:1")
    payload = wire.encode_batch(1.0, [wire.stored([1], 16)])
    t = 1000.0
    for seq in range(10):
        source.feed(seq, payload, now=t + seq * 0.001)
    source.feed(2 ** 62, payload, now=t + 0.011)  # one message numbered 2^62
    assert source.missed == 0 and source.restarts == 1
    # Two publishers on one endpoint, taking turns a millisecond apart.
    t += 1.0
    for n in range(1_000):
        source.feed(10 + n, payload, now=t + n * 0.002)
        source.feed(1_970_000 + n, payload, now=t + n * 0.002 + 0.001)
    source.feed(1_970_000 + 1_000 + 4, payload, now=t + 2.1)  # a real gap of 4 still counts
    report = source.report(now=t + 3)
    assert report["intake"]["missed"] == 4 and report["window"]["missed"] == 4
    changes = source.take_changes()
    assert len(changes) == 1 and "a second publisher" in changes[0][2]  # said once
    assert report["intake"]["jumps"] >= 1000 and report["intake"]["restarts"] >= 2000


def test_a_negative_sequence_leaves_the_replay_thread_alive():
    endpoint, replay_endpoint = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    source = KVEventSource(endpoint, replay=replay_endpoint)
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(replay_endpoint)
    source.start()
    try:
        pub = _publisher(ctx, endpoint)
        frame = lambda seq: [b"kv", seq.to_bytes(8, "big", signed=True), wire.encode_batch(1.0, [])]
        while source.messages == 0:  # the subscription reaches the publisher
            pub.send_multipart(frame(-5))
            _wait(lambda: source.messages > 0, 0.1)
        pub.send_multipart(frame(-5))
        pub.send_multipart(frame(3))  # a "gap" from -4 on
        pub.send_multipart(frame(10))  # a real one: 4 to 9
        assert _wait(lambda: source.messages >= 3)
        asked = []
        while router.poll(3000):
            asked.append(int.from_bytes(router.recv_multipart()[2], "big", signed=True))
            if 4 in asked:
                break
        assert 4 in asked and all(first >= 0 for first in asked)
        assert all(t.is_alive() for t in source._threads)
        pub.close(0)
    finally:
        router.close(0)
        source.stop()
        ctx.term()


# --- malformed messages and the log ------------------------------------------------

def test_each_malformed_kind_is_logged_once_a_minute_without_a_traceback(caplog):
    source = KVEventSource("tcp://127.0.0.1:1")
    # A stored event whose token ids (never decoded, but skipped) nest 1,000 deep: 1 KB.
    nested = b"\x92\xcb" + bytes(8) + b"\x91\x94\xabBlockStored\x90\xc0" + b"\x91" * 1000 + b"\x00"
    clock = [0.0]
    source._malformed_log.clock = lambda: clock[0]
    with caplog.at_level(logging.DEBUG, logger="kvwatch"):
        for seq in range(200):
            source.feed(seq, nested if seq % 2 else b"\xc1" * (seq + 1), now=1.0)
        assert source.malformed == 200
        assert len(caplog.records) == 2 and not any(r.exc_info for r in caplog.records)
        clock[0] += 61  # a minute later each kind is said again
        source.feed(200, nested, now=2.0)
        assert len(caplog.records) == 3
    assert "nested deeper" in source.report(now=3.0)["last_malformed"]


# --- ipc:// endpoints ------------------------------------------------------------------

def test_an_ipc_endpoint_naming_a_file_that_is_not_a_socket_is_refused(tmp_path, capsys):
    from kvwatch.cli import main
    from kvwatch.settings import SettingsError, load_settings

    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    with pytest.raises(SettingsError, match="is not a socket"):
        load_settings(overrides={"kv_events": f"ipc://{precious}"}, environ={})
    assert main(["serve", "--target", "http://127.0.0.1:9/metrics", "--kv-events", f"ipc://{precious}"]) == 2
    assert "precious.txt, which exists and is not a socket" in capsys.readouterr().err
    source = KVEventSource(f"ipc://{precious}")  # a file that appeared after the settings were read
    source.start()
    try:
        assert "is not a socket" in (source.listen_error or "")
    finally:
        source.stop()
    assert precious.read_text() == "keep me"
    fresh = tmp_path / "events.sock"  # a path that does not exist is bound as before
    source = KVEventSource(f"ipc://{fresh}")
    source.start()
    try:
        assert source.listen_error is None
    finally:
        source.stop()


# --- captures ---------------------------------------------------------------------------

def test_one_future_stamped_record_in_a_capture_hides_nothing_after_it(fixtures_dir, tmp_path):
    from kvwatch.capture.bundle import Capture, CaptureWriter
    from kvwatch.capture.record import manifest_for
    from kvwatch.capture.replay import replay
    from kvwatch.commands.diagnose import replay_settings
    from kvwatch.pipeline.monitor import Monitor

    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    out = tmp_path / "capture"
    writer = CaptureWriter(out, {**manifest_for("http://127.0.0.1:8000/metrics", 5.0, 60.0), "kv_events": "tcp://x:1"})
    batches = rotation(prefixes=12, blocks=15, cache=100, rounds=4)
    t = 1_700_000_000.0
    for poll in range(6):
        for seq in range(poll * 8, poll * 8 + 8):
            at = t + 1e9 if seq == 3 else t + seq * 0.5  # one record stamped 30 years ahead
            assert writer.add_event(at, seq, wire.encode_batch(t, batches[seq]))
        writer.add(t + poll * 5.0 + 4.0, 0.01, page)
    writer.close(ended_at=t + 30, interrupted=False)
    captured = Capture(out)
    states = []
    replay(captured, lambda source: Monitor(replay_settings(captured, None, "5m"), fetcher=source,
                                            clock=source.now), on_state=states.append)
    last = states[-1].kv_events
    assert last["totals"]["stored"] == 720 and last["totals"]["stored_again"] == 540
    assert last["intake"]["missed"] == 0 and last["intake"]["restarts"] == 0


def test_kvwatch_diagnose_says_the_fold_once_and_prints_no_long_name(fixtures_dir):
    import io

    from kvwatch.commands.diagnose import print_report
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings
    from kvwatch.sidecar.report import diagnosis_json, signals_json
    from pageserver import Answer, PageServer

    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(page), Answer(page)]) as server:
        settings = load_settings(overrides={"target": server.url, "kv_events": "tcp://127.0.0.1:1"}, environ={})
        monitor = Monitor(settings)
        monitor.poll_once()
        for seq in range(100):
            monitor.kv_events.feed(seq, _long_named_batch(seq, 100_000), now=monitor.clock())
        state = monitor.poll_once()
    out = io.StringIO()
    print_report(out, signals_json(state, settings), diagnosis_json(state, settings), 2, state)
    text = out.getvalue()
    assert text.count('every new one is counted under "other"') == 1 and "m" * 1000 not in text
    assert len(json.dumps(diagnosis_json(state, settings), default=str)) < 500_000
