"""The cause catalogue (kvwatch/diagnose/causes.py) is the one place a cause
is described: every surface that says something about a cause says what its
record says, so changing the record changes them all."""

import dataclasses

import pytest
import yaml

from kvwatch.diagnose import arbitration, causes
from kvwatch.diagnose.causes import ALERT_LIST, CAUSE, CAUSE_LIST, CAUSES, SYMPTOM_LIST, severity_of
from kvwatch.mixin import alertmanager, grafana_alerts
from kvwatch.mixin.alerts import alert_specs
from kvwatch.mixin.config import DEFAULT_FOR, DEFAULT_SEVERITIES, PREEMPTING_SUFFIX, MixinConfig
from kvwatch.sidecar.statuspage import page_meta


def test_every_alert_rule_carries_its_cause_record_severity_and_its_alert_record_duration():
    config = MixinConfig(no_reuse_alert=True, upstream_histogram="gateway_request_duration_seconds")
    seen = set()
    # Central mode's own health (store_unreachable) is generated in its mode alone.
    for spec in alert_specs(config) + alert_specs(dataclasses.replace(config, mode="central")):
        if spec.kind != "cause":
            continue
        record = CAUSE[spec.cause]
        assert record.alert == spec.alert, spec
        # The page's own rule (severity_of): one severity per finding on the page, in kvwatch_finding and the alert.
        assert spec.severity == severity_of(spec.cause, preempting=spec.variant == "preempting"), spec
        alert = next(a for a in ALERT_LIST if a.name == spec.alert)
        assert spec.for_ == alert.for_ and (spec.dashboard, spec.panel) == alert.panel
        assert spec.uid.startswith(f"kvwatch-{alert.uid}-")
        seen.add(spec.cause)
    # Every cause that names an alert has a rule in it (with the optional ones configured).
    assert seen == {c.name for c in CAUSE_LIST if c.alert}
    # A cause the page raises while the engine preempts has that rule apart, at the page's severity.
    raised = {c.name for c in CAUSE_LIST if c.alert and c.preempting_severity and c.preempting_severity != c.severity}
    assert raised and {s.cause for s in alert_specs(config) if s.variant == "preempting"} == raised


def test_the_mixin_defaults_are_the_records():
    for cause in CAUSE_LIST:
        if cause.alert:
            assert DEFAULT_SEVERITIES[cause.name] == cause.severity
        if cause.preempting_severity and cause.alert:
            assert DEFAULT_SEVERITIES[cause.name + PREEMPTING_SUFFIX] == cause.preempting_severity
    assert {a.name: a.for_ for a in ALERT_LIST}.items() <= DEFAULT_FOR.items()


def test_each_owned_cause_routes_to_its_owner_and_no_other():
    routes = alertmanager.example(MixinConfig())["route"]["routes"]
    receivers = {}
    for route in routes:
        for matcher in route.get("matchers", ()):
            if matcher.startswith("cause=~"):
                for cause in matcher.split('"')[1].split("|"):
                    receivers.setdefault(cause, set()).add(route["receiver"])
    for cause in CAUSE_LIST:
        if cause.owner:
            assert receivers[cause.name] == {cause.owner}, cause.name
        else:
            assert cause.name not in receivers, cause.name
    grafana = yaml.safe_dump(grafana_alerts.notification_example(MixinConfig()))
    for owner in ("platform", "application"):
        assert "|".join(c.name for c in CAUSE_LIST if c.owner == owner) in grafana


def test_the_grafana_rules_take_the_records_no_data_state():
    for spec in alert_specs(MixinConfig()):
        if spec.kind == "cause":
            assert grafana_alerts.NO_DATA[(spec.alert, spec.cause)] == CAUSE[spec.cause].no_data


def test_the_page_shows_the_records_words():
    meta = page_meta()
    for cause in CAUSE_LIST:
        assert meta["causes"].get(cause.name) == cause.title
        assert meta["actions"].get(cause.name) == (cause.next_action or None)
        assert meta["deciding"].get(cause.name) == (list(cause.deciding) or None)
    assert meta["symptoms"] == {s.name: s.title for s in SYMPTOM_LIST if s.title}


