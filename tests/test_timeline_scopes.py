"""The timeline keeps each scope's open episodes apart (a replica's, a
model's fleet rules'): one scope's step ends only that scope's episodes,
whatever the others hold, and an episode that ends and comes back is a new
one."""

from __future__ import annotations

from kvwatch.diagnose.timeline import Timeline
from kvwatch.diagnose.vocabulary import Finding


def finding(cause: str, replica: str = "") -> Finding:
    return Finding("exhaustion", cause, "warning", "high", "m", "0", cause, {"replica": replica} if replica else {})


def test_a_scopes_step_ends_only_its_own_episodes():
    timeline = Timeline()
    scopes = [f"r{i}" for i in range(50)]
    for at in range(5):
        for scope in scopes:
            # Odd replicas lose their finding at step 3 and get it back at 4.
            keep = int(scope[1:]) % 2 == 0 or at != 3
            timeline.add(scope, float(at), [finding("concurrency_beyond_capacity")] if keep else [], replica=scope)
        timeline.add("fleet:m", float(at), [finding("imbalance", "r0")] if at < 2 else [])
    timeline.finish()
    by_replica: dict[str, list] = {}
    for episode in timeline.episodes:
        by_replica.setdefault(episode.replica, []).append(episode)
    for index, scope in enumerate(scopes):
        spans = sorted((e.start, e.end, e.polls, e.active_at_end) for e in by_replica[scope]
                       if e.cause == "concurrency_beyond_capacity")
        if index % 2 == 0:
            assert spans == [(0.0, 4.0, 5, True)]
        else:
            assert spans == [(0.0, 2.0, 3, False), (4.0, 4.0, 1, True)]
    (fleet,) = [e for e in timeline.episodes if e.cause == "imbalance"]
    assert (fleet.replica, fleet.start, fleet.end, fleet.active_at_end) == ("r0", 0.0, 1.0, False)
