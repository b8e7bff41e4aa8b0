"""The history diagnosis: read the range in time chunks, rebuild each
replica's page at each step, and run the sidecar's own pipeline over it
(adapter -> Window -> evaluate_window -> diagnose -> the now span's judgment
and the hold, diagnose/now.py; one adapter and one window per replica, as
one sidecar per replica would have), then the fleet rules across the
replicas of each model at the same step.

Memory is bounded by the chunk, not the range: a chunk reads every family
for at most `max_samples` samples in all, its steps are diagnosed while the
next chunk is read, and only the replicas' windows (one window span each)
and the timeline are kept.

With `workers` (the command's default: one per usable core), the
replicas' pipelines run in worker processes, each replica always in the same
one with its adapter and window, one chunk at a time; their answers (each
replica's findings and fleet rows per step) come back and are put into the
timeline, and through the fleet rules, in replica order here, so the result
is the one a single process gives. A worker holds its share of one chunk.

Each step's Snapshot is built from the query results as the parser's
families (Replica.families -> VllmAdapter.adapt_families): the adapter's
own reading of every alias, fold and configuration, without writing the
page's text and parsing it back (Replica.page, `pages_as_text`, gives the
same Snapshots and stays as the reference).
"""

from __future__ import annotations

import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from kvwatch import diagnose as diagnosis
from kvwatch.diagnose.fleet import ReplicaRow, fleet_findings
from kvwatch.diagnose.hold import FindingHold
from kvwatch.diagnose.now import NowJudgment
from kvwatch.diagnose.timeline import Timeline
from kvwatch.engines import make_adapter
from kvwatch.history.pages import (DEFAULT_REPLICA_LABELS, PROCESS_START, KnownSeries, Pages, Replica, family_of,
                                   family_query, name_matcher, wanted)
from kvwatch.history.query import MAX_POINTS, PrometheusClient, merge_selector
from kvwatch.labels import bounded_label
from kvwatch.signals import evaluate_window
from kvwatch.window import Window

MAX_EVENTS = 100  # per replica, as the sidecar keeps
MAX_TREND_POINTS = 600  # per replica, for the report's charts


@dataclass
class ReplicaState:
    name: str
    labels: dict[str, str]
    adapter: Any
    window: Window
    events: deque = field(default_factory=lambda: deque(maxlen=MAX_EVENTS))
    restarted_at: float | None = None
    models: set = field(default_factory=set)
    steps: int = 0
    # (time, KV usage, waiting, prefix hit ratio over the window) per step
    trend: list = field(default_factory=list)
    # What is true now and the hold (diagnose/now.py), as the replica's sidecar judges them.
    judgment: NowJudgment | None = None
    # Its page's plan in the chunk before (Replica.carried), taken over by
    # the next chunk's Replica (Replica.earlier); not kept past the diagnosis.
    carried: tuple | None = field(default=None, repr=False, compare=False)


@dataclass
class History:
    start: float
    end: float
    step: float
    window: float
    source: str
    selector: str
    replicas: dict[str, ReplicaState]
    timeline: Timeline
    cost: dict[str, Any]
    diagnose_seconds: float
    steps: int


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a container's
    cpuset sets it), for `workers`."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def replica_name(labels: dict[str, str], key: tuple[str, ...]) -> str:
    values = [value for value in key if value]
    return bounded_label("/".join(values)) if values else "(no target labels)"


def discover(client: PrometheusClient, selector: str, start: float, end: float, source: str,
             diagnosed_only: bool = False, listed: Callable[[list[dict]], None] | None = None,
             listed_labels: tuple[str, ...] = ()):
    """(source, {family: [series names]}, {family: series count}); with
    `diagnosed_only`, without the families no rule reads. `listed` is
    handed the chosen source's series list before it is let go, each
    series' labels cut to its name and `listed_labels` (the list holds
    only what is read from it: PrometheusClient.series)."""
    inner = merge_selector(selector, "")[1:-1]
    candidates = ("vllm", "kvwatch") if source == "auto" else (source,)
    for candidate in candidates:
        found = client.series(merge_selector(selector, name_matcher(candidate)), start, end,
                              labels=("__name__", *listed_labels))
        names: dict[str, set] = {}
        counts: dict[str, int] = {}
        for labels in found:
            name = labels.get("__name__", "")
            if not wanted(name, candidate, diagnosed_only):
                continue
            family = family_of(name, candidate)
            names.setdefault(family, set()).add(name)
            counts[family] = counts.get(family, 0) + 1
        if names and listed is not None:
            listed(found)
        # Let go before the next list is read: two lists at once are twice
        # the memory of one (a list at central mode's 32 MiB cap is over
        # 100 MiB decoded).
        found = []
        if names:
            if candidate == "vllm":
                process = client.series(merge_selector(selector, f'__name__="{PROCESS_START}"'), start, end,
                                        labels=("__name__",))
                if process:
                    names[PROCESS_START] = {PROCESS_START}
                    counts[PROCESS_START] = len(process)
            return candidate, {family: sorted(n) for family, n in names.items()}, counts, inner
    return None, {}, {}, inner


