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
