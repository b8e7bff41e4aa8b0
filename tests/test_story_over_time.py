"""The incident told over time: the fixes the timeline
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
from kvwatch.sim.score import run_scenario, score, settings_for


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
    # A shown cause the rules no longer find at all is no rival: it ends after its handover (the
    # new cause's evidence says the story moved on), and the new cause shows then, before the lead.
    handover = SYMPTOMS["slow_first_token"].handover
    assert 0 < handover < lead
    hold = FindingHold(60.0)
    hold.apply(0.0, [finding("slow_first_token", "prefill")])
    shown = [hold.apply(2.0 + t, [finding("slow_first_token", "upstream")])[0].cause for t in range(0, int(lead), 2)]
    assert shown[0] == "prefill" and shown[-1] == "upstream"
    assert handover <= shown.index("upstream") * 2.0 + 2.0 < lead


def test_two_exclusive_readings_of_one_exhaustion_change_only_after_the_lead():
    """The exhaustion rule names exactly one load shape per window: in the
    demo's recovery-2 (seed 1) short requests queued behind the last long
    generations, the window read `concurrency_beyond_capacity` for 34 s and
    the page showed long_requests -> concurrency -> long_requests, since the
    shape not named was taken for a lapse. A reading in its place is a
    rival that must lead for the symptom's lead."""
    lead = SYMPTOMS["exhaustion"].lead
    assert lead > 35.0 > SYMPTOMS["exhaustion"].handover
    hold = FindingHold(60.0)
    for t in range(0, 60, 2):
        hold.apply(float(t), [finding("exhaustion", "long_requests")])
    shown = [hold.apply(60.0 + t, [finding("exhaustion", "concurrency_beyond_capacity")])[0].cause
             for t in range(0, 36, 2)]
    assert set(shown) == {"long_requests"}, shown  # 34 s of the other reading: the story stays
    shown = [hold.apply(96.0 + t, [finding("exhaustion", "concurrency_beyond_capacity")])[0].cause
             for t in range(0, 20, 2)]
    assert shown[-1] == "concurrency_beyond_capacity"  # led for longer than its lead: the story changes


def test_a_harm_beside_its_advisory_shows_at_once():
    """An exhaustion found while only its sizing advisory was shown is no
    rival reading to wait out (the long-requests phase started 46 s late)."""
    hold = FindingHold(60.0)
    hold.apply(0.0, [finding("exhaustion", "capacity_below_max_num_seqs", "info")])
    found = replace(finding("exhaustion", "long_requests"), contributing=({"cause": "capacity_below_max_num_seqs"},))
    assert [f.cause for f in hold.apply(2.0, [found])] == ["long_requests"]


