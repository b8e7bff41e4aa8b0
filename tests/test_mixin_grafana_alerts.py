"""Every Grafana-managed rule matches its Prometheus twin (same query,
comparison, threshold, for, labels, annotations, runbook and dashboard
links), the provisioning file has what Grafana 10 requires of each rule,
uids are stable and unique, and the notification example routes every
cause somewhere by severity and cause."""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from kvwatch.mixin.alerts import alert_specs
from kvwatch.mixin.config import ALERT_CAUSES, MixinConfig, MixinConfigError, config_from_mapping
from kvwatch.commands.generate import GRAFANA_NOTIFICATIONS_FILE, GRAFANA_RULES_FILE, RULES_FILE, render_all
from kvwatch.mixin.grafana_alerts import GRAFANA_VALUE
from kvwatch.mixin.objectives import OBJECTIVE_ALERTS
from kvwatch.mixin.rules import expand, recorded_exprs, split_alert_expr
from mixin_support import GRAFANA_RULES, REPO, RULES, iter_panels, load_dashboards

NO_DATA_STATES = {"NoData", "Alerting", "OK", "KeepLast"}
EXEC_ERR_STATES = {"Alerting", "Error", "OK", "KeepLast"}
UPSTREAM = {"upstream_histogram": "app_retrieval_seconds", "upstream_selector": 'job="rag-app"'}


def prometheus_alerts(rules_text: str) -> list[dict]:
    return [r for g in yaml.safe_load(rules_text)["groups"] for r in g["rules"] if "alert" in r]


def grafana_rules(provisioning: dict) -> list[dict]:
    return [rule for group in provisioning["groups"] for rule in group["rules"]]


def twin_problems(rules_text: str, provisioning: dict, config: MixinConfig | None = None) -> list[str]:
    """Differences between each Prometheus alert rule and its Grafana twin."""
    problems = []
    by_key = {}
    def key_of(title: str, labels: dict) -> tuple:
        return (title, labels.get("cause") or labels.get("objective"), labels["severity"], labels.get("long_window"),
                labels.get("route"))

    for rule in grafana_rules(provisioning):
        by_key.setdefault(key_of(rule["title"].split(" ")[0], rule["labels"]), []).append(rule)
    recorded = recorded_exprs(config or MixinConfig())
    alerts = prometheus_alerts(rules_text)
    if len(alerts) != len(grafana_rules(provisioning)):
        problems.append(f"{len(alerts)} Prometheus rules, {len(grafana_rules(provisioning))} Grafana rules")
    for alert in alerts:
        key = key_of(alert["alert"], alert["labels"])
        twins = by_key.get(key, [])
        if len(twins) != 1:
            problems.append(f"{key}: {len(twins)} Grafana twins")
            continue
        rule = twins[0]
        query, op, threshold = split_alert_expr(alert["expr"])
        data = {q["refId"]: q for q in rule["data"]}
        # Grafana reads no recording rule: the query is the alert's with each
        # recorded series it reads replaced by the rule's expression.
        if data["A"]["model"]["expr"] != expand(query, recorded):
            problems.append(f"{key}: query differs")
        if data["B"]["model"]["type"] != "reduce" or data["B"]["model"]["expression"] != "A":
            problems.append(f"{key}: B does not reduce A")
        match = re.fullmatch(r"\$B ([<>]) (\S+)", data[rule["condition"]]["model"]["expression"])
        if not match or match.group(1) != op or float(match.group(2)) != threshold:
            problems.append(f"{key}: threshold {data[rule['condition']]['model']['expression']!r} != {op} {threshold}")
        if rule["for"] != alert["for"]:
            problems.append(f"{key}: for {rule['for']} != {alert['for']}")
        if rule.get("keepFiringFor") != alert.get("keep_firing_for"):
            problems.append(f"{key}: keepFiringFor {rule.get('keepFiringFor')} != {alert.get('keep_firing_for')}")
        if rule["labels"] != alert["labels"]:
            problems.append(f"{key}: labels {rule['labels']} != {alert['labels']}")
        normalised = {k: v.replace(GRAFANA_VALUE, "$value") for k, v in rule["annotations"].items()}
        # cause_alerts and burning_replicas query Prometheus from a Prometheus template: a Prometheus rule's alone.
        if normalised != {k: v for k, v in alert["annotations"].items() if k not in PROMETHEUS_ONLY}:
            problems.append(f"{key}: annotations differ")
    return problems


