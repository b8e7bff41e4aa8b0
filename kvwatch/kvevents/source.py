"""The engine's KV-cache event stream as a source beside its page
(`--kv-events tcp://127.0.0.1:5557`).

vLLM's publisher connects to any endpoint that is not a wildcard, so by
default kvwatch **binds** a SUB socket there and the engine connects to it
(same pod); with a publisher that binds a wildcard (`tcp://*:5557`),
`--kv-events-connect` makes kvwatch connect to it instead.

Two threads, both bounded:
- the receiver reads messages (ZMQ refuses one over the byte cap, and keeps
  at most RCVHWM messages itself), checks each message's sequence number
  (a jump forward is a gap: messages the engine's PUB socket dropped or the
  network lost, as many as a publisher could have sent since the last one;
  a longer jump, or one back, is a publisher starting over) and hands the
  payload to a queue bounded in messages and in bytes; a message that does
  not fit is dropped and counted, so a flood costs counts, never memory;
- the accountant decodes (kvwatch/kvevents/wire.py) and accounts
  (kvwatch/kvevents/ledger.py) what the queue holds.

The poll loop calls `report()` once per poll: the window's counts, rates and
sizing curve from checkpoints of the ledger's totals (one per poll, as the
page's window keeps snapshots). Tests and replays call `feed()`, the same
accounting without sockets.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from typing import Any, Callable

from kvwatch.kvevents.endpoint import ipc_path_problem
from kvwatch.kvevents.ledger import (DEFAULT_TABLE_BYTES, DISTANCE_BUCKETS, ENTRY_BYTES, RETURN_BOUNDS, Ledger,
                                     Totals, bucket_upper, curve)
from kvwatch.kvevents.wire import CLEARED, REMOVED, STORED, Decoder, Malformed
from kvwatch.stream_report import (KVEventsChange, KVEventsIntake, KVEventsLabelRow, KVEventsPart, KVEventsPause,
                                      KVEventsReport, KVEventsTable, KVEventsTierRow, KVEventsTotals, KVEventsWindow)
from kvwatch.present import Throttle

log = logging.getLogger("kvwatch")

# One engine step's batch: a step computes at most max_num_batched_tokens
# tokens (8k by default, 64k at the most), each at most 5 bytes of token id
# plus its block's hash: well under 1 MiB; 4 MiB leaves room.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
DEFAULT_QUEUE_BYTES = 16 * 1024 * 1024
QUEUE_MESSAGES = 4096
# ZMQ's own receive queue, in messages whatever their size: with the byte
# cap, at most 8 x 4 MiB waits there (the receiver drains it into the
# bounded queue as fast as it reads; past it the engine's PUB socket drops,
# which kvwatch sees as sequence gaps).
RCVHWM = 8
# Everything the intake may hold at once at its default bounds: kvwatch's
# queue, ZMQ's queue and the message being read (the ledger's table apart).
INTAKE_HELD_BYTES = DEFAULT_QUEUE_BYTES + (RCVHWM + 1) * DEFAULT_MAX_MESSAGE_BYTES
# A stored event says how many blocks it carries; more than this in one event
# is no engine's step (a 1 M-token prompt at 16 tokens a block is 62,500).
MAX_EVENT_BLOCKS = 1 << 20
MAX_CHANGES = 50
MAX_CHECKPOINTS = 2_000
# The replay socket (vLLM's replay_endpoint): gaps waiting to be asked for,
# and what one replay may read and take.
MAX_PENDING_GAPS = 16
# Pauses in the engine's stores (no BlockStored for this long or longer), the last
# MAX_PAUSES kept (they span 21 min or more, past hit_baseline_max_age_seconds):
# a load that began after one is a new load (diagnose/stream.py).
PAUSE_MIN_SECONDS = 5.0
MAX_PAUSES = 256
REPLAY_MAX_MESSAGES = 10_000
REPLAY_DEADLINE_SECONDS = 2.0
REPLAY_PAUSE_SECONDS = 0.5
# Extra cache the sizing curve is read at, as multiples of the most blocks
# seen cached at once (the engine's cache, as far as the stream shows it).
CURVE_FACTORS = (0.125, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
# The most messages a publisher could have sent: vLLM publishes one batch per
# engine step (a millisecond at the least), so 10,000 a second since the last
# message, and a burst of SEQUENCE_SLACK; a jump forward past that is no loss
# but a publisher that started over elsewhere, or a second one on the endpoint.
MAX_MESSAGES_PER_SECOND = 10_000
# Who evicts whom (routing/tenants.py's EvictionLedger, tenants by the stored
# blocks' LoRA adapter): its two block tables bounded in bytes, an entry (an
# ordered dict's slot, the hash and the names it points to) about 200 bytes.
EVICTION_TABLE_BYTES = 32 * 1024 * 1024
EVICTION_ENTRY_BYTES = 200
# Its (evictor, victim) counts: at most this many pairs, copied at most
# EVICTION_MARKS times over the window (a window's start is then up to
# 1/EVICTION_MARKS of the window early): a few MB at the most.
EVICTION_PAIRS = 1_000
EVICTION_MARKS = 16
BASE_TENANT = "(base)"
SEQUENCE_SLACK = 10_000
# A restart or an impossible jump is filed as a change at most once a minute
# (two publishers on one endpoint jump on every message); each is counted.
SEQUENCE_NOTE_SECONDS = 60.0
# The log says each kind of malformed message (its sentence, numbers aside)
# at most once a minute, and remembers at most this many kinds.
MALFORMED_LOG_SECONDS = 60.0
MAX_MALFORMED_KINDS = 64
_NUMBERS = re.compile(r"[0-9][0-9,]*")


class Replayed(bytes):
    """A payload the replay socket answered: accounted after the messages
    that followed it, so a block it stores may be cached already by then;
    that is no hit of full report mode, and the ledger is told so."""


class KVEventSource:
    def __init__(self, endpoint: str, *, connect: bool = False, topic: str = "",
                 window_seconds: float = 300.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES, table_bytes: int = DEFAULT_TABLE_BYTES,
                 clock: Callable[[], float] = time.time,
                 tap: Callable[[float, int, bytes], Any] | None = None, replay: str | None = None):
        self.endpoint = endpoint
        # The engine's replay socket (vLLM's replay_endpoint, a ROUTER it
        # binds): kvwatch connects and asks for the messages a gap lost.
        self.replay_endpoint = replay
        self._gaps: deque[tuple[int, int]] = deque(maxlen=MAX_PENDING_GAPS)
        self._gap_wake = threading.Event()
        self.replay_requests = 0
        self.recovered = 0
        # Called with (time, sequence, payload) of each well-formed message as
        # it is received (kvwatch capture --kv-events records them).
        self.tap = tap
        self.connect = connect
        self.topic = topic
        self.window_seconds = window_seconds
        self.max_message_bytes = max_message_bytes
        self.queue_bytes = queue_bytes
        self.clock = clock
        self.ledger = Ledger(table_bytes)
        # Imported here: kvwatch.routing's package imports the diagnosis, which imports this module.
        from kvwatch.routing.tenants import EvictionLedger

        self.evictions = EvictionLedger(max_blocks=EVICTION_TABLE_BYTES // (2 * EVICTION_ENTRY_BYTES),
                                        max_pairs=EVICTION_PAIRS)
        # (time, the eviction ledger's snapshot), one each window / EVICTION_MARKS at the most.
        self._eviction_checkpoints: deque[tuple[float, tuple]] = deque(maxlen=EVICTION_MARKS + 2)
        self.decoder = Decoder()
        self._lock = threading.Lock()  # the ledger and the counters below
        self._queue: deque[bytes] = deque()
        self._queued_bytes = 0
        self.accounting = False  # a batch off the queue, not yet in the ledger (queue empty and False: all in it)
        self._wake = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._socket: Any = None  # a zmq socket, its monitor and context once started (zmq is imported then)
        self._monitor: Any = None
        self._context: Any = None
        # Publishers whose ZMQ handshake with kvwatch succeeded (since start,
        # and connected now): a stream no publisher ever reached is told from
        # an idle engine's, which sends nothing either.
        self.connections = 0
        self.publishers = 0
        self.last_store_time: float | None = None
        self._pauses: deque[tuple[float, float]] = deque(maxlen=MAX_PAUSES)  # (last store, next store)
        self.started = False
        self.listen_error: str | None = None
        # Intake (the receiver's) and decoding (the accountant's) counts.
        self.messages = 0
        self.bytes = 0
        self.dropped = 0  # kvwatch's queue was full
        self.dropped_bytes = 0
        self.missed = 0  # sequence numbers that never arrived
        self.restarts = 0  # the sequence went back: the publisher started over
        self.malformed = 0
        self.skipped_events = 0
        self.absurd_events = 0
        self.batches = 0
        self.last_malformed: str | None = None
        self.last_message_time: float | None = None
        self.first_message_time: float | None = None
        self.block_size: int | None = None
        self.ranks: set[int] = set()
        self._expected: int | None = None
        self._sequence_time: float | None = None  # when the last sequence number was read
        self._sequence_noted: float | None = None  # when a restart or jump was last filed
        self.jumps = 0  # impossible jumps forward (counted in restarts too)
        self._malformed_log = Throttle(MALFORMED_LOG_SECONDS, MAX_MALFORMED_KINDS)
        # (time, the ledger's totals, (missed, dropped, messages)) at each poll,
        # as long as the window and at most MAX_CHECKPOINTS (a few KB each: past
        # it the oldest goes and the window's `seconds` says what is covered).
        self._checkpoints: deque[tuple[float, Totals, tuple[int, int, int]]] = deque(maxlen=MAX_CHECKPOINTS)
        self.created: float | None = None  # the first report's time
        self._changes: deque[tuple[float, str, str]] = deque(maxlen=MAX_CHANGES)  # (time, kind, detail)
        self._pending: list[tuple[float, str, str]] = []

    # --- sockets and threads -------------------------------------------

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        try:
            import zmq
        except ImportError:  # pragma: no cover - pyzmq is a dependency
            self.listen_error = "pyzmq is not installed"
            return
        self._context = zmq.Context()
        sock = self._context.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            problem = None if self.connect or not self.endpoint.startswith("ipc://") else ipc_path_problem(self.endpoint)
            if problem:
                raise zmq.ZMQError(msg=problem)
            if self.connect:
                sock.connect(self.endpoint)
            else:
                sock.bind(self.endpoint)
        except zmq.ZMQError as exc:
            self.listen_error = (f"kvwatch cannot {'connect to' if self.connect else 'listen on'} {self.endpoint} "
                                 f"for KV-cache events ({exc.strerror})")
            log.warning("%s", self.listen_error)
            sock.close(0)
            return
        self._socket = sock
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        workers = [(self._receive, "kvwatch-kv-events-receive"), (self._account, "kvwatch-kv-events-account")]
        if self.replay_endpoint:
            workers.append((self._replayer, "kvwatch-kv-events-replay"))
        for target, name in workers:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        log.info("KV-cache events: %s %s", "connected to" if self.connect else "listening on", self.endpoint)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._gap_wake.set()
        with self._wake:
            self._wake.notify_all()
        for thread in self._threads:
            thread.join(timeout)
        if self._monitor is not None:
            self._socket.disable_monitor()
            self._monitor.close(0)
        if self._socket is not None:
            self._socket.close(0)
        if self._context is not None:
            self._context.term()

    def _receive(self) -> None:
        import zmq

        sock = self._socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ready = dict(poller.poll(200))
                if self._monitor in ready:
                    self._peer_event(zmq)
                if sock not in ready:
                    continue
                frames = sock.recv_multipart()
            except zmq.ZMQError:
                if self._stop.is_set():
                    return
                time.sleep(0.05)
                continue
            try:
                self.intake(frames, self.clock())
            except Exception:  # pragma: no cover - no message may stop the receiver
                with self._lock:
                    self._malformed("a message kvwatch could not read")

    def _peer_event(self, zmq) -> None:
        """A handshake or a disconnect on the socket (ZMQ's socket monitor)."""
        from zmq.utils.monitor import recv_monitor_message

        event = recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"]
        with self._lock:
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connections += 1
                self.publishers += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.publishers = max(0, self.publishers - 1)  # also a peer whose handshake failed

    def intake(self, frames: list[bytes], now: float) -> None:
        """One message from the socket: checked, counted, queued or dropped."""
        size = sum(len(f) for f in frames)
        with self._lock:
            self.messages += 1
            self.bytes += size
            self.last_message_time = now
            if self.first_message_time is None:
                self.first_message_time = now
            if len(frames) != 3 or len(frames[1]) != 8:
                self._malformed(f"a message of {len(frames)} frames, not topic, sequence and payload")
                return
            if size > self.max_message_bytes:
                self._malformed(f"a message of {size} bytes, over the cap of {self.max_message_bytes}")
                return
            seq = int.from_bytes(frames[1], "big", signed=True)
            self._sequence(seq, now)
        payload = frames[2]
        if self.tap is not None:
            try:
                self.tap(now, seq, payload)
            except Exception:  # pragma: no cover - a recorder's failure must not stop the stream
                log.exception("recording a KV-cache event message failed")
        self._enqueue(payload)

    def _enqueue(self, payload: bytes) -> bool:
        """Queues a message for the accountant, or drops and counts it when
        the intake is full (in messages or bytes); says whether it was queued."""
        with self._wake:
            if len(self._queue) >= QUEUE_MESSAGES or self._queued_bytes + len(payload) > self.queue_bytes:
                with self._lock:
                    self.dropped += 1
                    self.dropped_bytes += len(payload)
                return False
            self._queue.append(payload)
            self._queued_bytes += len(payload)
            self._wake.notify()
            return True

    def _sequence(self, seq: int, now: float) -> None:
        expected, since = self._expected, self._sequence_time
        self._expected, self._sequence_time = seq + 1, now
        if expected is None or seq == expected:
            return
        if seq < expected:
            self.restarts += 1
            self._note_sequence(now, f"the engine's event sequence started over (at {seq}, after {expected - 1}): "
                                     "its publisher restarted")
            return
        elapsed = max(0.0, now - since) if since is not None else 0.0
        if seq - expected > SEQUENCE_SLACK + MAX_MESSAGES_PER_SECOND * elapsed:
            self.restarts += 1
            self.jumps += 1
            self._note_sequence(now, f"the engine's event sequence jumped from {expected - 1} to {seq}, more than a "
                                     f"publisher sends in {elapsed:.1f} s: read as a publisher that started over or "
                                     f"a second publisher on {self.endpoint}, not as lost messages")
            return
        self.missed += seq - expected
        if self.replay_endpoint and expected >= 0:
            self._gaps.append((expected, seq - 1))
            self._gap_wake.set()

    def _note_sequence(self, now: float, sentence: str) -> None:
        noted = self._sequence_noted
        if noted is not None and 0 <= now - noted < SEQUENCE_NOTE_SECONDS:
            return
        self._sequence_noted = now
        self._change(now, "kv_events_restart", sentence)

    def _replayer(self) -> None:
        """Asks the engine's replay socket for each gap's messages, one gap
        at a time, at most REPLAY_MAX_MESSAGES of them within
        REPLAY_DEADLINE_SECONDS; what comes back goes through the same
        bounded queue (accounted after later messages: a return is counted
        as it is read, a distance may be off by the gap)."""
        import zmq

        while not self._stop.is_set():
            self._gap_wake.wait(1.0)
            self._gap_wake.clear()
            while self._gaps and not self._stop.is_set():
                try:
                    first, last = self._gaps.popleft()
                except IndexError:
                    break
                try:
                    self._replay_gap(zmq, first, last)
                except zmq.ZMQError as exc:
                    log.info("KV-cache events: replay from %s failed (%s)", self.replay_endpoint, exc.strerror)
                except Exception:  # pragma: no cover - no answer may stop the replayer
                    with self._lock:
                        self._malformed("a replay answer kvwatch could not read")
                time.sleep(REPLAY_PAUSE_SECONDS)  # a lossy link must not turn into a replay storm

    def _replay_gap(self, zmq, first: int, last: int) -> None:
        with self._lock:
            self.replay_requests += 1
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        sock.setsockopt(zmq.RCVHWM, 64)
        try:
            sock.connect(self.replay_endpoint)
            sock.send_multipart([b"", first.to_bytes(8, "big")])
            deadline = time.monotonic() + REPLAY_DEADLINE_SECONDS
            read = 0
            taken: set[int] = set()  # a replay answering a sequence again is read once
            while read < REPLAY_MAX_MESSAGES and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(int(left * 1000) + 1):
                    return
                frames = sock.recv_multipart()
                read += 1
                if len(frames) == 4:
                    frames = [frames[0], frames[2], frames[3]]  # TensorRT-LLM's replay sends the topic too
                if len(frames) != 3 or len(frames[1]) != 8:
                    with self._lock:
                        self._malformed(f"a replayed message of {len(frames)} frames, not delimiter, sequence and "
                                        "payload")
                    return
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq < 0:
                    return  # the end of the replay
                if seq < first or seq > last or seq in taken:
                    continue  # the replay sends everything from `first` on; only the gap is missing
                taken.add(seq)
                if not self._enqueue(Replayed(frames[2])):
                    continue
                with self._lock:
                    self.recovered += 1
                    self.missed = max(0, self.missed - 1)
        finally:
            sock.close(0)

    def _account(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                while not self._queue and not self._stop.is_set():
                    self._wake.wait(0.5)
                if self._stop.is_set():
                    return
                self.accounting = True  # before the queue empties, so that one of the two always says so
                payload = self._queue.popleft()
                self._queued_bytes -= len(payload)
            try:
                self.account(payload, self.clock())
            except Exception:  # pragma: no cover - no batch may stop the accountant
                with self._lock:
                    self._malformed("a batch kvwatch could not account")
            self.accounting = False

    # --- accounting (also what tests and replays call) -----------------

    def feed(self, seq: int, payload: bytes, now: float | None = None, topic: bytes = b"kv") -> None:
        """One message accounted at once, without sockets or queue."""
        now = self.clock() if now is None else now
        size = len(payload) + len(topic) + 8
        with self._lock:
            self.messages += 1
            self.bytes += size
            self.last_message_time = now
            if self.first_message_time is None:
                self.first_message_time = now
            if size > self.max_message_bytes:
                self._malformed(f"a message of {size} bytes, over the cap of {self.max_message_bytes}")
                return
            self._sequence(seq, now)
        self.account(payload, now)

    def account(self, payload: bytes, now: float) -> None:
        try:
            batch = self.decoder.decode(payload)
        except Malformed as exc:
            with self._lock:
                self._malformed(str(exc))
            return
        except Exception:  # pragma: no cover - a decoder bug must not stop the stream
            with self._lock:
                self._malformed("the payload could not be decoded")
            return
        ledger = self.ledger
        late = "NEW" if isinstance(payload, Replayed) else None
        with self._lock:
            self.batches += 1
            self.skipped_events += batch.skipped
            if batch.rank is not None and len(self.ranks) < 64:
                self.ranks.add(batch.rank)
            for event in batch.events:
                if len(event.hashes) > MAX_EVENT_BLOCKS:
                    self.absurd_events += 1
                    self._malformed(f"a {event.kind} event of {len(event.hashes)} blocks, more than any engine "
                                    f"step holds ({MAX_EVENT_BLOCKS})")
                    continue
                if event.kind == STORED:
                    self._stored_at(now)
                    if event.block_size is not None and 0 < event.block_size <= 1 << 20:
                        self.block_size = event.block_size
                    ledger.stored(event.hashes, now, event.medium, event.lora, event.origin or late, event.locality)
                    if event.medium in (None, "GPU") and not late and event.origin != "REUSED":
                        self.evictions.stored(event.hashes, event.lora or BASE_TENANT)
                elif event.kind == REMOVED:
                    ledger.removed(event.hashes, now, event.medium, event.locality)
                    if event.medium in (None, "GPU"):
                        self.evictions.removed(event.hashes)
                elif event.kind == CLEARED:
                    ledger.clear()
                    self.evictions.clear()
                    self._change(now, "kv_cache_cleared",
                                 "the engine cleared its prefix cache (AllBlocksCleared): every cached block is gone "
                                 "and reuse starts over")

    def _stored_at(self, now: float) -> None:
        last = self.last_store_time
        if last is not None and now - last >= PAUSE_MIN_SECONDS:
            self._pauses.append((last, now))
        if last is None or now > last:
            self.last_store_time = now

    def _malformed(self, sentence: str) -> None:
        self.malformed += 1
        self.last_malformed = sentence
        if self._malformed_log.ready(_NUMBERS.sub("N", sentence)):
            log.info("KV-cache events: %s", sentence)

    def _change(self, now: float, kind: str, detail: str) -> None:
        self._changes.append((now, kind, detail))
        if len(self._pending) < MAX_CHANGES:
            self._pending.append((now, kind, detail))

    def take_changes(self) -> list[tuple[float, str, str]]:
        """The changes the stream showed since the last call (the poll loop
        files them with the page's changes)."""
        with self._lock:
            pending, self._pending = self._pending, []
        return pending

    # --- the window ------------------------------------------------------

    def _intake(self) -> KVEventsIntake:
        """The intake's and the decoder's counts (under the lock)."""
        return KVEventsIntake(messages=self.messages, bytes=self.bytes, batches=self.batches,
                              dropped=self.dropped, dropped_bytes=self.dropped_bytes, missed=self.missed,
                              restarts=self.restarts, malformed=self.malformed, absurd_events=self.absurd_events,
                              replay_requests=self.replay_requests, recovered=self.recovered,
                              gaps=self.missed + self.recovered,  # found missing, ever (a counter: never goes back)
                              skipped_events=self.skipped_events, queued=len(self._queue),
                              queued_bytes=self._queued_bytes, jumps=self.jumps,
                              labels_folded=self.ledger.labels.folded, connections=self.connections,
                              publishers=self.publishers)

    def report(self, now: float | None = None, bytes_per_block: float | None = None,
               checkpoint: bool = True, recent_seconds: float | None = None) -> KVEventsReport:
        """The stream's state for one poll (it records the poll's checkpoint).
        `recent_seconds`: the recent part of the window the diagnosis judges
        (hit_recent_seconds; a third of the window by default), also counted
        apart from the part before it."""
        now = self.clock() if now is None else now
        if self.created is None:
            self.created = now
        with self._lock:
            totals = self.ledger.totals.copy()
            ledger = self.ledger
            table = KVEventsTable(entries=ledger.entries(), capacity=ledger.capacity,
                                  bytes=ledger.entries() * ENTRY_BYTES, sampling_rate=ledger.rate,
                                  forgotten=ledger.forgotten, horizon_blocks=ledger.horizon)
            cached_peak = ledger.peak_cached
            intake = self._intake()
            labels_note = ledger.labels.sentence
            last = self.last_message_time
            first = self.first_message_time
            last_malformed = self.last_malformed
            changes = [KVEventsChange(time=t, kind=k, detail=d) for t, k, d in self._changes
                       if t >= now - self.window_seconds]
            ranks, pauses = sorted(self.ranks), list(self._pauses)
            flow = (self.missed, self.dropped, self.messages)
        checkpoints = self._checkpoints
        if not checkpoints:
            # The stream's start: nothing counted before it.
            checkpoints.append((min(now, first) if first is not None else now, Totals(), (0, 0, 0)))
        if checkpoint:
            checkpoints.append((now, totals, flow))
            horizon = now - self.window_seconds
            while len(checkpoints) > 2 and checkpoints[1][0] <= horizon:
                checkpoints.popleft()
        start_time, start, start_flow = checkpoints[0]
        seconds = now - start_time
        window = _window(start, totals, seconds)
        window["missed"], window["dropped"] = flow[0] - start_flow[0], flow[1] - start_flow[1]
        window["messages"] = flow[2] - start_flow[2]
        recent_seconds = self.window_seconds / 3 if recent_seconds is None else recent_seconds
        split_time, split = start_time, start
        for at, part, _ in checkpoints:
            if at > now - recent_seconds:
                break
            split_time, split = at, part
        recent = _part(split, totals, now - split_time)
        earlier = _part(start, split, split_time - start_time)
        if self.listen_error:
            up, reason, detail = False, "listen", self.listen_error
        elif last is None:
            up, reason, detail = False, "no_events", (f"no KV-cache event has reached kvwatch at {self.endpoint} "
                                                      "yet (is the engine started with --kv-events-config?)")
        else:
            up, reason, detail = True, None, ""
        block_size = self.block_size
        sizing = sizing_curve(window, cached_peak, block_size, bytes_per_block)
        return KVEventsReport(
            endpoint=self.endpoint,
            mode="connect" if self.connect else "bind",
            up=up,
            reason=reason,
            detail=detail,
            last_message_age_seconds=None if last is None else max(0.0, now - last),
            listening_seconds=None if first is None else max(0.0, now - first),
            last_malformed=last_malformed,
            labels_note=labels_note,
            intake=intake,
            table=table,
            totals=_totals_dict(totals),
            window=window,
            recent=recent,
            earlier=earlier,
            configured_seconds=max(0.0, now - self.created),
            block_size=block_size,
            cached_blocks_peak=cached_peak,
            ranks=ranks,
            sizing=sizing,
            changes=changes, pause=_last_pause(pauses, recent_seconds, now),
            evictor=self._evictor(now, checkpoint), time=now,
        )

    def _evictor(self, now: float, checkpoint: bool) -> dict[str, Any] | None:
        """Over the window: the tenant (LoRA adapter) whose stores evicted other
        tenants' reusable blocks most, and its share (EvictionLedger.finding)."""
        marks = self._eviction_checkpoints
        if not marks:
            marks.append((now, ({}, {})))
        if checkpoint and now - marks[-1][0] >= self.window_seconds / EVICTION_MARKS:
            with self._lock:
                marks.append((now, self.evictions.snapshot()))
            while len(marks) > 2 and marks[1][0] <= now - self.window_seconds:
                marks.popleft()
        with self._lock:
            return self.evictions.finding(since=marks[0][1])


def _last_pause(pauses: list[tuple[float, float]], shortest: float, now: float) -> KVEventsPause | None:
    """The latest pause in the engine's stores of `shortest` seconds or more
    (the judged part): its length and how long ago stores resumed."""
    for last, resumed in reversed(pauses):
        if resumed - last >= shortest:
            return KVEventsPause(seconds=resumed - last, ended_seconds_ago=max(0.0, now - resumed))
    return None


def _totals_dict(totals: Totals) -> KVEventsTotals:
    return KVEventsTotals(
        stored=totals.stored, evicted=totals.evicted, stored_again=totals.again,
        return_seconds_sum=totals.again_seconds, cleared=totals.cleared,
        reused=totals.reused,
        by_label=[KVEventsLabelRow(medium=m, lora_name=lora, stored=row[0], stored_again=row[1], reused=row[2])
                  for (m, lora), row in sorted(totals.labels.items())],
        evicted_by_medium=dict(sorted(totals.evicted_by_medium.items())),
        tiers=_tier_rows(totals.tiers, {}, totals.removing),
        return_buckets=list(zip(RETURN_BOUNDS, _cumulative(totals.returns))),
    )


def _cumulative(values: list[float]) -> list[float]:
    out, running = [], 0.0
    for value in values:
        running += value
        out.append(running)
    return out


def _window(start: Totals, end: Totals, seconds: float) -> KVEventsWindow:
    stored = end.stored - start.stored
    evicted = end.evicted - start.evicted
    again = max(0.0, end.again - start.again)
    reused = max(0.0, end.reused - start.reused)
    again_seconds = max(0.0, end.again_seconds - start.again_seconds)
    restarted = end.stored < start.stored  # not possible today (one ledger per source); kept honest
    distance = [max(0.0, b - a) for a, b in zip(start.distance, end.distance)]
    returns = [max(0.0, b - a) for a, b in zip(start.returns, end.returns)]
    per = (lambda n: n / seconds) if seconds > 0 else (lambda n: None)
    return KVEventsWindow(
        seconds=seconds,
        stored=stored, evicted=evicted, stored_again=again, cleared=end.cleared - start.cleared,
        stored_per_second=per(stored), evicted_per_second=per(evicted),
        stored_again_per_second=per(again),
        # Hits the stream announced (full report mode): not new work, beside the page's prefix hits.
        reused=reused, reused_per_second=per(reused),
        stored_again_ratio=(min(1.0, again / stored) if stored > 0 else None),
        return_seconds_mean=again_seconds / again if again > 0 else None,
        return_seconds_median=_median(returns),
        distance=distance,
        restarted=restarted,
        by_label=[_label_delta(m, lora, row, start.labels.get((m, lora), _NO_ROW))
                  for (m, lora), row in sorted(end.labels.items())],
        tiers=_tier_rows(end.tiers, start.tiers, end.removing),
        tier_distance={name: [max(0.0, b - a) for a, b in zip(start.tier_distance.get(name, _NO_DISTANCE), row)]
                       for name, row in sorted(end.tier_distance.items())},
    )


_NO_ROW = (0.0, 0.0, 0.0)
_NO_DISTANCE = (0.0,) * DISTANCE_BUCKETS


def _tier_rows(end: dict, start: dict, removing: set) -> list[KVEventsTierRow]:
    """Stored, evicted and returned per (medium, locality) since `start`; a
    lower tier that never sent a BlockRemoved is store-only (its returned an
    upper bound: what it let go is not said)."""
    return [KVEventsTierRow(medium=medium, locality=locality,
                            stored=row[0] - start.get((medium, locality), _NO_ROW)[0],
                            evicted=row[1] - start.get((medium, locality), _NO_ROW)[1],
                            returned=row[2] - start.get((medium, locality), _NO_ROW)[2],
                            store_only=medium != "GPU" and medium not in removing)
            for (medium, locality), row in sorted(end.items())]


def _label_delta(medium: str, lora: str, end, start) -> KVEventsLabelRow:
    return KVEventsLabelRow(medium=medium, lora_name=lora, stored=end[0] - start[0], stored_again=end[1] - start[1],
                            reused=end[2] - start[2])


def _part(start: Totals, end: Totals, seconds: float) -> KVEventsPart:
    stored = end.stored - start.stored
    again = max(0.0, end.again - start.again)
    return KVEventsPart(seconds=seconds, stored=stored, evicted=end.evicted - start.evicted, stored_again=again,
                        stored_again_ratio=min(1.0, again / stored) if stored > 0 else None,
                        reused=max(0.0, end.reused - start.reused))


def extra_for_share(distance: list[float], again: float, share: float) -> int | None:
    """The fewest extra blocks that keep `share` of the returns (whole
    buckets), None without returns."""
    if again <= 0:
        return None
    kept = 0.0
    for index, count in enumerate(distance):
        kept += count
        if kept >= share * again - 1e-9:
            return bucket_upper(index) + 1
    return None


def _median(buckets: list[float]) -> float | None:
    total = sum(buckets)
    if total <= 0:
        return None
    running = 0.0
    for bound, count in zip(RETURN_BOUNDS, buckets):
        running += count
        if running >= total / 2:
            return bound if bound != float("inf") else RETURN_BOUNDS[-2]
    return None  # pragma: no cover


def sizing_curve(window: KVEventsWindow, cached_peak: float, block_size: int | None,
                 bytes_per_block: float | None, hits: float | None = None,
                 queries: float | None = None) -> dict[str, Any]:
    """What more cache would have saved over the window: for each extra
    size, the blocks stored again that it would have kept, as a share of the
    blocks stored (recomputation avoided). An estimate (first order, whole
    distance buckets): see kvwatch/kvevents/ledger.py."""
    stored = window["stored"]
    again = window["stored_again"]
    base = max(1, int(round(cached_peak)))
    factors = [(f, max(1, int(round(base * f)))) for f in CURVE_FACTORS]
    rows = []
    kept_at = curve(window["distance"], again, [e for _, e in factors], stored=stored)
    for (factor, _), (extra, kept) in zip(factors, kept_at):
        rows.append({
            "extra_cache": factor,
            "extra_blocks": extra,
            "extra_bytes": None if bytes_per_block is None else extra * bytes_per_block,
            "extra_tokens": None if not block_size else extra * block_size,
            "blocks_kept": kept,
            "recomputation_avoided_ratio": (kept / again) if again > 0 else None,
            "stored_blocks_avoided_ratio": (kept / stored) if stored > 0 else None,
            # The page's prefix hit ratio over the window, with the kept blocks' tokens as hits.
            "hit_ratio": (min(1.0, (hits + kept * block_size) / queries)
                          if hits is not None and queries and block_size else None),
        })
    # The curve per lower tier: the GPU cache that would have kept the returns that tier served.
    tiers = {name: [{"extra_cache": factor, "extra_blocks": extra, "blocks_kept": kept,
                     "tier_returns_avoided_ratio": kept / sum(row) if sum(row) > 0 else None}
                    for (factor, _), (extra, kept) in zip(factors, curve(row, sum(row), [e for _, e in factors]))]
             for name, row in (window.get("tier_distance") or {}).items()}
    largest = max((bucket_upper(i) for i, c in enumerate(window["distance"]) if c), default=None)
    return {
        "cache_blocks": cached_peak,
        "hit_ratio_now": (min(1.0, hits / queries) if hits is not None and queries else None),
        "points": rows,
        "tiers": tiers,
        "largest_distance_blocks": largest,
        "note": ("an estimate: a block stored again after its eviction would have stayed cached in a cache larger "
                 "by more than its distance (blocks stored between its eviction and its return); first order, "
                 "it ignores what the kept blocks change afterwards"),
    }


def public_report(report: KVEventsReport | None) -> dict[str, Any] | None:
    """The report as the API serves it: the distance histograms (256 buckets
    each) left out; the sizing curve is what they say."""
    if report is None:
        return None
    out = dict(report)
    out["window"] = {k: v for k, v in report.get("window", {}).items() if k != "distance"}
    totals = dict(report.get("totals") or {})
    out["totals"] = totals
    return out