def test_a_lapse_is_hidden_for_its_quiet_but_no_longer_than_the_finding_stood():
    """A lapse shorter than the symptom's quiet is not shown (the demo's
    true lapses last up to 30 s); a finding seen for a few polls is not
    kept for a whole quiet (a low-confidence blip stood 44 s), and never
    for less than the handover (a one-poll lapse is never shown)."""
    quiet, handover = SYMPTOMS["low_hit_rate"].quiet, SYMPTOMS["low_hit_rate"].handover
    assert quiet >= 30.0
    hold = FindingHold(120.0)
    for t in range(0, 120, 2):
        hold.apply(float(t), [finding("low_hit_rate", "eviction_before_reuse")])
    during = [hold.apply(120.0 + t, [])[0].clearing_since for t in range(0, int(quiet) + 4, 2)]
    assert during[int(quiet) // 2 - 1] is None and during[-1] == 120.0
    hold = FindingHold(120.0)
    for t in (0.0, 2.0, 4.0):
        hold.apply(t, [finding("low_hit_rate", "prefix_changed")])
    during = [hold.apply(6.0 + t, [])[0].clearing_since for t in range(0, int(quiet), 2)]
    assert during[int(handover) // 2 - 1] is None and during[int(handover) // 2 + 1] == 6.0


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


def test_two_readings_of_one_exhausted_cache_change_only_after_the_lead():
    """Queued for KV blocks and preempted are both named only while the cache
    is exhausted (causes.Cause.while_exhausted): their shares trade places as
    requests grow. In the demo's exhaustion phase (seed 1) the queue reading
    lapsed for 22 s, preemption was read for 26 s and the queue again: the
    page showed queue -> preemption -> queue. A shown one no longer found
    beside the other is not found absent: the other must lead."""
    lead = SYMPTOMS["slow_first_token"].lead
    hold = FindingHold(60.0)
    for t in range(0, 60, 2):
        hold.apply(float(t), [finding("slow_first_token", "queueing_kv_bound")])
    for t in range(60, 80, 2):  # a lapse hidden by the quiet
        hold.apply(float(t), [])
    shown = [hold.apply(80.0 + t, [finding("slow_first_token", "preemption")])[0].cause
             for t in range(0, int(lead) - 2, 2)]
    assert set(shown) == {"queueing_kv_bound"}, shown
    shown = [hold.apply(80.0 + t, [finding("slow_first_token", "preemption")])[0].cause
             for t in range(int(lead) - 2, int(lead) + 4, 2)]
    assert shown[-1] == "preemption"  # led for its lead: the story changes


def test_a_lapsed_finding_never_shown_is_not_shown_when_its_rival_ends():
    """A cause found for one poll behind the shown one, then lapsed, must not
    become the story when the shown one ends (seed 1 at the defaults: a
    one-poll prefill reading stood in for the exhaustion's queue for 5 s,
    then preemption: two cause changes); it is not true now."""
    hold = FindingHold(60.0)
    for t in range(0, 100, 5):
        hold.apply(float(t), [finding("slow_first_token", "queueing_kv_bound")])
    hold.apply(100.0, [])  # the shown one lapses
    hold.apply(105.0, [])
    out = hold.apply(110.0, [finding("slow_first_token", "prefill")])
    assert [f.cause for f in out if f.clearing_since is None] == ["queueing_kv_bound"]
    shown = [hold.apply(115.0 + t, []) for t in range(0, 30, 5)]
    assert all(f.cause == "queueing_kv_bound" for out in shown for f in out), shown
    assert shown[-1] and shown[-1][0].clearing_since == 100.0  # shown ended, from its own lapse


def test_an_exhaustion_pausing_beside_its_advisory_is_one_episode():
    """Intermittent exhaustion: in the demo's slow-prefill (seed 1) 4-7k-token
    documents overlap about once a minute; between overlaps only the sizing
    advisory is found (the cache still cannot hold what the scheduler
    admits), and the exhaustion showed ended for 42 s and came back within
    its hold. While its advisory stands, its lapse is a pause of one
    condition, hidden for the hold (as its alert keeps firing); without the
    advisory it shows ended after its quiet, as before."""
    quiet = SYMPTOMS["exhaustion"].quiet
    advisory = finding("exhaustion", "capacity_below_max_num_seqs", "info")

    def run(between):
        hold = FindingHold(60.0)
        for t in range(0, 60, 2):
            hold.apply(float(t), [finding("exhaustion", "long_requests")])
        return [hold.apply(60.0 + t, between) for t in range(0, 58, 2)], hold

    paused, hold = run([advisory])
    assert all([(f.cause, f.clearing_since) for f in out] == [("long_requests", None)] for out in paused), paused
    back = hold.apply(118.0, [finding("exhaustion", "long_requests")])
    assert [(f.cause, f.clearing_since) for f in back] == [("long_requests", None)]
    assert [f.cause for f in hold.apply(180.0, [advisory])] == ["long_requests"]  # still within the hold
    assert [f.cause for f in hold.apply(240.0, [advisory])] == ["capacity_below_max_num_seqs"]  # the hold ended it
    ended, hold = run([])
    assert ended[int(quiet) // 2 + 1][0].clearing_since == 60.0  # no advisory: shown ended after its quiet
    # Shown ended, it stays ended: its advisory coming back (seed 0's recovery-2) does not revive it.
    assert [f.clearing_since for f in hold.apply(118.0, [advisory]) if f.cause == "long_requests"] == [60.0]


def test_an_advisory_only_in_the_window_does_not_make_one_episode():
    """The one-episode rule reads the advisory the now span finds: one the
    window alone still shows (its 5 minutes hold the exhaustion that made it
    so) is no warning sign standing now, and the harm ends after its quiet,
    not the hold."""
    quiet = SYMPTOMS["exhaustion"].quiet
    harm, advisory = finding("exhaustion", "long_requests", "critical"), finding(
        "exhaustion", "capacity_below_max_num_seqs", "info")
    hold = FindingHold(60.0)
    for t in range(0, 60, 5):
        hold.apply(float(t), judged_now([harm, advisory], [harm]))
    after = [hold.apply(60.0 + t, judged_now([harm, advisory], [])) for t in range(0, int(quiet) + 10, 5)]
    ended = [out[0].clearing_since for out in after]
    assert ended[int(quiet) // 5 - 1] is None and ended[int(quiet) // 5] == 60.0, after


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
    """Now and the window apart: a window finding whose symptom
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
    assert memory.recall(("m", "0"), 300.0, DEFAULT_THRESHOLDS.hit_baseline_max_age_seconds) == (0.6, 100.0)
    assert memory.recall(("m", "0"), 100.0 + DEFAULT_THRESHOLDS.hit_baseline_max_age_seconds + 1,
                         DEFAULT_THRESHOLDS.hit_baseline_max_age_seconds) is None


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
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("config, diagnosis", [(DEMO_SETTINGS, None), (None, {"max_num_seqs": 12})],
                         ids=["demo-settings", "defaults"])
def test_the_demo_loop_is_told_right_over_time(config, diagnosis, seed):
    """One loop of the demo through the whole pipeline on simulated time,
    scored against each phase's story, holds every bar (score.BARS) at the
    demo's settings and at the defaults: the banner right on 97 % of scored
    polls, at most 0.5 min of false findings (none at high confidence), at
    most one cause change a phase, no active/clearing toggle after a phase's
    first 75 s, none born clearing, no contradicting text, and each phase's
    finding starting within 45 s and ending within 75 s. Before this work,
    seed 0 at the demo's settings: banner right on 34.7 % of polls, 7.6 min
    of false findings (6.2 at high confidence), 3 born clearing, findings
    never ended; seed 1 then had 4 toggles and 2 exhaustion cause changes in
    recovery-2, seed 2 one toggle; seed 1 since changed its first-token cause
    twice in slow-prefill (compute-bound -> KV-bound -> prefill), until KV-bound
    was decided by the cache while the requests waited."""
    demo = load_scenario("demo")
    result = score(demo, run_scenario(demo, settings_for(config, diagnosis=diagnosis), demo.cycle_seconds, seed))
    said = f"seed {seed}: {result.figures()}; " + "; ".join(result.wrong_lines())
    assert result.failures() == [], said
    assert result.contradictions == 0, said  # no finding text contradicts the findings beside it
    assert result.start_seconds and result.clear_seconds, said  # the bars on start and end were measured


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
    limit = t.hit_baseline_max_age_seconds
    assert baseline_confidence("high", {"hit_ratio_last_healthy_seconds_ago": limit / 8}, t) == "high"
    assert baseline_confidence("high", {"hit_ratio_last_healthy_seconds_ago": limit / 3}, t) == "medium"
    assert baseline_confidence("high", {"hit_ratio_last_healthy_seconds_ago": limit * 0.96}, t) == "low"
    assert baseline_confidence("low", {"hit_ratio_last_healthy_seconds_ago": 1.0}, t) == "low"
    assert baseline_confidence("high", {}, t) == "high"  # no baseline read: as sure as its own evidence
