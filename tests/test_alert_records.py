"""The alerts as declarative records (kvwatch/mixin/alert_records.py): the
signals an alert reads are found in its query and recorded before it in its
own group, so no alert reads a series one evaluation late; the records agree
with the cause catalogue or kvwatch refuses them with one sentence; the
advice an alert gives is its cause's record's."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest

from kvwatch.diagnose import causes
from kvwatch.diagnose.causes import CAUSE, CatalogueError
from kvwatch.mixin import alerts
from kvwatch.mixin.alert_records import CAUSE_ALERTS
from kvwatch.mixin.alerts import AlertCatalogueError, alert_specs, signals_read
from kvwatch.mixin.conditions import twin_record
from kvwatch.mixin.config import MixinConfig, config_from_mapping
from kvwatch.mixin.rules import ALERTS_GROUP, recording_rules, rule_groups
from mixin_support import REPO

sys.path.insert(0, str(REPO / "tests" / "promtool"))
import cases  # noqa: E402

RECORDED = re.compile(r"(?<![\w:])[a-zA-Z_]\w*:[\w:]+")
CONFIGS = (MixinConfig(), config_from_mapping(cases.UPSTREAM_CONFIG), config_from_mapping(cases.NO_REUSE_CONFIG))


def _panel_ids():
    return {panel: ("uid", 1) for panel in alerts.ALERT_PANELS.values()}


def _alerts_group(config: MixinConfig) -> list[dict]:
    (group,) = [g for g in rule_groups(config, _panel_ids()) if g["name"] == ALERTS_GROUP]
    return group["rules"]


def _read_late(config: MixinConfig) -> list[tuple[str, str]]:
    """(alert, recorded series) where a cause's alert reads a series its group
    has not written before it (the burn-rate pages read the objectives'
    group, their own design: kvwatch/mixin/objectives.py)."""
    written: set[str] = set()
    late = []
    for rule in _alerts_group(config):
        if "record" in rule:
            written.add(rule["record"])
            continue
        if "cause" not in rule["labels"]:
            continue
        late += [(rule["alert"], name) for name in RECORDED.findall(rule["expr"]) if name not in written]
    return late


@pytest.mark.parametrize("config", CONFIGS, ids=("default", "upstream", "no_reuse"))
def test_every_series_an_alert_reads_is_recorded_before_it_in_its_group(config):
    assert _read_late(config) == []
    # The signals read are found in the queries, not listed: each is read.
    queries = "\n".join(spec.query for spec in alert_specs(config))
    assert signals_read(config) and all(twin_record(config, s) in queries for s in signals_read(config))


@pytest.mark.parametrize("signal", ["kvwatch_preemptions_per_second", "kvwatch_requests_finished_per_second"])
def test_an_alert_on_another_signal_gets_its_twin_in_its_group(monkeypatch, signal):
    """A record reading a signal no alert read before (one labelled by its
    finished_reason too): its twin moves into the alerts' group, before the alert, under the
    name its recording rule has, with nothing listed by hand."""
    config = MixinConfig()
    assert signal not in signals_read(config)
    rising = next(r for r in CAUSE_ALERTS if r.cause == "usage_rising")
    scratch = dataclasses.replace(rising, query=lambda f: [f.signal(signal), ("unless", f.exhausted())])
    monkeypatch.setattr(alerts, "CAUSE_ALERTS", tuple(scratch if r is rising else r for r in CAUSE_ALERTS))
    assert signal in signals_read(config)
    assert _read_late(config) == []
    engine_group = next(g for g in rule_groups(config, _panel_ids()) if g["name"] == "kvwatch-engine.rules")
    assert twin_record(config, signal) not in {rule["record"] for rule in engine_group["rules"]}
    assert twin_record(config, signal) in {rule["record"] for rule in _alerts_group(config) if "record" in rule}
    # The same name its engine-level recording rule has wherever no alert reads it.
    assert twin_record(config, signal) in {rule["record"] for rule in recording_rules(config, "engine")}


def test_the_records_and_the_cause_catalogue_agree_or_kvwatch_refuses(monkeypatch):
    prefill = next(r for r in CAUSE_ALERTS if r.cause == "prefill")
    monkeypatch.setattr(alerts, "CAUSE_ALERTS", CAUSE_ALERTS + (prefill,))
    with pytest.raises(AlertCatalogueError, match="prefill: one record per cause"):
        alerts._check_records()
    monkeypatch.setattr(alerts, "CAUSE_ALERTS", tuple(r for r in CAUSE_ALERTS if r.cause != "prefill"))
    with pytest.raises(AlertCatalogueError, match="prefill: .* has no CauseAlert for it"):
        alerts._check_records()
    stuck = dataclasses.replace(prefill, cause="requests_stalled")
    monkeypatch.setattr(alerts, "CAUSE_ALERTS", CAUSE_ALERTS + (stuck,))
    with pytest.raises(AlertCatalogueError, match="requests_stalled: an alert record for a cause whose record routes"):
        alerts._check_records()


def test_a_description_placeholder_that_names_nothing_is_one_sentence(monkeypatch):
    prefill = next(r for r in CAUSE_ALERTS if r.cause == "prefill")
    typo = dataclasses.replace(prefill, description="Mean {ttft_mean_secnds}s")
    monkeypatch.setattr(alerts, "CAUSE_ALERTS", tuple(typo if r is prefill else r for r in CAUSE_ALERTS))
    with pytest.raises(AlertCatalogueError, match=r"\{ttft_mean_secnds\} in an alert record names no phrase"):
        alert_specs(MixinConfig())


@pytest.mark.parametrize("config", CONFIGS, ids=("default", "upstream", "no_reuse"))
def test_each_alert_gives_its_cause_records_advice_once(config):
    for spec in alert_specs(config):
        if spec.kind != "cause":
            continue
        advice = CAUSE[spec.cause].next_check
        assert spec.description.endswith(" Next: " + advice), spec.cause
        assert spec.description.count("Next:") == 1, spec.cause
        assert "{" not in spec.description.replace("{{ ", "").replace(" }}", ""), spec.cause


def test_an_inconsistent_cause_catalogue_is_a_real_error(monkeypatch):
    """Not an assert, which python -O skips."""
    broken = dataclasses.replace(CAUSE["prefill"], owner="nobody")
    monkeypatch.setattr(causes, "CAUSE_LIST", tuple(broken if c.name == "prefill" else c for c in causes.CAUSE_LIST))
    with pytest.raises(CatalogueError, match="prefill: owner 'nobody' is not one of"):
        causes._check()


def test_the_records_are_declared_by_keyword():
    with pytest.raises(TypeError):
        alerts.CauseAlert("prefill", lambda f: "x", ">", 0, "s", "d")  # type: ignore[misc]



def test_an_alert_only_cause_without_prose_gets_its_runbook_section_from_its_records(tmp_path, monkeypatch):
    """Its advice, what its alert's description says in words, the dashboard
    it links; a cause the diagnosis names still needs its prose."""
    import shutil

    from kvwatch.mixin import runbooks

    shutil.copytree(str(runbooks.PROSE), tmp_path / "runbooks")
    (tmp_path / "runbooks" / "usage_rising.md").unlink()
    monkeypatch.setattr(runbooks, "PROSE", tmp_path / "runbooks")
    first, meaning, confirm, do, dont = runbooks.cause_sections(
        MixinConfig(), "VllmKvCacheExhaustionSoon", "usage_rising").values()
    assert first == CAUSE["usage_rising"].next_check
    assert meaning.startswith("KV usage of engine <engine> of <model_name> on <instance> is rising") \
        and "the cache is full in the alert's value" in meaning and "{" not in meaning and "Next:" not in meaning
    assert confirm == f"{runbooks.DASHBOARDS['exhaustion'][1]}: the panel the alert links."
    assert (do, dont) == ("", "")
    assert "### VllmKvCacheExhaustionSoon: usage_rising" in runbooks.render(MixinConfig())
    (tmp_path / "runbooks" / "prefill.md").unlink()
    with pytest.raises(runbooks.RunbookProseError, match="prefill.md is missing"):
        runbooks.render(MixinConfig())


@pytest.mark.parametrize("config", CONFIGS, ids=("default", "upstream", "no_reuse"))
def test_a_finding_decided_symptom_fires_from_kvwatch_finding_for_each_cause_the_rules_decide(config):
    # A low hit rate the KV-event stream decided shows on the page while the ratio's twin may not hold:
    # each cause the rules decide has a twin that fires from kvwatch_finding, at the same severity.
    specs = alert_specs(config)
    decided = {s.cause: s for s in specs if s.symptom == "low_hit_rate" and "route" not in s.labels()}
    twins = {s.cause: s for s in specs if s.symptom == "low_hit_rate" and s.labels().get("route") == "finding"}
    # (A cause only kvwatch's finding decides, routed_by_finding, has the finding's rule alone.)
    by_finding_alone = {cause for cause in twins if CAUSE[cause].routed_by_finding}
    assert decided and twins.keys() - by_finding_alone == decided.keys()
    for cause, twin in twins.items():
        assert f'kvwatch_finding{{{config.kvwatch_selector},symptom="low_hit_rate",cause="{cause}"}}' in twin.query
        if cause in by_finding_alone:
            assert twin.severity == CAUSE[cause].severity
            continue
        assert twin.severity == decided[cause].severity and twin.uid != decided[cause].uid


def test_two_routes_of_one_symptom_that_could_fire_together_are_a_real_error(monkeypatch):
    # The catalogue's check, not a hand list: drop either side's exclusion and kvwatch refuses the rules.
    real = alerts._routes

    def without(side):
        def routes(config, specs):
            out, records = real(config, specs)
            if side == "finding":
                out = [dataclasses.replace(s, query=s.query.split("\nunless on")[0])
                       if s.labels().get("route") == "finding" and s.symptom == "low_hit_rate" else s for s in out]
            else:
                out = [dataclasses.replace(s, query=s.query.replace(
                    alerts.route_record(config, "low_hit_rate", "firing_finding"), "vector(0)"))
                       if s.kind == "cause" and "route" not in s.labels() else s for s in out]
            return out, records
        return routes

    for side in ("finding", "rules"):
        monkeypatch.setattr(alerts, "_routes", without(side))
        with pytest.raises(AlertCatalogueError, match="can fire together for one engine"):
            alert_specs(MixinConfig())
    monkeypatch.setattr(alerts, "_routes", real)
    assert alert_specs(MixinConfig())
