"""The generated rules pass `promtool check rules`, and `promtool test rules`
proves each alert and each cause branch: the right cause fires on its
series, the other causes and alerts do not (tests/promtool/, built by
tests/promtool/cases.py). The exhaustion ETA's recorded series are tested the
same way (hand-computed values, no series on flat, falling or just-emptied
usage), and each expected value is the sidecar's own signal on those samples."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvwatch.mixin.alerts import alert_specs
from kvwatch.mixin.config import MixinConfig, config_from_mapping
from kvwatch.mixin.objectives import OBJECTIVE_ALERTS
from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.mixin.rules import ALERTS_GROUP, MEMORY_GROUP
from mixin_support import PROMETHEUS_RULE, REPO, RULES, load_rules

sys.path.insert(0, str(REPO / "tests" / "promtool"))
import cases  # noqa: E402

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make system-deps)")
CASES_DIR = REPO / "tests" / "promtool"


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


RECORDED = re.compile(r"[a-zA-Z_]*:[a-zA-Z0-9_]+:[a-zA-Z0-9_]+")


def alerts_without_annotations(rules_text: str) -> str:
    """The alerts' group (the records they read, then the alerts) and the
    hit-ratio memory, in the file's order, the alerts' annotations removed
    (promtool compares rendered annotations verbatim). The objectives' burn
    alerts and their records have their own cases
    (tests/test_objectives_promtool.py); the other recording rules are left
    out (evaluating every one makes promtool several times slower)."""
    data = yaml.safe_load(rules_text)
    burns = {alert for alert, _, _ in OBJECTIVE_ALERTS.values()}
    groups = []
    for group in data["groups"]:
        if group["name"] == MEMORY_GROUP:
            groups.append(group)
        elif group["name"] == ALERTS_GROUP:
            rules = [rule for rule in group["rules"] if rule.get("alert") not in burns]
            for rule in rules:
                rule.pop("annotations", None)
            groups.append({**group, "rules": rules})
    return yaml.safe_dump({"groups": groups}, width=1 << 16)


def run_cases(tmp_path: Path, case_file: str, rules_text: str, only: str | None = None) -> subprocess.CompletedProcess:
    """Run a case file against `rules_text`; `only` keeps the cases whose name starts with it."""
    if only is None:
        shutil.copy(CASES_DIR / case_file, tmp_path / case_file)
    else:
        data = yaml.safe_load((CASES_DIR / case_file).read_text())
        data["tests"] = [test for test in data["tests"] if test["name"].startswith(only)]
        (tmp_path / case_file).write_text(yaml.safe_dump(data, width=1 << 16))
    (tmp_path / "rules.yaml").write_text(alerts_without_annotations(rules_text))
    return promtool("test", "rules", case_file, cwd=tmp_path)


@needs_promtool
def test_committed_rules_pass_promtool_check():
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_prometheus_rule_spec_passes_promtool_check(tmp_path):
    document = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert document["apiVersion"] == "monitoring.coreos.com/v1" and document["kind"] == "PrometheusRule"
    assert document["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(document["spec"]))
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_upstream_config_rules_pass_promtool_check(tmp_path):
    path = tmp_path / "rules.yaml"
    path.write_text(render_all(config_from_mapping(cases.UPSTREAM_CONFIG))[RULES_FILE])
    result = promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def test_case_files_are_current():
    for name, build in cases.FILES.items():
        assert (CASES_DIR / name).read_text() == cases.render(build()), \
            f"tests/promtool/{name} is stale: run `python tests/promtool/cases.py`"
    for name, (build, render) in cases.RENDER_FILES.items():
        assert (CASES_DIR / name).read_text() == render(build()), \
            f"tests/promtool/{name} is stale: run `python tests/promtool/cases.py`"


def eta_rules(rules_text: str) -> str:
    """The exhaustion ETA's recording rules alone, per engine and per model."""
    data = yaml.safe_load(rules_text)
    groups = []
    for group in data["groups"]:
        rules = [rule for rule in group["rules"] if rule.get("record") in cases.ETA_RECORDS.values()]
        if rules:
            groups.append({**group, "rules": rules})
    assert sum(len(group["rules"]) for group in groups) == len(cases.ETA_RECORDS)
    return yaml.safe_dump({"groups": groups}, width=1 << 16)


