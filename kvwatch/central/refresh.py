"""Central mode (`kvwatch serve --prometheus URL`): the history diagnosis run
incrementally, for clusters where no sidecar polls the engines.

Every refresh (the poll interval, 30 s by default) reads only the steps since
the last one from the store (the first refresh back-fills one window span),
advances each replica's window with the history pipeline's own step
(run.diagnose_step: adapter -> Window -> evaluate_window -> diagnose -> the
now span's judgment and the hold, then the fleet rules across the replicas of each model), and publishes one
immutable CentralState: per replica the sidecar's State (what the status page,
the JSON API and the exporter read), plus the fleet findings.

Bounded: each refresh reads at most one window span (a refresh after a long
outage of the store skips to the latest window), with the client's timeout,
sample budget and concurrency; at most `max_replicas` replicas are kept (the
rest counted as dropped); a replica with no data for a window span is
forgotten; each replica's trend is cut to its window.

A store that fails or times out never ends the loop: the state says so in one
sentence (readiness fails, the page shows it, the replicas' States are marked
down so their findings and series are not served as current), and the next
refresh reads from where the last good one ended.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from kvwatch.engines.coverage import dark_signals
from kvwatch.history.pages import DEFAULT_REPLICA_LABELS, Pages, family_query
from kvwatch.history.query import PrometheusClient, QueryError, merge_selector
from kvwatch.history.run import diagnose_step, discover
from kvwatch.central.routers import StoreRouters
from kvwatch.history.shard import Shard, identity, marker_matcher, shard_matcher
from kvwatch.pipeline.monitor import State, run_at_fixed_rate
from kvwatch.diagnose.vocabulary import finding_key
from kvwatch.present import public_url
from kvwatch.signals import evaluate_window

log = logging.getLogger("kvwatch")

DEFAULT_MAX_REPLICAS = 256
DEFAULT_INTERVAL = 30.0


@dataclass(frozen=True)
class ReplicaView:
    """One replica as central mode serves it."""

    name: str
    labels: dict[str, str]
    state: State


@dataclass(frozen=True)
class CentralState:
    up: bool = False
    reason: str | None = "not_polled_yet"
    detail: str = "kvwatch has not read the store yet"
    refreshes: int = 0
    failures: int = 0
    last_refresh_time: float | None = None
    last_success_time: float | None = None
    # The latest step diagnosed (the store's time of the replicas' States).
    last_step: float | None = None
    source: str | None = None
    replicas: dict[str, ReplicaView] = field(default_factory=dict)
    fleet: tuple = ()
    dropped_replicas: int = 0
    cost: dict[str, Any] = field(default_factory=dict)
    # Sharded (--shard k/N): "k/N", and how many replicas the store holds
    # for every shard at the latest discovery.
    shard: str | None = None
    store_replicas: int | None = None


class _Latest:
    """Stands in for the Timeline diagnose_step feeds: keeps each scope's
    latest findings and step, and each replica's latest step with data."""

    def __init__(self) -> None:
        self.findings: dict[str, tuple[float, list]] = {}
        self.gaps: dict[str, float] = {}

    def add(self, scope: str, at: float, findings, replica: str | None = None) -> None:
        self.findings[scope] = (at, list(findings))

    def gap(self, replica: str, at: float, step: float) -> None:
        self.gaps[replica] = at


