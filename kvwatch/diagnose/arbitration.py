"""One story per engine and symptom: the arbitration rule, written once.

Several rules can each find a cause of one symptom on one engine at the same
poll: a full cache that is both "more requests than fit" and "a scheduler
that admits more than fit"; a slow first token that is both queue and
prefill. The on-call engineer gets one story: the primary cause, chosen here
from the evidence, and the others ride on it as contributing factors (data:
`Finding.contributing`), never as rival findings. The JSON, the page and
`kvwatch_finding` (one series per symptom per engine, its contributors in
`kvwatch_finding_contributor`) read the arbitrated list; the alert rules
follow the same rule in PromQL (kvwatch/mixin/alerts.py: the causes of one
symptom partition its value with `unless`, and the first-token residual is
`preemption` wherever the exhaustion detector holds, `front_end` elsewhere).

The rule, in order:
0. a cause that is only the reason another could happen (SUBORDINATE: the
   scheduler's setting behind an exhausted cache) is primary only alone;
1. higher confidence wins (what the numbers prove beats what they suggest);
2. then the larger share of the symptom the cause explains (WEIGHT: the
   evidence value that measures it, e.g. the queue's share of the time to
   first token: the PromQL twins name the largest part too);
3. then the cause's place in RANK.
Between 1 and 2, the primary of the previous poll (the hold knows it) keeps
its place: the story changes when the evidence is stronger, not on noise.

Change findings are not arbitrated: each is an event with its own time (a
model change and a restart at one poll are both true), not a rival reading
of one symptom; nor are `kv_events` findings, facts about kvwatch's own
event source (a silent stream and lost messages are both true). Fleet
findings are arbitrated per replica they name.

Alternatives are another matter: a primary that the data cannot tell from
another cause lists it in `Finding.alternatives` (data: the cause, and what
would decide between them; see `alternative`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable

from kvwatch.diagnose.causes import CAUSE, CAUSE_LIST, CONFIDENCES, SYMPTOM_LIST
from kvwatch.diagnose.vocabulary import Finding, finding_order

# The rule's inputs are each cause's record (causes.py: subordinate, weight)
# and each symptom's (arbitrated, ranking); these are views of them.
# Symptoms whose causes compete; "change" findings are events, each true.
ARBITRATED = tuple(s.name for s in SYMPTOM_LIST if s.arbitrated)

# symptom -> its causes, the first preferred when the evidence is otherwise
# equal (the symptom's ranking; causes.py says why each order).
RANK: dict[str, tuple[str, ...]] = {s.name: s.ranking for s in SYMPTOM_LIST if s.arbitrated}

# Causes that are a reason another cause could happen, not a reading of the
# symptom: primary only when no other cause of the symptom was found. The
# scheduler admitting more than fit is why too many or too long requests
# exhaust the cache; the alert names the load shape (it has no rule of its
# own), and so does kvwatch_finding.
SUBORDINATE = frozenset(c.name for c in CAUSE_LIST if c.subordinate)

# cause -> the evidence value (0..1) that says how much of the symptom it
# explains, where causes of one symptom are told apart by size.
WEIGHT: dict[str, str] = {c.name: c.weight for c in CAUSE_LIST if c.weight}

# What can decide between causes the page cannot tell apart (the `decided_by`
# values of an alternative): a vLLM flag or a sharper source.
# A finding a source decided says so in its headline (the page's banner and
# card, the noscript page, `kvwatch diagnose`): beside a hit-ratio card that
# reads healthy, "evicted before reuse" must say what decided it.
DECIDED_HEADLINE = {"kv_events": "decided by the engine's KV-cache events",
                    "kv_cache_metrics": "decided by vLLM's block residency histograms"}


def decided_headline(evidence: dict[str, Any]) -> str:
    """' (decided by ...)' for a finding a source decided, else ''."""
    said = DECIDED_HEADLINE.get(str(evidence.get("decided_by")))
    return f" ({said})" if said else ""


DECIDERS = {
    "kv_cache_metrics": "vLLM's --kv-cache-metrics (block residency: idle time before eviction against the gap "
                        "between reuses)",
    "kv_events": "vLLM's KV-cache event stream (--kv-events-config: which blocks were stored, evicted and hit, "
                 "with their prefix hashes)",
    "request_lengths": "the lengths of the requests in flight at the peak (the gateway log, or vLLM's "
                       "request_prompt_tokens and request_generation_tokens per request)",
}


def alternative(cause: str, decided_by: Iterable[str], how: str = "") -> dict[str, Any]:
    """One alternative a finding cannot rule out: the cause, the sources
    that would decide (keys of DECIDERS), and a sentence on how."""
    decided = tuple(decided_by)
    if not all(d in DECIDERS for d in decided):  # a check -O keeps
        raise ValueError(f"{cause}: unknown deciders {[d for d in decided if d not in DECIDERS]}")
    return {"cause": cause, "decided_by": list(decided), "how": how or "; ".join(DECIDERS[d] for d in decided)}


def group_key(finding: Finding) -> tuple | None:
    """The story a finding belongs to, or None when it is not arbitrated."""
    if finding.symptom not in ARBITRATED:
        return None
    return (finding.model, finding.engine or "", finding.symptom, str(finding.evidence.get("replica", "")))


def _confidence(finding: Finding) -> int:
    return -(CONFIDENCES.index(finding.confidence) if finding.confidence in CONFIDENCES else len(CONFIDENCES))


def strength(finding: Finding, incumbents: frozenset | set = frozenset()) -> tuple:
    """How strongly the evidence supports a finding: larger is stronger. An
    incumbent (the primary of its story at the previous poll) wins ties of
    confidence, so two causes of about equal size do not swap the story at
    every poll (an alert's `for:` would start over at each swap)."""
    weight = finding.evidence.get(WEIGHT.get(finding.cause, ""))
    causes = RANK.get(finding.symptom, ())
    place = causes.index(finding.cause) if finding.cause in causes else len(causes)
    incumbent = (group_key(finding), finding.cause) in incumbents
    return (finding.cause not in SUBORDINATE, _confidence(finding), incumbent,
            weight if isinstance(weight, (int, float)) else -1.0, -place)


def contributor(finding: Finding) -> dict[str, Any]:
    """A rival reduced to what the primary carries of it: its cause, how
    sure and how severe, its sentence and its numbers."""
    return {"cause": finding.cause, "severity": finding.severity, "confidence": finding.confidence,
            "summary": finding.summary, "evidence": finding.evidence}


def primaries(findings: Iterable[Finding]) -> set[tuple]:
    """(story, cause) of each arbitrated finding: the incumbents of the next
    poll's arbitration."""
    return {(key, f.cause) for f in findings if (key := group_key(f)) is not None}


def caused_by(findings: list[Finding]) -> dict[int, int]:
    """One causal story across symptoms: where a finding's cause is named
    only while the cache is exhausted (causes.Cause.while_exhausted: first
    tokens late because requests queue for KV blocks or are preempted), the
    active exhaustion on its engine is that cause, and the page tells the two
    as one story, not two cards. Index of each such finding -> index of the
    exhaustion finding (both active)."""
    exhausted = {(f.model, f.engine or ""): i for i, f in enumerate(findings)
                 if f.symptom == "exhaustion" and f.clearing_since is None and f.severity in ("critical", "warning")}
    out = {}
    for i, f in enumerate(findings):
        record = CAUSE.get(f.cause)
        lower = exhausted.get((f.model, f.engine or ""))
        if (lower is not None and f.symptom != "exhaustion" and f.clearing_since is None and record is not None
                and record.while_exhausted):
            out[i] = lower
    return out


def arbitrate(findings: Iterable[Finding], incumbents: frozenset | set = frozenset()) -> list[Finding]:
    """One primary per (model, engine, symptom[, replica]); its rivals become
    its `contributing` factors (active ones only: a clearing rival's
    condition no longer holds). An active finding outranks a held (clearing)
    one, except the previous primary held while clearing, which keeps the
    story against active rivals of lower confidence (they ride on it).
    `incumbents` (primaries() of the previous poll) also keep their place on
    a tie of confidence. The result is in finding_order."""
    groups: dict[tuple, list[Finding]] = {}
    out: list[Finding] = []
    for finding in findings:
        key = group_key(finding)
        if key is None:
            out.append(finding)
        else:
            groups.setdefault(key, []).append(finding)
    for members in groups.values():
        if len(members) == 1:
            out.append(members[0])
            continue
        members.sort(key=lambda f: strength(f, incumbents), reverse=True)
        active = [f for f in members if f.clearing_since is None]
        primary = active[0] if active else members[0]
        # A held primary is not unseated by a weaker active rival: the story
        # stays while it clears, unless a rival at least as sure takes over.
        held = next((f for f in members if f.clearing_since is not None and (group_key(f), f.cause) in incumbents),
                    None)
        if active and held is not None and strength(held)[:2] > strength(primary)[:2]:
            primary = held
        rivals = [f for f in active if f is not primary]
        if rivals:
            known = {c["cause"] for c in primary.contributing}
            extra = tuple(contributor(r) for r in rivals if r.cause not in known)
            primary = replace(primary, contributing=primary.contributing + extra)
        out.append(primary)
    out.sort(key=finding_order)
    return out


def one_primary_each(findings: Iterable[Finding]) -> bool:
    """The invariant the tests check at every poll."""
    seen = set()
    for finding in findings:
        key = group_key(finding)
        if key is None:
            continue
        if key in seen:
            return False
        seen.add(key)
    return True
