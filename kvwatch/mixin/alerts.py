"""The alerts: the rules of each alert and cause, from the config.

Each rule is a query, a comparison and a threshold: the Prometheus rule is
`(query) > threshold` (or `<`), and the Grafana rule queries the same PromQL
and applies the same threshold, so the two cannot disagree about when an
alert holds. The rules come from three places: the objectives' burn rates
(kvwatch/mixin/objectives.py); the CauseAlert records of the causes
Prometheus decides alone (kvwatch/mixin/alert_records.py: the diagnosis
written again in PromQL over the recorded conditions of
kvwatch/mixin/conditions.py); and the causes routed by kvwatch's own finding,
whose cause record says so, with a finding twin of each PromQL-decided cause
of a symptom kvwatch may decide alone (alert_records.FINDING_DECIDED). The two
routes of one symptom exclude each other per engine (_routes), and
check_routes refuses rules where they could fire together.

A rule's alert, `for:`, severity, symptom, panel and advice come from its
cause's record (kvwatch/diagnose/causes.py). The catalogue signals a query
reads are found in the query (signals_read), and recorded before the alerts
in their group.
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass, replace
from itertools import groupby
from typing import Any

from kvwatch.diagnose.causes import ALERT_LIST, CAUSE, CAUSE_LIST
from kvwatch.diagnose.causes import ALERTS as ALERTS_BY_NAME
from kvwatch.mixin import objectives
from kvwatch.mixin.alert_records import CAUSE_ALERTS, FINDING_DECIDED, CauseAlert
from kvwatch.mixin.config import ALERTS, PREEMPTING_SUFFIX, MixinConfig
from kvwatch.mixin.config_kinds import MODES
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


# The label that tells a finding-routed rule from a PromQL-decided one, in ALERTS too.
ROUTE_LABEL = ("route", "finding")


def _finding_spec(config: MixinConfig, cause_name: str, variant: str = "") -> AlertSpec:
    """A cause that fires where kvwatch's own diagnosis names it: kvwatch_finding
    holds it as long as the finding is held, at the severity the page shows."""
    cause = CAUSE[cause_name]
    if cause.alert is None:  # causes._check: a finding-routed cause names its alert
        raise AlertCatalogueError(f"{cause.name}: routed by its finding to no alert")
    by = ", ".join(config.engine_labels)
    title = cause.title or cause.name.replace("_", " ")
    dashboard, panel = ALERT_PANELS[cause.alert]
    return AlertSpec(
        alert=cause.alert, cause=cause.name, symptom=ALERTS[cause.alert],
        query=(f'max by ({by}) (kvwatch_finding{{{config.kvwatch_selector},symptom="{cause.symptom}",'
               f'cause="{cause.name}"}})'),
        op=">", threshold=0, for_=config.for_duration(cause.alert), severity=config.severity(cause.name),
        summary=f"kvwatch diagnoses {title}.",
        description=(
            f"kvwatch's diagnosis names {cause.name} ({cause.symptom}) for {_where(config)} (kvwatch_finding; "
            f"the evidence is on kvwatch's status page and /api/v1/diagnosis)"
            + ("; the rules' own twin does not decide it here (the KV-event stream, or a part of the window the "
               "ratio does not judge, decided it)" if variant else "") + f". Next: {cause.next_check}"),
        dashboard=dashboard, panel=panel, variant=variant, extra_labels=(ROUTE_LABEL,))


def _finding_specs(config: MixinConfig, decided: list[AlertSpec]) -> list[AlertSpec]:
    """The finding-routed rules: each cause whose record routes it by its finding,
    and a finding twin of each PromQL-decided cause of a FINDING_DECIDED symptom."""
    specs = [_finding_spec(config, c.name) for c in CAUSE_LIST if c.alert and c.routed_by_finding]
    twins = dict.fromkeys(spec.cause for spec in decided if spec.kind == "cause" and spec.symptom in FINDING_DECIDED)
    return specs + [_finding_spec(config, cause, "finding") for cause in twins]


def route_record(config: MixinConfig, symptom: str, what: str) -> str:
    """The recorded series, per engine, of `symptom`'s PromQL-decided causes that
    hold ("decided"), or of its rules firing by one route ("firing_finding", "firing_rules")."""
    level = "_".join(label for label in config.engine_labels if label not in config.group_labels)
    name = {"decided": f"decided_by_rules:condition{config.rate_window}", "firing_finding": "routed_by_finding:firing",
            "firing_rules": "decided_by_rules:firing"}[what]
    return f"{level}:kvwatch_{symptom}_{name}"


def _firing(config: MixinConfig, symptom: str, finding: bool) -> str:
    # Every cause rule of the symptom, whichever alert (an exhaustion finding silences the forecast too);
    # an objective's page carries no cause.
    route = f'{ROUTE_LABEL[0]}{"=" if finding else "!="}"{ROUTE_LABEL[1]}"'
    return (f'max by ({", ".join(config.engine_labels)}) '
            f'(ALERTS{{symptom="{symptom}",cause!="",alertstate="firing",{route}}})')


def _then(query: str, *steps: tuple[str, str]) -> str:
    """`query` filtered by more (`unless on (...)`, record) steps, one line each:
    appended as they are where the query has no top-level `or` (`and` and
    `unless` associate to the left and bind tighter), so the alert still reads
    in a few lines; else the query in parentheses first (promql.chain)."""
    depth, quoted, word = 0, False, ""
    for char in query + " ":
        quoted = quoted != (char == '"')
        if not quoted and char in "()":
            depth += 1 if char == "(" else -1
        if char.isalpha() and not quoted:
            word += char
            continue
        if word == "or" and depth == 0:
            return chain(query, *steps)
        word = ""
    return "\n".join([query, *(f"{op} {record}" for op, record in steps)])


def _routed_by_finding(spec: AlertSpec) -> bool:
    return ROUTE_LABEL in spec.extra_labels


def _decided(specs: list[AlertSpec], symptom: str) -> list[AlertSpec]:
    return [s for s in specs if s.kind == "cause" and s.symptom == symptom and not _routed_by_finding(s)]


def _routes(config: MixinConfig, specs: list[AlertSpec]) -> tuple[list[AlertSpec], list[dict]]:
    """The two routes of one symptom made exclusive per engine: a PromQL-decided
    rule holds unless a finding-routed one of its symptom fires; a finding-routed
    one unless a PromQL-decided cause holds or fires (held by keep_firing_for).
    Returns the specs and the route records they read."""
    on = f"unless on ({', '.join(config.engine_labels)})"
    records, out = [], list(specs)
    for symptom in sorted({s.symptom for s in specs if _routed_by_finding(s) and s.symptom is not None}):
        decided = _decided(out, symptom)
        if not decided:
            continue
        records.append({"record": route_record(config, symptom, "firing_finding"),
                        "expr": _firing(config, symptom, True)})
        out = [replace(s, query=_then(s.query, (on, route_record(config, symptom, "firing_finding"))))
               if s in decided else s for s in out]
        records += [{"record": route_record(config, symptom, "decided"),
                     "expr": "\nor\n".join(paren(s.expr) for s in _decided(out, symptom))},
                    {"record": route_record(config, symptom, "firing_rules"), "expr": _firing(config, symptom, False)}]
        steps = ((on, route_record(config, symptom, "decided")), (on, route_record(config, symptom, "firing_rules")))
        out = [replace(s, query=_then(s.query, *steps)) if s.symptom == symptom and _routed_by_finding(s) else s
               for s in out]
    return out, records


def check_routes(config: MixinConfig, specs: list[AlertSpec], records: list[dict]) -> None:
    """No two routes of one symptom fire together for one engine: every
    finding-routed rule excludes each PromQL-decided rule of its symptom
    (holding, or firing while held), and each of those excludes it firing;
    else kvwatch refuses the rules with one sentence."""
    recorded = {r["record"]: r["expr"] for r in records}
    for f in filter(_routed_by_finding, specs):
        if f.symptom is None:  # a finding always has its symptom
            continue
        read = lambda what: recorded.get(route_record(config, f.symptom or "", what), "")  # noqa: E731
        for p in _decided(specs, f.symptom):
            if not (paren(p.expr) in read("decided") and read("firing_rules") == _firing(config, f.symptom, False)
                    and read("firing_finding") == _firing(config, f.symptom, True)
                    and all(route_record(config, f.symptom, what) in f.query for what in ("decided", "firing_rules"))
                    and route_record(config, f.symptom, "firing_finding") in p.query):
                raise AlertCatalogueError(
                    f"{f.alert} {f.cause} (routed by kvwatch_finding) and {p.alert} {p.cause} (decided by PromQL) "
                    f"can fire together for one engine: the two routes of {f.symptom} must exclude each other")


def alert_specs(config: MixinConfig) -> list[AlertSpec]:
    """Every rule the config generates: the objectives', the records', the findings'."""
    return _routed(config)[0]