def test_every_grafana_rule_matches_its_prometheus_twin():
    assert twin_problems(RULES.read_text(), json.loads(GRAFANA_RULES.read_text())) == []


def test_twins_also_match_with_an_upstream_histogram():
    files = render_all(config_from_mapping(UPSTREAM))
    provisioning = json.loads(files[GRAFANA_RULES_FILE])
    assert any(r["labels"].get("cause") == "upstream" for r in grafana_rules(provisioning))
    assert twin_problems(files[RULES_FILE], provisioning, config_from_mapping(UPSTREAM)) == []


def test_the_twin_check_catches_drift():
    provisioning = json.loads(GRAFANA_RULES.read_text())
    rules = grafana_rules(provisioning)
    rules[0]["for"] = "1m"
    condition = next(q for q in rules[1]["data"] if q["refId"] == rules[1]["condition"])
    condition["model"]["expression"] = condition["model"]["expression"].replace(">", "<")
    rules[2]["data"][0]["model"]["expr"] += " * 2"
    rules[3]["labels"]["summary_of_drift"] = "x"
    problems = twin_problems(RULES.read_text(), provisioning)
    assert len(problems) == 4, problems


def test_provisioning_has_what_grafana_requires():
    provisioning = json.loads(GRAFANA_RULES.read_text())
    config = MixinConfig()
    assert provisioning["apiVersion"] == 1
    for group in provisioning["groups"]:
        assert group["name"] and group["folder"] and group["orgId"] == config.grafana_org_id
        assert re.fullmatch(r"\d+[smh]", group["interval"])
        for rule in group["rules"]:
            for key in ("uid", "title", "condition", "data", "for", "labels", "annotations",
                        "noDataState", "execErrState", "dashboardUid", "panelId"):
                assert key in rule, (rule.get("uid"), key)
            assert rule["noDataState"] in NO_DATA_STATES and rule["execErrState"] in EXEC_ERR_STATES
            ref_ids = [q["refId"] for q in rule["data"]]
            assert len(ref_ids) == len(set(ref_ids)) and rule["condition"] in ref_ids
            for query in rule["data"]:
                assert {"refId", "datasourceUid", "model", "relativeTimeRange"} <= set(query)
                assert query["model"]["refId"] == query["refId"]
                if "expr" in query["model"]:
                    assert query["datasourceUid"] == config.grafana_datasource_uid
                    assert query["model"]["datasource"] == {"type": "prometheus", "uid": config.grafana_datasource_uid}
                    assert query["model"]["instant"] is True
                    assert query["relativeTimeRange"]["from"] > 0
                else:
                    assert query["datasourceUid"] == "-100"  # server-side expression
                    assert query["model"]["type"] in ("reduce", "math", "threshold", "classic_conditions")
            # Multi-dimensional: one alert instance per engine, not classic conditions.
            assert all(q["model"].get("type") != "classic_conditions" for q in rule["data"])
            assert {"summary", "description"} <= set(rule["annotations"])


def test_uids_are_unique_stable_and_valid():
    rules = grafana_rules(json.loads(GRAFANA_RULES.read_text()))
    uids = [r["uid"] for r in rules]
    assert len(uids) == len(set(uids))
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]{1,40}", uid) for uid in uids)
    titles = [r["title"] for r in rules]
    assert len(titles) == len(set(titles))  # unique per folder
    # Stable: regenerating gives the same uids, and a config change that is
    # not about identity does not move them.
    again = grafana_rules(json.loads(render_all(config_from_mapping({"hit_ratio_low": 0.3}))[GRAFANA_RULES_FILE]))
    assert [r["uid"] for r in again] == uids
    assert "kvwatch-ttft-queueing-kv-bound" in uids


