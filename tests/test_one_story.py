"""One story per incident (diagnose/arbitration.py): at every poll, per
(model, engine, symptom) at most one primary cause, in the findings, in the
JSON the page draws from (/api/v1/diagnosis) and in kvwatch_finding; and no
`front_end` while requests were preempted or the cache was exhausted in the
window (the residual is `preemption` then). Checked over every real-vLLM
recording in tests/fixtures and over two full loops of the demo at several
seeds, each through the sidecar's own Monitor (hold included)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from kvwatch.capture.bundle import Capture
from kvwatch.capture.replay import replay
from kvwatch.diagnose import Finding
from kvwatch.diagnose.arbitration import ARBITRATED, DECIDERS, arbitrate, group_key, one_primary_each
from kvwatch.diagnose.hold import FindingHold
from kvwatch.sidecar.collector import KvwatchCollector
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sidecar.report import diagnosis_json
from kvwatch.settings import load_settings
from sim_support import SIM_BASE, sim_monitor

SEEDS = (0, 1, 2)


class Checker:
    """Reads every poll's state the way the surfaces show it."""

    def __init__(self, monitor_of):
        self.monitor_of = monitor_of  # () -> the Monitor (for the collector and settings)
        self.polls = 0
        self.exhausted_polls = 0
        self.preemption_named = 0
        self.contributors = Counter()
        self.alternatives = Counter()

    def __call__(self, state) -> None:
        if not state.up:
            return
        self.polls += 1
        monitor = self.monitor_of()
        where = state.last_poll_time
        # The findings.
        assert one_primary_each(state.findings), (where, _stories(state.findings))
        # The JSON the page and the API serve.
        found = diagnosis_json(state, monitor.settings)["findings"]
        keys = Counter((f["model_name"], f.get("engine"), f["symptom"], str(f["evidence"].get("replica", "")))
                       for f in found if f["symptom"] in ARBITRATED)
        assert max(keys.values(), default=0) <= 1, (where, keys)
        # /metrics: one kvwatch_finding series per symptom per engine.
        families = {family.name: family for family in KvwatchCollector(monitor)._findings(state)}
        series = Counter((s.labels["model_name"], s.labels["engine"], s.labels["symptom"])
                         for s in families["kvwatch_finding"].samples if s.labels["symptom"] in ARBITRATED)
        assert max(series.values(), default=0) <= 1, (where, series)
        for sample in families["kvwatch_finding_contributor"].samples:
            self.contributors[(sample.labels["cause"], sample.labels["contributor"])] += 1
        for sample in families["kvwatch_finding_alternative"].samples:
            assert sample.labels["decided_by"] in DECIDERS
            self.alternatives[(sample.labels["cause"], sample.labels["alternative"])] += 1
        # Never the front end while the cache is the cause.
        for row in state.per_engine:
            if row.engine is None:
                continue
            mine = [f for f in state.findings if (f.model, f.engine) == (row.model, row.engine)]
            preempted = (row.values.get("kvwatch_preemptions_per_second") or 0) > 0
            exhausted = any(f.symptom == "exhaustion" and f.clearing_since is None and f.severity != "info"
                            for f in mine)
            if preempted or exhausted:
                self.exhausted_polls += 1
                assert not [f for f in mine if f.cause == "front_end" or
                            any(c["cause"] == "front_end" for c in f.contributing)], (where, _stories(mine))
            self.preemption_named += sum(1 for f in mine if f.cause == "preemption")


def _stories(findings) -> list:
    return [(f.symptom, f.cause, f.engine, f.clearing_since is not None, [c["cause"] for c in f.contributing])
            for f in findings]


RECORDINGS = ("changes", "concurrency", "eviction-growing", "eviction-rotation", "front-end", "long-requests",
              "no-reuse", "prefix-changed", "residency-eviction-growing", "residency-eviction-rotation",
              "residency-no-reuse", "residency-prefix-changed", "residency-shortfall", "restart")


