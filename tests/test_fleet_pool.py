"""The lost-affinity rule pools each replica's peers from the fleet's sums
less the replica's own (not by summing the peers again for each replica):
the peers' ratio it reports must be the float that summing them one by one
gives, whole token counts or not."""

from __future__ import annotations

import random

from kvwatch.diagnose.fleet import ReplicaRow, _PeerPool, _pooled, fleet_findings


def _row(name: str, queries, hits) -> ReplicaRow:
    counters = {}
    if queries is not None:
        counters["prefix_queries"] = queries
    if hits is not None:
        counters["prefix_hits"] = hits
    return ReplicaRow(name, "0", {"kvwatch_kv_cache_usage_max_ratio": 0.3}, counters)


def _fleets():
    rng = random.Random(7)
    for _ in range(300):
        size = rng.randint(2, 12)
        kind = rng.choice(("whole", "fraction", "mixed", "huge", "missing"))
        rows = []
        for i in range(size):
            queries = float(rng.randint(0, 10**6))
            hits = float(rng.randint(0, int(queries)))
            if kind == "fraction" or (kind == "mixed" and i % 3 == 0):
                queries, hits = queries / 3.7, hits / 3.7
            if kind == "huge":
                queries, hits = queries * 2.0**40, hits * 2.0**40
            if kind == "missing" and i % 2:
                queries, hits = None, None
            rows.append(_row(f"r{i}", queries, hits))
        yield rows


def test_each_replicas_peers_pool_to_the_float_of_summing_them_one_by_one():
    for rows in _fleets():
        pool = _PeerPool(rows)
        for index in range(len(rows)):
            peers = rows[:index] + rows[index + 1:]
            assert repr(pool.without(index)) == repr(_pooled(peers)), (rows, index)


def test_lost_affinity_evidence_carries_the_peers_summed_ratio():
    rows = [_row(f"r{i}", 100_000.0 / 3, 80_000.0 / 3) for i in range(5)] + [_row("lost", 100_000.0, 1_000.0)]
    found = [f for f in fleet_findings("m", rows) if f.cause == "lost_prefix_affinity"]
    assert [f.evidence["replica"] for f in found] == ["lost"]
    assert found[0].evidence["peers_hit_ratio"] == _pooled(rows[:5])
    assert found[0].evidence["peers"] == 5


def test_a_row_slimmed_to_what_the_rules_read_gives_the_same_findings():
    """History workers send each replica's rows slimmed (ReplicaRow.slim):
    every fleet rule must read nothing else."""
    from kvwatch.diagnose.vocabulary import Finding

    rng = random.Random(11)
    full = Finding("exhaustion", "concurrency_beyond_capacity", "critical", "high", "m", "0", "full", {}, "")
    queue = Finding("slow_first_token", "queueing_kv_bound", "warning", "high", "m", "0", "queue", {}, "")
    seen = set()
    for _ in range(300):
        rows = []
        for i in range(rng.randint(2, 8)):
            queries = float(rng.randint(0, 10**6))
            values = {"kvwatch_kv_cache_usage_max_ratio": rng.choice((0.2, 0.5, 0.95, 1.0, None)),
                      "kvwatch_requests_waiting": rng.choice((0.0, 0.0, 3.0, None)),
                      "kvwatch_kv_cache_usage_ratio": rng.random(), "kvwatch_ttft_seconds": {"0.5": 0.1}}
            counters = {"prefix_queries": queries, "prefix_hits": float(rng.randint(0, int(queries))),
                        "prompt_tokens": queries, "preemptions": 2.0}
            findings = rng.choice(([], [], [full], [queue]))
            rows.append(ReplicaRow(f"r{i}", "0", values, counters, findings,
                                   rng.choice((None, None, None, 1000.0))))
        expected = fleet_findings("m", rows)
        assert fleet_findings("m", [row.slim() for row in rows]) == expected
        seen.update(f.cause for f in expected)
    assert seen == {"imbalance", "cold_replica", "lost_prefix_affinity"}


def test_imbalance_counts_every_peer_with_room_and_their_highest_peak():
    """Each pressed replica's peers with room are counted once for the fleet
    (a fleet of n was n * n): the evidence must still be each replica's,
    computed from its own peers."""
    from kvwatch.diagnose.vocabulary import Finding

    rng = random.Random(3)
    exhausted = Finding("exhaustion", "concurrency_beyond_capacity", "critical", "high", "m", "0", "", {}, "")
    rows = []
    for i in range(40):
        pressed = rng.random() < 0.4
        peak = 0.99 if pressed else round(rng.uniform(0.1, 0.95), 3)
        rows.append(ReplicaRow(f"r{i}", "0", {"kvwatch_kv_cache_usage_max_ratio": peak,
                                              "kvwatch_requests_waiting": 4.0 if pressed else 0.0},
                               {}, [exhausted] if pressed else []))
    found = {f.evidence["replica"]: f for f in fleet_findings("m", rows) if f.cause == "imbalance"}
    from kvwatch.diagnose.thresholds import DEFAULT_THRESHOLDS

    room = DEFAULT_THRESHOLDS.fleet_room_usage_ratio
    for row in rows:
        peers = [p for p in rows if p is not row and p.usage_peak <= room and p.waiting <= 0 and not p.findings]
        if not row.findings or not peers:
            assert row.replica not in found
            continue
        evidence = found[row.replica].evidence
        assert evidence["peers_with_room"] == len(peers) and evidence["peers"] == len(rows) - 1
        assert evidence["peers_usage_peak_max"] == max(p.usage_peak for p in peers)
    assert found  # the fleet has pressed replicas with roomy peers