LINKS = {"runbook_url_pattern": "https://git.example.org/ops/kvwatch/blob/main/alerts/runbooks.md#{anchor}",
         "dashboard_url_pattern": "https://grafana.example.org/d/{uid}?var-model={model_name}&viewPanel={panel_id}"}


PROMETHEUS_ONLY = ("cause_alerts", "burning_replicas")


def _rendered_without_labels(url: str) -> str:
    """A link as Prometheus or Grafana renders it for an alert without the labels it names
    (KvwatchDown{cause="kvwatch_absent"} has no instance): every label template empty."""
    return re.sub(r"\{\{[^}]*\}\}", "", url)


@pytest.mark.parametrize("links", [{}, {"runbook_base_url": "https://kvwatch.example.org/runbooks/"},
                                   {"runbook_url_pattern": "https://git.example.org/rb.md#{anchor}"}])
def test_every_runbook_link_has_a_host_even_for_an_alert_without_labels(links):
    # A page at 3am carries a link the on-call laptop opens: a literal host, never
    # a pod's address from $labels.instance (http:///runbooks on an alert without it).
    files = render_all(config_from_mapping(links))
    rules = grafana_rules(json.loads(files[GRAFANA_RULES_FILE])) + prometheus_alerts(files[RULES_FILE])
    panel_links = [link["url"] for name, text in files.items() if name.startswith("dashboards/")
                   for panel in iter_panels(json.loads(text)) for link in panel.get("links", [])]
    assert len(rules) >= 30 and len(panel_links) > 30
    for url in [rule["annotations"]["runbook_url"] for rule in rules] + panel_links:
        rendered = urlsplit(_rendered_without_labels(url))
        assert rendered.scheme == "https" and rendered.hostname and "." in rendered.hostname, url
        assert rendered.fragment, url
    assert "dashboard_url" not in files[RULES_FILE]  # no Grafana named, no link to guess


def test_runbook_base_defaults_to_the_published_runbooks_and_follows_the_config():
    from kvwatch.mixin.config import PUBLISHED_RUNBOOKS_URL

    urls = {r["annotations"]["runbook_url"] for r in prometheus_alerts(render_all(MixinConfig())[RULES_FILE])}
    assert PUBLISHED_RUNBOOKS_URL + "#vllmtimetofirsttokenbudgetburn" in urls
    assert all(url.startswith(PUBLISHED_RUNBOOKS_URL + "#") for url in urls)
    published = render_all(config_from_mapping({"runbook_base_url": "https://kvwatch.example.org/runbooks/"}))
    urls = {r["annotations"]["runbook_url"] for r in prometheus_alerts(published[RULES_FILE])}
    assert "https://kvwatch.example.org/runbooks#vllmtimetofirsttokenbudgetburn" in urls
    assert all(url.startswith("https://kvwatch.example.org/runbooks#") for url in urls)


@pytest.mark.parametrize("base", ["http://{{ $labels.instance }}/runbooks", "http:///runbooks", "runbooks.md",
                                  "https://wiki.example.org/rb#top", "https://wiki.example.org/a b"])
def test_a_runbook_base_without_a_host_of_its_own_is_refused_in_one_sentence(base):
    with pytest.raises(MixinConfigError) as error:
        config_from_mapping({"runbook_base_url": base})
    assert error.value.problems == [f"config: runbook_base_url: {base!r} must be an http(s) URL with a host of its "
                                    "own (no {{ template }}, no #fragment, no quotes or spaces)"]


def test_grafana_base_gives_every_prometheus_alert_its_panel_link():
    files = render_all(config_from_mapping({"dashboard_base_url": "https://grafana.example.org/"}))
    for rule in prometheus_alerts(files[RULES_FILE]):
        url = urlsplit(_rendered_without_labels(rule["annotations"]["dashboard_url"]))
        assert url.hostname == "grafana.example.org" and url.path.startswith("/d/kvwatch"), rule["alert"]
        assert parse_qs(url.query)["viewPanel"][0].isdigit()