def test_the_recordings_listed_are_all_there_are(fixtures_dir):
    found = {p.parent.name for p in (fixtures_dir / "vllm-0.32-cpu-scenarios").glob("*/capture.tar.gz")}
    assert found == set(RECORDINGS)


@pytest.mark.parametrize("name", RECORDINGS)
def test_every_real_recording_tells_one_story_per_engine_and_symptom(fixtures_dir, name):
    settings = load_settings(overrides={"poll_interval": "1s", "window": "60s"}, environ={})
    made = []

    def monitor(source):
        made.append(Monitor(settings, fetcher=source, clock=source.now))
        return made[-1]

    check = Checker(lambda: made[-1])
    replay(Capture(fixtures_dir / "vllm-0.32-cpu-scenarios" / name / "capture.tar.gz"), monitor, on_state=check)
    assert check.polls >= 20
    if name in ("concurrency", "long-requests"):
        assert check.exhausted_polls > 0  # the front-end check had something to check


def test_the_burst_names_preemption_where_it_named_front_end(fixtures_dir):
    """The real 24-request burst (concurrency): its first-token residual under
    preemption is never front_end; the API server stalled in slices
    (front-end) still is."""
    # The objectives the vLLM tier judges each with (docs/diagnosis.md).
    for name, cause, other, objectives in (("concurrency", "queueing_kv_bound", "front_end", (0.5, 0.25)),
                                           ("front-end", "front_end", "preemption", (0.1, 0.02))):
        settings = load_settings(overrides={"poll_interval": "1s", "window": "60s",
                                            "diagnosis": {"ttft_p95_seconds": objectives[0],
                                                          "ttft_mean_seconds": objectives[1]}},
                                 environ={})
        named = set()
        replay(Capture(fixtures_dir / "vllm-0.32-cpu-scenarios" / name / "capture.tar.gz"),
               lambda source: Monitor(settings, fetcher=source, clock=source.now),
               on_state=lambda state: named.update((f.cause, f.summary) for f in state.findings
                                                   if f.symptom == "slow_first_token") if state.up else None)
        # Every figure that can be compared says its span.
        assert all(summary.startswith("Time to first token over the last ") for _cause, summary in named)
        named = {cause for cause, _summary in named}
        assert other not in named, (name, named)
        assert cause in named, (name, named)


