"""Findings over time, folded into episodes: one finding (symptom, cause,
model, engine) on one replica, active over consecutive steps, with its start,
end and the evidence at its worst point.

The episode's fields and JSON are those of the findings timeline over a
recorded capture (`kvwatch diagnose --replay`: symptom, cause, model, engine,
start, end, polls, worst {time, severity, confidence, summary, evidence,
next_check}, active_at_end), plus `replica`, so the two can become one
timeline format. A step where the replica had no data neither starts nor
ends an episode; it is recorded as a gap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from kvwatch.diagnose.vocabulary import CONFIDENCES, SEVERITIES
from kvwatch.sidecar.report import _clean

_SEVERITY_RANK = {severity: len(SEVERITIES) - index for index, severity in enumerate(SEVERITIES)}
_CONFIDENCE_RANK = {confidence: len(CONFIDENCES) - index for index, confidence in enumerate(CONFIDENCES)}
MAX_EPISODES = 10_000


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
        return (_SEVERITY_RANK.get(self.worst.get("severity"), 0),
                _CONFIDENCE_RANK.get(self.worst.get("confidence"), 0))


def _worst_of(finding, at: float) -> dict[str, Any]:
    return {"time": at, "severity": finding.severity, "confidence": finding.confidence,
            "summary": finding.summary, "evidence": _clean(dict(finding.evidence)), "next_check": finding.next_check}


class Timeline:
    """Feed it each replica's findings at each step, in time order."""

    def __init__(self) -> None:
        self.episodes: list[Episode] = []
        self.dropped = 0
        self.gaps: dict[str, list[list[float]]] = {}
        self._open: dict[tuple, Episode] = {}

    def add(self, scope: str, at: float, findings: Iterable, replica: str | None = None) -> None:
        """The findings of one scope (a replica, or one model's fleet rules)
        at one step: episodes of the scope not in `findings` end. `replica`
        names the replica of every finding; without it, each finding's
        evidence["replica"] does."""
        seen = set()
        for finding in findings:
            where = replica if replica is not None else str(finding.evidence.get("replica", ""))
            key = (scope, where, finding.symptom, finding.cause, finding.model, finding.engine)
            seen.add(key)
            episode = self._open.get(key)
            if episode is None:
                if len(self.episodes) >= MAX_EPISODES:
                    self.dropped += 1
                    continue
                episode = Episode(finding.symptom, finding.cause, finding.model, finding.engine, at, at,
                                  worst=_worst_of(finding, at), replica=where)
                self._open[key] = episode
                self.episodes.append(episode)
                continue
            episode.end = at
            episode.polls += 1
            candidate = (_SEVERITY_RANK.get(finding.severity, 0), _CONFIDENCE_RANK.get(finding.confidence, 0))
            if candidate > episode.rank():
                episode.worst = _worst_of(finding, at)
        for key in [key for key in self._open if key[0] == scope and key not in seen]:
            del self._open[key]

    def gap(self, replica: str, at: float, step: float) -> None:
        spans = self.gaps.setdefault(replica, [])
        if spans and abs(spans[-1][1] + step - at) < step / 2:
            spans[-1][1] = at
        else:
            spans.append([at, at])

    def finish(self) -> "Timeline":
        for episode in self._open.values():
            episode.active_at_end = True
        self.episodes.sort(key=lambda e: (e.start, -e.rank()[0], e.model, e.replica, e.symptom, e.cause))
        return self

    def by_model(self) -> dict[str, list[Episode]]:
        models: dict[str, list[Episode]] = {}
        for episode in self.episodes:
            models.setdefault(episode.model, []).append(episode)
        return models

    def to_json(self) -> list[dict[str, Any]]:
        return [asdict(e) for e in self.episodes]

    def signature(self, step: float = 1.0) -> list[tuple]:
        """Comparable values: cause, place, and start/end in steps."""
        return sorted((e.symptom, e.cause, e.model, e.engine, round(e.start / step), round(e.end / step))
                      for e in self.episodes)
