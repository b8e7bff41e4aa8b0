"""The objectives' burn-rate alerts under `promtool test rules`: each pair
fires when both its windows burn, a spike that burns only the short window
never pages, the abort objective never pages whatever it burns, and an engine
that never failed a request has an error ratio of 0, not none. The series are
an engine's TTFT histogram (the objective's bucket and the count) and its
finished requests by reason, one sample a minute, after seven healthy hours
(so the 6h window is full of history, as in production)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.mixin import objectives
from kvwatch.mixin.config import MixinConfig, MixinConfigError, config_from_mapping
from kvwatch.mixin.rules import OBJECTIVES_GROUP

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make system-deps)")

ENGINE = {"namespace": "llm", "job": "kvwatch", "instance": "10.0.0.1:9400", "model_name": "m", "engine": "0"}
MODEL = {"namespace": "llm", "job": "kvwatch", "model_name": "m"}  # what a page is about: every replica
HEALTHY = 420  # minutes of healthy history before anything happens
END = 500
PER_MINUTE = 10
OBJECTIVE_NAMES = {objective: alert for objective, (alert, _, _) in objectives.OBJECTIVE_ALERTS.items()}


def cumulative(per_minute) -> str:
    """A counter sampled each minute 0..END; per_minute(m) is what it gains in minute m."""
    values, total = [], 0.0
    for minute in range(END + 1):
        if minute:
            total += per_minute(minute)
        values.append(f"{total:g}")
    return " ".join(values)


def sel(name: str, engine: dict | None = None, **extra) -> str:
    labels = {**(engine or ENGINE), **extra}
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def ttft_series(slow_share, engine: dict | None = None, per_minute=lambda m: PER_MINUTE) -> list[dict]:
    """slow_share(m): the share of minute m's requests later than the objective's bound; per_minute(m): how many."""
    return [
        {"series": sel("kvwatch_engine_time_to_first_token_seconds_bucket", engine, le="2.5"),
         "values": cumulative(lambda m: per_minute(m) * (1 - slow_share(m)))},
        {"series": sel("kvwatch_engine_time_to_first_token_seconds_count", engine),
         "values": cumulative(per_minute)},
    ]


def finished_series(shares: dict) -> list[dict]:
    """shares: reason -> share(m); stop takes the rest."""
    out = [{"series": sel("kvwatch_engine_requests_finished_total", finished_reason=reason),
            "values": cumulative(lambda m, share=share: PER_MINUTE * share(m))} for reason, share in shares.items()]
    out.append({"series": sel("kvwatch_engine_requests_finished_total", finished_reason="stop"),
                "values": cumulative(lambda m: PER_MINUTE * (1 - sum(s(m) for s in shares.values())))})
    return out


def after(start: int, share: float, until: int = END + 1):
    return lambda m: share if start <= m < until else 0.0


def firing(objective: str, *pairs: tuple[str, str, str]) -> list[dict]:
    alert, symptom, _ = objectives.OBJECTIVE_ALERTS[objective]
    return [{"exp_labels": {**MODEL, "severity": severity, "objective": objective, "long_window": long,
                            "short_window": short, "symptom": symptom}} for long, short, severity in pairs]


def checks(eval_time: str, expected: dict[str, list[dict]]) -> list[dict]:
    return [{"eval_time": eval_time, "alertname": alert, "exp_alerts": expected.get(alert, [])}
            for alert in OBJECTIVE_NAMES.values()]


PAGE_1H = ("1h", "5m", "critical")
PAGE_6H = ("6h", "30m", "critical")
TICKET_1D = ("1d", "2h", "warning")


def cases() -> list[dict]:
    ttft_alert, error_alert, abort_alert = (OBJECTIVE_NAMES[o] for o in ("first_token", "availability", "aborts"))
    no_errors = finished_series({})
    fast = ttft_series(lambda m: 0.0)
    return [
        {"name": "every first token late from minute 421: the 1h/5m pair pages once both windows burn",
         "interval": "1m", "input_series": ttft_series(after(HEALTHY + 1, 1.0)) + no_errors,
         "alert_rule_test": (
             # 5m burns at once, 1h only after ~9 minutes: nothing yet.
             checks(f"{HEALTHY + 5}m", {})
             # 1h above 14.4% from minute 429, firing after for: 2m; 6h and 1d not yet.
             + checks(f"{HEALTHY + 12}m", {ttft_alert: firing("first_token", PAGE_1H)})
             # Half an hour on, 6h/30m (6%) and 1d/2h (3%) burn too.
             + checks(f"{HEALTHY + 30}m", {ttft_alert: firing("first_token", PAGE_1H, PAGE_6H, TICKET_1D)}))},
        {"name": "a two-minute spike of late first tokens burns the 5m window and pages nothing",
         "interval": "1m", "input_series": ttft_series(after(HEALTHY + 1, 1.0, HEALTHY + 3)) + no_errors,
         "promql_expr_test": [{
             "expr": f"{objectives.record_name(MixinConfig(), 'first_token', '5m')} > 0.144",
             "eval_time": f"{HEALTHY + 4}m",
             "exp_samples": [{"labels": sel(objectives.record_name(MixinConfig(), "first_token", "5m")),
                              "value": 0.4}]}],
         "alert_rule_test": [c for t in range(HEALTHY + 1, HEALTHY + 40, 3) for c in checks(f"{t}m", {})]},
        {"name": "a fifth of requests end in error: every pair burns, the pages are critical",
         "interval": "1m", "input_series": fast + finished_series({"error": after(HEALTHY + 1, 0.2)}),
         "alert_rule_test": checks(f"{HEALTHY + 20}m",
                                   {error_alert: firing("availability", PAGE_1H, PAGE_6H, TICKET_1D)})},
        {"name": "half the requests aborted: the abort objective burns, but warns (never pages)",
         "interval": "1m", "input_series": fast + finished_series({"abort": after(HEALTHY + 1, 0.5)}),
         "alert_rule_test": checks(f"{HEALTHY + 30}m",
                                   {abort_alert: firing("aborts", ("1h", "5m", "warning"), TICKET_1D)})},
        {"name": "an engine that never failed a request has an error ratio of 0, not none",
         "interval": "1m", "input_series": fast + no_errors,
         "promql_expr_test": [{
             "expr": objectives.record_name(MixinConfig(), "availability", "1h"), "eval_time": f"{HEALTHY}m",
             "exp_samples": [{"labels": sel(objectives.record_name(MixinConfig(), "availability", "1h")),
                              "value": 0}]}],
         "alert_rule_test": checks(f"{HEALTHY}m", {})},
    ]


REPLICAS = [{**ENGINE, "instance": f"10.0.0.{i}:9400"} for i in range(1, 9)]


def one_incident_on_eight_replicas() -> dict:
    """Eight replicas of one model, each serving 20 requests an hour (160 together: over the guard, which
    counts the model), all late from minute 421: one page for the model, not eight."""
    series = [s for engine in REPLICAS
              for s in ttft_series(after(HEALTHY + 1, 1.0), engine, per_minute=lambda m: 1 / 3)]
    series += [s for engine in REPLICAS for s in finished_series_of(engine)]
    return {"name": "one incident on 8 replicas: one page for the model",
            "interval": "1m", "input_series": series,
            "alert_rule_test": checks(f"{HEALTHY + 12}m",
                                      {OBJECTIVE_NAMES["first_token"]: firing("first_token", PAGE_1H)})}


def finished_series_of(engine: dict) -> list[dict]:
    return [{"series": sel("kvwatch_engine_requests_finished_total", engine, finished_reason="stop"),
             "values": cumulative(lambda m: 1 / 3)}]


def a_handful_with_two_slow() -> dict:
    """A one-replica model serving a request every ten minutes (6 an hour), two of them late: a third of
    its hour is late, far over 14.4%, yet six requests are no budget burning."""
    every_ten = lambda m: 1.0 if m % 10 == 0 else 0.0  # noqa: E731
    slow = lambda m: 1.0 if m in (HEALTHY + 10, HEALTHY + 20) else 0.0  # noqa: E731
    record = objectives.model_record_name(MixinConfig(), "first_token", "1h")
    return {"name": "a replica serving a handful of requests, two slow, pages nothing",
            "interval": "1m", "input_series": ttft_series(slow, per_minute=every_ten) + finished_series({}),
            # The ratio does burn (the case would page without the guard) ...
            "promql_expr_test": [{"expr": f"count({record} > 0.144)", "eval_time": f"{HEALTHY + 24}m",
                                  "exp_samples": [{"labels": "{}", "value": 1}]}],
            # ... and nothing pages, before, while, or after the late ones.
            "alert_rule_test": [c for t in range(HEALTHY + 5, HEALTHY + 60, 3) for c in checks(f"{t}m", {})]}


@needs_promtool
def test_one_incident_on_eight_replicas_is_one_page_and_a_handful_of_requests_none(tmp_path):
    result = run(tmp_path, render_all(MixinConfig())[RULES_FILE], [one_incident_on_eight_replicas(),
                                                                    a_handful_with_two_slow()])
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


@needs_promtool
def test_the_guard_is_the_configured_minimum(tmp_path):
    # With the guard at 5 requests, the same handful pages: the guard, not the data, kept it quiet.
    result = run(tmp_path, render_all(config_from_mapping({"objective_min_requests": 5}))[RULES_FILE],
                 [a_handful_with_two_slow()])
    assert result.returncode != 0 and OBJECTIVE_NAMES["first_token"] in result.stdout + result.stderr


def objective_rules(rules_text: str) -> str:
    """The objectives' recording rules and their alerts (annotations removed:
    promtool compares them verbatim, and cause_alerts queries ALERTS)."""
    data = yaml.safe_load(rules_text)
    groups = []
    for group in data["groups"]:
        if group["name"] == OBJECTIVES_GROUP:
            groups.append(group)
            continue
        alerts = [rule for rule in group["rules"] if rule.get("alert") in OBJECTIVE_NAMES.values()]
        for rule in alerts:
            rule.pop("annotations", None)
        if alerts:
            groups.append({**group, "rules": alerts})
    return yaml.safe_dump({"groups": groups}, width=1 << 16)


def run(tmp_path: Path, rules_text: str, tests: list[dict]) -> subprocess.CompletedProcess:
    (tmp_path / "rules.yaml").write_text(objective_rules(rules_text))
    (tmp_path / "objectives.test.yaml").write_text(yaml.safe_dump(
        {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": tests}, width=1 << 16))
    return subprocess.run([PROMTOOL, "test", "rules", "objectives.test.yaml"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)


@needs_promtool
def test_burn_rate_alerts_fire_when_both_windows_burn_and_not_on_a_spike(tmp_path):
    result = run(tmp_path, render_all(MixinConfig())[RULES_FILE], cases())
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]


@needs_promtool
def test_the_cases_catch_a_pair_that_ignores_its_short_window(tmp_path):
    # Mutation: the 1h pair reading its short window in place of the long one
    # pages on the spike; the spike case must catch it.
    data = yaml.safe_load(render_all(MixinConfig())[RULES_FILE])
    for group in data["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == OBJECTIVE_NAMES["first_token"] and rule["labels"]["long_window"] == "1h":
                rule["expr"] = rule["expr"].replace(":ratio_rate1h", ":ratio_rate5m")
    result = run(tmp_path, yaml.safe_dump(data, width=1 << 16), [cases()[1]])
    assert result.returncode != 0 and OBJECTIVE_NAMES["first_token"] in result.stdout + result.stderr


def test_thresholds_are_factor_times_budget_and_windows_are_configurable():
    config = config_from_mapping({"ttft_objective": 0.95, "ttft_objective_seconds": 1,
                                  "burn_rate_windows": [{"long": "2h", "short": "10m", "factor": 10,
                                                         "severity": "critical"}]})
    rules = yaml.safe_load(render_all(config)[RULES_FILE])
    burn = [r for g in rules["groups"] for r in g["rules"] if r.get("alert") == OBJECTIVE_NAMES["first_token"]]
    assert len(burn) == 1 and burn[0]["labels"]["long_window"] == "2h"
    assert burn[0]["expr"].rstrip().endswith("> 0.5")  # 10 x (1 - 0.95)
    records = {r["record"]: r["expr"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    ttft_2h = records["instance_model_name_engine:kvwatch_time_to_first_token_slow:ratio_rate2h"]
    assert 'le=~"1(\\\\.0+)?"' in ttft_2h and "[2h]" in ttft_2h


@pytest.mark.parametrize("bad, problem", [
    ({"ttft_objective": 1}, "strictly between 0 and 1"),
    ({"availability_objective": 99.9}, "strictly between 0 and 1"),
    ({"burn_rate_windows": []}, "non-empty list"),
    ({"burn_rate_windows": [{"long": "5m", "short": "1h", "factor": 14.4, "severity": "critical"}]},
     "must be shorter than long"),
    ({"burn_rate_windows": [{"long": "1h", "short": "5m", "factor": 0, "severity": "page"}]}, "factor 0"),
])
def test_bad_objective_settings_are_one_sentence_each(bad, problem):
    with pytest.raises(MixinConfigError) as caught:
        config_from_mapping(bad)
    assert problem in str(caught.value)


def test_le_matcher_reads_either_spelling_of_a_bound():
    import re

    for bound, spellings in ((2.5, ("2.5", "2.50")), (1, ("1", "1.0")), (10, ("10", "10.0"))):
        pattern = objectives.le_matcher(bound).split('"')[1].replace("\\\\", "\\")
        for spelling in spellings:
            assert re.fullmatch(pattern, spelling), (bound, spelling)
        assert not re.fullmatch(pattern, "25" if bound == 2.5 else "100")


def test_a_page_holds_for_its_short_window():
    # A short window without any request has no ratio: without the hold the
    # page would resolve there and page again (benchmarks/demo_time_to_page.py).
    rules = yaml.safe_load(render_all(MixinConfig())[RULES_FILE])
    burns = [r for g in rules["groups"] for r in g["rules"] if "objective" in r.get("labels", {})]
    assert burns and all(r["keep_firing_for"] == r["labels"]["short_window"] for r in burns)


@needs_promtool
def test_the_page_names_its_cause_while_the_cause_alert_waits_out_its_longer_for(tmp_path):
    # The page fires after 2m, the cause alerts after 10m: the page's cause_alerts reads them pending too,
    # counted per cause over the model's replicas, and never another model's.
    data = yaml.safe_load(render_all(MixinConfig())[RULES_FILE])
    page = next(r for g in data["groups"] for r in g["rules"]
                if r.get("alert") == OBJECTIVE_NAMES["first_token"] and r["labels"]["long_window"] == "1h")
    page["annotations"] = {"cause_alerts": page["annotations"]["cause_alerts"]}
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "page", "rules": [page]}]}))
    model = ",".join(f'{k}="{v}"' for k, v in MODEL.items())
    pending = 'alertname="VllmTimeToFirstTokenSlow",alertstate="pending",cause="prefill",severity="warning"'
    series = [{"series": f"model_name:kvwatch_time_to_first_token_slow:ratio_rate{w}{{{model}}}", "values": "0.5x20"}
              for w in ("1h", "5m")]
    series += [{"series": f"model_name:kvwatch_engine_time_to_first_token_seconds_count:increase1h{{{model}}}",
                "values": "1000x20"}]
    series += [{"series": f'ALERTS{{{model},{pending},instance="10.0.0.{i}:9400",engine="0"}}', "values": "1x20"}
               for i in (1, 2)]
    series += [{"series": 'ALERTS{namespace="llm",job="kvwatch",model_name="other",alertname="VllmKvCacheExhausted",'
                          'alertstate="firing",cause="long_requests",severity="warning"}', "values": "1x20"}]
    labels = {**MODEL, **page["labels"]}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": [
        {"interval": "1m", "input_series": series, "alert_rule_test": [
            {"eval_time": "3m", "alertname": OBJECTIVE_NAMES["first_token"], "exp_alerts": [
                {"exp_labels": labels, "exp_annotations": {
                    "cause_alerts": "VllmTimeToFirstTokenSlow (prefill, pending) on 2 engine(s); "}}]}]}]},
        width=1 << 16))
    done = subprocess.run([PROMTOOL, "test", "rules", "t.yaml"], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
