"""`kvwatch generate`: the committed files are what it writes now (regenerated
into a temp dir and compared), its output is deterministic, `--check`
catches stale files, and the config reports every problem at once."""

from __future__ import annotations

import argparse
import json

import pytest
import yaml

from kvwatch import cli
from kvwatch.commands import generate
from kvwatch.mixin.config import (
    DEFAULT_FOR, MixinConfig, MixinConfigError, config_from_mapping, describe_config, load_config,
)
from kvwatch.commands.generate import RULES_FILE, render_all, stale_files
from mixin_support import REPO


def generate_args(**overrides) -> argparse.Namespace:
    values = {"config": None, "out": None, "check": False, "print_config": False, **overrides}
    return argparse.Namespace(**values)


def test_committed_generated_files_are_current(tmp_path):
    assert generate.run(generate_args(out=str(tmp_path))) == 0
    written = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert written == sorted(render_all(MixinConfig()))
    differing = [name for name in written
                 if not (REPO / name).is_file() or (REPO / name).read_text() != (tmp_path / name).read_text()]
    assert not differing, f"committed files differ from `kvwatch generate` (run it and commit): {differing}"
    assert stale_files(render_all(MixinConfig()), REPO) == []


def test_generate_writes_the_expected_files(tmp_path):
    files = render_all(MixinConfig())
    for name in ("dashboards/kvwatch-overview.json", "dashboards/kvwatch-exhaustion.json",
                 "dashboards/kvwatch-prefix-cache.json", "dashboards/kvwatch-first-token.json",
                 "alerts/kvwatch-rules.yaml", "alerts/kvwatch-prometheusrule.yaml", "alerts/runbooks.md",
                 "alerts/grafana/kvwatch-alert-rules.json", "alerts/grafana/kvwatch-notifications.example.yaml"):
        assert name in files
    # The manifests module is called with the rules and dashboards generated here.
    assert "deploy/kubernetes/base/prometheusrule.yaml" in files
    assert "VllmKvCacheExhausted" in files["deploy/kubernetes/base/prometheusrule.yaml"]


def test_output_is_deterministic():
    first, second = render_all(MixinConfig()), render_all(MixinConfig())
    assert first == second
    for name, text in first.items():
        if name.endswith(".json"):
            assert text == json.dumps(json.loads(text), sort_keys=True, indent=2) + "\n", name


def test_check_flag_catches_a_stale_and_a_leftover_file(tmp_path, capsys):
    assert generate.run(generate_args(out=str(tmp_path))) == 0
    assert generate.run(generate_args(out=str(tmp_path), check=True)) == 0
    rules = tmp_path / RULES_FILE
    rules.write_text(rules.read_text().replace("for: 10m", "for: 1m"))
    (tmp_path / "dashboards" / "old.json").write_text("{}")
    assert generate.run(generate_args(out=str(tmp_path), check=True)) == 1
    err = capsys.readouterr().err
    assert "alerts/kvwatch-rules.yaml: differs" in err and "dashboards/old.json: not generated any more" in err
    # A second plain run repairs the changed file (the leftover is reported, not deleted).
    assert generate.run(generate_args(out=str(tmp_path))) == 0
    assert "for: 10m" in rules.read_text()


def test_cli_dispatches_to_generate(tmp_path, capsys):
    config = tmp_path / "mixin.yaml"
    config.write_text("selector: 'job=\"llm-sidecars\"'\nrate_window: 2m\n")
    assert cli.main(["generate", "--config", str(config), "--out", str(tmp_path / "out")]) == 0
    rules = (tmp_path / "out" / RULES_FILE).read_text()
    assert 'job="llm-sidecars"' in rules and "[2m]" in rules and "rate2m" in rules
    assert 'job="kvwatch"' not in rules


def test_config_reports_every_problem_at_once(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({
        "selector": "job=kvwatch",  # unquoted value
        "rate_window": "5 minutes",
        "hit_ratio_low": 2,
        "severities": {"no_reuse": "page"},
        "for_durations": {"VllmKvCacheFull": "5m"},
        "grafana_datasource_uid": "",
        "colour": "blue",
        "deploy": {"kvwatch_port": 8000, "vllm_port": 8000},
    }))
    with pytest.raises(MixinConfigError) as error:
        load_config(path)
    problems = error.value.problems
    assert len(problems) == 8, problems
    text = "\n".join(problems)
    for fragment in ("selector", "rate_window", "hit_ratio_low", "no_reuse", "VllmKvCacheFull",
                     "grafana_datasource_uid", "unknown field 'colour'", "deploy"):
        assert fragment in text