def run_eta_cases(tmp_path: Path, rules_text: str, only: str | None = None) -> subprocess.CompletedProcess:
    """Run eta.test.yaml against `rules_text`; `only` keeps the case of that name."""
    data = yaml.safe_load((CASES_DIR / "eta.test.yaml").read_text())
    if only is not None:
        data["tests"] = [test for test in data["tests"] if test["name"] == only]
        assert data["tests"], only
    (tmp_path / "eta.test.yaml").write_text(yaml.safe_dump(data, width=1 << 16))
    (tmp_path / "rules.yaml").write_text(eta_rules(rules_text))
    return promtool("test", "rules", "eta.test.yaml", cwd=tmp_path)


@needs_promtool
def test_promtool_unit_tests_of_the_eta_recording_rules(tmp_path):
    result = run_eta_cases(tmp_path, RULES.read_text())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_eta_cases_are_the_sidecars_signal_on_the_same_samples():
    # One number, one definition: the sidecar's ETA (kvwatch/signals/evaluation.py),
    # fed each case's samples up to its evaluation time (one a minute, as
    # promtool's), gives the value the recorded series must hold, or none.
    from kvwatch.signals.evaluation import _eta

    cases_seen = 0
    for case in cases.eta_cases():
        for usage, expected in zip(case.usage, case.expect):
            values = cases.expand(usage)[:case.minute + 1]
            got = _eta([(60.0 * minute, value) for minute, value in enumerate(values)])
            assert (got is None) == (expected is None), (case.name, got, expected)
            if expected is not None:
                assert got == pytest.approx(expected, abs=1e-3), case.name
        cases_seen += 1
    assert cases_seen >= 6 and any(e is None for c in cases.eta_cases() for e in c.expect)


@needs_promtool
@pytest.mark.parametrize("old, new, case", [
    ("> 0)", ">= 0)", "flat usage: no series"),
    (" >= avg_over_time(", " >= 0 * avg_over_time(", "rising trend but usage now under its 5m mean: no series"),
], ids=["no rising slope", "no mean condition"])
def test_the_eta_cases_catch_a_rule_without_its_rising_conditions(tmp_path, old, new, case):
    # Each condition has the case that fails without it (and passes with it:
    # test_promtool_unit_tests_of_the_eta_recording_rules).
    text = RULES.read_text()
    assert old in text
    result = run_eta_cases(tmp_path, text.replace(old, new), only=case)
    assert result.returncode != 0
    assert "exp: nil" in result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_of_the_committed_rules(tmp_path):
    result = run_cases(tmp_path, "alerts.test.yaml", RULES.read_text())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_unit_tests_with_an_upstream_histogram(tmp_path):
    rules = render_all(config_from_mapping(cases.UPSTREAM_CONFIG))[RULES_FILE]
    result = run_cases(tmp_path, "upstream.test.yaml", rules)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_with_the_no_reuse_alert_on(tmp_path):
    rules = render_all(config_from_mapping(cases.NO_REUSE_CONFIG))[RULES_FILE]
    result = run_cases(tmp_path, "no-reuse.test.yaml", rules)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_of_the_fleet_alert(tmp_path):
    """Fires on an unbalanced fleet (one replica exhausted beside replicas
    with room, one that lost prefix affinity, one restarted) and not on a
    balanced one, nor on a fleet all exhausted or all restarted."""
    result = run_cases(tmp_path, "fleet.test.yaml", RULES.read_text())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_unit_tests_of_the_kv_event_stream_alert(tmp_path):
    """Fires on a stream no publisher ever reached, one that stopped while
    the engine stores blocks, and lost messages; not on an idle engine's
    stream, a quiet one whose engine stores nothing, a late start, one gap."""
    result = run_cases(tmp_path, "kv-events.test.yaml", RULES.read_text())
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_no_reuse_alert_is_off_by_default():
    # A workload without shared prefixes would keep it firing forever.
    assert ("VllmPrefixCacheHitRateLow", "no_reuse") not in {(s.alert, s.cause) for s in alert_specs(MixinConfig())}
    on = {(s.alert, s.cause): s for s in alert_specs(config_from_mapping(cases.NO_REUSE_CONFIG))}
    assert on[("VllmPrefixCacheHitRateLow", "no_reuse")].severity == "info"


