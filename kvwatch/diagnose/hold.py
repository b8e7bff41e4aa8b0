"""The hold: a finding stays active until its condition has been clear for
`finding_hold_seconds` (diagnose/thresholds.py), measured from the first poll
that found it clear, as Prometheus measures an alert's `keep_firing_for`.

Rules judge one window at a time, and a window's quantiles, shares and counts
cross their thresholds by noise; without a hold a finding that lapses for one
poll leaves the page, the API and `kvwatch_finding` for that poll and comes
back, which sends an alert's `for:` back to pending or resolves and re-fires
it. While held, a finding is reported as it was last seen, with
`clearing_since` set; if its condition holds again it is plain active again,
and after the hold it ends. The sidecar (Monitor), a replay (which runs the
Monitor), the history and central mode (one hold per replica, and one per
model for its fleet findings) apply the same hold.

Its severity never falls while it lasts: a rule may judge one episode
critical at one poll and warning at the next (an exhaustion is critical
while preemptions are in the window, warning once they have left it but the
cache is still full), and `kvwatch_finding` carries the severity as a label,
so a fall would end one series and start another: an alert on the first
resolves and one on the second starts its `for:` over. The finding keeps the
highest severity seen since it began; a rise shows at once.

A finding held while clearing is reported only while no other cause of its
symptom on its engine is active (diagnose/arbitration.py), unless it was the
story's primary and the active rival is less sure (the rival rides on it):
when the primary changes on stronger evidence, the story changes with it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from kvwatch.diagnose.arbitration import arbitrate, primaries
from kvwatch.diagnose.vocabulary import SEVERITIES, Finding


def hold_key(finding: Finding) -> tuple:
    """What a finding is across polls: its symptom and cause where it is
    (model, engine, and the replica a fleet finding names)."""
    return (finding.symptom, finding.cause, finding.model, finding.engine or "",
            str(finding.evidence.get("replica", "")))


# The most findings held while clearing: findings that come and go with new
# names each poll (a served model name per request) were each held for the
# whole hold, a hold's worth of them on the page and in the API.
MAX_HELD = 100


class FindingHold:
    """Feed `apply()` each poll's findings in time order; it returns them plus
    the findings still held. Bounded: it keeps only findings active at the
    last poll (each at most one record), and at most MAX_HELD clearing ones,
    those that cleared last."""

    def __init__(self, seconds: float):
        self.seconds = max(0.0, float(seconds))
        # key -> (the finding as last seen, the time its condition was first found clear or None)
        self._held: dict[tuple, tuple[Finding, float | None]] = {}
        # (story, cause) of each primary reported at the last poll (arbitration.primaries)
        self._primaries: set[tuple] = set()

    def apply(self, at: float, findings: Iterable[Finding]) -> list[Finding]:
        current = [self._no_lower(f) for f in findings]
        seen = {hold_key(f) for f in current}
        held: dict[tuple, tuple[Finding, float | None]] = {hold_key(f): (f, None) for f in current}
        out = list(current)
        clearing = []
        for key, (finding, clear_since) in self._held.items():
            if key in seen:
                continue
            since = at if clear_since is None else clear_since
            if at - since < self.seconds:
                clearing.append((since, key, finding))
        if len(clearing) > MAX_HELD:
            # Those that cleared last stay (sorted is stable: the order they were held in breaks ties).
            clearing = sorted(clearing, key=lambda item: item[0], reverse=True)[:MAX_HELD]
            clearing.reverse()
        for since, key, finding in clearing:
            held[key] = (finding, since)
            out.append(replace(finding, clearing_since=since))
        self._held = held
        # One story per engine and symptom: a held finding never stands beside
        # an active cause of the same symptom (it is kept here and comes back
        # if its rival clears first); between held ones, the last primary stays.
        out = arbitrate(out, self._primaries)
        self._primaries = primaries(out)
        return out

    def incumbents(self) -> set[tuple]:
        """The primary cause of each story at the last poll (active or held):
        what diagnose() keeps on a tie (arbitration.strength)."""
        return self._primaries

    def _no_lower(self, finding: Finding) -> Finding:
        """The finding at the highest severity seen since it began (its
        record here, active or held, is the episode's)."""
        before = self._held.get(hold_key(finding))
        if before is None:
            return finding
        severity = before[0].severity
        if _rank(severity) < _rank(finding.severity):
            return replace(finding, severity=severity)
        return finding


def _rank(severity: str) -> int:
    return SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)
