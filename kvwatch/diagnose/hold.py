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

Hysteresis, written once, with each symptom's seconds in the cause
catalogue (causes.Symptom `quiet`, `lead`, `handover`): a condition clear for
less than `quiet` is not shown (the finding stays plain active as last seen,
so a lapse does not toggle the page), but no longer than the finding stood
before it and never less than `handover` (a harm whose lapse stands beside
its own advisory, the warning sign seen without the harm, is intermittent:
its lapse is hidden for the whole hold), and not at all where the now span's
evidence says the condition is clearly over (NowJudgment's `over`: for an
exhaustion, nothing preempted or full and the cache well below the line with
nothing waiting), which is no flicker near a threshold; a new cause of a story replaces the
cause shown only once it has led for `lead` (until then the shown cause
stays, as last seen), or, where the rules no longer find the shown cause at
all, after its `handover` (unless both are exclusive readings of one
evidence, causes.Cause.exclusive, or two parts of one exhausted cache's harm,
causes.Cause.while_exhausted: then the new one must lead); and a finding is
never first shown already clearing, nor while its condition is clear (one the
last poll did not show, hidden behind an active rival, stays hidden).

A finding held while clearing is reported only while no other cause of its
symptom on its engine is active (diagnose/arbitration.py), unless it was the
story's primary and the active rival is less sure (the rival rides on it):
when the primary changes on stronger evidence, the story changes with it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Collection, Iterable

from kvwatch.diagnose.arbitration import arbitrate, group_key, primaries
from kvwatch.diagnose.causes import CAUSE, SYMPTOMS
from kvwatch.diagnose.vocabulary import SEVERITIES, Finding, is_actionable


def where(finding: Finding) -> tuple[str, str, str]:
    """Where a finding's symptom stands: (symptom, model, engine); the now span judges each apart."""
    return (finding.symptom, finding.model, finding.engine or "")


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

    def __init__(self, seconds: float, hysteresis: bool = True):
        self.seconds = max(0.0, float(seconds))
        # False: the hold alone (each symptom's quiet and lead taken as 0).
        self.hysteresis = hysteresis
        # key -> (the finding as last seen, the time its condition was first found clear or None)
        self._held: dict[tuple, tuple[Finding, float | None]] = {}
        # key -> when its episode began (the same keys as _held)
        self._born: dict[tuple, float] = {}
        # (story, cause) of each primary reported at the last poll (arbitration.primaries)
        self._primaries: set[tuple] = set()
        # The hysteresis' memory: what the last poll showed (hold keys), each
        # story's cause shown active then, and since when another cause leads it.
        self._shown: set[tuple] = set()
        self._ended: set[tuple] = set()  # those shown clearing then
        self._shown_cause: dict[tuple, Finding] = {}
        self._challengers: dict[tuple, float] = {}

    def apply(self, at: float, findings: Iterable[Finding], over: Collection[tuple] = frozenset()) -> list[Finding]:
        """`over`: the (symptom, model, engine) whose condition is clearly over now (NowJudgment's
        CLEARLY_OVER): a lapse of theirs is shown ended at once, not hidden for the quiet."""
        current = self._led(at, [self._no_lower(f) for f in findings])
        seen = {hold_key(f) for f in current}
        held: dict[tuple, tuple[Finding, float | None]] = {hold_key(f): (f, None) for f in current}
        born = {key: self._born.get(key, at) for key in held}
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
        contradicted = _contradicted(current)
        # Stories with a harm found now: a shown cause no longer found beside another one waits only its
        # handover (an advisory left once the harm ended is no successor: that is a lapse).
        found = {story: f.cause for f in current if (story := group_key(f)) is not None and is_actionable(f)}
        advised = {story for f in current if (story := group_key(f)) is not None and _advisory(f)}
        for since, key, finding in clearing:
            held[key] = (finding, since)
            born[key] = self._born.get(key, since)
            story = group_key(finding)
            successor = story is not None and found.get(story, finding.cause) != finding.cause
            handover = self._symptom(finding.symptom, "handover")
            # A lapse is hidden for its quiet, but no longer than the finding stood before it (a blip
            # stays a blip), and never less than its handover (a one-poll lapse is never shown).
            wait = handover if successor else max(handover, min(self._symptom(finding.symptom, "quiet"),
                                                                  since - born[key]))
            if not successor and where(finding) in over:
                wait = 0.0  # the evidence says it is over, far from the line a flicker crosses: nothing to hide
            if not successor and story in advised and is_actionable(finding) and self.hysteresis:
                # Intermittent: the harm paused while its own warning sign stands (the cache still cannot
                # hold what the scheduler admits), so it recurs; one episode, as its alert keeps firing.
                wait = self.seconds
            # Once shown ended it stays so until its condition holds again (a lapse shown is never taken back).
            quiet = at - since < wait and not contradicted(finding) and key not in self._ended
            out.append(finding if quiet else replace(finding, clearing_since=since))
        self._held, self._born = held, born
        # One story per engine and symptom: a held finding never stands beside
        # an active cause of the same symptom (it is kept here and comes back
        # if its rival clears first); between held ones, the last primary stays.
        # Never first shown already clearing, nor while its condition is clear: a lapsed cause that stood
        # behind the shown one must not become the story when that one ends (it is not true now).
        lapsed = {key for _, key, _ in clearing} - self._shown
        out = arbitrate([f for f in out if hold_key(f) not in lapsed], self._primaries)
        out = [f for f in out if f.clearing_since is None or hold_key(f) in self._shown]
        self._shown = {hold_key(f) for f in out}
        self._ended = {hold_key(f) for f in out if f.clearing_since is not None}
        self._shown_cause = {story: f for f in out
                             if f.clearing_since is None and (story := group_key(f)) is not None}
        self._primaries = primaries(out)
        return out

    def _led(self, at: float, current: list[Finding]) -> list[Finding]:
        """Each story's new cause in place of the one shown, once it has led
        for its symptom's `lead`; until then the shown one, as last seen."""
        out = []
        # A story absent for a poll keeps its timer (the window's rule may lapse for a poll).
        leading = {story: since for story, since in self._challengers.items() if story in self._shown_cause}
        for finding in current:
            story = group_key(finding)
            shown = self._shown_cause.get(story) if story is not None else None
            if (story is None or shown is None or shown.cause == finding.cause
                    or self._symptom(finding.symptom, "lead") <= 0
                    or _across_exhaustion(shown.cause, finding.cause)
                    # The harm ended (an advisory is left) or began (beside the advisory): not noise.
                    or is_actionable(shown) != is_actionable(finding)
                    # No rival: the shown cause is no longer found, and it ends as a lapse does, after
                    # its handover; unless both are exclusive readings of one evidence (causes.Cause.exclusive),
                    # where the rule could name only one: the new one is then a rival, and must lead.
                    or (shown.cause not in {c.get("cause") for c in finding.contributing}
                        and not _rival_readings(shown.cause, finding.cause))):
                if story is not None:
                    leading.pop(story, None)
                out.append(finding)
                continue
            # Since when the shown cause has not led (whichever led instead: two
            # challengers taking turns must not keep a stale cause shown).
            since = leading[story] = self._challengers.get(story, at)
            if at - since >= self._symptom(finding.symptom, "lead"):
                self._held.pop(hold_key(shown), None)  # replaced, not ended: nothing to hold
                out.append(finding)
            else:
                out.append(shown)
        self._challengers = leading
        return out

    def _symptom(self, name: str, field: str) -> float:
        record = SYMPTOMS.get(name)
        return getattr(record, field) if record is not None and self.hysteresis else 0.0

    def held_where(self) -> set[tuple[str, str, str]]:
        """The (symptom, model, engine) of each finding held (active at the last poll, or clearing)."""
        return {where(f) for f, _ in self._held.values()}

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
            # The figure that made it so stays on the card, said as the episode's.
            said = before[0].evidence.get("severity_because")
            evidence = finding.evidence if not said else {
                "severity_because": said if said.startswith("earlier") else f"earlier in this episode, {said}",
                **finding.evidence}
            return replace(finding, severity=severity, evidence=evidence)
        return finding


