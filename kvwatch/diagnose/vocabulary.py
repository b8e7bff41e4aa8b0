"""The diagnosis' vocabulary: the Finding record every rule returns, the
order findings are listed in, and the runbook link a finding carries. What is
said about each cause (symptom, severity, next check, alert) is its record in
the cause catalogue (causes.py). The `symptom`/`cause` values are also the
labels of `kvwatch_finding` and of the generated alert rules; do not rename
them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# The tables by cause name are views of the cause catalogue (causes.py), one
# record per cause; they are re-exported here for the rules that read them.
from kvwatch.diagnose.causes import (  # noqa: F401
    ALERT_CAUSES, CAUSES, CONFIDENCES, FELT_ORDER, NEXT_ACTION, NEXT_CHECK, PREEMPTING_SEVERITY, SEVERITIES, SEVERITY,
    SYMPTOM_ALERTS, severity_of)

# kvwatch serves the runbooks (GET /runbooks): a finding's link is relative
# to the kvwatch that reports it (the status page, the JSON API).
RUNBOOK_PATH = "runbooks"


def runbook_link(symptom: str, cause: str, alert_causes: dict[str, tuple[str, ...]] | None = None) -> str | None:
    """The runbook section of a finding: its alert and cause's section (the
    anchors of mixin/alerts.py runbook_anchor), or the alert's when no rule
    names the cause; None for changes, which have no alert."""
    alert = SYMPTOM_ALERTS.get(symptom)
    if alert is None:
        return None
    anchor = alert.lower()
    if alert_causes is None or cause in alert_causes.get(alert, ()):
        anchor += "-" + cause.replace("_", "-")
    return f"{RUNBOOK_PATH}#{anchor}"


@dataclass(frozen=True)
class Finding:
    symptom: str  # exhaustion | low_hit_rate | slow_first_token | change
    cause: str
    severity: str  # critical | warning | info
    confidence: str  # high | medium | low
    model: str
    engine: str | None
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next_check: str = ""
    # Set while the finding is held (diagnose/hold.py): its condition has been
    # clear since this time (epoch seconds), for less than the hold; the
    # finding is still active and reported as it was last seen.
    clearing_since: float | None = None
    # Other causes of the same symptom on the same engine that the rules also
    # found, weaker than this one (diagnose/arbitration.py): each
    # {"cause", "severity", "confidence", "summary"}.
    contributing: tuple[dict[str, Any], ...] = ()
    # Causes the data cannot tell from this one, each {"cause", "decided_by":
    # [sources that would decide, arbitration.DECIDERS], "how"}.
    alternatives: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class Change:
    """One change that invalidates comparisons across it: found between two
    window entries, kept by the monitor beyond the window, read by the
    diagnosis and shown on every surface as the same record."""

    time: float
    kind: str  # restart | cache_config | models | lora | kv_cache_cleared | kv_events_restart
    model: str | None
    engine: str | None
    detail: str
    keys: tuple[str, ...] = ()  # cache_config keys that changed
    # Served models before and after, and those added: at most MAX_NAMES
    # each (the detail gives the counts).
    before: tuple[str, ...] = ()
    after: tuple[str, ...] = ()
    added: tuple[str, ...] = ()


def finding_key(finding: Finding) -> tuple[str, str, str, str]:
    """What names one finding across polls: symptom, cause, model, engine."""
    return (finding.symptom, finding.cause, finding.model, finding.engine or "")


def finding_order(finding: Finding) -> tuple:
    """The order findings are listed in: active ones before those held while
    clearing; within each, actionable (warning, critical) before info, then
    by what users feel (causes.FELT_ORDER: late first tokens lead a full
    cache, which leads a low hit rate), then most severe (the page's banner
    shows the first, and draws clearing ones muted below the active)."""
    felt = FELT_ORDER.index(finding.symptom) if finding.symptom in FELT_ORDER else len(FELT_ORDER)
    return (finding.clearing_since is not None, not is_actionable(finding), felt,
            SEVERITIES.index(finding.severity) if finding.severity in SEVERITIES else 9, finding.symptom,
            finding.model, finding.engine or "", finding.cause)


def is_actionable(finding: Finding) -> bool:
    """Warning and critical findings: what makes `kvwatch diagnose` exit 1."""
    return finding.severity in ("critical", "warning")
