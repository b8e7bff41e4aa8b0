"""Findings over time, folded into episodes: the one timeline format of
`kvwatch diagnose --replay` (one recorded target, fed the Monitor's states)
and `kvwatch diagnose --prometheus` (many replicas, fed each replica's
findings and each model's fleet findings at each step).

An episode is one finding (symptom, cause, model, engine) on one replica,
active over consecutive polls or steps; as JSON: symptom, cause,
model_name (the API's and the metrics' name), engine, start, end, polls,
worst {time, severity, confidence, summary, evidence, next_check},
active_at_end, replica ("" for a replay: its one target is named by the
capture). The worst point is the first poll at the episode's
highest severity, then confidence. A poll that failed, or a step where a
replica had no data, neither starts nor ends an episode (the window did not
move): it is kept as an outage (replay, with its reason) or a gap (history).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from kvwatch.diagnose.vocabulary import CONFIDENCES, SEVERITIES
from kvwatch.present import clean

_SEVERITY_RANK = {severity: len(SEVERITIES) - index for index, severity in enumerate(SEVERITIES)}
_CONFIDENCE_RANK = {confidence: len(CONFIDENCES) - index for index, confidence in enumerate(CONFIDENCES)}
MAX_EPISODES = 10_000
ACTIONABLE = ("critical", "warning")


@dataclass
class Episode:
    symptom: str
    cause: str
    model: str
    engine: str | None
    start: float
    end: float
    polls: int = 1
    worst: dict[str, Any] = field(default_factory=dict)
    active_at_end: bool = False
    replica: str = ""

    def rank(self) -> tuple[int, int]:
        return (_SEVERITY_RANK.get(self.worst.get("severity", ""), 0),
                _CONFIDENCE_RANK.get(self.worst.get("confidence", ""), 0))

    @property
    def actionable(self) -> bool:
        return self.worst.get("severity") in ACTIONABLE


def episode_json(episode: Episode) -> dict[str, Any]:
    """An episode as JSON, its model under `model_name` as the API's findings
    and the metrics' label name it."""
    return {("model_name" if key == "model" else key): value for key, value in asdict(episode).items()}


def _worst_of(finding, at: float) -> dict[str, Any]:
    worst = {"time": at, "severity": finding.severity, "confidence": finding.confidence,
             "summary": finding.summary, "evidence": clean(dict(finding.evidence)), "next_check": finding.next_check}
    # One story (diagnose/arbitration.py): what rode on it, and what it could not be told from.
    if finding.contributing:
        worst["contributing"] = [{k: v for k, v in c.items() if k != "evidence"} for c in finding.contributing]
    if finding.alternatives:
        worst["alternatives"] = [dict(a) for a in finding.alternatives]
    return worst


class Timeline:
    """Feed it in time order: `add_state()` with each State a Monitor
    publishes (a replay), or `add()` with each scope's findings at each step
    and `gap()` where a replica had no data (history); then `finish()`."""

    def __init__(self) -> None:
        self.episodes: list[Episode] = []
        self.dropped = 0
        self.gaps: dict[str, list[list[float]]] = {}
        self.outages: list[dict[str, Any]] = []
        self.polls = 0
        self.failed = 0
        self.first: float | None = None
        self.last: float | None = None
        # Open episodes per scope: a step's add() for one scope ends only
        # that scope's (looking through every scope's made a fleet's step
        # cost replicas x open episodes).
        self._open: dict[str, dict[tuple, Episode]] = {}

    def add(self, scope: str, at: float, findings: Iterable, replica: str | None = None) -> None:
        """The findings of one scope (a replica, or one model's fleet rules)
        at one step: episodes of the scope not in `findings` end. `replica`
        names the replica of every finding; without it, each finding's
        evidence["replica"] does."""
        seen = set()
        open_here = self._open.get(scope)
        if open_here is None:
            open_here = self._open[scope] = {}
        for finding in findings:
            where = replica if replica is not None else str(finding.evidence.get("replica", ""))
            key = (scope, where, finding.symptom, finding.cause, finding.model, finding.engine)
            seen.add(key)
            episode = open_here.get(key)
            if episode is None:
                if len(self.episodes) >= MAX_EPISODES:
                    self.dropped += 1
                    continue
                episode = Episode(finding.symptom, finding.cause, finding.model, finding.engine, at, at,
                                  worst=_worst_of(finding, at), replica=where)
                open_here[key] = episode
                self.episodes.append(episode)
                continue
            episode.end = at
            episode.polls += 1
            candidate = (_SEVERITY_RANK.get(finding.severity, 0), _CONFIDENCE_RANK.get(finding.confidence, 0))
            if candidate > episode.rank():
                episode.worst = _worst_of(finding, at)
        for key in [key for key in open_here if key not in seen]:
            del open_here[key]
        if not open_here:
            del self._open[scope]

    def add_state(self, state, replica: str = "") -> None:
        """One poll of a Monitor: a failed one is an outage (consecutive
        failures for one reason are one), a successful one's findings go to
        `add()`."""
        at = state.last_poll_time
        self.polls += 1
        self.first = at if self.first is None else self.first
        self.last = at
        if not state.up:
            self.failed += 1
            outage = self.outages[-1] if self.outages else None
            if outage and outage["reason"] == state.reason and outage["open"]:
                outage.update(end=at, polls=outage["polls"] + 1)
            else:
                self.outages.append({"reason": state.reason, "detail": state.detail, "start": at, "end": at,
                                     "polls": 1, "open": True})
            return
        if self.outages:
            self.outages[-1]["open"] = False
        self.add(replica, at, state.findings, replica=replica)

    def gap(self, replica: str, at: float, step: float) -> None:
        spans = self.gaps.setdefault(replica, [])
        if spans and abs(spans[-1][1] + step - at) < step / 2:
            spans[-1][1] = at
        else:
            spans.append([at, at])

    def finish(self) -> "Timeline":
        for open_here in self._open.values():
            for episode in open_here.values():
                episode.active_at_end = True
        for outage in self.outages:
            outage.pop("open", None)
        self.episodes.sort(key=lambda e: (e.start, -e.rank()[0], e.model, e.replica, e.symptom, e.cause))
        return self

    @property
    def actionable(self) -> bool:
        return any(episode.actionable for episode in self.episodes)

    def by_model(self) -> dict[str, list[Episode]]:
        models: dict[str, list[Episode]] = {}
        for episode in self.episodes:
            models.setdefault(episode.model, []).append(episode)
        return models

    def findings_json(self) -> list[dict[str, Any]]:
        return [episode_json(e) for e in self.episodes]

    def to_json(self) -> dict[str, Any]:
        """A replay's report: the polls, the findings, the failed fetches."""
        return {
            "polls": self.polls,
            "failed_polls": self.failed,
            "start": self.first,
            "end": self.last,
            "findings": self.findings_json(),
            "findings_dropped": self.dropped,
            "outages": [dict(o) for o in self.outages],
        }

    def signature(self) -> list[tuple]:
        """Every value of every episode, comparable (a replay against live)."""
        return [(e.symptom, e.cause, e.model, e.engine, e.replica, e.start, e.end, e.polls, e.worst["time"],
                 e.worst["severity"], tuple(sorted(e.worst["evidence"].items()))) for e in self.episodes]

    def outline(self, step: float = 1.0) -> list[tuple]:
        """Cause, place, and start/end in steps (two readings of one history)."""
        return sorted((e.symptom, e.cause, e.model, e.engine, e.replica, round(e.start / step), round(e.end / step))
                      for e in self.episodes)