def _contradicted(active: list[Finding]):
    """Whether a lapsed finding, shown as last seen, would contradict the
    active ones on its engine: a cause named only while the cache is not
    exhausted beside an active exhaustion, or an exhaustion beside such a
    cause. Its lapse is then shown at once."""
    exhausted = {(f.model, f.engine or "") for f in active if f.symptom == "exhaustion"}
    unexhausted = {(f.model, f.engine or "") for f in active
                   if CAUSE.get(f.cause) is not None and CAUSE[f.cause].while_exhausted is False}

    def contradicted(finding: Finding) -> bool:
        where = (finding.model, finding.engine or "")
        if finding.symptom == "exhaustion":
            return where in unexhausted
        record = CAUSE.get(finding.cause)
        return record is not None and record.while_exhausted is False and where in exhausted
    return contradicted


def _across_exhaustion(shown: str, new: str) -> bool:
    """The two causes sit on either side of the exhaustion detector's line
    (causes.Cause.while_exhausted): the evidence decided, not noise."""
    before, after = CAUSE.get(shown), CAUSE.get(new)
    return (before is not None and after is not None and None not in (before.while_exhausted, after.while_exhausted)
            and before.while_exhausted != after.while_exhausted)


def _rival_readings(shown: str, new: str) -> bool:
    """Both causes are exclusive readings of their symptom's evidence
    (causes.Cause.exclusive), or both are named only while the cache is
    exhausted (causes.Cause.while_exhausted: queued for KV blocks, preempted),
    two parts of one exhausted cache's harm whose shares trade places as
    requests grow: the one not named was not found absent."""
    before, after = CAUSE.get(shown), CAUSE.get(new)
    return before is not None and after is not None and (
        (before.exclusive and after.exclusive) or (before.while_exhausted is True and after.while_exhausted is True))


def _advisory(finding: Finding) -> bool:
    """A harm's warning sign, seen without the harm: a cause that is a
    warning or critical where it harms, found at info (causes.Cause.severity)."""
    record = CAUSE.get(finding.cause)
    return not is_actionable(finding) and record is not None and record.severity in ("warning", "critical")


def _rank(severity: str) -> int:
    return SEVERITIES.index(severity) if severity in SEVERITIES else len(SEVERITIES)

