"""Grafana-managed alert rules, built with grafanalib's alert classes, in
Grafana's file-provisioning format; plus an example of contact points and a
notification policy that route by severity and cause.

One Grafana rule per Prometheus alert rule (alert and cause), from the same
AlertSpec: query A is the same PromQL (instant), B reduces it to its last
value, and C is the same comparison and threshold as a math expression (a
threshold on every series, so each engine is its own alert instance; classic
conditions would collapse them into one). `for`, labels and annotations are
the Prometheus rule's, the description reading the value as $values.B.Value.

grafanalib 0.7.1's AlertRulev9 renders the ruler-API shape (`grafana_alert`
nested, no dashboard link) and AlertGroup has no orgId; the subclasses below
render the provisioning shape Grafana reads from
provisioning/alerting/*.yaml|json (Grafana 9.1+, checked against Grafana 10).
"""

from __future__ import annotations

import attr
from grafanalib import core as g

from kvwatch.diagnose.causes import CAUSE_LIST, owned_by
from kvwatch.mixin.alerts import AlertSpec, alert_specs
from kvwatch.mixin.config import MixinConfig
from kvwatch.mixin.objectives import OBJECTIVE_ALERTS
from kvwatch.mixin.promql import num
from kvwatch.mixin.rules import alert_annotations, expand, keep_firing_for, recorded_exprs

GRAFANA_VALUE = "$values.B.Value"
# What Grafana does when a rule's query returns no series, decided per alert
# and cause (every rule must have a decision: tests/test_mixin_grafana_alerts.py),
# with the reason docs/alerts.md shows: each cause's record says it.
NO_DATA: dict[tuple[str, str], tuple[str, str]] = {
    **{(cause.alert, cause.name): cause.no_data for cause in CAUSE_LIST if cause.alert},
    **{(alert, objective): (
        "OK", "The query is a filter over both windows' error ratios: no series is an engine whose budget does "
              "not burn, or one without requests (nothing to judge).")
       for objective, (alert, _, _) in OBJECTIVE_ALERTS.items()},
}
EXEC_ERR_STATE = "Error"
RULE_GROUP = "kvwatch"


@attr.s
class ProvisionedAlertRule(g.AlertRulev9):
    """AlertRulev9 in Grafana's file-provisioning shape."""

    keep_firing_for = attr.ib(default=None)

    def to_json_data(self):
        ruler = super().to_json_data()
        data = []
        for query in ruler["grafana_alert"]["data"]:
            query = dict(query)
            query.setdefault("queryType", "")
            model = query["model"] = dict(query["model"])
            if "expr" in model:
                # A Prometheus query: grafanalib's Target carries dashboard
                # fields; an alert query wants the datasource reference and an
                # instant evaluation.
                for unused in ("query", "target", "metric", "step", "interval", "intervalFactor", "format"):
                    model.pop(unused, None)
                model.update({"datasource": {"type": "prometheus", "uid": query["datasourceUid"]},
                              "instant": True, "range": False, "intervalMs": 1000, "maxDataPoints": 43200})
            data.append(query)
        rule = {
            "uid": self.uid,
            "title": self.title,
            "condition": self.condition,
            "data": data,
            "noDataState": self.noDataAlertState,
            "execErrState": self.errorAlertState,
            "for": self.evaluateFor,
            "labels": self.labels,
            "annotations": self.annotations,
            "isPaused": False,
        }
        if self.keep_firing_for:
            # Grafana 12+ keeps an instance firing this long after its
            # condition clears, as Prometheus' keep_firing_for does; older
            # Grafana ignores the key.
            rule["keepFiringFor"] = self.keep_firing_for
        if self.dashboard_uid:
            rule["dashboardUid"] = self.dashboard_uid
            rule["panelId"] = self.panel_id
        return rule


@attr.s
class ProvisionedAlertGroup(g.AlertGroup):
    """AlertGroup with the organisation Grafana provisions it into."""

    orgId = attr.ib(default=1)

    def to_json_data(self):
        group = super().to_json_data()
        group["orgId"] = self.orgId
        return group