def diagnose_history(client: PrometheusClient, start: float, end: float, step: float, selector: str = "",
                     source: str = "auto", window: float = 300.0, thresholds: dict[str, Any] | None = None,
                     replica_labels: tuple[str, ...] = DEFAULT_REPLICA_LABELS,
                     progress: Callable[[str], None] | None = None, pages_as_text: bool = False,
                     workers: int = 1) -> History:
    """`pages_as_text`: write each step's page and parse it, as a sidecar
    would have read it, instead of handing the adapter the families read
    from the query results (same Snapshots, slower; kept to prove it).

    `workers`: processes that diagnose the replicas (each replica always in
    the same one, its state kept there), 1 for none (in this process). The
    timeline is the same either way; with workers, each ReplicaState comes
    back at the end with its window but a fresh adapter."""
    started = time.monotonic()
    # The workers start before the first query, while this process is
    # small (a fork copies its page tables) and before the reader thread.
    collector = _tuned_collector()
    pool = None
    try:
        if workers > 1:
            pool = _Workers(workers, window, thresholds, not pages_as_text)
        return _diagnose_history(client, start, end, step, selector, source, window, thresholds, replica_labels,
                                 progress, pages_as_text, pool, started)
    finally:
        if pool is not None:
            pool.close()
        _restore_collector(collector)


def _tuned_collector() -> tuple:
    """The collector as the diagnosis wants it (as `kvwatch serve` runs,
    pipeline.monitor.tune_garbage_collector): what exists before it is never
    its garbage (frozen, not scanned again), and a young collection every
    GC_GEN0_THRESHOLD allocations instead of 700. A step allocates thousands
    of objects, nearly all freed by their count going to zero; with the
    default threshold the collector ran hundreds of times a chunk, and each
    full collection scanned every replica's window (more replicas, longer
    scans). Returns what _restore_collector puts back."""
    import gc

    from kvwatch.pipeline.monitor import GC_GEN0_THRESHOLD

    threshold = gc.get_threshold()
    frozen = gc.get_freeze_count()
    gc.freeze()
    gc.set_threshold(max(threshold[0], GC_GEN0_THRESHOLD), *threshold[1:])
    return threshold, frozen


def _restore_collector(collector: tuple) -> None:
    import gc

    threshold, frozen = collector
    gc.set_threshold(*threshold)
    if not frozen:  # unfrozen only where nothing was frozen before: a caller's freeze stays
        gc.unfreeze()