def test_arbitration_orders_causes_by_their_symptoms_ranking():
    for symptom in SYMPTOM_LIST:
        if not symptom.arbitrated:
            assert symptom.name not in arbitration.ARBITRATED and not symptom.ranking
            continue
        ranked = arbitration.RANK[symptom.name]
        assert ranked == symptom.ranking
        assert sorted(ranked) == sorted(CAUSES[symptom.name])
    assert arbitration.RANK["slow_first_token"][0] == "upstream"
    assert arbitration.RANK["exhaustion"][-1] == "capacity_below_max_num_seqs"
    assert arbitration.SUBORDINATE == {c.name for c in CAUSE_LIST if c.subordinate}


@pytest.mark.parametrize("ranking", [
    ("caching_disabled", "cold_cache", "prefix_changed", "eviction_before_reuse"),  # one cause left out
    ("caching_disabled", "cold_cache", "prefix_changed", "eviction_before_reuse", "no_reuse", "no_reuse"),
    ("caching_disabled", "cold_cache", "prefix_changed", "eviction_before_reuse", "no_reuse", "prefill"),
])
def test_a_ranking_that_misses_repeats_or_borrows_a_cause_stops_the_import(monkeypatch, ranking):
    symptoms = tuple(dataclasses.replace(s, ranking=ranking) if s.name == "low_hit_rate" else s for s in causes.SYMPTOM_LIST)
    monkeypatch.setattr(causes, "SYMPTOM_LIST", symptoms)
    monkeypatch.setattr(causes, "SYMPTOMS", {s.name: s for s in symptoms})
    with pytest.raises(causes.CatalogueError, match="low_hit_rate: its ranking"):
        causes._check()


def test_severity_rule_raises_only_a_preempting_cause():
    for cause in CAUSE_LIST:
        if not cause.diagnosed:
            continue
        assert severity_of(cause.name) == cause.severity
        assert severity_of(cause.name, preempting=True) == (cause.preempting_severity or cause.severity)


def test_every_alert_and_alerted_cause_has_its_prose_and_every_placeholder_resolves():
    from kvwatch.mixin import runbooks

    text = runbooks.render(MixinConfig(no_reuse_alert=True, upstream_histogram="gateway_request_duration_seconds"))
    for alert in ALERT_LIST:
        assert f"## {alert.name}\n" in text
    for cause in CAUSE_LIST:
        if cause.alert:
            sections = runbooks.cause_sections(MixinConfig(), cause.alert, cause.name)
            # A cause only its alert names may come without prose: its records then fill the first three.
            written = runbooks.PROSE.joinpath(f"{cause.name}.md").is_file()
            assert tuple(sections) == runbooks.SECTIONS, cause.name
            assert all(list(sections.values())[:None if written else 3]), cause.name
    # No placeholder left unfilled (the jsonpath and PromQL braces are text).
    assert "{dashboard:" not in text and ":pct}" not in text and "{for}" not in text


def test_a_threshold_in_the_config_reaches_the_prose():
    from kvwatch.mixin import runbooks

    sections = runbooks.cause_sections(MixinConfig(long_request_capacity_share=0.37), "VllmKvCacheExhausted",
                                       "long_requests")
    assert "at least 37% of the KV cache" in sections["What it means"]
    intro = runbooks.alert_intro(MixinConfig(for_durations={"VllmTimeToFirstTokenSlow": "7m"}),
                                 "VllmTimeToFirstTokenSlow")
    assert "for 7m." in intro and "upstream" not in intro
    intro = runbooks.alert_intro(MixinConfig(upstream_histogram="rag_seconds"), "VllmTimeToFirstTokenSlow")
    assert "(counting the upstream stage rag_seconds before the engine)" in intro and ", and upstream." in intro