def grafana_rule(spec: AlertSpec, config: MixinConfig, panel_ids) -> ProvisionedAlertRule:
    uid, panel_id = panel_ids[(spec.dashboard, spec.panel)]
    query = g.Target(expr=expand(spec.query, recorded_exprs(config)), refId="A", datasource=config.grafana_datasource_uid, instant=True)
    reduce = g.AlertExpression(refId="B", expression="A", expressionType=g.EXP_TYPE_REDUCE,
                               reduceFunction=g.EXP_REDUCER_FUNC_LAST, reduceMode=g.EXP_REDUCER_FUNC_DROP_NN)
    threshold = g.AlertExpression(refId="C", expression=f"$B {spec.op} {num(spec.threshold)}",
                                  expressionType=g.EXP_TYPE_MATH)
    return ProvisionedAlertRule(  # type: ignore[call-arg]  # fields of grafanalib's untyped base
        title=f"{spec.alert} ({spec.cause}{', ' + spec.variant if spec.variant else ''})",
        uid=spec.uid,
        triggers=[query, reduce, threshold],
        condition="C",
        annotations=alert_annotations(spec, config, uid, panel_id, GRAFANA_VALUE),
        labels=spec.labels(),
        evaluateFor=spec.for_,
        noDataAlertState=NO_DATA[(spec.alert, spec.cause)][0],
        errorAlertState=EXEC_ERR_STATE,
        # The range the query may look back; the query's own [range] does the windowing.
        timeRangeFrom=600,
        timeRangeTo=0,
        dashboard_uid=uid,
        panel_id=panel_id,
        keep_firing_for=keep_firing_for(spec, config),
    )


def provisioning(config: MixinConfig, panel_ids) -> dict:
    group = ProvisionedAlertGroup(  # type: ignore[call-arg]  # fields of grafanalib's untyped base
        name=RULE_GROUP,
        folder=config.deploy_settings.grafana_folder,
        evaluateInterval=config.grafana_rule_interval,
        rules=[grafana_rule(spec, config, panel_ids) for spec in alert_specs(config)],
        orgId=config.grafana_org_id,
    )
    return g.AlertFileBasedProvisioning(groups=[group]).to_json_data()


# Causes whose fix lies with whoever runs, sizes and scales the engines (and
# kvwatch beside them), and those whose fix lies with whoever owns prompts,
# the application, the gateway or router: each cause's record says (owner).
PLATFORM_CAUSES = owned_by("platform")
APPLICATION_CAUSES = owned_by("application")


def notification_example(config: MixinConfig) -> dict:
    """Contact points and a notification policy routing kvwatch's alerts by
    severity and cause. An example: replace the webhook URLs, and merge the
    routes into your tree (provisioning `policies` replaces the organisation's
    whole policy tree)."""
    org = config.grafana_org_id

    def contact(name: str, url: str) -> dict:
        return {"orgId": org, "name": name, "receivers": [
            {"uid": name, "type": "webhook", "disableResolveMessage": False,
             "settings": {"url": url, "httpMethod": "POST"}}]}

    def route(receiver: str, matchers: list[list[str]], **extra) -> dict:
        return {"receiver": receiver, "object_matchers": matchers, **extra}

    regex = lambda causes: "|".join(causes)  # noqa: E731
    return {
        "apiVersion": 1,
        "contactPoints": [
            contact("kvwatch-pager", "https://pager.example.com/hooks/kvwatch"),
            contact("kvwatch-platform", "https://chat.example.com/hooks/llm-platform"),
            contact("kvwatch-application", "https://chat.example.com/hooks/llm-application"),
            contact("kvwatch-tickets", "https://tickets.example.com/hooks/kvwatch"),
        ],
        "policies": [{
            "orgId": org,
            "receiver": "kvwatch-tickets",
            # One notification per model: the page (over all replicas) and the cause alerts that explain it.
            "group_by": list(config.model_labels),
            "group_wait": "30s",
            "group_interval": "5m",
            "repeat_interval": "4h",
            "routes": [
                # Critical first: an objective's budget burns fast, or the engine is unreachable.
                route("kvwatch-pager", [["severity", "=", "critical"]], group_wait="30s", repeat_interval="1h"),
                # Info findings (caching off, cold cache, no reuse) only make tickets.
                route("kvwatch-tickets", [["severity", "=", "info"]]),
                # A slow burn of the first-token or error budget: the platform's queue; aborts: the application's.
                route("kvwatch-platform", [["objective", "=~", "first_token|availability"]]),
                route("kvwatch-application", [["objective", "=", "aborts"]]),
                route("kvwatch-platform", [["cause", "=~", regex(PLATFORM_CAUSES)]]),
                route("kvwatch-application", [["cause", "=~", regex(APPLICATION_CAUSES)]]),
            ],
        }],
    }