class Central:
    """`clock` is the store's time to read up to (tests over backfilled
    history pass their own); `step` the time between rebuilt polls."""

    def __init__(self, client: PrometheusClient, settings, selector: str = "", source: str = "auto",
                 replica_labels: tuple[str, ...] = DEFAULT_REPLICA_LABELS, step: float | None = None,
                 max_replicas: int = DEFAULT_MAX_REPLICAS, clock: Callable[[], float] | None = None,
                 shard: Shard | None = None):
        self.client = client
        self.settings = settings
        self.selector = selector
        self.wanted_source = source
        self.replica_labels = tuple(replica_labels)
        self.step = float(step or settings.poll_interval)
        self.window = float(settings.window)
        self.max_replicas = max(1, int(max_replicas))
        self.clock = clock or time.time
        self.shard = shard
        self._store_replicas: int | None = None  # every shard's, at the latest discovery (sharded only)
        self.url = public_url(client.url)
        self.state = CentralState()
        self.after_poll: list[Callable[[CentralState], None]] = []
        self._replicas: dict[tuple, Any] = {}  # replica key -> run.ReplicaState
        self._last_data: dict[tuple, float] = {}
        self._since: dict[tuple, dict] = {}  # replica key -> finding key -> first seen
        self._fleet_since: dict[tuple, float] = {}
        self._findings: dict[tuple, list] = {}
        self._fleet: list = []
        self._fleet_holds: dict = {}  # model -> FindingHold of its fleet findings
        # The routers the store holds (a shard sees a share of the replicas: none read there).
        self._routers = StoreRouters(settings, self.window, self.replica_labels) if shard is None else None
        self._routing_since: dict[tuple, float] = {}
        self._last_step: float | None = None
        self._source: str | None = None
        self._discovered: tuple | None = None  # discover's answer and the step it was asked at
        # Past max_replicas at the latest discovery: the first max_replicas of
        # the store's replicas in order (those _admit would take first), else None.
        self._listed: list[tuple] | None = None
        self._dropped = 0  # replicas the store has beyond max_replicas, at the latest refresh
        self._refreshes = 0
        self._failures = 0
        self._last_success: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- the loop -------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kvwatch-central", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        run_at_fixed_rate(self._stop, self.step, self.refresh_once,
                          lambda: self._failed("internal",
                                               "kvwatch itself failed while reading the store (see its log)"),
                          self.after_poll, lambda: self.state, "refresh")

    # --- one refresh ----------------------------------------------------

    def refresh_once(self) -> CentralState:
        with self._lock:
            step = self.step
            end = (self.clock() // step) * step
            start = end - self.window if self._last_step is None else self._last_step + step
            # Never more than one window span per refresh: after a long outage
            # of the store, what lies before the latest window is no longer shown.
            start = max(start, end - self.window)
            if start > end:
                return self.state
            try:
                with _collector_paused():
                    self._read_and_step(start, end)
            except QueryError as exc:
                log.warning("reading %s failed: %s", self.url, exc)
                return self._failed("store", store_sentence(self.url, exc))
            self._last_step = end
            self._last_success = self.clock()
            return self._publish(end)

    def _read_and_step(self, start: float, end: float) -> None:
        step = self.step
        # Which families exist is asked once per window span, not every
        # refresh (the series API answers with every series' labels, the
        # bulk of a refresh's cost): the range queries select by family, so a
        # new replica appears in them at once, a new family at the next
        # discovery. Asked over the whole window, not the new steps alone:
        # the series API answers for samples inside the range, and a few
        # seconds between two steps may hold none of a replica's.
        found = self._discovered
        if found is None or found[0] is None or end - found[4] >= self.window:
            self._listed = None
            found = self._discovered = (*self._discover(min(start, end - self.window), end), end)
        source, families, counts, inner, _at = found
        if source is None:
            self._step_nothing(end)
            return
        self._source = source
        queries = [(family_query(family, names, inner), counts[family]) for family, names in sorted(families.items())]
        points = int(round((end - start) / step)) + 1
        pages = Pages(start, step, points, source, self.replica_labels)
        self._forget(end)  # first, so that a replica gone for a window makes room for a new one now
        # Past max_replicas, the replicas chosen from the list; within it,
        # every replica the answers bring until max_replicas: a store may
        # answer more replicas than it listed (new ones, or a hostile store:
        # a list of two and answers of 680,000 held 2.1 GiB).
        admitted = set(self._replicas) | set(self._listed or ())
        admission = _Admission(self.replica_labels, admitted, self._owns,
                               room=0 if self._listed is not None else self.max_replicas - len(admitted))
        for result in self.client.read_ranges(queries, start, end, step, keep=admission):
            pages.add(result)
        ordered = self._admit(sorted((key, replica) for key, replica in pages.replicas.items() if self._owns(key)))
        self._dropped += len(admission.refused)
        latest = _Latest()
        for index in range(points):
            at = start + index * step
            latest.findings.clear()
            diagnose_step(at, index, ordered, self._replicas, latest, self.window, self.settings.diagnosis, step,
                           self._fleet_holds)
            for key, _replica in ordered:
                state = self._replicas.get(key)
                if state is None:
                    continue
                scope = latest.findings.get(state.name)
                if scope is not None and scope[0] == at:
                    self._last_data[key] = at
                    self._findings[key] = scope[1]
                    since = self._since.setdefault(key, {})
                    current = {finding_key(f) for f in scope[1]}
                    for gone in [k for k in since if k not in current]:
                        del since[gone]
                    for k in current:
                        since.setdefault(k, at)
            # A shard sees only its share of each model's replicas: the
            # fleet's findings are the store's (shard.py).
            fleet = [] if self.shard is not None else [
                f for scope, (when, found) in sorted(latest.findings.items())
                if scope.startswith("fleet:") and when == at for f in found]
            self._fleet = fleet
            current = {_fleet_key(f) for f in fleet}
            self._fleet_since = {k: self._fleet_since.get(k, at) for k in current}
        self._route(start, end)
        self._forget(end)

    def _route(self, start: float, end: float) -> None:
        """The routers' findings at the refresh's last step, with the fleet's."""
        if self._routers is None:
            return
        self._routers.read(self.client, self.selector, start, end, self.step)
        routing, decided = self._routers.findings([state.window for state in self._replicas.values()])
        current = {_fleet_key(f) for f in routing}
        self._routing_since = {k: self._routing_since.get(k, end) for k in current}
        # The router's window decides prefix affinity for its models: the peers' comparison gives way.
        peers = [f for f in self._fleet if not (f.cause == "lost_prefix_affinity" and f.model in decided)]
        self._fleet = peers + routing
        self._fleet_since.update(self._routing_since)

    def _discover(self, start: float, end: float) -> tuple:
        """discover's answer for the replicas this instance serves: all of
        them, or a shard's (found from one family's series, then selected in
        every query by shard_matcher)."""
        source = self._source or self.wanted_source
        if self.shard is None:
            return discover(self.client, self.selector, start, end, source, listed=self._note_listing,
                            listed_labels=self.replica_labels)
        for candidate in ("vllm", "kvwatch") if source == "auto" else (source,):
            found = self.client.series(merge_selector(self.selector, marker_matcher(candidate)), start, end,
                                       labels=self.replica_labels)
            keys = {tuple(labels.get(label, "") for label in self.replica_labels) for labels in found}
            if keys:
                break
        self._store_replicas = len(keys)
        mine = sorted(key for key in keys if self._owns(key))
        if not mine:
            return None, {}, {}, ""
        selector = merge_selector(self.selector, shard_matcher(self.replica_labels, mine))
        return discover(self.client, selector, start, end, candidate, listed=self._note_listing,
                        listed_labels=self.replica_labels)

    def _note_listing(self, listing: list[dict]) -> None:
        """From the series list, which replicas a read may keep where the
        store holds more than max_replicas: those known, and the first
        max_replicas of the rest in order (a superset of what _admit takes
        while they have data). A fleet within max_replicas reads every
        series, so a replica new since the list still shows at once."""
        found = {tuple(labels.get(label, "") for label in self.replica_labels) for labels in listing}
        keys = [key for key in found if self._owns(key)]
        self._listed = sorted(keys)[:self.max_replicas] if len(keys) > self.max_replicas else None

    def _owns(self, key: tuple) -> bool:
        return self.shard is None or self.shard.owns(identity(self.replica_labels, key))

    def _step_nothing(self, end: float) -> None:
        self._fleet = []
        self._fleet_since = {}
        self._forget(end)

    def _admit(self, found: list) -> list:
        """The replicas read this refresh that are kept: those known, then new
        ones in order up to max_replicas; how many were left out is counted."""
        kept = []
        room = self.max_replicas - len(self._replicas)
        for key, replica in found:
            if key in self._replicas:
                kept.append((key, replica))
            elif room > 0:
                kept.append((key, replica))
                room -= 1
        self._dropped = len(found) - len(kept)
        return kept

    def _forget(self, end: float) -> None:
        """Replicas with no data for a window span go; the rest keep a trend
        no longer than their window."""
        for key in list(self._replicas):
            last = self._last_data.get(key)
            if last is None or end - last > self.window:
                for table in (self._replicas, self._last_data, self._since, self._findings):
                    table.pop(key, None)
                continue
            state = self._replicas[key]
            keep = max(1, int(self.window // self.step) + 1)
            if len(state.trend) > keep:
                del state.trend[:-keep]

    def _failed(self, reason: str, sentence: str) -> CentralState:
        self._refreshes += 1
        self._failures += 1
        previous = self.state
        down = {name: dataclasses.replace(view, state=dataclasses.replace(
                    view.state, up=False, reason=reason, detail=sentence, errors_by_reason={reason: 1}))
                for name, view in previous.replicas.items()}
        self.state = dataclasses.replace(
            previous, up=False, reason=reason, detail=sentence, refreshes=self._refreshes,
            failures=self._failures, last_refresh_time=self.clock(), replicas=down, fleet=())
        return self.state

    def _publish(self, end: float) -> CentralState:
        self._refreshes += 1
        views: dict[str, ReplicaView] = {}
        for key, state in sorted(self._replicas.items()):
            views[state.name] = ReplicaView(state.name, dict(state.labels), self._replica_state(key, state, end))
        self.state = CentralState(
            up=True, reason=None, detail="", refreshes=self._refreshes, failures=self._failures,
            last_refresh_time=self.clock(), last_success_time=self._last_success, last_step=end,
            source=self._source, replicas=views,
            fleet=tuple((f, self._fleet_since.get(_fleet_key(f))) for f in self._fleet),
            dropped_replicas=self._dropped, cost=self.client.cost.to_json(),
            shard=str(self.shard) if self.shard else None, store_replicas=self._store_replicas)
        return self.state

    def _replica_state(self, key: tuple, state, end: float) -> State:
        window = state.window
        latest = window.latest
        last = self._last_data.get(key)
        common = dict(polls=state.steps, last_poll_time=end, last_success_time=last,
                      engine="vllm", dark_signals=dark_signals(state.adapter.__class__),
                      dropped_series=state.adapter.dropped_series)
        if latest is None or last != end:
            return State(up=False, reason="no_data",
                         detail=f"the store holds no samples of {state.name} since "
                                f"{time.strftime('%H:%M:%S', time.gmtime(last)) if last else 'the start'} UTC",
                         errors_by_reason={"no_data": 1}, **common)
        per_engine, per_model = evaluate_window(window)
        findings = tuple(self._findings.get(key, ()))
        since = self._since.get(key, {})
        earliest = window.earliest
        return State(
            up=True, reason=None, detail="", snapshot=latest,
            window_seconds=latest.time - earliest.time if earliest else 0.0,
            per_engine=tuple(per_engine), per_model=tuple(per_model), findings=findings,
            events=tuple(e for e in state.events if e.time >= end - window.seconds),
            findings_since={k: since.get(k, end) for k in (finding_key(f) for f in findings)},
            entries=tuple(window.entries), **common)

    def ready(self) -> tuple[bool, str]:
        state = self.state
        if not state.up:
            return False, f"last refresh failed: {state.reason}: {state.detail}"
        age = self.clock() - (state.last_success_time or 0)
        limit = max(3 * self.step, self.client.timeout + self.step)
        if age > limit:
            return False, f"no successful refresh for {age:.0f}s"
        if not state.replicas and self.shard is not None and self._store_replicas:
            # Ready: a shard that owns none of the replicas is not broken (a
            # StatefulSet's rollout waits for every pod's readiness).
            return True, f"ok (shard {self.shard} owns none of the {self._store_replicas} replicas)"
        if not state.replicas:
            return False, f"the store at {self.url} holds no vLLM series for the selector {self.selector or '{}'}"
        return True, "ok"


class _collector_paused:
    """The cyclic garbage collector off while a refresh reads and steps,
    then one collection of the young generations. A read's answers are
    large containers built as they are decoded (a list of 1.3 million series
    at 1,000 replicas), and every young collection while they are young
    walks them: at 1,000 replicas the collector took 2.2 s of an 8.1 s
    steady refresh (27 %), at 64 replicas 13 %, so the cost per replica
    grew with the fleet. Paused, the refresh is 5.8 s, and the same per
    replica at 64 and 1,000. What the refresh kept is scanned once after it
    (gc.collect(1)), so its cyclic garbage is still collected every refresh,
    and the oldest generation keeps its own trigger."""

    def __enter__(self):
        self._was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc):
        if self._was_enabled:
            gc.enable()
            gc.collect(1)
        return False


class _Admission:
    """read_ranges' `keep`: a series is kept if its replica may be
    (`admitted`, and up to `room` more replicas of this instance as they
    come); every other replica of this instance with data in the read is
    counted (as a hash: a set of 370,000 label tuples is 50 MiB, of their
    hashes 20) for dropped_replicas, as _admit counts those it leaves out.
    Called as each answer is decoded, one answer at a time."""

    def __init__(self, replica_labels: tuple[str, ...], admitted: set, owns: Callable[[tuple], bool],
                 room: int = 0):
        self.replica_labels = replica_labels
        self.admitted = admitted
        self.owns = owns
        self.room = room
        self.refused: set[int] = set()
        self._blanks = ("",) * len(replica_labels)

    def __call__(self, labels: dict) -> bool:
        key = tuple(map(labels.get, self.replica_labels, self._blanks))  # labels.get(label, "") in C
        if key in self.admitted:
            return True
        if not self.owns(key):
            return False
        if self.room > 0:
            self.room -= 1
            self.admitted.add(key)
            return True
        self.refused.add(hash(key))
        return False


def store_sentence(url: str | None, error: QueryError) -> str:
    """One sentence for people on why the store could not be read (the
    exception's full text goes to the log)."""
    text = str(error)
    if "no answer within" in text:
        why = "it did not answer " + text[text.index("within"):]
    elif error.reason == "tls" or "SSLError" in text:
        why = "the TLS handshake failed"
    elif error.reason in ("refused", "dns", "disconnected", "connection") or "ConnectTimeout" in text:
        why = "the connection failed (is it running, and is the URL right?)"
    elif error.reason == "too_large":
        why = "an answer was larger than kvwatch reads of one (narrow the selector, or split the fleet with --shard)"
    elif error.reason == "limit":
        why = ("it refused a query as over one of its limits (series, samples or query length): narrow the "
               "selector, or split the fleet over more shards (--shard)")
    elif error.reason == "throttled":
        why = "it is throttling kvwatch's queries (HTTP 429, a rate or concurrency limit); the next refresh asks again"
    elif error.reason == "partial":
        why = ("it could read only part of the data (a store behind it failed): kvwatch does not diagnose a fleet "
               "from part of it")
    elif error.status is not None:
        # Not the store's own text: /readyz is open to anyone who can reach
        # kvwatch, and that text is the store's to choose (the log has it).
        why = f"it answered HTTP {error.status}"
    elif ": HTTP " in text:
        why = "it answered " + text[text.index("HTTP "):].split(",")[0][:40]
    else:
        why = "its answer could not be read (see kvwatch's log)"
    return f"kvwatch cannot read the store at {url}: {why}."


def _fleet_key(finding) -> tuple:
    return (finding.cause, finding.model, str(finding.evidence.get("replica", "")))
