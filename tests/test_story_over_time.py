"""The incident told over time (issues #47, #55): the fixes the timeline
scorer exposed, each on hand-built findings or polls, and the scorer's bars
on the simulated demo loop (kvwatch/sim/score.py)."""

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvwatch.diagnose import DEFAULT_THRESHOLDS, HitRateMemory
from kvwatch.diagnose.causes import SYMPTOMS
from kvwatch.diagnose.hold import FindingHold
from kvwatch.diagnose.now import judged_now
from kvwatch.diagnose.stream import baseline_confidence, stream_residency
from kvwatch.diagnose.vocabulary import Finding, finding_order
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.score import BARS, run_scenario, score, settings_for


def finding(symptom, cause, severity="warning", clearing=None):
    return Finding(symptom, cause, severity, "high", "m", "0", f"{cause}", clearing_since=clearing)


def test_the_banner_leads_with_what_users_feel():
    """Late first tokens lead a low hit rate of the same severity (the
    queueing phase's banner was the hit-rate warning while 51 requests
    waited), and lead a critical exhaustion that makes them late; info and
    clearing findings still come after every actionable active one."""
    found = [finding("low_hit_rate", "prefix_changed"), finding("exhaustion", "concurrency_beyond_capacity", "critical"),
             finding("slow_first_token", "queueing_kv_bound"), finding("exhaustion", "capacity_below_max_num_seqs", "info"),
             finding("stuck", "kv_held_idle", clearing=1.0)]
    order = [f.cause for f in sorted(found, key=finding_order)]
    assert order == ["queueing_kv_bound", "concurrency_beyond_capacity", "prefix_changed",
                     "capacity_below_max_num_seqs", "kv_held_idle"]


def test_a_new_cause_replaces_the_shown_one_only_after_leading_for_its_lead():
    """17 primary-cause changes in 28 minutes of the demo: a cause that leads
    for a few polls does not change the story; one that leads for the
    symptom's `lead` (causes.Symptom) does."""
    lead = SYMPTOMS["slow_first_token"].lead
    assert lead > 4.0
    def rival(cause, over):  # `cause` leads, `over` still found beside it (a contributing factor)
        return replace(finding("slow_first_token", cause), contributing=({"cause": over},))

    hold = FindingHold(60.0)
    hold.apply(0.0, [finding("slow_first_token", "queueing_kv_bound")])
    blip = hold.apply(2.0, [rival("preemption", "queueing_kv_bound")])
    assert [f.cause for f in blip] == ["queueing_kv_bound"]
    back = hold.apply(4.0, [finding("slow_first_token", "queueing_kv_bound")])
    assert [f.cause for f in back] == ["queueing_kv_bound"]
    shown = [hold.apply(6.0 + t, [rival("prefill", "queueing_kv_bound")])[0].cause for t in range(0, int(lead) + 4, 2)]
    assert shown[0] == "queueing_kv_bound" and shown[-1] == "prefill"
    assert shown.index("prefill") * 2.0 >= lead
    # A shown cause the rules no longer find at all is no rival: it ends as a lapse does, after its
    # quiet, and the new cause shows then, before the lead.
    quiet = SYMPTOMS["slow_first_token"].quiet
    assert quiet < lead
    hold = FindingHold(60.0)
    hold.apply(0.0, [finding("slow_first_token", "prefill")])
    shown = [hold.apply(2.0 + t, [finding("slow_first_token", "upstream")])[0].cause for t in range(0, int(lead), 2)]
    assert shown[0] == "prefill" and shown[-1] == "upstream"
    assert quiet <= shown.index("upstream") * 2.0 + 2.0 < lead


