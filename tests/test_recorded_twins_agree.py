"""The recording rules the alerts read agree with kvwatch's in-process values.

kvwatch polls the simulated exhaustion scenario every 15 s (simulated time)
with a 5-minute window; each poll's /metrics becomes one sample of
promtool's input series, and promtool evaluates the generated engine-level
twins (their 5-minute rate window is kvwatch's window) at the polls where
the window is full. Each recorded value must equal the signal kvwatch
exported at the same poll (rounded to 1e-4): one number, one definition,
whether Prometheus or kvwatch computes it. Every signal of the catalogue is
compared but those whose `inexact_twin` says why not; a ratio over no
queries is absent in kvwatch and NaN (0/0) in Prometheus, compared as absent
(both are false against any threshold)."""

from __future__ import annotations

import math
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.mixin.conditions import twin_record
from kvwatch.mixin.config import MixinConfig
from kvwatch.sidecar.collector import make_registry
from kvwatch.signals.catalogue import SIGNALS as CATALOGUE, SIGNALS_BY_NAME
from sim_support import sim_monitor

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make system-deps)")
EVERY = 15  # seconds between polls, and between promtool's samples
TARGET = {"namespace": "llm", "job": "kvwatch", "instance": "10.0.0.1:9400"}
# Every signal whose twin the catalogue declares exact.
SIGNALS = tuple(signal.name for signal in CATALOGUE if not signal.inexact_twin)


def _selector(name: str, labels: dict) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def promql_round(value: float, to: float = 0.0001) -> float:
    """PromQL's round(value, to), the same float operations."""
    inverse = 1.0 / to
    return math.floor(value * inverse + 0.5) / inverse


def polled_pages(until: float) -> list[dict[tuple, float]]:
    """{(sample name, labels): value} of kvwatch's /metrics after each poll."""
    pages = []

    def on_state(state):
        text = generate_latest(make_registry(SimpleNamespace(state=state))).decode()
        page = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.startswith("kvwatch_"):
                    page[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        pages.append(page)

    sim_monitor("exhaustion", until=until, every=EVERY, window="5m", on_state=on_state)
    return pages


@pytest.fixture(scope="module")
def pages():
    return polled_pages(until=7 * 60)


def run_twins(tmp_path, pages, mutate=lambda expr: expr, signals=SIGNALS, at_least=50) -> subprocess.CompletedProcess:
    config = MixinConfig()
    keys = sorted({key for page in pages for key in page if key[0].startswith("kvwatch_engine_")})
    series = []
    for name, labels in keys:
        values = []
        for page in pages:
            value = page.get((name, labels))
            values.append("_" if value is None else repr(float(value)))
        series.append({"series": _selector(name, {**dict(labels), **TARGET}), "values": " ".join(values)})
    rules = yaml.safe_load(render_all(config)[RULES_FILE])
    wanted = {twin_record(config, signal): signal for signal in signals}
    records = [{**rule, "expr": mutate(rule["expr"])} for group in rules["groups"] for rule in group["rules"]
               if rule.get("record") in wanted]
    assert {rule["record"] for rule in records} == set(wanted)  # a quantile signal: one rule per quantile
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "twins", "rules": records}]}))
    checks, compared = [], 0
    window_polls = 300 // EVERY
    for index in range(window_polls, len(pages)):
        for record, signal in wanted.items():
            # A twin of one part (the TTFT share's queue) is compared with that part.
            part = set(SIGNALS_BY_NAME[signal].record_labels)
            samples = [(dict(labels), value) for (name, labels), value in pages[index].items()
                       if name == signal and part <= set(labels)]
            expected = [{"labels": _selector(f"round({record}, 0.0001)", {**labels, **TARGET})
                         .replace(f"round({record}, 0.0001)", ""),
                         "value": promql_round(value)}
                        for labels, value in samples if value == value]
            checks.append({"expr": f"round({record}, 0.0001) unless ({record} != {record})",
                           "eval_time": f"{index * EVERY}s",
                           "exp_samples": expected})
            compared += len(expected)
    assert compared >= at_least  # the scenario's overload is in the compared span, not only its quiet start
    (tmp_path / "twins.test.yaml").write_text(yaml.safe_dump({
        "rule_files": ["rules.yaml"], "evaluation_interval": f"{EVERY}s",
        "tests": [{"interval": f"{EVERY}s", "input_series": series, "promql_expr_test": checks}]}, width=1 << 16))
    return subprocess.run([PROMTOOL, "test", "rules", "twins.test.yaml"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)


@needs_promtool
def test_recorded_twins_equal_kvwatchs_own_signals(tmp_path, pages):
    result = run_twins(tmp_path, pages)
    assert result.returncode == 0, (result.stdout + result.stderr)[-6000:]


@needs_promtool
def test_the_comparison_catches_a_twin_over_another_window(tmp_path, pages):
    result = run_twins(tmp_path, pages, lambda expr: expr.replace("[5m]", "[4m]"))
    assert result.returncode != 0 and "got:" in result.stdout + result.stderr


@needs_promtool
def test_the_comparison_catches_a_twin_that_does_not_round_as_kvwatch_does(tmp_path, pages):
    # kvwatch_kv_cache_used_bytes is a whole number of bytes; its twin once was not.
    result = run_twins(tmp_path, pages, lambda expr: expr.replace("round(sum by", "(sum by"),
                       signals=("kvwatch_kv_cache_used_bytes",), at_least=8)
    assert result.returncode != 0 and "kv_cache_used_bytes" in result.stdout + result.stderr


def test_every_signal_is_compared_or_says_why_not():
    inexact = {signal.name for signal in CATALOGUE if signal.inexact_twin}
    assert set(SIGNALS) | inexact == {signal.name for signal in CATALOGUE} and not set(SIGNALS) & inexact
    assert all(len(signal.inexact_twin) > 20 for signal in CATALOGUE if signal.inexact_twin)  # a reason, not a flag


@needs_promtool
def test_the_comparison_catches_a_ratio_of_means_divided_left_to_right(tmp_path, pages):
    # a / b / on(...) c / d divides the queue's mean by TTFT's sum, then by its count: the share's twin once did.
    def unparenthesised(expr: str) -> str:
        return (expr.replace("clamp_max(\n(", "clamp_max(\n").replace(")\n/ on", "\n/ on")
                .replace("\n(sum", "\nsum").replace("]))),\n1)", "])),\n1)"))

    result = run_twins(tmp_path, pages, unparenthesised, signals=("kvwatch_time_to_first_token_share_ratio",),
                       at_least=8)
    assert result.returncode != 0 and "time_to_first_token_share" in result.stdout + result.stderr
