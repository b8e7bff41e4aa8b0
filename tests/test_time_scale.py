"""The test-only rendering of the mixin with time scaled down
(tests/time_scale.py): every span the rules read is divided by one factor,
and the rules rendered from it carry the scaled spans."""

from __future__ import annotations

import re

import yaml

from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.mixin.config import DEFAULT_FOR
from kvwatch.mixin.promql import MEMORY_BRIDGE
from kvwatch.units import parse_prometheus_duration
from time_scale import DURATION_FIELDS, milliseconds, scaled, scaled_config


def test_every_span_is_divided_by_the_factor():
    config = scaled_config({"for_durations": {"VllmTimeToFirstTokenSlow": "90s"}}, 12)
    assert config.rate_window == "25s" and config.finding_hold == "5s" and config.hit_ratio_baseline_window == "5m"
    assert config.for_duration("VllmTimeToFirstTokenSlow") == "7500ms"
    assert config.for_duration("VllmTimeToFirstTokenBudgetBurn") == "10s"
    assert [(p["long"], p["short"]) for p in config.burn_rate_windows][0] == ("5m", "25s")
    assert config.exhaustion_eta_minutes == 1.25
    unscaled = scaled({}, 1)
    assert all(parse_prometheus_duration(unscaled[name]) == 12 * parse_prometheus_duration(getattr(
        scaled_config({}, 12), name)) for name in DURATION_FIELDS)
    assert set(unscaled["for_durations"]) == set(DEFAULT_FOR)
    assert milliseconds(0.0001) == "1ms" and milliseconds(90) == "90s" and milliseconds(120) == "2m"


def test_the_rendered_rules_carry_the_scaled_spans():
    rules = yaml.safe_load(render_all(scaled_config({}, 12))[RULES_FILE])
    alerts = [r for g in rules["groups"] for r in g["rules"] if "alert" in r]
    page = next(r for r in alerts if r["alert"] == "VllmTimeToFirstTokenBudgetBurn" and "5m" in r["expr"])
    assert page["for"] == "10s" and "ratio_rate25s" in page["expr"]
    assert all(g.get("interval") == "1s" for g in rules["groups"])
    # Every range is a scaled span: the rate window (25 s), the cold-cache window (150 s), the
    # baseline and the fast pair's long window (5 m), the slower pairs' (30 m/150 s, 120 m/10 m);
    # only the last-healthy memory's bridge is a fixed hour (promql.MEMORY_BRIDGE, not configurable).
    exprs = "".join(r["expr"] for g in rules["groups"] for r in g["rules"])
    ranges = set(re.findall(r"\[([0-9a-z:]+)\]", exprs))
    assert ranges == {"25s", "25s:", "150s", "5m", "5m:25s", "30m", "120m", "10m", MEMORY_BRIDGE}, ranges
