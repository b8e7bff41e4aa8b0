"""Every PromQL expression in the generated dashboards, rules and Grafana
alert rules parses (promtool, on a rules file holding them with Grafana's
variables substituted) and names only series kvwatch exports, recording
rules it defines, or series in the real captures. Queries follow the house
rules: quantiles over `sum by (le)`, counters only through a range function
(never a lifetime ratio)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from kvwatch.mixin.config import MixinConfig, config_from_mapping
from kvwatch.commands.generate import GRAFANA_RULES_FILE, RULES_FILE, render_all
from mixin_support import (
    annotation_exprs, capture_names, dashboard_exprs, exported_names, load_dashboards, load_rules, metric_names, substitute,
    variable_selectors, GRAFANA_RULES,
)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make system-deps)")


def committed_exprs() -> list[tuple[str, str]]:
    exprs = []
    for name, dashboard in load_dashboards().items():
        exprs += [(where, substitute(expr)) for where, expr in dashboard_exprs(dashboard)]
        exprs += [(where, substitute(expr)) for where, expr in variable_selectors(dashboard)]
        exprs += [(where, substitute(expr)) for where, expr in annotation_exprs(dashboard)]
    for rule in load_rules():
        exprs.append((rule.get("record") or rule.get("alert"), rule["expr"]))
    for group in json.loads(GRAFANA_RULES.read_text())["groups"]:
        for rule in group["rules"]:
            for query in rule["data"]:
                if "expr" in query["model"]:
                    exprs.append((f"grafana {rule['uid']}", query["model"]["expr"]))
    return exprs


def _promtool_parses(tmp_path, exprs: list[tuple[str, str]]) -> subprocess.CompletedProcess:
    rules = [{"record": f"kvwatch_test:expression_{i}:check", "expr": expr} for i, (_, expr) in enumerate(exprs)]
    path = tmp_path / "expressions.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "expressions", "rules": rules}]}, width=1 << 16))
    return subprocess.run([PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)


@needs_promtool
def test_every_committed_expression_parses(tmp_path):
    exprs = committed_exprs()
    assert len(exprs) > 100
    result = _promtool_parses(tmp_path, exprs)
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_the_parse_check_catches_a_broken_expression(tmp_path):
    result = _promtool_parses(tmp_path, [("broken", "sum by (le (rate(x[5m]))")])
    assert result.returncode != 0


@needs_promtool
def test_expressions_of_a_customised_config_parse(tmp_path):
    config = config_from_mapping({
        "selector": 'job=~"kvwatch|vllm-sidecar",namespace!="test"', "group_labels": ["cluster", "namespace"],
        "instance_label": "pod", "rate_window": "2m", "upstream_histogram": "gateway_request_seconds",
        "upstream_selector": 'job="gateway"', "upstream_join_labels": ["cluster", "namespace"],
    })
    files = render_all(config)
    exprs = [(r.get("record") or r.get("alert"), r["expr"])
             for g in yaml.safe_load(files[RULES_FILE])["groups"] for r in g["rules"]]
    for name, text in files.items():
        if name.startswith("dashboards/"):
            dashboard = json.loads(text)
            exprs += [(w, substitute(e)) for w, e in dashboard_exprs(dashboard) + annotation_exprs(dashboard)]
    grafana = json.loads(files[GRAFANA_RULES_FILE])
    exprs += [(r["uid"], q["model"]["expr"]) for r in grafana["groups"][0]["rules"] for q in r["data"]
              if "expr" in q["model"]]
    result = _promtool_parses(tmp_path, exprs)
    assert result.returncode == 0, result.stdout + result.stderr


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.95, sum by (le, model_name) (rate(a_bucket{job=~"x|y",le!="1"}[5m])))\n'
            '/ on (model_name) group_left () (b_total offset 5m) and c{d="e"} unless clamp_min(f, 0) > 1e-06')
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "f"}
    assert metric_names("kvwatch_up{job=\"kvwatch\"} < 1") == {"kvwatch_up"}
    assert metric_names("max by (instance) (up)") == {"up"}


def test_every_name_is_exported_recorded_or_in_the_captures(fixtures_dir):
    # up and ALERTS are Prometheus' own (the annotations mark kvwatch's firing alerts).
    allowed = exported_names(fixtures_dir) | capture_names(fixtures_dir) | {"up", "ALERTS"}
    allowed |= {rule["record"] for rule in load_rules() if "record" in rule}
    # Sanity: the exporter really ran (engine series, findings, health).
    assert {"kvwatch_up", "kvwatch_engine_preemptions_total", "kvwatch_finding",
            "kvwatch_engine_time_to_first_token_seconds_bucket", "kvwatch_engine_info"} <= allowed
    unknown = {}
    for where, expr in committed_exprs():
        missing = metric_names(expr) - allowed
        if missing:
            unknown[where] = sorted(missing)
    assert not unknown, f"expressions name series nobody exports: {unknown}"


def test_peer_pitfall_names_are_not_allowed(fixtures_dir):
    # The check must reject what peers got wrong: bare counter names (the
    # series carry _total), and names no version ever exported.
    allowed = exported_names(fixtures_dir) | capture_names(fixtures_dir)
    for wrong in ("vllm:num_preemptions", "vllm:prefix_cache_hits", "kvwatch_engine_preemptions",
                  "vllm:kv_cache_usage_percent"):
        assert wrong not in allowed


def test_quantiles_sum_buckets_by_le():
    for where, expr in committed_exprs():
        for match in re.finditer(r"histogram_quantile\(", expr):
            inner = expr[match.end():]
            assert re.match(r"\s*[\d.]+,\s*sum by \(([^)]*\b)?le\b[^)]*\) \(rate\(", inner), (where, expr[:200])


# Counters a rule reads whole on purpose: "no engine publisher ever reached
# kvwatch" (KvwatchKvEventStreamUnhealthy events_never_connected) asks
# whether the lifetime total since kvwatch started is still zero.
EVER_COUNTERS = frozenset({"kvwatch_kv_events_connections_total", "kvwatch_kv_events_messages_total"})


def test_counters_and_histograms_are_read_through_ranges_never_as_lifetime_totals():
    # A counter or histogram series without a [range] is a lifetime total;
    # dividing two of those is the peer pitfall "hit rate since start".
    cumulative = re.compile(r"\b(\w+_(?:total|bucket|sum|count))\{[^}]*\}(\s*\[)?")
    for where, expr in committed_exprs():
        for match in cumulative.finditer(expr):
            if match.group(1) in EVER_COUNTERS:
                # Whole on purpose, never divided: only compared with "< 1" (nothing, ever).
                assert "/" not in expr, (where, expr[:300])
                continue
            assert match.group(2), f"{where}: {match.group(1)} read without a range: {expr[:300]}"
        # And what reads the range is a rate-like function, not *_over_time of a counter.
        for match in re.finditer(r"(\w+)\((\w+_(?:total|bucket|sum|count))\{", expr):
            assert match.group(1) in ("rate", "increase", "resets", "irate"), (where, match.group(0))


def test_default_selector_follows_the_deploy_job():
    assert 'job="kvwatch"' in MixinConfig().kvwatch_selector
    assert MixinConfig(deploy={"job": "sidecars"}).kvwatch_selector == 'job="sidecars"'
