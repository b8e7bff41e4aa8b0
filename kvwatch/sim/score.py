"""The timeline scorer: a scenario run through the whole pipeline on
simulated time (no sleeping), every poll scored against the story its phase
states (kvwatch/sim/story.py).

The sidecar's Monitor polls the simulated engine's page, its RAG service's
page (the upstream histogram) and its KV-cache events (fed as the stream's
messages), exactly the sources `make run` gives it; only the clock and the
transport are the simulation's. Per poll it takes the findings as
`/api/v1/diagnosis` lists them, and scores:

- the banner: the first active finding (changes aside, they are events) is
  the phase's `lead`, or nothing is active where the lead is `nothing`;
  scored from `settle` seconds after each phase starts;
- false findings: findings neither the lead nor fair, in minutes of scored
  polls (and those at high confidence);
- cause changes: the primary cause of one symptom changing within a phase;
- toggles: a finding going from active to clearing and back, after `settle`;
- findings born clearing (first seen held);
- time from a phase's start to its lead's finding, and from its end until
  that finding has ended (gone, or shown clearing: "ended at"), when the
  next phase does not also allow it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from kvwatch.diagnose.causes import CAUSE
from kvwatch.pipeline.monitor import Monitor
from kvwatch.scrape import RenderedPage
from kvwatch.settings import load_settings
from kvwatch.sim.kvevents import attach
from kvwatch.sim.render import render_app_metrics, render_metrics
from kvwatch.sim.scenario import Scenario, load_scenario
from kvwatch.sim.simulation import Simulation
from kvwatch.sim.story import UNSCORED_SYMPTOMS, Story

SIM_BASE = 1_700_000_000.0
SETTLE_SECONDS = 75.0
MAX_WRONG = 200
FULL = 0.9  # usage of a full simulated cache (the diagnosis' exhaustion_usage_ratio)
# The bars of the story over time (per loop of the demo, and per phase).
BARS = {"banner_right_share": 0.97, "false_minutes": 0.5, "false_high_minutes": 0.0, "cause_changes_per_phase": 1,
        "toggles": 0, "born_clearing": 0, "start_seconds": 45.0, "clear_seconds": 75.0}


@dataclass(frozen=True)
class Seen:
    """One finding as a poll listed it."""

    symptom: str
    cause: str
    severity: str
    confidence: str
    clearing: bool
    summary: str
    evidence: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass
class Poll:
    at: float  # simulated seconds since the start
    phase: int  # index in the scenario's phases
    cycle: int
    into: float  # seconds into the phase
    findings: tuple[Seen, ...]
    # Requests the simulated engines hold waiting (the truth, not kvwatch's
    # reading): a phase's load outlives it until its queue drains.
    waiting: int = 0
    # The simulated cache ran out since the last poll (a preemption, or full
    # with requests waiting): when an exhaustion's condition truly starts.
    full: bool = False

    @property
    def banner(self) -> Seen | None:
        scored = [f for f in self.findings if f.symptom not in UNSCORED_SYMPTOMS]
        active = [f for f in scored if not f.clearing]
        return active[0] if active else (scored[0] if scored else None)


# The simulated sources, as the Monitor's targets (the simulation stands in for each).
SIM_SOURCES = {"target": "http://127.0.0.1:9/metrics", "upstream_target": "http://127.0.0.1:9/app/metrics",
               "upstream_histogram": "app_retrieval_seconds", "kv_events": "tcp://127.0.0.1:9"}


def settings_for(config_file: str | None = None, overrides: dict[str, Any] | None = None,
                 diagnosis: dict[str, Any] | None = None, sources: dict[str, str] | None = None):
    """The sidecar's settings (a config file such as scripts/demo-kvwatch.yaml,
    or the defaults, never the environment's), with `sources` as its targets:
    the simulated ones unless given (a real engine's, for the tier)."""
    fixed = SIM_SOURCES if sources is None else sources
    settings = load_settings(config_file, overrides={**fixed, **(overrides or {})}, environ={})
    if diagnosis is not None:
        settings.diagnosis = {**(settings.diagnosis or {}), **diagnosis}
    return settings


def run_scenario(scenario: Scenario | str, settings, until: float, seed: int = 0) -> list[Poll]:
    """Every poll of a Monitor reading the simulated scenario for `until`
    simulated seconds at the settings' poll interval."""
    if isinstance(scenario, str):
        scenario = load_scenario(scenario)
    sim = Simulation(scenario, seed=seed, created_unix=SIM_BASE)
    attach(sim.engines)
    monitor = Monitor(settings, fetcher=RenderedPage(lambda: render_metrics(sim.engines, sim.model_name, SIM_BASE,
                                                                     include_process=False)),
                      clock=lambda: SIM_BASE + sim.now)
    if monitor.upstream is not None:
        monitor.upstream.fetcher = RenderedPage(lambda: render_app_metrics(sim.app_retrieval, SIM_BASE))
    every = settings.poll_interval
    sequences = [0] * len(sim.engines)
    preemptions = 0
    polls = []
    at = 0.0
    while at < until - 1e-9:
        at = min(until, at + every)
        sim.advance_to(at)
        if monitor.kv_events is not None:
            for engine in sim.engines:
                recorder = engine.pool.events
                events = recorder.take() if recorder is not None else None
                if recorder is not None and events:
                    # The recorder's own payload: the layout it publishes (vLLM's unless the scenario says).
                    monitor.kv_events.feed(sequences[engine.index], recorder.payload(SIM_BASE + at, events, engine.index),
                                           now=SIM_BASE + at)
                    sequences[engine.index] += 1
        state = monitor.poll_once()
        now_preempted = sum(e.stats.num_preemptions for e in sim.engines)
        waiting = sum(len(e.waiting) for e in sim.engines)
        full = now_preempted > preemptions or (waiting > 0 and max(e.pool.usage() for e in sim.engines) >= FULL)
        preemptions = now_preempted
        status = sim.phase_status()
        phase = scenario.phases[sim.phase_index]
        into = phase.duration - status["next_in_seconds"] if status["next_in_seconds"] is not None else at
        polls.append(poll_of(at, sim.phase_index, into, state.findings, sim.cycle, waiting, full))
    return polls


def poll_of(at: float, phase: int, into: float, findings, cycle: int = 0, waiting: int = 0,
            full: bool = False) -> Poll:
    """One poll's findings (the Monitor's, as `/api/v1/diagnosis` lists
    them), placed in its phase: a simulated run and a real engine's scripted
    sequence are scored from the same records."""
    return Poll(at, phase, cycle, into, tuple(
        Seen(f.symptom, f.cause, f.severity, f.confidence, f.clearing_since is not None, f.summary, dict(f.evidence))
        for f in findings), waiting, full)


@dataclass(frozen=True)
class Phase:
    """A scored phase of a sequence the simulator did not run (a real
    engine's scripted load): its name and its story."""

    name: str
    story: Story | None


@dataclass(frozen=True)
class Timeline:
    """The phases of such a sequence, in order, scored as a scenario's are."""

    phases: tuple[Phase, ...]


class PollRecorder:
    """Each successful poll of a live Monitor (one of its `after_poll`
    listeners): when, its findings, and whether the cache ran out since the
    poll before (a preemption, or a full cache with requests waiting), read
    from the engine's page as the simulator's truth is read from it. `polls()`
    places them in the phases of a scripted sequence, for `score()`."""

    def __init__(self) -> None:
        self.records: list[tuple[float, tuple, bool]] = []
        self._preempted: float | None = None

    def __call__(self, state) -> None:
        if not state.up or state.snapshot is None:
            return
        engines = state.snapshot.engines.values()
        preempted = sum(e.counters.get("preemptions", 0.0) for e in engines)
        waiting = sum(e.gauges.get("waiting", 0.0) for e in engines)
        usage = max((e.gauges.get("kv_usage", 0.0) for e in engines), default=0.0)
        full = (self._preempted is not None and preempted > self._preempted) or (waiting > 0 and usage >= FULL)
        self._preempted = preempted
        self.records.append((state.last_poll_time, tuple(state.findings), full))

    def polls(self, starts: list[float]) -> list[Poll]:
        """The polls from the first phase's start on, each in the phase whose
        start (on the Monitor's clock) it follows; times from the first start."""
        out = []
        for at, findings, full in list(self.records):
            phase = sum(1 for start in starts if start <= at) - 1
            if phase >= 0:
                out.append(poll_of(at - starts[0], phase, at - starts[phase], findings, full=full))
        return out


@dataclass
class Score:
    polls: int = 0
    scored: int = 0
    banner_right: int = 0
    false_seconds: float = 0.0
    false_high_seconds: float = 0.0
    cause_changes_max: int = 0
    toggles: int = 0
    born_clearing: int = 0
    contradictions: int = 0  # finding texts that contradict the poll's findings (contradictions())
    start_seconds: list[tuple[str, float | None]] = field(default_factory=list)
    clear_seconds: list[tuple[str, float | None]] = field(default_factory=list)
    # Per phase run: [polls whose banner was right, polls scored]
    banner_by_phase: dict[str, list[int]] = field(default_factory=dict)
    # What was wrong, said once per phase run and kind: sentence -> [first, last seconds into the phase, polls]
    wrong: dict[str, list[float]] = field(default_factory=dict)

    def note(self, name: str, what: str, into: float) -> None:
        key = f"{name}: {what}"
        seen = self.wrong.get(key)
        if seen is None and len(self.wrong) < MAX_WRONG:
            self.wrong[key] = [into, into, 1]
        elif seen is not None:
            seen[1], seen[2] = into, seen[2] + 1

    def wrong_lines(self) -> list[str]:
        return [f"{key} (+{first:.0f}..{last:.0f}s, {count:.0f} polls)" for key, (first, last, count) in self.wrong.items()]

    @property
    def banner_right_share(self) -> float:
        return self.banner_right / self.scored if self.scored else 1.0

    def worst(self, pairs) -> float | None:
        """The longest delay of `pairs`, None when one never happened (inf)."""
        values = [v for _, v in pairs]
        return None if any(v is None for v in values) else max(values, default=0.0)

    def failures(self, bars: dict[str, float] = BARS) -> list[str]:
        """Each bar missed, as a sentence."""
        out = []
        if self.banner_right_share < bars["banner_right_share"]:
            out.append(f"banner right on {self.banner_right_share:.1%} of scored polls")
        if self.false_seconds / 60 > bars["false_minutes"]:
            out.append(f"{self.false_seconds / 60:.2f} min of false findings")
        if self.false_high_seconds / 60 > bars["false_high_minutes"]:
            out.append(f"{self.false_high_seconds / 60:.2f} min of false high-confidence findings")
        if self.cause_changes_max > bars["cause_changes_per_phase"]:
            out.append(f"{self.cause_changes_max} cause changes in one phase")
        if self.toggles > bars["toggles"]:
            out.append(f"{self.toggles} active/clearing toggles")
        if self.contradictions:
            out.append(f"{self.contradictions} finding texts contradict their poll's findings")
        if self.born_clearing > bars["born_clearing"]:
            out.append(f"{self.born_clearing} findings born clearing")
        out += [f"{name}: its finding {'never started' if v is None else f'started after {v:.0f} s'}"
                for name, v in self.start_seconds if v is None or v > bars["start_seconds"]]
        out += [f"{name}: its finding {'never cleared' if v is None else f'cleared {v:.0f} s after its end'}"
                for name, v in self.clear_seconds if v is None or v > bars["clear_seconds"]]
        return out

    def figures(self) -> dict[str, Any]:
        return {"polls": self.polls, "scored": self.scored, "banner_right": round(self.banner_right_share, 4),
                "false_min": round(self.false_seconds / 60, 2), "false_high_min": round(self.false_high_seconds / 60, 2),
                "cause_changes_max": self.cause_changes_max, "toggles": self.toggles,
                "born_clearing": self.born_clearing, "contradictions": self.contradictions, "start_worst_s": self.worst(self.start_seconds),
                "clear_worst_s": self.worst(self.clear_seconds)}


def _stretches(polls: list[Poll]) -> list[list[Poll]]:
    """The polls of each phase as it ran (a loop runs each phase again)."""
    out: list[list[Poll]] = []
    for poll in polls:
        if out and (out[-1][0].phase, out[-1][0].cycle) == (poll.phase, poll.cycle):
            out[-1].append(poll)
        else:
            out.append([poll])
    return out


def score(scenario: Scenario | Timeline, polls: list[Poll], settle: float = SETTLE_SECONDS) -> Score:
    """The score of a run's polls against its phases' stories (phases
    without a story are not scored). A phase's condition ends at its end, or
    where requests it queued still wait then, when that queue drains: its
    lead and fair findings stay fair in the next phase until `settle` after
    that, and its lead's clearing is measured from there."""
    result = Score(polls=len(polls))
    stretches = _stretches(polls)
    carried: tuple[tuple[str, ...], float] | None = None  # the last phase's findings, fair until then
    previous: Poll | None = None
    for index, stretch in enumerate(stretches):
        story = scenario.phases[stretch[0].phase].story
        following = stretches[index + 1] if index + 1 < len(stretches) else None
        ended = _condition_end(stretch, following)
        if story is not None:
            _score_stretch(result, scenario, story, stretch, following, previous, settle, carried, ended)
        carried = ((story.lead, *story.fair) if story.lead else story.fair, ended + settle) \
            if story is not None else None
        previous = stretch[-1]
    return result


def _condition_start(story: Story, stretch: list[Poll]) -> float:
    """Seconds into the phase its lead's condition began: an exhaustion when
    the simulated cache first ran out (a few requests that grow fill it late
    in their phase), any other at the phase's start."""
    if story.lead is None or not story.lead.startswith("exhaustion"):
        return 0.0
    return next((p.into for p in stretch if p.full), stretch[-1].into)


def _condition_end(stretch: list[Poll], following: list[Poll] | None) -> float:
    if not stretch[-1].waiting or following is None:
        return stretch[-1].at
    return next((p.at for p in following if not p.waiting), following[-1].at)


def _score_stretch(result: Score, scenario: Scenario | Timeline, story: Story, stretch: list[Poll],
                   following: list[Poll] | None, before: Poll | None, settle: float,
                   carried: tuple[tuple[str, ...], float] | None, ended: float) -> None:
    name = f"{scenario.phases[stretch[0].phase].name} (cycle {stretch[0].cycle})"
    every = stretch[1].at - stretch[0].at if len(stretch) > 1 else 0.0
    changes: dict[str, int] = {}
    last = before
    began = _condition_start(story, stretch)
    for poll in stretch:
        if poll.into >= settle:
            fair = Story(story.lead, story.fair + (carried[0] if carried and poll.at <= carried[1] else ()))
            if poll.into < began:  # its condition has not begun: nothing, or the lead seen early, is right
                fair = Story(None, fair.fair + ((story.lead,) if story.lead else ()))
            _score_poll(result, fair, poll, every, name)
            for key in _toggles(last, poll):
                result.toggles += 1
                result.note(name, f"toggle {'/'.join(key)}", poll.into)
        for symptom, (was, now) in _changes(last, poll).items():
            changes[symptom] = changes.get(symptom, 0) + 1
            result.note(name, f"cause change {symptom}: {was} -> {now}", poll.into)
        for text in contradictions(poll):
            result.contradictions += 1
            result.note(name, "contradiction: " + text, poll.into)
        for key in _born_clearing(last, poll):
            result.born_clearing += 1
            result.note(name, f"born clearing {'/'.join(key)}", poll.into)
        last = poll
    result.cause_changes_max = max([result.cause_changes_max, *changes.values()])
    if story.lead is not None and stretch[-1].into >= settle:
        # Looked for into the next phase too: a condition that begins late in its phase is still its.
        began_at = stretch[0].at - stretch[0].into + began
        start = next((p.at - began_at for p in stretch + (following or []) if p.at >= began_at and any(
            story.leads(f.symptom, f.cause) and not f.clearing for f in p.findings)), None)
        result.start_seconds.append((name, start))
    if story.lead is not None and following is not None:
        after = scenario.phases[following[0].phase].story
        if after is not None and not after.allows(*story.lead.partition("/")[::2]) and following[-1].at >= ended + settle:
            # Ended: gone, or shown clearing ("ended at"), which the hold keeps as its alert keeps firing.
            gone = next((p.at - ended for p in following if p.at >= ended and not any(
                story.leads(f.symptom, f.cause) and not f.clearing for f in p.findings)), None)
            result.clear_seconds.append((name, gone))


def _score_poll(result: Score, story: Story, poll: Poll, every: float, name: str) -> None:
    result.scored += 1
    banner = poll.banner
    right = (banner is None or banner.clearing or story.allows(banner.symptom, banner.cause)) if story.lead is None \
        else (banner is not None and story.leads(banner.symptom, banner.cause))
    result.banner_right += right
    tally = result.banner_by_phase.setdefault(name, [0, 0])
    tally[0], tally[1] = tally[0] + right, tally[1] + 1
    if not right:
        result.note(name, "banner " + ("nothing" if banner is None else f"{banner.symptom}/{banner.cause}"
                                       + (" (clearing)" if banner.clearing else "")), poll.into)
    for finding in poll.findings:
        if finding.clearing or story.allows(finding.symptom, finding.cause):
            continue
        result.false_seconds += every
        if finding.confidence == "high":
            result.false_high_seconds += every
        result.note(name, f"false {finding.symptom}/{finding.cause} ({finding.severity}, {finding.confidence})",
                    poll.into)


# Prose that says the cache was not exhausted (exhaustion.py, first_token.py, hit_rate.py).
NOT_EXHAUSTED = ("not exhausted",)


def contradictions(poll: Poll) -> list[str]:
    """Finding texts that contradict what the same poll shows: a card
    headlined exhaustion whose body says the cache was not exhausted, or
    another active finding saying so beside an active exhaustion."""
    exhausted = any(f.symptom == "exhaustion" and f.severity != "info" and not f.clearing for f in poll.findings)
    out = []
    for finding in poll.findings:
        says_not = any(phrase in finding.summary.lower() for phrase in NOT_EXHAUSTED)
        if says_not and finding.symptom == "exhaustion" and finding.severity != "info":
            out.append(f"{finding.symptom}/{finding.cause} ({finding.severity}) says the cache was not exhausted")
        elif says_not and exhausted and not finding.clearing and finding.symptom != "exhaustion":
            out.append(f"{finding.symptom}/{finding.cause} says the cache was not exhausted beside an active exhaustion")
    return out


def _primary(poll: Poll) -> dict[str, str]:
    """Each symptom's shown cause; a subordinate cause (causes.Cause.subordinate:
    only the reason another could happen, a latent risk once the harm ended)
    is no rival story."""
    return {f.symptom: f.cause for f in poll.findings if not f.clearing and f.symptom not in UNSCORED_SYMPTOMS
            and not (CAUSE.get(f.cause) is not None and CAUSE[f.cause].subordinate)}


def _changes(last: Poll | None, poll: Poll) -> dict[str, tuple[str, str]]:
    """symptom -> (cause before, cause now) where its primary changed."""
    if last is None:
        return {}
    before = _primary(last)
    return {symptom: (before[symptom], cause) for symptom, cause in _primary(poll).items()
            if symptom in before and before[symptom] != cause}


def _keys(poll: Poll, clearing: bool) -> set[tuple[str, str]]:
    return {(f.symptom, f.cause) for f in poll.findings if f.clearing == clearing}


def _toggles(last: Poll | None, poll: Poll) -> set[tuple[str, str]]:
    """Findings clearing at the last poll and active again at this one."""
    return set() if last is None else _keys(last, True) & _keys(poll, False)


def _born_clearing(last: Poll | None, poll: Poll) -> set[tuple[str, str]]:
    seen = set() if last is None else _keys(last, True) | _keys(last, False)
    return _keys(poll, True) - seen


def score_runs(scenario: str, settings, until: float, seeds: Iterable[int]) -> list[tuple[int, Score]]:
    loaded = load_scenario(scenario)
    return [(seed, score(loaded, run_scenario(loaded, settings, until, seed))) for seed in seeds]
