"""The alerts: the rules of each alert and cause, from the config.

Each rule is a query, a comparison and a threshold: the Prometheus rule is
`(query) > threshold` (or `<`), and the Grafana rule queries the same PromQL
and applies the same threshold, so the two cannot disagree about when an
alert holds. The rules come from three places: the objectives' burn rates
(kvwatch/mixin/objectives.py); the CauseAlert records of the causes
Prometheus decides alone (kvwatch/mixin/alert_records.py: the diagnosis
written again in PromQL over the recorded conditions of
kvwatch/mixin/conditions.py); and the causes routed by kvwatch's own finding,
whose cause record says so (nothing to declare here).

A rule's alert, `for:`, severity, symptom, panel and advice come from its
cause's record (kvwatch/diagnose/causes.py). The catalogue signals a query
reads are found in the query (signals_read), and recorded before the alerts
in their group.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from itertools import groupby
from typing import Any

from kvwatch.diagnose.causes import ALERT_LIST, CAUSE, CAUSE_LIST
from kvwatch.diagnose.causes import ALERTS as ALERTS_BY_NAME
from kvwatch.mixin import objectives
from kvwatch.mixin.alert_records import CAUSE_ALERTS, CauseAlert
from kvwatch.mixin.config import ALERTS, PREEMPTING_SUFFIX, MixinConfig
from kvwatch.mixin.conditions import Recorded, twin_record
from kvwatch.mixin.objectives import OBJECTIVE_ALERTS
from kvwatch.mixin.promql import Scope, chain, num, paren
from kvwatch.signals import SIGNALS

# Where each alert is shown: (dashboard key, panel key), see dashboards.py;
# the catalogue's alerts say it in their record.
OBJECTIVE_PANEL = ("overview", "objective_burn")
ALERT_PANELS = {
    **{alert.name: alert.panel for alert in ALERT_LIST},
    **{alert: OBJECTIVE_PANEL for alert, _, _ in OBJECTIVE_ALERTS.values()},
}

# Stand-in for the alert's value in description templates: Prometheus calls
# it $value, Grafana $values.<refId>.Value.
VALUE = "VALUE"
PROMETHEUS_VALUE = "$value"


class AlertCatalogueError(ValueError):
    """The alert records disagree with the cause catalogue."""


@dataclass(frozen=True, kw_only=True)
class AlertSpec:
    """One generated rule: a record (or an objective's burn window) expanded for a config."""

    alert: str
    cause: str
    symptom: str | None
    query: str
    op: str  # ">" or "<"
    threshold: float
    for_: str
    severity: str
    summary: str
    description: str  # Go template with VALUE standing for the value
    dashboard: str
    panel: str
    variant: str = ""  # "preempting" for an exhaustion cause's rule with preemptions; the long window of a burn
    # "cause": the label `cause` names it; "objective": a burn-rate page, the label `objective` names it
    kind: str = "cause"
    extra_labels: tuple[tuple[str, str], ...] = ()

    @property
    def expr(self) -> str:
        return f"{paren(self.query)}\n{self.op} {num(self.threshold)}"

    @property
    def anchor(self) -> str:
        if self.kind == "objective":
            return runbook_anchor(self.alert)
        return runbook_anchor(self.alert, self.cause)

    @property
    def uid(self) -> str:
        """Stable Grafana rule uid (at most 40 characters)."""
        short = "burn" if self.kind == "objective" else ALERTS_BY_NAME[self.alert].uid
        uid = f"kvwatch-{short}-{self.cause.replace('_', '-')}"
        if self.variant:
            return uid[:39 - len(self.variant)] + "-" + self.variant
        return uid[:40]

    def labels(self) -> dict[str, str]:
        if self.kind == "objective":
            labels = {"severity": self.severity, "objective": self.cause}
        else:
            labels = {"severity": self.severity, "cause": self.cause}
        labels.update(self.extra_labels)
        if self.symptom:
            labels["symptom"] = self.symptom
        return labels

    def description_for(self, value_ref: str) -> str:
        return self.description.replace(VALUE, value_ref)


def runbook_anchor(alert: str, cause: str | None = None) -> str:
    anchor = alert.lower()
    return f"{anchor}-{cause.replace('_', '-')}" if cause else anchor


def _lbl(name: str) -> str:
    return "{{ $labels." + name + " }}"


def engine_scope(config: MixinConfig) -> Scope:
    return Scope(config.kvwatch_selector, config.rate_window, config.engine_labels)


def _model_where(config: MixinConfig) -> str:
    groups = ", ".join(f"{label} {_lbl(label)}" for label in config.group_labels)
    return f"model {_lbl('model_name')} ({groups})"


def _where(config: MixinConfig) -> str:
    return f"engine {_lbl('engine')} of {_lbl('model_name')} on {_lbl(config.instance_label)}"


class _Value:
    """The alert's value in a description: {value:pct}, {value:duration} or {value:count}."""

    FILTERS = {"pct": "humanizePercentage", "duration": "humanizeDuration", "count": "humanize"}

    def __format__(self, spec: str) -> str:
        return "{{ " + VALUE + " | " + self.FILTERS[spec] + " }}"


class _Template(string.Formatter):
    """Fills a record's description: its phrases, then the mixin config's fields."""

    def __init__(self, config: MixinConfig, phrases: dict[str, Any]):
        self.config, self.phrases = config, phrases

    def get_value(self, key, args, kwargs):
        if key in self.phrases:
            return self.phrases[key]
        if isinstance(key, str) and hasattr(self.config, key):
            return getattr(self.config, key)
        raise AlertCatalogueError(f"{{{key}}} in an alert record names no phrase and no mixin config field")

    def format_field(self, value, spec):
        if isinstance(value, _Value):
            return format(value, spec)
        if spec == "pct":
            return f"{float(value) * 100:g}%"
        if spec:
            raise AlertCatalogueError(f"{{...:{spec}}} in an alert record: the only form is :pct")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return num(value)
        return str(value)


def _phrases(config: MixinConfig, alert: str, variant: str) -> dict[str, Any]:
    return {
        "where": _where(config), "instance": _lbl(config.instance_label), "job": _lbl("job"),
        "peer_where": f"{_lbl('model_name')} on {_lbl(config.instance_label)} (engine {_lbl('engine')})",
        "for": config.for_duration(alert), "value": _Value(),
        "and_preempting": " and preempting" if variant == "preempting" else "",
        "preemption_state": {"preempting": ", requests are being preempted (their KV recomputed)",
                             "unpreempted": ", requests wait (none preempted)"}.get(variant, ""),
    }


def _cause_spec(record: CauseAlert, f: Recorded, config: MixinConfig, variant: str = "") -> AlertSpec:
    cause = CAUSE[record.cause]
    alert = str(cause.alert)
    query = record.query(f)
    if variant:
        query = [*query, ("and" if variant == "preempting" else "unless", f.preempting())]
    template = _Template(config, _phrases(config, alert, variant))
    dashboard, panel = ALERT_PANELS[alert]
    return AlertSpec(
        alert=alert, cause=cause.name, symptom=ALERTS[alert],
        query=chain(*query) if isinstance(query, list) else query,
        op=record.op, threshold=record.threshold_for(config), for_=config.for_duration(alert),
        severity=config.severity(cause.name + (PREEMPTING_SUFFIX if variant == "preempting" else "")),
        summary=template.format(record.summary),
        description=f"{template.format(record.description)} Next: {cause.next_check}",
        dashboard=dashboard, panel=panel, variant="preempting" if variant == "preempting" else "")


def _split_specs(records: list[CauseAlert], f: Recorded, config: MixinConfig) -> list[AlertSpec]:
    """Causes split on preemption, variant by variant: with preemptions and
    without where the config sets the two severities apart, else one rule."""
    def split(record: CauseAlert) -> bool:
        return config.severity(record.cause + PREEMPTING_SUFFIX) != config.severity(record.cause)
    return [_cause_spec(record, f, config, variant if split(record) else "")
            for variant, wanted in (("preempting", True), ("unpreempted", True), ("", False))
            for record in records if split(record) == wanted]


def _objective_specs(config: MixinConfig) -> list[AlertSpec]:
    """The burn-rate pages: one rule per objective and window pair."""
    pct = lambda x: f"{x * 100:g}%"  # noqa: E731
    specs = []
    for objective, (alert, symptom, _) in OBJECTIVE_ALERTS.items():
        target = objectives.objective_target(config, objective)
        what = {"first_token": f"got their first token later than {num(config.ttft_objective_seconds)}s",
                "availability": "ended in error", "aborts": "were aborted by their client"}[objective]
        goal = {"first_token": f"{pct(target)} of first tokens within {num(config.ttft_objective_seconds)}s",
                "availability": f"{pct(target)} of requests without error",
                "aborts": f"{pct(target)} of requests not aborted"}[objective]
        summary = {"first_token": "vLLM first tokens are late for too many requests: the objective's budget burns.",
                   "availability": "vLLM requests fail: the availability objective's budget burns.",
                   "aborts": "Clients abort many vLLM requests: the abort objective's budget burns."}[objective]
        dashboard, panel = ALERT_PANELS[alert]
        for pair in objectives.burn_windows(config):
            query, threshold = objectives.burn_query(config, objective, pair)
            specs.append(AlertSpec(
                alert=alert, cause=objective, symptom=symptom, query=query, op=">", threshold=threshold,
                for_=config.for_duration(alert), severity=objectives.severity(objective, pair), summary=summary,
                description=(
                    f"{{{{ {VALUE} | humanizePercentage }}}} of the requests to all replicas of {_model_where(config)} "
                    f"{what} over the last {pair.long}, and more than {pct(threshold)} over the last "
                    f"{pair.short} as well: the budget of the objective ({goal}) burns {num(pair.factor)}x faster "
                    "than it lasts. The replicas burning alone are in annotation burning_replicas; the alerts firing "
                    "beside it for this model say where to look (annotation cause_alerts; the first-token and "
                    "exhaustion dashboards, per replica)."),
                dashboard=dashboard, panel=panel, variant=pair.long, kind="objective",
                extra_labels=(("long_window", pair.long), ("short_window", pair.short))))
    return specs


def _finding_specs(config: MixinConfig) -> list[AlertSpec]:
    """A cause whose record routes it by its finding fires where kvwatch's own
    diagnosis names it: kvwatch_finding holds it as long as the finding is held."""
    by = ", ".join(config.engine_labels)
    specs = []
    for cause in CAUSE_LIST:
        if cause.alert and cause.routed_by_finding:
            title = cause.title or cause.name.replace("_", " ")
            dashboard, panel = ALERT_PANELS[cause.alert]
            specs.append(AlertSpec(
                alert=cause.alert, cause=cause.name, symptom=ALERTS[cause.alert],
                query=(f'max by ({by}) (kvwatch_finding{{{config.kvwatch_selector},symptom="{cause.symptom}",'
                       f'cause="{cause.name}"}})'),
                op=">", threshold=0, for_=config.for_duration(cause.alert), severity=config.severity(cause.name),
                summary=f"kvwatch diagnoses {title}.",
                description=(
                    f"kvwatch's diagnosis names {cause.name} ({cause.symptom}) for {_where(config)} (kvwatch_finding; "
                    f"the evidence is on kvwatch's status page and /api/v1/diagnosis). Next: {cause.next_check}"),
                dashboard=dashboard, panel=panel))
    return specs


def alert_specs(config: MixinConfig) -> list[AlertSpec]:
    """Every rule the config generates: the objectives', the records', the findings'."""
    f = Recorded(engine_scope(config), config)
    specs = _objective_specs(config)
    wanted = [record for record in CAUSE_ALERTS if record.when(config)]
    for split, group in groupby(wanted, key=lambda record: record.split_on_preemption):
        records = list(group)
        specs += _split_specs(records, f, config) if split else [_cause_spec(r, f, config) for r in records]
    return specs + _finding_specs(config)


# A recorded series' name, `level:metric:operations` (not a subquery's `[1h:5m]`).
_RECORDED = re.compile(r"(?<![\w:])[a-zA-Z_]\w*:[\w:]+")


def signals_read(config: MixinConfig) -> tuple[str, ...]:
    """The catalogue signals whose recorded twin some alert's query reads, in
    catalogue order: recorded in the alerts' group, before them (see
    kvwatch/mixin/conditions.py), so no alert reads one an evaluation late."""
    read = {name for spec in alert_specs(config) for name in _RECORDED.findall(spec.query)}
    one_record = [s for s in SIGNALS if s.record[0] and (s.label is None or s.output_labels) and not s.record_labels]
    return tuple(s.name for s in one_record if twin_record(config, s.name) in read)


def _check_records() -> None:
    """Each cause routed to an alert by PromQL has exactly one record, and its
    record says what the alert needs; else kvwatch does not import."""
    declared = [record.cause for record in CAUSE_ALERTS]
    for record in CAUSE_ALERTS:
        cause = CAUSE.get(record.cause)
        if cause is None or cause.alert is None or cause.routed_by_finding:
            raise AlertCatalogueError(f"{record.cause}: an alert record for a cause whose record routes it to no "
                                      "alert by PromQL (causes.py: alert=, routed_by_finding=False)")
        if declared.count(record.cause) > 1 or record.op not in (">", "<"):
            raise AlertCatalogueError(f"{record.cause}: one record per cause, its op '>' or '<'")
    for cause in CAUSE_LIST:
        if cause.alert and not cause.routed_by_finding and cause.name not in declared:
            raise AlertCatalogueError(f"{cause.name}: its record routes it to {cause.alert} by PromQL, and "
                                      "kvwatch/mixin/alert_records.py has no CauseAlert for it")
        if cause.alert and not cause.next_check:
            raise AlertCatalogueError(f"{cause.name}: an alerted cause needs its advice (next_check)")


_check_records()


def dashboard_url(config: MixinConfig, uid: str, panel_id: int) -> str:
    return config.dashboard_link_pattern.format(uid=uid, panel_id=panel_id, model_name=_lbl("model_name"),
                                                engine=_lbl("engine"))


def runbook_url(config: MixinConfig, alert: str, cause: str | None = None) -> str:
    return config.runbook_link(runbook_anchor(alert, cause))