def test_cases_cover_every_alert_and_cause_and_check_every_alert():
    # Every rule, preempting and waiting-only exhaustion apart (their severities differ).
    covered = {(e[0], e[1], cases.expected_severity(*e[1::2]))
               for case in cases.default_cases() + cases.upstream_cases() + cases.no_reuse_cases()
               + cases.fleet_cases() + cases.stream_cases() for e in case.expect}
    # (The objectives' burn-rate alerts have their own cases: tests/test_objectives_promtool.py.)
    specs = {(s.alert, s.cause, s.severity) for config in (MixinConfig(), config_from_mapping(cases.UPSTREAM_CONFIG),
                                                           config_from_mapping(cases.NO_REUSE_CONFIG))
             for s in alert_specs(config) if s.kind == "cause"}
    assert specs == covered
    # Each case checks every alert name, so a cause firing where another
    # should is a failure: the negative half of every branch.
    rendered = yaml.safe_load((CASES_DIR / "alerts.test.yaml").read_text())
    for test in rendered["tests"]:
        assert {check["alertname"] for check in test["alert_rule_test"]} == set(cases.ALERT_NAMES)
    # And there are cases where nothing may fire.
    assert sum(1 for case in cases.default_cases() if not case.expect) >= 6


def test_case_labels_match_the_config():
    config = MixinConfig()
    for spec in alert_specs(config):
        if spec.kind == "cause":
            assert cases.expected_severity(spec.cause, cases.PREEMPTING if spec.variant == "preempting" else None) \
                == spec.severity
    # Every alert names its cause, or (a page) its objective.
    assert all(rule["labels"].get("cause") or rule["labels"].get("objective") for rule in load_rules() if "alert" in rule)


@needs_promtool
def test_the_unit_tests_catch_swapped_causes(tmp_path):
    # If two causes' conditions were swapped, the cases must fail.
    data = yaml.safe_load(RULES.read_text())
    alerts = [r for g in data["groups"] for r in g["rules"] if r.get("alert") == "VllmKvCacheExhausted"]
    alerts[0]["labels"]["cause"], alerts[1]["labels"]["cause"] = alerts[1]["labels"]["cause"], alerts[0]["labels"]["cause"]
    result = run_cases(tmp_path, "alerts.test.yaml", yaml.safe_dump(data, width=1 << 16), only="exhaustion")
    assert result.returncode != 0
    assert "long_requests" in result.stdout + result.stderr


@needs_promtool
def test_the_unit_tests_catch_a_threshold_that_never_fires(tmp_path):
    config = config_from_mapping({"ttft_mean_seconds": 60})
    result = run_cases(tmp_path, "alerts.test.yaml", render_all(config)[RULES_FILE], only="first token")
    assert result.returncode != 0
    assert "VllmTimeToFirstTokenSlow" in result.stdout + result.stderr