def test_a_story_crossing_the_exhaustion_line_changes_at_once():
    """Compute-bound queueing says the cache was not exhausted: once the
    exhaustion detector holds, keeping it shown for its lead contradicted the
    exhaustion card beside it (the scorer's check found 15 such polls a loop)."""
    hold = FindingHold(60.0)
    hold.apply(0.0, [finding("slow_first_token", "queueing_compute_bound")])
    out = hold.apply(2.0, [finding("slow_first_token", "queueing_kv_bound"), finding("exhaustion", "long_requests")])
    assert sorted(f.cause for f in out) == ["long_requests", "queueing_kv_bound"]
    # And a compute-bound finding whose condition lapsed is shown ended, not quietly active, beside an exhaustion.
    hold = FindingHold(60.0)
    hold.apply(0.0, [finding("slow_first_token", "queueing_compute_bound")])
    out = hold.apply(2.0, [finding("exhaustion", "long_requests")])
    assert [(f.cause, f.clearing_since) for f in out] == [("long_requests", None), ("queueing_compute_bound", 2.0)]


def test_an_advisory_now_does_not_keep_the_harm_the_window_shows():
    window = [finding("exhaustion", "long_requests", "critical")]
    assert judged_now(window, [finding("exhaustion", "capacity_below_max_num_seqs", "info")]) == [
        finding("exhaustion", "capacity_below_max_num_seqs", "info")]


def test_a_finding_is_never_first_shown_clearing():
    """A cause held behind an active rival of its symptom was never shown;
    when the rival ends it must not appear already clearing."""
    hold = FindingHold(60.0, hysteresis=False)
    hold.apply(0.0, [finding("exhaustion", "long_requests")])
    hold.apply(2.0, [finding("exhaustion", "concurrency_beyond_capacity")])  # long_requests held, hidden
    out = hold.apply(4.0, [])
    assert [(f.cause, f.clearing_since is not None) for f in out] == [("concurrency_beyond_capacity", True)]


def test_a_finding_is_active_while_its_symptom_is_true_now():
    """Now and the window apart (issue #55): a window finding whose symptom
    the rules no longer find over the last now_seconds has ended; a symptom
    true now that the window does not show yet starts from the now finding;
    changes, the stream's own findings and stuck keep their own spans."""
    window = [finding("exhaustion", "concurrency_beyond_capacity", "critical"),
              finding("slow_first_token", "queueing_kv_bound"), finding("change", "engine_restarted", "info"),
              finding("kv_events", "events_missed")]
    now = [finding("slow_first_token", "preemption"), finding("low_hit_rate", "no_reuse", "info")]
    judged = judged_now(window, now)
    assert [(f.symptom, f.cause) for f in judged] == [
        ("slow_first_token", "preemption"), ("change", "engine_restarted"), ("kv_events", "events_missed"),
        ("low_hit_rate", "no_reuse")]


def test_a_healthy_hit_ratio_is_no_baseline_once_old():
    """The demo's 'last healthy 23 %' came from 13-18 minutes before: a
    baseline expires (hit_baseline_max_age_seconds)."""
    memory = HitRateMemory()
    memory.remember(("m", "0"), 0.6, 100.0)
    assert memory.recall(("m", "0"), 300.0, DEFAULT_THRESHOLDS["hit_baseline_max_age_seconds"]) == (0.6, 100.0)
    assert memory.recall(("m", "0"), 100.0 + DEFAULT_THRESHOLDS["hit_baseline_max_age_seconds"] + 1,
                         DEFAULT_THRESHOLDS["hit_baseline_max_age_seconds"]) is None


def test_blocks_stored_again_while_the_cache_is_exhausted_are_no_eviction_before_reuse():
    """A preempted request's blocks are evicted and stored again when it is
    recomputed: in the demo's exhaustion phase (prompts sharing nothing) the
    stream's 18 % stored again read as eviction before reuse at high
    confidence. While preempting, the stream decides nothing about reuse."""
    report = {"up": True, "recent": {"stored": 2700, "stored_again": 480, "stored_again_ratio": 0.18,
                                     "evicted": 2600, "seconds": 30.0},
              "earlier": {"stored": 2000, "stored_again_ratio": 0.15}, "window": {}, "listening_seconds": 600.0}
    ctx = SimpleNamespace(stream=report, t=DEFAULT_THRESHOLDS, exhaustion=None)
    assert stream_residency(ctx)[0] is True
    ctx.exhaustion = SimpleNamespace(preemptions=0.0)  # full, nothing preempted: a rotation's evictions
    assert stream_residency(ctx)[0] is True
    ctx.exhaustion = SimpleNamespace(preemptions=3.0)
    assert stream_residency(ctx) is None


