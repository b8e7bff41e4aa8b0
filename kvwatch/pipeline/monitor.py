"""The poll loop and the state it publishes.

One poll per interval, whatever scrapes kvwatch: fetch -> adapt -> window ->
signals -> diagnosis. Each poll ends by swapping in one new immutable State;
readers (the exporter, the API, the status page) take a reference to the
current State and never see a half-built one, and never wait on the engine.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from kvwatch import diagnose as diagnosis
from kvwatch.diagnose import Change
from kvwatch.diagnose.now import NowJudgment
from kvwatch.diagnose.vocabulary import finding_key
from kvwatch.engines import AUTO, ENGINES, make_adapter, recognize
from kvwatch.engines.base import EngineAdapter
from kvwatch.engines.coverage import dark_signals
from kvwatch.engines.plausible import window_faults
from kvwatch.kvevents.join import silence, with_page
from kvwatch.kvevents.source import KVEventSource
from kvwatch.pipeline.demo import DemoSource
from kvwatch.pipeline.lmcache import LMCacheSource
from kvwatch.pipeline.reports import BusyReport, DemoStatus, LMCacheReport, ReplayProgress, UpstreamReport
from kvwatch.stream_report import KVEventsReport
from kvwatch.pipeline.router import RouterSource
from kvwatch.pipeline.upstream import UpstreamSource
from kvwatch.labels import LABEL_VALUE_MAX_BYTES
from kvwatch.present import public_host, public_url
from kvwatch.scrape import Fetcher, FetchResult, PageSource, failure_sentence
from kvwatch.settings import Settings
from kvwatch.signals import Evaluated, evaluate_window
from kvwatch.signals.worth import with_worth
from kvwatch.snapshot import Snapshot
from kvwatch.window import Window

log = logging.getLogger("kvwatch")

MAX_EVENTS = 100
# A page answered later than this share of the poll interval is stamped at
# the time it was answered (see Monitor._ingest).
LATE_FRACTION = 0.1
MAX_LORA_NAMES = 10_000
# The adapter names remembered, in bytes as lora_name_bytes counts them: a
# count alone let 61 polls of one 8 MiB adapter name each hold 490 MB. A name
# longer than LORA_NAME_MAX_CHARS (bytes: kvwatch.labels' one rule for label
# values) is remembered by its start and a digest of it.
MAX_LORA_BYTES = 1024 * 1024
LORA_NAME_MAX_CHARS = LABEL_VALUE_MAX_BYTES
LORA_ENTRY_BYTES = 160  # a dict slot, the float and the str header (sys.getsizeof, CPython 3.11)

# A poll allocates a few hundred thousand short-lived objects at 64 engines
# (samples, label tuples, snapshots), almost none in reference cycles, so
# reference counting frees them. At CPython's default threshold (700) the
# cyclic collector ran about 70 times per poll there, each pass re-scanning
# the window's live objects, and took half the poll's CPU (make bench).
GC_GEN0_THRESHOLD = 50_000


def tune_garbage_collector() -> None:
    """For the process whose work is polling (kvwatch serve):
    what start-up built (modules, the app) is never garbage, so the collector
    stops scanning it, and it runs after 50,000 allocations instead of 700."""
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, older, oldest)


@dataclass(frozen=True)
class State:
    up: bool = False
    reason: str | None = "not_polled_yet"
    # One human sentence for the failure, for people (page, JSON, /readyz, CLI);
    # never an exception's text or what the engine sent (that is only logged).
    detail: str = "kvwatch has not polled the engine yet"
    polls: int = 0
    errors_by_reason: dict[str, int] = field(default_factory=dict)
    parse_errors: int = 0
    last_parse_errors: tuple[str, ...] = ()
    dropped_series: int = 0
    last_poll_time: float | None = None
    last_success_time: float | None = None
    poll_seconds: float = 0.0
    poll_cpu_seconds: float = 0.0
    # How long the engine took to answer the latest page (None before one).
    page_late_seconds: float | None = None
    snapshot: Snapshot | None = None
    window_seconds: float = 0.0
    per_engine: tuple[Evaluated, ...] = ()
    per_model: tuple[Evaluated, ...] = ()
    findings: tuple[diagnosis.Finding, ...] = ()
    events: tuple[Change, ...] = ()
    upstream: UpstreamReport | None = None
    # The LMCache tier's latest poll (kvwatch/pipeline/lmcache.py), None unless lmcache_target is set.
    lmcache: LMCacheReport | None = None
    # The KV-cache event stream's report (kvwatch/kvevents/source.py), None unless kv_events is set.
    kv_events: KVEventsReport | None = None
    # The router's latest poll (kvwatch/pipeline/router.py), None unless router_target is set.
    router: dict[str, Any] | None = None
    # finding key (report.finding_key) -> when it was first seen, while it stays active
    findings_since: dict[tuple[str, str, str, str], float] = field(default_factory=dict)
    # The window's entries as of this poll (the trends on the status page);
    # a tuple, so readers never see the poll thread's deque change.
    entries: tuple = ()
    # The engine whose adapter reads the page (None while `auto` has not seen
    # a page with engine metrics), and the catalogue's signals it cannot provide.
    engine: str | None = None
    dark_signals: tuple[str, ...] = ()
    # A replay's progress (kvwatch serve --replay; None when live): the
    # monitor's one dict, so its `finished` shows on the last state too.
    replay: ReplayProgress | None = None
    # The simulator's phase now and the next (kvwatch/pipeline/demo.py), only with demo_target.
    demo: DemoStatus | None = None
    # One sentence when the window reached its byte bound this poll and
    # forgot pairs or polls before their time (kvwatch.window), else None.
    window_trimmed: str | None = None
    # Values of the latest page, and ratios of the window, that cannot be true
    # (kvwatch.engines.plausible.SourceFault): shown as faults of the source, never clamped.
    source_faults: tuple = ()
    # Faults seen since start, by kind (kvwatch_source_faults_total).
    source_faults_by_kind: dict[str, int] = field(default_factory=dict)
    # The engine answers /metrics late, or not within the deadline, while it
    # has requests running or waiting: busy, not down (Monitor._busy), with
    # the lateness measured; None otherwise.
    busy: BusyReport | None = None
    # The engine has not answered since kvwatch started and load_grace has not passed:
    # a model still loading its weights, not an engine that answered and stopped.
    engine_starting: bool = True



def run_at_fixed_rate(stop: threading.Event, interval: float, once: Callable[[], Any], failed: Callable[[], Any],
                      after: list[Callable[[Any], None]], state: Callable[[], Any], what: str) -> None:
    """Calls `once` every `interval` s until `stop` is set, then each of
    `after` with `state()`: the sidecar's poll loop and central mode's
    refresh loop. The loop outlives any bug in one call (`failed` records
    it); a slow call skips the slots it missed, never bursts."""
    next_due = time.monotonic()
    while not stop.is_set():
        try:
            once()
        except Exception:
            log.exception("%s failed unexpectedly; kvwatch keeps going", what)
            failed()
        for listener in after:
            try:
                listener(state())
            except Exception:
                log.exception("after-%s work failed; kvwatch keeps going", what)
        next_due += interval
        now = time.monotonic()
        if next_due < now:
            next_due = now + interval
        stop.wait(next_due - now)

class Monitor:
    """`fetcher` and `clock` are the engine and the time it is read at; a
    replay (kvwatch.capture.replay) passes recorded pages and their recorded
    times, and everything after the fetch is the same code as live."""

    def __init__(self, settings: Settings, fetcher: PageSource | None = None,
                 clock: Callable[[], float] | None = None, whole_run: bool = False):
        self.settings = settings
        # `kvwatch diagnose`: the window widens to keep every poll of the run
        # (_add), however late a loaded machine or a slow engine made them.
        self.whole_run = whole_run
        self.fetcher: PageSource = fetcher or Fetcher(
            settings.target,
            settings.fetch_timeout,
            settings.max_body_bytes,
            settings.bearer_token_file,
            settings.ca_bundle,
            settings.tls_verify,
        )
        # The time each poll is read at: the window's time axis and the
        # times in the state (a replay passes the recorded times).
        self.clock = clock or self._steady_clock
        # With `auto`, the adapter is chosen from the first page some adapter
        # recognizes, and kept: a target serves one engine.
        self.adapter = None if settings.engine == AUTO else make_adapter(settings.engine, settings.max_series)
        self.window = Window(settings.window)
        self.upstream = None
        if settings.upstream_target and settings.upstream_histogram:
            # The monitor's clock (steady; recorded time in a replay), not the
            # wall clock: an NTP step back kept stale steps in its window.
            self.upstream = UpstreamSource(settings, self.window.seconds, clock=self.clock)
        self.lmcache = None
        if settings.lmcache_target:
            self.lmcache = LMCacheSource(settings, self.window.seconds, clock=self.clock)
        self.router = RouterSource(settings, self.window.seconds, clock=self.clock) if settings.router_target else None
        self.demo = None
        if settings.demo_target:
            self.demo = DemoSource(settings.demo_target, settings.fetch_timeout, settings.poll_interval)
        self.kv_events = None
        if settings.kv_events:
            self.kv_events = KVEventSource(settings.kv_events, connect=settings.kv_events_connect,
                                           topic=settings.kv_events_topic, replay=settings.kv_events_replay,
                                           window_seconds=self.window.seconds,
                                           table_bytes=settings.kv_events_table_bytes, clock=self.clock)
        # LMCache sharing vLLM's registry is on the engine's own page: read that page, never fetch it twice.
        self._lmcache_on_engine_page = bool(settings.lmcache_target) and settings.lmcache_target == settings.target
        self.replay: ReplayProgress | None = None
        self.state = State()
        self._errors: dict[str, int] = {}
        self._parse_errors = 0
        self._polls = 0
        self._faults_by_kind: dict[str, int] = {}
        self._events: deque[Change] = deque(maxlen=MAX_EVENTS)
        # LoRA adapter name -> when last seen: only those seen within the
        # window are kept (a page with a new adapter set each poll grew a set
        # that never shrank to 1.5 M names), at most MAX_LORA_NAMES and
        # MAX_LORA_BYTES.
        self._lora_seen: dict[str, float] = {}
        self._lora_bytes = 0
        self.hit_memory = diagnosis.HitRateMemory()
        self.thresholds = diagnosis.resolve_thresholds(settings.diagnosis)
        # What is true now (the same rules over the last now_seconds) and the
        # hold: the judgment every mode applies (diagnose/now.py).
        self.judgment = NowJudgment(self.window.seconds, settings.diagnosis)
        # (time, running, waiting) of the latest page read, and when the
        # current run of busy polls began (None outside one).
        self._last_load: tuple[float, float, float] | None = None
        self._busy_since: float | None = None
        # Whether the engine has answered once since start, and when start was (engine_starting).
        self._answered_once = False
        self._started_monotonic = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one poll at a time (loop or CLI)
        # The live clock: wall time at start-up plus monotonic time since, so
        # an NTP step or a resumed VM never moves the window backwards (a
        # step back an hour made every rate vanish for an hour). The times it
        # shows drift from the wall clock only by such steps.
        self._clock_offset = time.time() - time.monotonic()
        # Work the poll loop does after each poll, outside the poll's own
        # CPU figure (the exporter renders ahead there for busy scrapers).
        self.after_poll: list[Callable[[State], None]] = []

    # --- the loop -------------------------------------------------------

    def start(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()
        self._thread = threading.Thread(target=self._run, name="kvwatch-poll", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self.kv_events is not None:
            self.kv_events.stop()

    def _run(self) -> None:
        run_at_fixed_rate(self._stop, self.settings.poll_interval, self.poll_once,
                          lambda: self._record_failure("internal", "unexpected error, see log", time.time(), 0.0, 0.0),
                          self.after_poll, lambda: self.state, "poll")

    # --- one poll -------------------------------------------------------

    def poll_once(self) -> State:
        with self._lock:
            started_cpu = time.thread_time()
            started = self.clock()
            started_monotonic = time.monotonic()
            result = self.fetcher.fetch()
            if not result.ok:
                state = self._record_failure(result.reason or "error", result.detail, started, result.seconds,
                                             time.thread_time() - started_cpu, result.sentence)
            else:
                state = self._ingest(result, started, started_monotonic, started_cpu)
            if self.demo is not None:
                state = self.state = replace(state, demo=self.demo.poll())
            return state

    def _ingest(self, result: FetchResult, started: float, started_monotonic: float, started_cpu: float) -> State:
        if self.adapter is None:
            engine = recognize(result.page)
            if engine is None:
                return self._no_engine_metrics(
                    result, f"no engine metrics in a page of {result.size} bytes (looked for the families of "
                    f"{', '.join(ENGINES)})", (), started, started_cpu)
            self.adapter = make_adapter(engine, self.settings.max_series)
            log.info("polling %s: the page is %s's", public_url(self.settings.target), self.adapter.title)
        adapter = self.adapter
        answered = self._answered_at(result, started)
        previous = self.window.latest
        snapshot = adapter.adapt(result.page, at=answered)
        self._parse_errors += len(snapshot.parse_errors)
        if snapshot.parse_errors:
            log.debug("%d malformed lines, first: %s", len(snapshot.parse_errors), snapshot.parse_errors[0])
        if not snapshot.engines:
            return self._no_engine_metrics(
                result, f"no {adapter.name} engine metrics in a page of {result.size} bytes",
                snapshot.parse_errors, started, started_cpu)
        self._add(snapshot)
        self._note_changes(previous, snapshot)
        per_engine, per_model = evaluate_window(self.window)
        source_faults = self._count_faults(snapshot, per_engine, adapter)
        upstream = self.upstream.poll() if self.upstream is not None else None
        lmcache = self._poll_lmcache(result.text if self._lmcache_on_engine_page else None, answered)
        kv_events = self._report_kv_events(answered, per_engine)
        events = tuple(e for e in self._events if e.time >= snapshot.time - self.window.seconds)
        findings = diagnosis.diagnose(self.window, per_engine, events,
                                      self.settings.diagnosis, upstream, self.hit_memory, lmcache, kv_events,
                                      incumbents=self.judgment.incumbents())
        upstream_now = self.upstream.recent(upstream, self.judgment.window.seconds) if (
            self.upstream is not None) else upstream
        findings = self.judgment.judge(answered, self.window, findings, events, upstream_now, lmcache, kv_events,
                                       others=self._poll_router(answered))
        busy = self._busy(snapshot, result.seconds, timed_out=False, at=answered)
        self._polls += 1
        was_up = self.state.up
        previous_since = self.state.findings_since
        earliest = self.window.earliest
        self.state = State(
            up=True,
            reason=None,
            engine_starting=self._starting(answered=True),
            polls=self._polls,
            errors_by_reason=dict(self._errors),
            parse_errors=self._parse_errors,
            last_parse_errors=tuple(str(e) for e in snapshot.parse_errors[:5]),
            dropped_series=adapter.dropped_series,
            last_poll_time=answered,
            last_success_time=answered,
            poll_seconds=time.monotonic() - started_monotonic,
            poll_cpu_seconds=time.thread_time() - started_cpu,
            page_late_seconds=result.seconds,
            snapshot=snapshot,
            window_seconds=snapshot.time - earliest.time if earliest else 0.0,
            per_engine=tuple(per_engine),
            per_model=tuple(per_model),
            findings=tuple(findings),
            events=events,
            upstream=upstream,
            lmcache=lmcache, router=self.router.last if self.router is not None else None,
            kv_events=kv_events,
            findings_since={key: previous_since.get(key, started) for key in (finding_key(f) for f in findings)},
            entries=tuple(self.window.entries),
            engine=adapter.name,
            dark_signals=dark_signals(type(adapter)),
            replay=self.replay,
            window_trimmed=self.window.trimmed,
            source_faults=source_faults,
            source_faults_by_kind=dict(self._faults_by_kind),
            busy=busy,
        )
        if not was_up:
            count = len(snapshot.engines)
            log.info("polling %s: up (%d %s)", public_url(self.settings.target), count,
                     "engine" if count == 1 else "engines")
        return self.state

    def _add(self, snapshot: Snapshot) -> None:
        """The snapshot into the window; in a whole run, the window first
        widened to keep the run's first poll."""
        earliest = self.window.earliest
        if self.whole_run and earliest is not None:
            self.widen(snapshot.time - earliest.time)
        self.window.add(snapshot)
        if self.window.trimmed and not self.state.window_trimmed:
            log.warning("%s", self.window.trimmed)

    def widen(self, seconds: float) -> None:
        """The window, and the spans kept beside it (the now span, the
        upstream's, LMCache's, the router's, the KV events'), at least
        `seconds` long; never narrowed."""
        if seconds <= self.window.seconds:
            return
        self.window.seconds = seconds
        self.judgment.window.seconds = min(self.judgment.thresholds.now_seconds, seconds)
        for source in (self.upstream, self.router, self.kv_events):
            if source is not None:
                source.window_seconds = seconds
        if self.lmcache is not None:
            self.lmcache.window.seconds = seconds

    def _answered_at(self, result: FetchResult, started: float) -> float:
        """The time the page is stamped with."""
        # A page describes the engine when it was answered, not when it was
        # asked for: a busy vLLM answers seconds late (1.5-12 s under load on
        # the tier's CPU), and a page stamped at the request would put the
        # load's peak that much too early and stretch the rates around it.
        # A page answered within a tenth of the interval keeps the time it
        # was asked for: the window does not resolve the difference, and a
        # replay then stamps exactly what the live sidecar stamped.
        late = max(0.0, result.seconds or 0.0)
        answered = started + late if late > LATE_FRACTION * self.settings.poll_interval else started
        previous = self.window.latest
        if previous is not None and answered <= previous.time:
            answered = previous.time + 1e-3  # the window's time axis only moves forward
        return answered

    def _count_faults(self, snapshot: Snapshot, per_engine, adapter: EngineAdapter) -> tuple:
        """The page's source faults and the window's, each counted by kind."""
        source_faults = tuple(snapshot.faults) + tuple(window_faults(per_engine, snapshot.sources, adapter.prefixes[0]))
        for fault in source_faults:
            self._faults_by_kind[fault.fault] = self._faults_by_kind.get(fault.fault, 0) + 1
        if snapshot.faults_dropped:
            self._faults_by_kind["undescribed"] = self._faults_by_kind.get("undescribed", 0) + snapshot.faults_dropped
        return source_faults

    def _poll_lmcache(self, page_text: str | None, at: float) -> LMCacheReport | None:
        """The tier's poll; its failure is its own (reported in its status),
        never the engine's."""
        if self.lmcache is None:
            return None
        try:
            return self.lmcache.poll(page_text, at if page_text is not None else None)
        except Exception:  # pragma: no cover - defensive: the tier must not take the engine's poll down
            log.exception("polling LMCache failed")
            return {"target": public_url(self.settings.lmcache_target), "up": False, "reason": "internal",
                    "detail": "kvwatch failed reading LMCache's page", "families": None, "models": [],
                    "time": self.clock()}

    def _poll_router(self, at: float) -> list:
        """The router's findings for this poll; its failure is its own, never the engine's."""
        if self.router is None:
            return []
        try:
            return self.router.poll(self.window, at)
        except Exception:  # pragma: no cover - defensive: the router must not take the engine's poll down
            log.exception("polling the router failed")
            return []

    def _report_kv_events(self, at: float, per_engine) -> KVEventsReport | None:
        """The stream's report for this poll, with the page's numbers it
        needs (bytes per block, prefix hits): its failure is its own."""
        if self.kv_events is None:
            return None
        try:
            new_changes = self.kv_events.take_changes()
            engines = [row for row in per_engine if row.engine is not None]
            # The stream is one engine's: its changes are that engine's where the page has one.
            model, engine = (engines[0].model, engines[0].engine) if len(engines) == 1 else (None, None)
            for when, kind, detail in new_changes:
                self._event(Change(when, kind, model, engine, detail))
            thresholds = diagnosis.resolve_thresholds(self.settings.diagnosis)
            recent = min(thresholds.hit_recent_seconds, self.window.seconds / 2)
            report = with_page(self.kv_events.report(at, recent_seconds=recent), per_engine)
            report["silence"] = silence(report, per_engine, self.window, thresholds.kv_events_silence_seconds)
            return with_worth(report, getattr(per_engine[0], "view", None) if per_engine else None)
        except Exception:  # pragma: no cover - defensive: the stream must not take the engine's poll down
            log.exception("reading the KV-cache event stream failed")
            return None

    def _no_engine_metrics(self, result: FetchResult, detail: str, parse_errors, started: float,
                           started_cpu: float) -> State:
        """A page was read but holds no engine the adapter knows: why, for
        the log (detail) and for people (one sentence)."""
        if result.unexpected_content_type:
            detail += f" of content type {result.content_type!r}"
        if parse_errors:
            detail += f" ({len(parse_errors)} malformed lines, first: {parse_errors[0]})"
        reason = "content_type" if result.unexpected_content_type else "no_engine_metrics"
        host = public_host(self.settings.target)
        engine = self.adapter.title if self.adapter is not None else "LLM"
        sentence = failure_sentence(reason, host, engine=engine)
        if result.unexpected_content_type:
            sentence = (f"{host} answers with a page of content type {result.content_type[:60]!r}, "
                        "not Prometheus metrics")
        elif parse_errors:
            sentence += f" ({len(parse_errors)} malformed lines in {result.size} bytes)"
        return self._record_failure(reason, detail, started, result.seconds, time.thread_time() - started_cpu,
                                    sentence)

    def _starting(self, answered: bool) -> bool:
        """True while the engine has never answered since kvwatch started and load_grace has not passed."""
        self._answered_once = self._answered_once or answered
        return not self._answered_once and time.monotonic() - self._started_monotonic < self.settings.load_grace

    def _record_failure(self, reason: str, detail: str, started: float, seconds: float, cpu: float,
                        sentence: str = "") -> State:
        self._polls += 1
        self._errors[reason] = self._errors.get(reason, 0) + 1
        previous = self.state
        # A connect that timed out never reached the engine's server: no busy page, an unreachable host.
        busy = (self._busy(None, seconds, timed_out=True, at=started)
                if reason == "timeout" and not detail.startswith("connect") else None)
        if busy is None:
            self._busy_since = None
        if busy is not None:
            sentence = busy["sentence"]
        if previous.up or previous.reason != reason:
            # Log transitions, not every failed poll: a down engine must not
            # flood the log at one line per interval.
            # public_url: the log must not carry credentials from the target URL.
            # The sentence for people; the technical detail (exception text) at debug.
            log.warning("polling %s failed: %s", public_url(self.settings.target),
                        sentence or failure_sentence(reason, public_host(self.settings.target),
                                                     self.settings.fetch_timeout))
            log.debug("polling %s failed: %s (%s)", public_url(self.settings.target), reason, detail)
        self.state = State(
            up=False,
            reason=reason,
            # An engine that answers without its statistics has answered: not loading.
            engine_starting=self._starting(answered=reason == "no_engine_metrics"),
            detail=sentence or failure_sentence(reason, public_host(self.settings.target),
                                                self.settings.fetch_timeout),
            polls=self._polls,
            errors_by_reason=dict(self._errors),
            parse_errors=self._parse_errors,
            dropped_series=self.adapter.dropped_series if self.adapter is not None else 0,
            last_poll_time=started,
            last_success_time=previous.last_success_time,
            poll_seconds=seconds,
            poll_cpu_seconds=cpu,
            # A busy engine's page is at least as late as the deadline waited.
            page_late_seconds=busy["late_seconds"] if busy is not None else previous.page_late_seconds,
            events=previous.events,
            kv_events=self._report_kv_events(started, ()),
            engine=previous.engine,
            dark_signals=previous.dark_signals,
            replay=self.replay,
            source_faults_by_kind=previous.source_faults_by_kind,
            busy=busy,
        )
        return self.state

    def _busy(self, snapshot: Snapshot | None, seconds: float | None, timed_out: bool, at: float) -> BusyReport | None:
        """Busy, not down: the page came `busy_late_seconds` or more late
        (or, `timed_out`, not within the deadline) while the engine had
        requests running or waiting, on this page or, for a timeout, on the
        latest page read at most `busy_timeout_seconds` before. The lateness
        is measured: how long the engine took to answer (for a timeout, the
        deadline waited: a lower bound)."""
        late = max(0.0, seconds or 0.0)
        if snapshot is not None:
            running = sum(e.gauges.get("running", 0.0) for e in snapshot.engines.values())
            waiting = sum(e.gauges.get("waiting", 0.0) for e in snapshot.engines.values())
            self._last_load = (snapshot.time, running, waiting)
            busy = late >= self.thresholds.busy_late_seconds and running + waiting > 0
        else:
            last = self._last_load
            busy = (last is not None and last[1] + last[2] > 0
                    and at - last[0] <= self.thresholds.busy_timeout_seconds)
            running, waiting = (last[1], last[2]) if last is not None else (0.0, 0.0)
        if not busy:
            self._busy_since = None
            return None
        if self._busy_since is None:
            self._busy_since = at
        host = public_host(self.settings.target)
        load = f"{running:g} running and {waiting:g} waiting"
        if timed_out and self._last_load is not None:
            sentence = (f"{host} is busy, not down: its /metrics did not answer within {late:.1f} s, and its latest "
                        f"page ({at - self._last_load[0]:.0f} s before) showed {load} requests")
        else:
            sentence = f"{host} is busy: its /metrics answered {late:.1f} s late with {load} requests"
        return BusyReport(late_seconds=late, timed_out=timed_out, running=running, waiting=waiting,
                          since=self._busy_since, sentence=sentence)

    def _note_changes(self, previous: Snapshot | None, current: Snapshot) -> None:
        if previous is None or len(self.window.entries) < 2:
            return
        for change in diagnosis.changes_between(self.window.entries[-2], self.window.entries[-1]):
            self._event(change)
        # Running and waiting adapter lists change with every request; what
        # invalidates comparisons is an adapter never seen before, or max_lora.
        # Each adapter set used since the last page, in the order vLLM set them:
        # the first adapter seen is no change, one used after it is.
        seen = self._lora_seen
        new: dict[str, None] = {}
        for adapters in current.lora_used:
            if seen:
                new.update(dict.fromkeys(name for name in adapters if name not in seen))
            for name in adapters:
                if seen.pop(name, None) is None:  # re-inserted last: the dict stays in order of last sight
                    self._lora_bytes += lora_name_bytes(name)
                seen[name] = current.time
        if new:
            self._event(Change(current.time, "lora", None, None,
                               f"new LoRA adapters: {diagnosis.names_text(sorted(new))}"))
        horizon = current.time - self.window.seconds
        while seen:
            oldest, at = next(iter(seen.items()))
            if at >= horizon and len(seen) <= MAX_LORA_NAMES and self._lora_bytes <= MAX_LORA_BYTES:
                break
            del seen[oldest]
            self._lora_bytes -= lora_name_bytes(oldest)
        before_max = (previous.lora or {}).get("max_lora")
        now_max = (current.lora or {}).get("max_lora")
        if before_max and now_max and before_max != now_max:
            self._event(Change(current.time, "lora", None, None, f"max_lora {before_max} -> {now_max}"))

    def _event(self, change: Change) -> None:
        log.info("change: %s %s/%s: %s", change.kind, change.model or "*", change.engine or "*", change.detail)
        self._events.append(change)

    def _steady_clock(self) -> float:
        return self._clock_offset + time.monotonic()  # `time` looked up per call: a benchmark's clock applies

    def ready(self) -> tuple[bool, str]:
        """Ready when the latest poll succeeded and is recent. The answer is
        served unauthenticated (/readyz): it names the reason, never the
        detail, which quotes what the engine sent (a redirect's Location with
        its query string, a content type, a malformed line)."""
        state = self.state
        if not state.up:
            return False, f"last poll failed: {state.reason}: {state.detail}"
        age = self.clock() - (state.last_success_time or 0)
        limit = max(3 * self.settings.poll_interval, self.settings.fetch_timeout + self.settings.poll_interval)
        if age > limit:
            return False, f"no successful poll for {age:.0f}s"
        return True, "ok"


def lora_name_bytes(name: str) -> int:
    """What remembering one adapter name costs, as MAX_LORA_BYTES counts it."""
    return LORA_ENTRY_BYTES + len(name)