def test_every_rule_has_a_no_data_decision_with_a_reason():
    from kvwatch.mixin.grafana_alerts import NO_DATA

    for config in (MixinConfig(), config_from_mapping({**UPSTREAM, "no_reuse_alert": True})):
        for spec in alert_specs(config):
            state, reason = NO_DATA[(spec.alert, spec.cause)]
            assert state in NO_DATA_STATES and len(reason) > 40
    assert set(NO_DATA) <= {(a, c) for a, causes in ALERT_CAUSES.items() for c in causes} | {
        (alert, objective) for objective, (alert, _, _) in OBJECTIVE_ALERTS.items()}


def test_panel_references_point_at_existing_panels():
    panels = {(d["uid"], p["id"]) for d in load_dashboards().values() for p in iter_panels(d)}
    files = render_all(config_from_mapping(LINKS))
    for rule in grafana_rules(json.loads(files[GRAFANA_RULES_FILE])):
        assert (rule["dashboardUid"], rule["panelId"]) in panels, rule["uid"]
        url = urlsplit(rule["annotations"]["dashboard_url"])
        assert url.path.endswith("/d/" + rule["dashboardUid"])
        assert parse_qs(url.query)["viewPanel"] == [str(rule["panelId"])]


def test_runbook_links_resolve_to_sections():
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', (REPO / "alerts" / "runbooks.md").read_text()))
    files = render_all(config_from_mapping(LINKS))
    for rule in grafana_rules(json.loads(files[GRAFANA_RULES_FILE])):
        assert rule["annotations"]["runbook_url"].split("#", 1)[1] in anchors


def test_datasource_uid_comes_from_the_config():
    files = render_all(config_from_mapping({"grafana_datasource_uid": "prom-main"}))
    for rule in grafana_rules(json.loads(files[GRAFANA_RULES_FILE])):
        assert rule["data"][0]["datasourceUid"] == "prom-main"


def test_notification_example_routes_every_cause_by_severity_and_cause():
    example = yaml.safe_load((REPO / GRAFANA_NOTIFICATIONS_FILE).read_text())
    contact_points = {cp["name"] for cp in example["contactPoints"]}
    policy = example["policies"][0]
    assert policy["receiver"] in contact_points
    # One notification per model (a page's labels): the page with every replica's cause alerts beside it.
    assert policy["group_by"] == ["namespace", "job", "model_name"]
    keys = set()
    for route in policy["routes"]:
        assert route["receiver"] in contact_points
        for label, op, value in route["object_matchers"]:
            keys.add(label)
            assert op in ("=", "!=", "=~", "!~")
    assert {"severity", "cause"} <= keys

    def receiver_for(labels: dict) -> str:
        for route in policy["routes"]:
            if all(_matches(labels.get(key, ""), op, v) for key, op, v in route["object_matchers"]):
                return route["receiver"]
        return policy["receiver"]

    for rule in grafana_rules(json.loads(GRAFANA_RULES.read_text())):
        receiver = receiver_for(rule["labels"])
        if rule["labels"]["severity"] == "critical":
            assert receiver == "kvwatch-pager"
        elif rule["labels"]["severity"] == "info":
            assert receiver == "kvwatch-tickets"
        else:
            assert receiver in ("kvwatch-platform", "kvwatch-application"), rule["labels"]
    assert receiver_for({"severity": "warning", "cause": "queueing_kv_bound"}) == "kvwatch-platform"
    assert receiver_for({"severity": "warning", "cause": "upstream"}) == "kvwatch-application"


def _matches(value: str, op: str, pattern: str) -> bool:
    if op in ("=", "!="):
        return (value == pattern) == (op == "=")
    return bool(re.fullmatch(pattern, value)) == (op == "=~")


@pytest.mark.parametrize("field", ["for", "labels", "annotations"])
def test_grafana_rules_carry_no_templating_grafana_would_reject(field):
    for rule in grafana_rules(json.loads(GRAFANA_RULES.read_text())):
        text = json.dumps(rule[field])
        # Prometheus' $value is a string in Grafana; the twins use $values.B.Value.
        assert "$value " not in text and "$value}" not in text
        # Grafana's provisioning expands ${VAR} from the environment in annotations.
        assert "${" not in text
