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
Monitor) and the history (one hold per replica) apply the same hold.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from kvwatch.diagnose.vocabulary import Finding, finding_order


def hold_key(finding: Finding) -> tuple:
    """What a finding is across polls: its symptom and cause where it is
    (model, engine, and the replica a fleet finding names)."""
    return (finding.symptom, finding.cause, finding.model, finding.engine or "",
            str(finding.evidence.get("replica", "")))


class FindingHold:
    """Feed `apply()` each poll's findings in time order; it returns them plus
    the findings still held. Bounded: it keeps only findings active at the
    last poll (each at most one record)."""

    def __init__(self, seconds: float):
        self.seconds = max(0.0, float(seconds))
        # key -> (the finding as last seen, the time its condition was first found clear or None)
        self._held: dict[tuple, tuple[Finding, float | None]] = {}

    def apply(self, at: float, findings: Iterable[Finding]) -> list[Finding]:
        current = list(findings)
        seen = {hold_key(f) for f in current}
        held: dict[tuple, tuple[Finding, float | None]] = {hold_key(f): (f, None) for f in current}
        out = list(current)
        for key, (finding, clear_since) in self._held.items():
            if key in seen:
                continue
            since = at if clear_since is None else clear_since
            if at - since < self.seconds:
                held[key] = (finding, since)
                out.append(replace(finding, clearing_since=since))
        self._held = held
        out.sort(key=finding_order)
        return out
