"""The story a scenario phase should produce, written in the scenario file
beside its workload (`story:` of a phase) and read by the timeline scorer
(kvwatch/sim/score.py):

    story:
      lead: slow_first_token/queueing_compute_bound   # what the banner leads with
      fair: [exhaustion, low_hit_rate/no_reuse]       # other findings that are true here

`lead` and each of `fair` name a symptom, or a symptom and one of its causes
(`symptom/cause`); `lead: nothing` says no finding should be active. A
finding that matches neither is a false one. Change findings (events, not
conditions) are never scored.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.diagnose.causes import CAUSES, SYMPTOMS

STORY_KEYS = ("lead", "fair")
NOTHING = "nothing"
# Findings that are events, not conditions: true at a point, never scored.
UNSCORED_SYMPTOMS = frozenset({"change"})


@dataclass(frozen=True)
class Story:
    lead: str | None  # "symptom" or "symptom/cause"; None: nothing active
    fair: tuple[str, ...] = ()

    def leads(self, symptom: str, cause: str) -> bool:
        return self.lead is not None and matches(self.lead, symptom, cause)

    def allows(self, symptom: str, cause: str) -> bool:
        """Whether a finding of this cause is true in this phase."""
        return (symptom in UNSCORED_SYMPTOMS or self.leads(symptom, cause)
                or any(matches(name, symptom, cause) for name in self.fair))


def matches(name: str, symptom: str, cause: str) -> bool:
    want_symptom, _, want_cause = name.partition("/")
    return want_symptom == symptom and (not want_cause or want_cause == cause)


def _check_name(name, where: str, problems: list[str]) -> str | None:
    if not isinstance(name, str) or not name:
        problems.append(f"{where}: expected 'symptom' or 'symptom/cause', got {name!r}")
        return None
    symptom, _, cause = name.partition("/")
    if symptom not in SYMPTOMS:
        problems.append(f"{where}: {symptom!r} is not a symptom (one of {', '.join(sorted(SYMPTOMS))})")
        return None
    if cause and cause not in CAUSES.get(symptom, ()):
        problems.append(f"{where}: {cause!r} is not a cause of {symptom} "
                        f"(one of {', '.join(CAUSES.get(symptom, ()))})")
        return None
    return name


def parse_story(raw, where: str, problems: list[str]) -> Story | None:
    """A phase's `story:` (None when absent or wrong; each problem said)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        problems.append(f"{where}: expected a mapping with 'lead' and optionally 'fair', got {raw!r}")
        return None
    for key in raw:
        if key not in STORY_KEYS:
            problems.append(f"{where}.{key}: unknown story key (expected one of {', '.join(STORY_KEYS)})")
    lead = raw.get("lead")
    if lead is None:
        problems.append(f"{where}.lead: missing ('nothing', a symptom, or 'symptom/cause')")
        return None
    lead = None if lead == NOTHING else _check_name(lead, f"{where}.lead", problems)
    fair_raw = raw.get("fair", [])
    if not isinstance(fair_raw, list):
        problems.append(f"{where}.fair: expected a list, got {fair_raw!r}")
        fair_raw = []
    fair = tuple(name for index, item in enumerate(fair_raw)
                 if (name := _check_name(item, f"{where}.fair[{index}]", problems)) is not None)
    if raw.get("lead") != NOTHING and lead is None:
        return None
    return Story(lead, fair)