def test_bad_prose_is_one_sentence_naming_the_file(tmp_path, monkeypatch):
    import pytest

    from kvwatch.mixin import runbooks

    monkeypatch.setattr(runbooks, "PROSE", tmp_path)
    with pytest.raises(runbooks.RunbookProseError, match="prefill.md is missing"):
        runbooks.cause_sections(MixinConfig(), "VllmTimeToFirstTokenSlow", "prefill")
    (tmp_path / "prefill.md").write_text("# prefill\n\n## What it means\n\nLong prompts.\n")
    with pytest.raises(runbooks.RunbookProseError, match="the sections are First five minutes"):
        runbooks.cause_sections(MixinConfig(), "VllmTimeToFirstTokenSlow", "prefill")
    (tmp_path / "prefill.md").write_text("prefill\n\ntext\n")
    with pytest.raises(runbooks.RunbookProseError, match="must start with the line '# prefill'"):
        runbooks.cause_sections(MixinConfig(), "VllmTimeToFirstTokenSlow", "prefill")
    (tmp_path / "VllmTimeToFirstTokenSlow.md").write_text("# VllmTimeToFirstTokenSlow\n\nAbove {ttft_mean_secs}s.\n")
    with pytest.raises(runbooks.RunbookProseError, match=r"\{ttft_mean_secs\} names no mixin config value"):
        runbooks.alert_intro(MixinConfig(), "VllmTimeToFirstTokenSlow")
    (tmp_path / "VllmTimeToFirstTokenSlow.md").write_text("# VllmTimeToFirstTokenSlow\n\nSee {dashboard:nope}.\n")
    with pytest.raises(runbooks.RunbookProseError, match="no dashboard 'nope'"):
        runbooks.alert_intro(MixinConfig(), "VllmTimeToFirstTokenSlow")
    (tmp_path / "VllmTimeToFirstTokenSlow.md").write_bytes(b"# VllmTimeToFirstTokenSlow\n\n" + b"x" * 70000)
    with pytest.raises(runbooks.RunbookProseError, match="over 65536 bytes"):
        runbooks.alert_intro(MixinConfig(), "VllmTimeToFirstTokenSlow")


def _route_by_finding(monkeypatch, name: str, alert: str):
    """The catalogue with one cause's record routed to `alert` by its finding."""
    import dataclasses

    from kvwatch.mixin import alerts

    routed = dataclasses.replace(CAUSE[name], alert=alert, owner="platform", routed_by_finding=True)
    records = tuple(routed if c.name == name else c for c in CAUSE_LIST)
    monkeypatch.setattr(alerts, "CAUSE_LIST", records)
    monkeypatch.setattr(alerts, "CAUSE", {c.name: c for c in records})
    # The mixin's defaults are read from the records when it is imported.
    monkeypatch.setitem(DEFAULT_SEVERITIES, name, routed.severity)
    return routed


def test_a_cause_routed_by_its_finding_gets_a_rule_on_kvwatch_finding(monkeypatch):
    routed = _route_by_finding(monkeypatch, "capacity_below_max_num_seqs", "VllmKvCacheExhausted")
    specs = [s for s in alert_specs(MixinConfig()) if s.cause == routed.name]
    assert len(specs) == 1
    spec = specs[0]
    assert spec.alert == "VllmKvCacheExhausted" and spec.severity == routed.severity
    assert 'kvwatch_finding{job="kvwatch",symptom="exhaustion",cause="capacity_below_max_num_seqs"}' in spec.query
    assert spec.op == ">" and spec.threshold == 0 and spec.description.endswith("Next: " + routed.next_check)


def test_a_cause_routed_by_its_finding_fires_in_promtool(monkeypatch, tmp_path):
    """promtool evaluates the generated rule: a finding held for the alert's
    `for:` fires it with the cause's labels; another cause's finding does not."""
    import shutil
    import subprocess

    import pytest

    from kvwatch.mixin.rules import alert_rule

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (make system-deps)")
    routed = _route_by_finding(monkeypatch, "capacity_below_max_num_seqs", "VllmKvCacheExhausted")
    config = MixinConfig()
    spec = next(s for s in alert_specs(config) if s.cause == routed.name)
    rule = alert_rule(spec, config, {(spec.dashboard, spec.panel): ("uid", 1)})
    rule.pop("annotations")
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "t", "rules": [rule]}]}))
    identity = 'job="kvwatch",namespace="vllm",instance="a:9400",model_name="m",severity="warning"'
    (tmp_path / "test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": "1m",
        "tests": [{"interval": "1m", "input_series": [
            {"series": f'kvwatch_finding{{{identity},engine="0",symptom="exhaustion",cause="capacity_below_max_num_seqs"}}',
             "values": "1x30"},
            {"series": f'kvwatch_finding{{{identity},symptom="exhaustion",cause="long_requests",engine="1"}}',
             "values": "1x30"}],
            "alert_rule_test": [
                {"eval_time": "5m", "alertname": "VllmKvCacheExhausted", "exp_alerts": []},
                {"eval_time": "20m", "alertname": "VllmKvCacheExhausted", "exp_alerts": [{"exp_labels": {
                    "job": "kvwatch", "namespace": "vllm", "instance": "a:9400", "model_name": "m", "engine": "0",
                    "severity": routed.severity, "cause": routed.name, "symptom": "exhaustion",
                    "route": "finding"}}]}]}]}))
    done = subprocess.run([promtool, "test", "rules", "test.yaml"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