@pytest.mark.parametrize("seed", SEEDS)
def test_two_loops_of_the_demo_tell_one_story_per_engine_and_symptom(seed):
    from kvwatch.sim.scenario import load_scenario

    loop = load_scenario("demo").cycle_seconds
    holder = []
    check = Checker(lambda: holder[0])
    # As `make run` polls: every 2 s over a 1-minute window, max_num_seqs told.
    import kvwatch.pipeline.monitor as monitor_module

    real_init = monitor_module.Monitor.__init__

    def keep(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        holder.append(self)

    monitor_module.Monitor.__init__ = keep
    try:
        sim_monitor("demo", 2 * loop, seed=seed, every=2.0, window="1m", thresholds={"max_num_seqs": 12},
                    on_state=check)
    finally:
        monitor_module.Monitor.__init__ = real_init
    assert check.polls >= 2 * loop / 2.0 - 2
    assert check.exhausted_polls > 50
    # The exhaustion and long-request phases: the scheduler's setting rides on the load shape.
    assert check.contributors[("long_requests", "capacity_below_max_num_seqs")] + \
        check.contributors[("concurrency_beyond_capacity", "capacity_below_max_num_seqs")] > 0
    # The demo's hit-rate phases cannot always tell a changed or unshared prefix from eviction.
    assert sum(n for (cause, alt), n in check.alternatives.items() if alt == "eviction_before_reuse") > 0


# --- the rule itself -------------------------------------------------------------------------

def _f(cause: str, symptom: str = "slow_first_token", confidence: str = "medium", engine: str = "0",
       **evidence) -> Finding:
    return Finding(symptom, cause, "warning", confidence, "m", engine, f"{cause} now", evidence)


def test_the_larger_share_is_primary_and_the_other_rides_on_it():
    [primary] = arbitrate([_f("prefill", prefill_share=0.3), _f("queueing_kv_bound", queue_share=0.6)])
    assert primary.cause == "queueing_kv_bound"
    assert [(c["cause"], c["evidence"]) for c in primary.contributing] == [("prefill", {"prefill_share": 0.3})]


def test_higher_confidence_beats_a_larger_share():
    [primary] = arbitrate([_f("prefill", confidence="medium", prefill_share=0.3),
                           _f("queueing_kv_bound", confidence="low", queue_share=0.6)])
    assert primary.cause == "prefill"


def test_the_previous_primary_keeps_a_tie_of_confidence():
    a, b = _f("prefill", prefill_share=0.45), _f("queueing_compute_bound", queue_share=0.55)
    assert arbitrate([a, b])[0].cause == "queueing_compute_bound"
    assert arbitrate([a, b], {(group_key(a), "prefill")})[0].cause == "prefill"


def test_the_schedulers_setting_is_never_the_primary_beside_a_load_shape():
    below = _f("capacity_below_max_num_seqs", "exhaustion", confidence="high")
    shape = _f("concurrency_beyond_capacity", "exhaustion", confidence="low")
    assert [f.cause for f in arbitrate([below, shape])] == ["concurrency_beyond_capacity"]
    assert [f.cause for f in arbitrate([below])] == ["capacity_below_max_num_seqs"]


def test_engines_symptoms_and_changes_are_separate_stories():
    found = arbitrate([_f("prefill", prefill_share=0.5), _f("prefill", engine="1", prefill_share=0.5),
                       _f("long_requests", "exhaustion"),
                       Finding("change", "model_changed", "info", "high", "m", "0", "changed"),
                       Finding("change", "engine_restarted", "info", "high", "m", "0", "restarted")])
    assert sorted((f.symptom, f.cause, f.engine) for f in found) == [
        ("change", "engine_restarted", "0"), ("change", "model_changed", "0"), ("exhaustion", "long_requests", "0"),
        ("slow_first_token", "prefill", "0"), ("slow_first_token", "prefill", "1")]


def test_a_clearing_finding_never_stands_beside_an_active_cause_of_its_symptom():
    hold = FindingHold(60.0, hysteresis=False)
    hold.apply(SIM_BASE, [_f("front_end", other_share=0.6)])
    out = hold.apply(SIM_BASE + 2, [_f("preemption", confidence="medium", other_share=0.6)])
    assert [(f.cause, f.clearing_since) for f in out] == [("preemption", None)]
    # A weaker active rival does not unseat the held primary: it rides on it while it clears.
    hold = FindingHold(60.0, hysteresis=False)
    hold.apply(SIM_BASE, [_f("eviction_before_reuse", "low_hit_rate", confidence="medium")])
    [held] = hold.apply(SIM_BASE + 2, [_f("prefix_changed", "low_hit_rate", confidence="low")])
    assert (held.cause, held.clearing_since) == ("eviction_before_reuse", SIM_BASE + 2)
    assert [c["cause"] for c in held.contributing] == ["prefix_changed"]


def test_active_findings_come_before_clearing_ones_whatever_their_severity():
    hold = FindingHold(60.0, hysteresis=False)
    hold.apply(SIM_BASE, [replace(_f("long_requests", "exhaustion"), severity="critical")])
    out = hold.apply(SIM_BASE + 2, [_f("prefill", prefill_share=0.5)])
    assert [(f.cause, f.clearing_since is None) for f in out] == [("prefill", True), ("long_requests", False)]


def test_alternatives_are_data_in_the_json_and_the_metrics():
    from kvwatch.sidecar.report import finding_json

    alternative = {"cause": "eviction_before_reuse", "decided_by": ["kv_cache_metrics", "kv_events"], "how": "x"}
    finding = replace(_f("prefix_changed", "low_hit_rate", confidence="low"), alternatives=(alternative,))
    assert finding_json(finding)["alternatives"] == [alternative]

    class State:
        findings = [finding]

    samples = next(f for f in KvwatchCollector(None)._findings(State) if f.name == "kvwatch_finding_alternative").samples
    assert sorted(s.labels["decided_by"] for s in samples) == ["kv_cache_metrics", "kv_events"]
    assert {s.labels["alternative"] for s in samples} == {"eviction_before_reuse"}


def test_the_headline_never_claims_more_requests_than_the_peak_held():
    """`diagnose --prometheus` printed "concurrency_beyond_capacity ... 5
    requests running or waiting at the peak, the cache holds about 56": the
    means chose the shape, and the headline claimed what its own evidence
    contradicted. Now it says what the numbers show and lists the other
    shape as an alternative, with what would decide."""
    from test_diagnose import Run

    run = Run()
    # Preemptions (so exhausted) with 3 running and nobody waiting, each holding 10 % of the cache on
    # average, at 200-token requests of which the 4,096-token cache holds about 20.
    run.steps(6, usage=0.3, running=3, waiting=0, requests=3, prompt=100, generated=100, preemptions=1)
    [finding] = [f for f in run.findings() if f.symptom == "exhaustion"]
    assert finding.cause == "concurrency_beyond_capacity" and finding.confidence == "low"
    assert finding.evidence["demand_at_peak"] < finding.evidence["kv_cache_capacity_requests"]
    assert "fewer than the roughly" in finding.summary and "longer than the mean" in finding.summary
    assert [(a["cause"], a["decided_by"]) for a in finding.alternatives] == [
        ("long_requests", ["request_lengths", "kv_events"])]


def test_the_default_rules_never_fire_two_causes_of_one_symptom_at_once():
    """The causes of one symptom partition its value (mixin/alerts.py), and an
    alert that stops holding is kept firing for the hold (keep_firing_for).
    When the cause changes, the old one is kept firing for the hold while the
    new one is pending; with every `for:` longer than the hold, the old one
    has resolved before the new one fires: one cause firing per symptom per
    engine at any evaluation (a real Prometheus in tests/test_e2e_alerting.py)."""
    from kvwatch.mixin.alerts import alert_specs
    from kvwatch.mixin.config import MixinConfig
    from kvwatch.units import parse_prometheus_duration

    config = MixinConfig()
    causes = Counter(spec.alert for spec in alert_specs(config) if spec.symptom in ARBITRATED)
    assert causes["VllmTimeToFirstTokenSlow"] >= 5
    for alert, count in causes.items():
        if count > 1:
            assert (parse_prometheus_duration(config.for_duration(alert))
                    > parse_prometheus_duration(config.finding_hold)), alert


def test_the_page_without_script_draws_one_story_too():
    from kvwatch.sidecar.report import finding_json
    from kvwatch.sidecar.statuspage import _findings_html

    alternative = {"cause": "eviction_before_reuse", "decided_by": ["kv_events"], "how": "x"}
    undecided = replace(_f("prefix_changed", "low_hit_rate", confidence="low"), alternatives=(alternative,))
    primary = arbitrate([_f("queueing_kv_bound", queue_share=0.6), _f("preemption", other_share=0.3)])[0]
    held = replace(_f("long_requests", "exhaustion"), clearing_since=SIM_BASE)
    text = _findings_html({"up": True, "findings": [finding_json(f) for f in (undecided, primary, held)]})
    assert "the prompt prefix changed, or prefixes are evicted before they are reused" in text
    assert "Contributing: requests preempted and recomputed in a full cache (medium confidence)" in text
    assert '<div class="finding clearing" data-symptom="exhaustion"' in text
