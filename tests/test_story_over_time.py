"""The incident told over time (issues #47, #55): the fixes the timeline
scorer exposed, each on hand-built findings or polls, and the scorer's bars
on the simulated demo loop (kvwatch/sim/score.py)."""

from kvwatch.diagnose.vocabulary import Finding, finding_order


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