def test_alert_severities_are_the_diagnosis_severities_without_exception():
    # One table for the causes: the page's rule (severity_of), kvwatch_finding's
    # severity label and the alert's are one value, preemptions included.
    from kvwatch.diagnose.vocabulary import SEVERITY, severity_of

    specs = alert_specs(MixinConfig())
    for spec in specs:
        if spec.symptom and spec.cause in SEVERITY:
            assert spec.severity == severity_of(spec.cause, preempting=spec.variant == "preempting"), spec.uid
    # The alerts the diagnosis has no finding for (a forecast, kvwatch's own health) are the
    # causes whose records say so, with their records' severities.
    from kvwatch.diagnose.causes import CAUSE, CAUSE_LIST

    alert_only = {s.cause for s in specs if s.cause not in SEVERITY and s.kind == "cause"}
    # (central mode's own store is watched in its mode alone)
    assert alert_only == {c.name for c in CAUSE_LIST if c.alert and not c.diagnosed} - {"store_unreachable"}
    assert all(s.severity == CAUSE[s.cause].severity for s in specs if s.cause in alert_only)
    critical = {(s.alert, s.kind) for s in specs if s.severity == "critical"}
    # Besides the objectives: an engine kvwatch cannot read, one that holds requests and produces
    # nothing, and a cache that preempts (the page's critical exhaustion).
    assert critical == {("VllmTimeToFirstTokenBudgetBurn", "objective"), ("VllmRequestErrorBudgetBurn", "objective"),
                        ("KvwatchEngineUnreachable", "cause"), ("VllmEngineStuck", "cause"),
                        ("VllmKvCacheExhausted", "cause")}
    # Each exhaustion cause is two rules: with preemptions in the rate window (critical) and without.
    exhausted = [s for s in specs if s.alert == "VllmKvCacheExhausted"]
    assert sorted((s.cause, s.variant, s.severity) for s in exhausted) == [
        ("concurrency_beyond_capacity", "", "warning"), ("concurrency_beyond_capacity", "preempting", "critical"),
        ("long_requests", "", "warning"), ("long_requests", "preempting", "critical")]
    detector = "instance_model_name_engine:kvwatch_kv_cache_exhausted:condition5m"
    assert all(detector in s.query for s in exhausted)
    assert "preemptions" in {r["record"]: r["expr"] for r in load_rules() if "record" in r}[detector]
    # ...and a config that keeps preemptions a warning gets one rule per cause back.
    quiet = alert_specs(config_from_mapping({"severities": {"concurrency_beyond_capacity_preempting": "warning"}}))
    split = {(s.variant, s.severity) for s in quiet if s.cause == "concurrency_beyond_capacity"}
    assert split == {("", "warning")}


def test_docs_alerts_table_gives_every_alert_its_severity_and_for():
    text = (REPO / "docs" / "alerts.md").read_text()
    table = [line for line in text.splitlines() if line.startswith("| `") and "pages whom" not in line]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table if line.count("|") == 7]
    for spec in alert_specs(MixinConfig()):
        assert any(row[0] == f"`{spec.alert}`" and f"`{spec.cause}`" in row[1] and row[2] == spec.severity
                   and row[3] == spec.for_ and row[4] and row[5]
                   and (spec.kind == "cause" or spec.variant in row[1] or "every pair" in row[1])
                   for row in rows), (spec.alert, spec.cause, spec.variant)


# An alert someone must check by reading it at 3am: its expression fits on a screen.
MAX_ALERT_LINES = 12


def unreadable(rules: list[dict]) -> list[str]:
    """Alerts whose expression runs over MAX_ALERT_LINES lines or that carry no runbook_url."""
    problems = []
    for rule in rules:
        if "alert" not in rule:
            continue
        name = f"{rule['alert']} ({rule['labels'].get('cause') or rule['labels'].get('objective')})"
        lines = rule["expr"].rstrip("\n").count("\n") + 1
        if lines > MAX_ALERT_LINES:
            problems.append(f"{name}: {lines} lines")
        if not rule.get("annotations", {}).get("runbook_url"):
            problems.append(f"{name}: no runbook_url")
    return problems


def all_configs():
    return (MixinConfig(), config_from_mapping(cases.UPSTREAM_CONFIG), config_from_mapping(cases.NO_REUSE_CONFIG))


def test_every_alert_reads_in_twelve_lines_and_links_its_runbook():
    assert unreadable(load_rules()) == []
    for config in all_configs():
        text = render_all(config)[RULES_FILE]
        assert unreadable([r for g in yaml.safe_load(text)["groups"] for r in g["rules"]]) == []