def route_records(config: MixinConfig) -> list[dict]:
    """The recording rules the finding-routed rules read (route_record), in the alerts' group."""
    return _routed(config)[1]


def _routed(config: MixinConfig) -> tuple[list[AlertSpec], list[dict]]:
    f = Recorded(engine_scope(config), config)
    specs = _objective_specs(config)
    wanted = [record for record in CAUSE_ALERTS if record.when(config)]
    for split, group in groupby(wanted, key=lambda record: record.split_on_preemption):
        records = list(group)
        specs += _split_specs(records, f, config) if split else [_cause_spec(r, f, config) for r in records]
    specs, routes = _routes(config, specs + _finding_specs(config, specs))
    check_routes(config, specs, routes)
    return specs, routes


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
    # A cause may have a record per install mode (its `when`), never two in one.
    in_mode = [[r.cause for r in CAUSE_ALERTS if r.when(MixinConfig(mode=mode, no_reuse_alert=True))] for mode in MODES]
    for record in CAUSE_ALERTS:
        cause = CAUSE.get(record.cause)
        if cause is None or cause.alert is None or cause.routed_by_finding:
            raise AlertCatalogueError(f"{record.cause}: an alert record for a cause whose record routes it to no "
                                      "alert by PromQL (causes.py: alert=, routed_by_finding=False)")
        if any(causes.count(record.cause) > 1 for causes in in_mode) or record.op not in (">", "<"):
            raise AlertCatalogueError(f"{record.cause}: one record per cause (per install mode), its op '>' or '<'")
    for cause in CAUSE_LIST:
        if cause.alert and not cause.routed_by_finding and cause.name not in declared:
            raise AlertCatalogueError(f"{cause.name}: its record routes it to {cause.alert} by PromQL, and "
                                      "kvwatch/mixin/alert_records.py has no CauseAlert for it")
        if cause.alert and not cause.next_check:
            raise AlertCatalogueError(f"{cause.name}: an alerted cause needs its advice (next_check)")


_check_records()


def dashboard_url(config: MixinConfig, uid: str, panel_id: int) -> str:
    return (config.dashboard_link_pattern or "").format(uid=uid, panel_id=panel_id, model_name=_lbl("model_name"),
                                                engine=_lbl("engine"))


def runbook_url(config: MixinConfig, alert: str, cause: str | None = None) -> str:
    return config.runbook_link(runbook_anchor(alert, cause))
