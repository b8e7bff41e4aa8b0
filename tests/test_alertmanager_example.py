"""The example Alertmanager configuration (alerts/alertmanager.example.yaml):
Alertmanager's own amtool accepts it, every generated alert reaches the
receiver its severity and cause or objective call for, alerts are grouped by
engine and model, and each inhibition names labels the alerts carry. The
end-to-end delivery through a real Alertmanager is tests/test_e2e_alerting.py."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from kvwatch.commands.generate import ALERTMANAGER_FILE
from kvwatch.mixin.alerts import alert_specs
from kvwatch.mixin.config import MixinConfig
from mixin_support import REPO

AMTOOL = shutil.which("amtool")
needs_amtool = pytest.mark.skipif(AMTOOL is None, reason="amtool not installed (make system-deps)")
ENGINE = {"namespace": "llm", "job": "kvwatch", "instance": "10.0.0.1:9400", "model_name": "m", "engine": "0"}


def amtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([AMTOOL, *args], capture_output=True, text=True, timeout=60)


def expected_receiver(labels: dict) -> str:
    from kvwatch.mixin.grafana_alerts import APPLICATION_CAUSES, PLATFORM_CAUSES

    if labels["severity"] == "critical":
        return "pager"
    if labels["severity"] == "info":
        return "tickets"
    if labels.get("objective"):
        return "application" if labels["objective"] == "aborts" else "platform"
    if labels["cause"] in PLATFORM_CAUSES:
        return "platform"
    assert labels["cause"] in APPLICATION_CAUSES, labels
    return "application"


@needs_amtool
def test_alertmanager_accepts_the_example():
    result = amtool("check-config", str(REPO / ALERTMANAGER_FILE))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 inhibit rules" in result.stdout


@needs_amtool
def test_every_alert_reaches_its_receiver():
    for spec in alert_specs(MixinConfig()):
        labels = {**ENGINE, "alertname": spec.alert, **spec.labels()}
        result = amtool("config", "routes", "test", f"--config.file={REPO / ALERTMANAGER_FILE}",
                        *(f"{k}={v}" for k, v in labels.items()))
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [expected_receiver(labels)], (spec.uid, result.stdout)


def test_one_group_per_model_and_inhibitions_on_labels_the_alerts_carry():
    # One incident across replicas is one notification: the page is per model, and so is the group,
    # which the cause alerts of every replica of that model share.
    example = yaml.safe_load((REPO / ALERTMANAGER_FILE).read_text())
    group_by = example["route"]["group_by"]
    assert group_by == ["namespace", "job", "model_name"]
    assert all("group_by" not in route for route in example["route"]["routes"])  # one key for page and cause
    labels_of = {spec.alert: {**ENGINE, **spec.labels()} for spec in alert_specs(MixinConfig())}
    for rule in example["inhibit_rules"]:
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            if matcher.startswith("alertname="):
                for alert in matcher.split('"')[1].split("|"):
                    assert alert in labels_of, alert
                    assert set(rule["equal"]) <= set(labels_of[alert]), (alert, rule["equal"])