def test_the_readability_check_fails_a_long_alert_and_a_missing_link():
    alert = next(rule for rule in load_rules() if "alert" in rule)
    long = {**alert, "expr": "\n".join(["up"] * (MAX_ALERT_LINES + 1))}
    unlinked = {**alert, "annotations": {"summary": "x"}}
    assert len(unreadable([long, unlinked])) == 2
    assert unreadable([{**alert, "expr": "\n".join(["up"] * MAX_ALERT_LINES)}]) == []


def test_every_recorded_series_an_alert_reads_is_recorded_before_it():
    # In file order: promtool and a Prometheus evaluation interval run the
    # groups one after another, so a record read later in the file is current.
    for config in all_configs():
        defined: set[str] = set()
        for group in yaml.safe_load(render_all(config)[RULES_FILE])["groups"]:
            for rule in group["rules"]:
                missing = set(RECORDED.findall(rule["expr"])) - defined
                if group["name"] == MEMORY_GROUP:  # the memory reads its own previous values
                    missing -= {r["record"] for r in group["rules"]}
                assert not missing, (rule.get("record") or rule.get("alert"), sorted(missing))
                if "record" in rule:
                    defined.add(rule["record"])


CENTRAL_TARGET = 'namespace="llm",job="kvwatch-central",instance="10.0.0.9:9400"'


def central_cases(health: str = "1x300") -> dict:
    """alerts.test.yaml as central mode's exports: the same replica series (central mode exports each
    replica's own labels), central mode's own target and health beside them; the cases of the sidecars'
    own health (KvwatchDown on their `up`) left out."""
    data = yaml.safe_load((CASES_DIR / "alerts.test.yaml").read_text())
    data["tests"] = [t for t in data["tests"]
                     if not any(c["alertname"] == "KvwatchDown" and c["exp_alerts"] for c in t["alert_rule_test"])]
    for test in data["tests"]:
        test["input_series"] += [{"series": f"up{{{CENTRAL_TARGET}}}", "values": "1x300"},
                                 {"series": f"kvwatch_central_store_up{{{CENTRAL_TARGET}}}", "values": health}]
    return data


@needs_promtool
def test_central_mode_rules_fire_what_the_sidecar_rules_fire_over_the_same_replicas(tmp_path):
    # Every case of the sidecars' rules, against the rules over central mode's exports (selected by the store's
    # matchers, here everything): the same alerts, with the same labels, at the same evaluation.
    config = config_from_mapping({"mode": "central", "deploy": {"central_selector": ""}})
    text = render_all(config)[RULES_FILE]
    assert 'job="kvwatch"' not in text and "\nup{" not in text and " up{" not in text
    data = central_cases()
    assert len(data["tests"]) > 40
    (tmp_path / "central.test.yaml").write_text(yaml.safe_dump(data, width=1 << 16))
    (tmp_path / "rules.yaml").write_text(alerts_without_annotations(text))
    result = promtool("test", "rules", "central.test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@needs_promtool
def test_central_mode_watches_itself_not_the_sidecars_job(tmp_path):
    # Its store unreadable for longer than for: -> KvwatchDown store_unreachable on central mode's target;
    # the sidecars' rules would call it absent for ever (no job="kvwatch"), central mode's do not.
    config = config_from_mapping({"mode": "central", "deploy": {"central_selector": ""}})
    data = central_cases(health="1x10 0x290")
    data["tests"] = data["tests"][:1]
    target = dict(pair.split("=") for pair in CENTRAL_TARGET.replace('"', "").split(","))
    for check in data["tests"][0]["alert_rule_test"]:
        if check["alertname"] == "KvwatchDown":
            check["exp_alerts"] = [{"exp_labels": {**target, "severity": "warning", "cause": "store_unreachable"}}]
    (tmp_path / "central.test.yaml").write_text(yaml.safe_dump(data, width=1 << 16))
    (tmp_path / "rules.yaml").write_text(alerts_without_annotations(render_all(config)[RULES_FILE]))
    result = promtool("test", "rules", "central.test.yaml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