def _diagnose_history(client: PrometheusClient, start: float, end: float, step: float, selector: str, source: str,
                      window: float, thresholds, replica_labels: tuple[str, ...], progress, pages_as_text: bool,
                      pool, started: float) -> History:
    # Only what the diagnosis reads: the timeline and the trends are all
    # that history reports (central mode, serving status pages, reads all).
    source, families, counts, inner = discover(client, selector, start, end, source, diagnosed_only=True)
    timeline = Timeline()
    replicas: dict[tuple, ReplicaState] = {}
    points = int((end - start) // step) + 1
    if source is None:
        return History(start, end, step, window, "none", selector, {}, timeline.finish(), client.cost.to_json(),
                       0.0, 0)
    queries = [(family_query(family, names, inner), counts[family]) for family, names in sorted(families.items())]
    total_series = max(1, sum(counts.values()))
    per_round = max(1, min(MAX_POINTS, client.max_samples // total_series))
    diagnose_seconds = 0.0
    fleet_holds: dict = {}  # model -> FindingHold of its fleet findings
    rounds = [(first, min(points - 1, first + per_round - 1)) for first in range(0, points, per_round)]

    # Twice the series found: room for replicas that come and go.
    known = KnownSeries(2 * total_series + 1024)

    def read(first: int, last: int) -> Pages:
        chunk_start = start + first * step
        pages = Pages(chunk_start, step, last - first + 1, source, replica_labels, known)
        for result in client.read_ranges(queries, chunk_start, start + last * step, step):
            pages.add(result)
        return pages

    # The next chunk is read while this one is diagnosed (the store answers
    # on its own cores): two chunks in memory at most (three with workers:
    # one being read, one being diagnosed there, the answers of the one
    # before being put into the timeline here).
    with ThreadPoolExecutor(max_workers=1) as reader:
        coming = reader.submit(read, *rounds[0])
        pending = None
        for number, (first, last) in enumerate(rounds):
            pages = coming.result()
            if number + 1 < len(rounds):
                coming = reader.submit(read, *rounds[number + 1])
            began = time.monotonic()
            ordered = sorted(pages.replicas.items())
            if pool is None:
                chunk_start = pages.start
                answers = _diagnose_chunk(chunk_start, step, last - first + 1, ordered, replicas, window,
                                          thresholds, not pages_as_text)
                del pages, ordered
                for index, found in enumerate(answers):
                    _fleet_step(chunk_start + index * step, found, timeline, thresholds, step, fleet_holds)
            else:
                sent = pool.send(pages.start, step, last - first + 1, ordered)
                del pages, ordered  # the workers have their copies: not kept here while they work
                if pending is not None:
                    pool.merge(*pending, timeline, step, fleet_holds)
                pending = (sent, pool.receive())
            diagnose_seconds += time.monotonic() - began
            if progress:
                progress(f"{last + 1}/{points} steps, {len(replicas) if pool is None else len(pool.owner)} "
                         f"replicas, {client.cost.queries} queries")
    if pool is not None:
        began = time.monotonic()
        if pending is not None:
            pool.merge(*pending, timeline, step, fleet_holds)
        replicas = pool.finish()
        diagnose_seconds += time.monotonic() - began
    timeline.finish()
    for state in replicas.values():
        state.carried = None
    cost = client.cost.to_json()
    cost["total_seconds"] = round(time.monotonic() - started, 3)
    cost["diagnose_seconds"] = round(diagnose_seconds, 3)
    named = {state.name: state for state in replicas.values()}
    return History(start, end, step, window, source, selector, named, timeline, cost, diagnose_seconds, points)


class StepSink(Protocol):
    """Where diagnose_step puts a step's findings: the Timeline, or central mode's latest step."""

    def add(self, scope: str, at: float, findings, replica: str | None = None) -> None: ...

    def gap(self, replica: str, at: float, step: float) -> None: ...


def diagnose_step(at: float, index: int, ordered, replicas: dict, timeline: StepSink, window_seconds: float,
                   thresholds, step: float, fleet_holds: dict, fast: bool = True) -> None:
    """Every replica of `ordered` at one step, then the fleet rules."""
    results = []
    for key, replica in ordered:
        state = _state(replicas, key, replica, window_seconds)
        replica.earlier = state.carried  # read where its plan is made (its first step)
        results.append((state.name, _replica_step(state, replica, index, at, thresholds, fast)))
        state.carried = replica.carried()
    _fleet_step(at, results, timeline, thresholds, step, fleet_holds)


def _diagnose_chunk(start: float, step: float, points: int, ordered, replicas: dict, window_seconds: float,
                    thresholds, fast: bool) -> list[list]:
    """Every replica of `ordered` at each step of a chunk: per step, in
    replica order, (name, _replica_step's answer with its rows slimmed to
    what the fleet rules read). One replica's steps run one after another
    (its window stays in the CPU's caches: a quarter less CPU than every
    replica at one step, then the next step); the replicas' states are
    their own, so the answers are the same."""
    answers: list[list] = [[] for _ in range(points)]
    for key, replica in ordered:
        state = _state(replicas, key, replica, window_seconds)
        replica.earlier = state.carried
        for index in range(points):
            answer = _replica_step(state, replica, index, start + index * step, thresholds, fast)
            if answer is not None:  # the rows as the fleet rules read them: less to keep or send
                answer = answer[0], [(model, row.slim()) for model, row in answer[1]]
            answers[index].append((state.name, answer))
        state.carried = replica.carried()
    return answers


def _state(replicas: dict, key: tuple, replica, window_seconds: float) -> ReplicaState:
    state = replicas.get(key)
    if state is None:
        state = replicas[key] = ReplicaState(replica_name(replica.labels, key), replica.labels,
                                             make_adapter("vllm"), Window(window_seconds))
    return state


def _replica_step(state: ReplicaState, replica, index: int, at: float, thresholds, fast: bool = True):
    """One replica's sidecar pipeline at one step: None where it had no page
    then (a gap), else (its findings, [(model, ReplicaRow)] for the fleet
    rules). Reads and changes only the replica's own state."""
    if fast:
        read = replica.families(index)
        snapshot = state.adapter.adapt_families(read[0], [], read[1], at=at) if read is not None else None
    else:
        text = replica.page(index)
        snapshot = state.adapter.adapt(text, at=at) if text is not None else None
    if snapshot is None or not snapshot.engines:
        return None
    window = state.window
    entry = window.add(snapshot)
    state.steps += 1
    if len(window.entries) >= 2:
        for change in diagnosis.changes_between(window.entries[-2], entry):
            state.events.append(change)
    if any(s.restarted for s in entry.steps.values()):
        state.restarted_at = at
    # Only the signals the rules, the trend and the fleet rows read are
    # derived (LazyValues): history reports nothing else of a step.
    per_engine, per_model = evaluate_window(window, lazy=True)
    events = tuple(e for e in state.events if e.time >= at - window.seconds)
    if state.judgment is None:
        state.judgment = NowJudgment(window.seconds, thresholds)
    findings = diagnosis.diagnose(window, per_engine, events, thresholds or {},
                                  incumbents=state.judgment.incumbents())
    findings = state.judgment.judge(at, window, findings, events)
    restarted = state.restarted_at if state.restarted_at is not None and at - state.restarted_at <= window.seconds else None
    usage: float | None = None
    waiting: float | None = None
    hit: float | None = None
    rows = []
    for row in per_engine:
        state.models.add(row.model)
        values = row.values
        mine = [f for f in findings if f.model == row.model and f.engine == row.engine]
        rows.append((row.model, ReplicaRow(state.name, row.engine or "", values, row.view.increase.counters, mine,
                                           restarted)))
        u = _scalar(values.get("kvwatch_kv_cache_usage_ratio"))
        usage = u if usage is None or (u is not None and u > usage) else usage
        waiting = (waiting or 0.0) + (_scalar(values.get("kvwatch_requests_waiting")) or 0.0)
    for row in per_model:
        hit = _scalar(row.values.get("kvwatch_prefix_cache_hit_ratio"))
    state.trend.append((at, usage, waiting, hit))
    return findings, rows


def _scalar(value: float | dict[str, float] | None) -> float | None:
    """A scalar signal's value (the trend's three are never per-quantile)."""
    return None if isinstance(value, dict) else value


def _fleet_step(at: float, results: list, timeline: StepSink, thresholds, step: float, fleet_holds: dict) -> None:
    """The replicas' results at one step (name, _replica_step's answer), in
    replica order, into the timeline; then the fleet rules per model, each
    model's findings held as a replica's are (`fleet_holds`, model ->
    FindingHold, kept by the caller from step to step): the fleet alerts
    carry the same `keep_firing_for`."""
    by_model: dict[str, list[ReplicaRow]] = {}
    for name, result in results:
        if result is None:
            timeline.gap(name, at, step)
            continue
        findings, rows = result
        timeline.add(name, at, findings, replica=name)
        for model, row in rows:
            by_model.setdefault(model, []).append(row)
    for model in sorted(by_model.keys() | fleet_holds.keys()):
        hold = fleet_holds.get(model)
        if hold is None:
            hold = fleet_holds[model] = FindingHold(diagnosis.resolve_thresholds(thresholds).finding_hold_seconds)
        rows = by_model.get(model)
        held = hold.apply(at, fleet_findings(model, rows, thresholds) if rows else [])
        # A held finding about a replica with no data at this step is not
        # shown: the replica is down or gone, as its own page says.
        present = {row.replica for row in rows or ()}
        held = [f for f in held if f.clearing_since is None or f.evidence.get("replica") in present]
        if held or rows:
            timeline.add(f"fleet:{model}", at, held)
        else:  # the model is gone and nothing of it is held: forgotten
            del fleet_holds[model]


# --------------------------------------------------------------------------
# Replicas diagnosed in worker processes
# --------------------------------------------------------------------------


def _serve(connection, window_seconds: float, thresholds, fast: bool) -> None:
    """A worker: the replicas it is sent, chunk after chunk, each with its
    own state kept here from one chunk to the next; answers per step, in
    the order sent, [(name, _replica_step's answer)]."""
    states: dict[tuple, ReplicaState] = {}
    skeletons: dict[tuple, tuple] = {}  # key -> Replica.skeleton() of the replica as last sent whole
    while True:
        try:
            message = connection.recv()
        except EOFError:  # the diagnosis stopped (an error there)
            return
        if message[0] == "chunk":
            _kind, start, step, points, share = message
            try:
                ordered = _replicas_sent(share, skeletons)
                del share
                answers = _diagnose_chunk(start, step, points, ordered, states, window_seconds, thresholds, fast)
            except Exception:  # handed to the diagnosis, which raises it
                import traceback

                connection.send(("error", traceback.format_exc()))
                return
            del ordered
            connection.send(answers)
        else:  # "finish": the states, without the adapters (their caches are keyed by object ids)
            for state in states.values():
                state.adapter = state.carried = None
            connection.send(states)
            return


def _replicas_sent(share: list, skeletons: dict) -> list:
    """A chunk's (key, Replica) as _Workers.send sent them: whole, or the
    values alone of a replica whose series are those of the one sent whole
    before (its skeleton kept here)."""
    ordered = []
    for key, replica, values in share:
        if replica is None:
            replica = Replica.from_skeleton(skeletons[key], values)
        else:
            skeletons[key] = replica.skeleton()
        ordered.append((key, replica))
    return ordered


class _Workers:
    """Worker processes, each owning a fixed share of the replicas (given
    out in turn as they first appear), fed one chunk at a time."""

    def __init__(self, count: int, window_seconds: float, thresholds, fast: bool):
        import multiprocessing
        import threading

        from kvwatch.scrape import deadlines_held

        self.thresholds = thresholds
        self.owner: dict[tuple, int] = {}
        # key -> Replica.skeleton() of the replica as last sent whole to its worker
        self.sent: dict[tuple, tuple] = {}
        self.connections = []
        self.processes = []
        # Fork is fastest (nothing to import again) but only safe while no
        # other thread of this process may hold a lock: none runs, or only
        # the fetches' deadlines thread, held still while the workers fork
        # (a caller's earlier fetches leave it waiting; it holds no lock
        # then). Otherwise the workers are fresh interpreters (spawn).
        with deadlines_held() as watcher:
            others = [thread for thread in threading.enumerate() if thread is not threading.current_thread()]
            alone = all(thread is watcher for thread in others)
            forks = alone and "fork" in multiprocessing.get_all_start_methods()
            method = "fork" if forks else "spawn"
            context = multiprocessing.get_context("fork") if forks else multiprocessing.get_context("spawn")
            for _ in range(count):
                mine, theirs = context.Pipe()
                process = context.Process(target=_serve, args=(theirs, window_seconds, thresholds, fast), daemon=True)
                process.start()
                theirs.close()
                self.connections.append(mine)
                self.processes.append(process)
        self.method = method

    def send(self, start: float, step: float, points: int, ordered: list) -> tuple:
        """One chunk's replicas (key order) out to their workers; returns what
        merge needs: the steps' times and each key's worker."""
        shares: list[list] = [[] for _ in self.connections]
        sent = self.sent
        for key, replica in ordered:
            owner = self.owner.get(key)
            if owner is None:
                owner = self.owner[key] = len(self.owner) % len(self.connections)
            # A replica's series are nearly always the chunk before's: then
            # only their values go (pickling every series' labels and
            # filing again cost the parent as much per chunk as reading it,
            # and the worker as much to take them in).
            skeleton = replica.skeleton()
            if sent.get(key) == skeleton:
                shares[owner].append((key, None, replica.values_only()))
            else:
                sent[key] = skeleton
                shares[owner].append((key, replica, None))
        for connection, share in zip(self.connections, shares):
            connection.send(("chunk", start, step, points, share))
        return start, points, [self.owner[key] for key, _replica in ordered]

    def receive(self) -> list:
        answers = [connection.recv() for connection in self.connections]
        for answer in answers:
            if isinstance(answer, tuple):  # ("error", the worker's traceback)
                raise RuntimeError(f"a diagnosis worker failed:\n{answer[1]}")
        return answers

    def merge(self, sent: tuple, answers: list, timeline: Timeline, step: float, fleet_holds: dict) -> None:
        """Each step's answers back in replica order, into the timeline and
        the fleet rules, as diagnose_history does after _diagnose_chunk in one
        process."""
        start, points, owners = sent
        for index in range(points):
            taken = [iter(answer[index]) for answer in answers]
            _fleet_step(start + index * step, [next(taken[owner]) for owner in owners], timeline,
                        self.thresholds, step, fleet_holds)

    def finish(self) -> dict[tuple, ReplicaState]:
        states: dict[tuple, ReplicaState] = {}
        for connection in self.connections:
            connection.send(("finish",))
        for connection in self.connections:
            states.update(connection.recv())
        for state in states.values():
            state.adapter = make_adapter("vllm")
        return {key: states[key] for key in self.owner}  # in the order first seen, as in one process

    def close(self) -> None:
        for connection in self.connections:
            connection.close()
        for process in self.processes:
            process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