# --- the bars on simulated time (the timeline section of make bench prints the figures) ---

DEMO_SETTINGS = str(Path(__file__).resolve().parent.parent / "scripts" / "demo-kvwatch.yaml")


@pytest.mark.slow
@pytest.mark.parametrize("config, diagnosis, ended_within, false_minutes", [
    # issue 47: the demo's settings, ended within 75 s, at most 0.5 min of false findings a loop
    (DEMO_SETTINGS, None, BARS["clear_seconds"], BARS["false_minutes"]),
    # issue 55: the defaults, no longer active 90 s after the end; false findings as issue 47's bar
    (None, {"max_num_seqs": 12}, 90.0, BARS["false_minutes"]),
])
def test_the_demo_loop_is_told_right_over_time(config, diagnosis, ended_within, false_minutes):
    """One loop of the demo per seed through the whole pipeline on simulated
    time, scored against each phase's story: the banner, false findings (none
    at high confidence), findings born clearing, contradicting texts, and each
    phase's finding starting within 45 s and ending within 75 s hold the bars
    of issue 47 (the defaults: ending within issue 55's 90 s). Not held here:
    toggles and one cause change a phase (docs/diagnosis.md says the figures). Before this work, seed 0 at
    the demo's settings: banner right on 34.7 % of polls, 7.6 min of false
    findings (6.2 at high confidence), 3 born clearing, findings never ended."""
    demo = load_scenario("demo")
    for seed in (0, 1, 2):
        result = score(demo, run_scenario(demo, settings_for(config, diagnosis=diagnosis), demo.cycle_seconds, seed))
        said = f"seed {seed}: {result.figures()}; " + "; ".join(result.wrong_lines())
        assert result.banner_right_share >= BARS["banner_right_share"], said
        assert result.false_seconds / 60 <= false_minutes, said
        assert result.false_high_seconds == 0, said  # none at high confidence
        assert result.born_clearing == 0, said
        assert result.contradictions == 0, said  # no finding text contradicts the findings beside it
        assert all(v is not None and v <= ended_within for _, v in result.clear_seconds), said
        assert all(v is not None and v <= BARS["start_seconds"] for _, v in result.start_seconds), said


def test_a_critical_exhaustion_shows_the_figure_that_made_it_critical():
    """A CRITICAL 'KV cache exhausted' stood on one preemption beside a chip
    reading 83.9 % peak usage, under the 90 % line, while its alert is a
    warning: every critical exhaustion says its preemptions, and its alert
    is critical on the same figure, held episodes included."""
    demo = load_scenario("exhaustion")
    polls = run_scenario(demo, settings_for(None, diagnosis={"max_num_seqs": demo.engine.max_num_seqs}), 240.0, 0)
    critical = [f for p in polls for f in p.findings if f.symptom == "exhaustion" and f.severity == "critical"]
    assert critical
    for found in critical:
        said = found.evidence.get("severity_because", "")
        assert "preemption" in said and "VllmKvCacheExhausted is critical" in said, found


def test_confidence_falls_with_the_baselines_age():
    t = DEFAULT_THRESHOLDS
    limit = t["hit_baseline_max_age_seconds"]
    assert baseline_confidence("high", {"hit_ratio_last_healthy_seconds_ago": limit / 8}, t) == "high"
    assert baseline_confidence("high", {"hit_ratio_last_healthy_seconds_ago": limit / 3}, t) == "medium"
    assert baseline_confidence("high", {"hit_ratio_last_healthy_seconds_ago": limit * 0.96}, t) == "low"
    assert baseline_confidence("low", {"hit_ratio_last_healthy_seconds_ago": 1.0}, t) == "low"
    assert baseline_confidence("high", {}, t) == "high"  # no baseline read: as sure as its own evidence