def test_config_cross_field_problems():
    with pytest.raises(MixinConfigError) as error:
        config_from_mapping({"cold_cache_window": "10m", "upstream_join_labels": ["cluster"]})
    text = "\n".join(error.value.problems)
    assert "cold_cache_window" in text and "upstream" in text


def test_generate_exits_2_on_a_bad_config(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text("rate_window: [5m]\n")
    assert generate.run(generate_args(config=str(path), out=str(tmp_path))) == 2
    assert "rate_window" in capsys.readouterr().err


def test_print_config_is_a_loadable_commented_config(tmp_path, capsys):
    assert generate.run(generate_args(print_config=True)) == 0
    text = capsys.readouterr().out
    assert text.count("\n# ") > 20  # every field explained
    path = tmp_path / "printed.yaml"
    path.write_text(text)
    assert load_config(path) == MixinConfig()
    assert text == describe_config() + "\n"


def test_config_changes_thresholds_windows_and_for():
    config = config_from_mapping({"exhaustion_usage_ratio": 0.95, "for_durations": {"VllmKvCacheExhausted": "3m"},
                                  "severities": {"long_requests": "critical"}, "rate_window": "10m"})
    rules = yaml.safe_load(render_all(config)[RULES_FILE])
    exhausted = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "VllmKvCacheExhausted"]
    # The alert reads the exhaustion detector's record (over the 10m window), which holds the threshold.
    records = {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    detector = "instance_model_name_engine:kvwatch_kv_cache_exhausted:condition10m"
    assert ") > 0.95\n" in records[detector] and "[10m]" in records[detector]
    assert all(detector in r["expr"] and r["for"] == "3m" for r in exhausted)
    assert {r["labels"]["cause"]: r["labels"]["severity"] for r in exhausted}["long_requests"] == "critical"
    # Unchanged entries keep their defaults.
    ttft = next(r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "VllmTimeToFirstTokenSlow")
    assert ttft["for"] == DEFAULT_FOR["VllmTimeToFirstTokenSlow"]


def test_exhaustion_soon_reads_the_eta_signal_and_its_threshold_in_minutes():
    from kvwatch.mixin.alerts import alert_specs, engine_scope

    config = config_from_mapping({"exhaustion_eta_minutes": 30,
                                  "for_durations": {"VllmKvCacheExhaustionSoon": "10m"},
                                  "runbook_url_pattern": "https://runbooks.example.org/kvwatch.md#{anchor}"})
    rules = yaml.safe_load(render_all(config)[RULES_FILE])
    (soon,) = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == "VllmKvCacheExhaustionSoon"]
    assert soon["expr"].endswith(")\n< 1800")
    assert soon["for"] == "10m"
    assert soon["labels"] == {"severity": "warning", "cause": "usage_rising", "symptom": "exhaustion"}
    # the ETA signal's own PromQL, the expression its recording rule records: one definition
    eta = engine_scope(config).signal("kvwatch_kv_cache_exhaustion_eta_seconds")
    (spec,) = [s for s in alert_specs(config) if s.alert == "VllmKvCacheExhaustionSoon"]
    records = {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    read = spec.query.split("\n")[0]
    assert read.endswith(":kvwatch_kv_cache_exhaustion_eta_seconds:deriv5m") and records[read] == eta
    assert "anchor" not in soon["annotations"]["runbook_url"]
    assert soon["annotations"]["runbook_url"].endswith("#vllmkvcacheexhaustionsoon-usage-rising")


def test_exhaustion_soon_threshold_must_outlast_its_for():
    with pytest.raises(MixinConfigError) as error:
        config_from_mapping({"exhaustion_eta_minutes": 5})
    assert "exhaustion_eta_minutes" in "\n".join(error.value.problems)
    runbook = (REPO / "alerts" / "runbooks.md").read_text()
    section = runbook.split('<a id="vllmkvcacheexhaustionsoon-usage-rising"></a>')[1]
    assert section.split("\n\n")[3].startswith("**First five minutes.**")


def test_recording_rules_follow_the_naming_convention_and_cover_the_catalogue():
    from kvwatch.signals import SIGNALS

    assert all(metric.startswith("kvwatch_") and ops for metric, ops in (s.record for s in SIGNALS))
    rules = yaml.safe_load((REPO / RULES_FILE).read_text())
    records = [r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r]
    assert "model_name:kvwatch_prefix_cache_hit:ratio_rate5m" in records
    assert "instance_model_name_engine:kvwatch_prefix_cache_hit:ratio_rate5m" in records
    for record in records:
        level, metric, operations = record.split(":")
        assert level and metric.startswith("kvwatch_") and operations
    # Quantiles of a model sum the buckets of all its sidecars by le.
    quantile = next(r for g in rules["groups"] for r in g["rules"]
                    if r.get("record") == "model_name_quantile:kvwatch_time_to_first_token_seconds:histogram_quantile_rate5m")
    assert "sum by (namespace, job, model_name, le) (rate(" in quantile["expr"]
    assert len(set(zip(records, [str(r.get("labels")) for g in rules["groups"] for r in g["rules"]
                                 if "record" in r]))) == len(records)


def test_version_flag(capsys):
    from kvwatch import __version__

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"kvwatch {__version__}"


def test_print_config_into_a_closed_pipe_ends_quietly(monkeypatch):
    # `kvwatch generate --print-config | head` ended in a BrokenPipeError traceback.
    import io
    import os
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (head) has gone

    class Closed(io.TextIOWrapper):
        pass

    stream = Closed(os.fdopen(write_end, "wb", buffering=0), write_through=True)
    monkeypatch.setattr(sys, "stdout", stream)
    monkeypatch.setattr(os, "dup2", lambda *args: None)  # keep the test runner's real stdout
    assert cli.main(["generate", "--print-config"]) == 0


def test_generate_writes_into_the_current_directory_and_says_where(tmp_path, monkeypatch, capsys):
    # From an installed (non-editable) kvwatch it wrote into site-packages.
    monkeypatch.chdir(tmp_path)
    assert cli.main(["generate"]) == 0
    assert (tmp_path / RULES_FILE).is_file() and (tmp_path / "dashboards").is_dir()
    err = capsys.readouterr().err
    assert f"files in {tmp_path.resolve()} (the current directory; --out DIR for another)" in err
    assert cli.main(["generate", "--check"]) == 0
    assert f"up to date in {tmp_path.resolve()}" in capsys.readouterr().out


def test_one_grammar_reads_every_prometheus_duration_of_the_mixin():
    """The windows, `for:` durations, burn-rate windows and scrape intervals
    are read by kvwatch.units' one Prometheus-duration parser: compound
    parts, `d`/`w`/`y`, no bare numbers, no fractions."""
    from kvwatch.mixin.config import deploy_settings
    from kvwatch.units import is_prometheus_duration, parse_prometheus_duration

    assert parse_prometheus_duration("1h30m") == 5400.0
    assert parse_prometheus_duration("500ms") == 0.5
    assert parse_prometheus_duration("0s") == 0.0
    assert parse_prometheus_duration("1y") == 365 * 86400
    for text in ("5", "5.5m", "", "5M", "5m ", 5, None):
        assert not is_prometheus_duration(text), text
        with pytest.raises(ValueError, match="is not a Prometheus duration"):
            parse_prometheus_duration(text)
    assert not is_prometheus_duration("1d", units="ms|s|m|h")
    with pytest.raises(MixinConfigError) as raised:
        config_from_mapping({"rate_window": "5.5m", "for_durations": {"VllmKvCacheExhausted": "3"},
                             "burn_rate_windows": [{"long": "1h", "short": "5", "factor": 14.4,
                                                    "severity": "critical"}]})
    problems = "\n".join(raised.value.problems)
    assert "rate_window: '5.5m' is not a Prometheus duration" in problems
    assert "for_durations: VllmKvCacheExhausted: '3' is not a Prometheus duration" in problems
    assert "short must be Prometheus durations" in problems
    with pytest.raises(ValueError, match="scrape_interval: '1d' is not a Prometheus duration"):
        deploy_settings({"scrape_interval": "1d"})
    assert config_from_mapping({"cold_cache_window": "1h30m"}).cold_cache_window == "1h30m"
