"""Fleet findings: what needs more than one replica of a model to see.

- imbalance: one replica is exhausted (the exhaustion detector's finding) or
  its queue waits for KV blocks or compute, while another replica of the same
  model has room (usage peak over the window at or below
  fleet_room_usage_ratio, nothing waiting). Routing, not capacity.
- lost_prefix_affinity: a replica's window hit ratio is below
  fleet_affinity_fraction of its peers' pooled ratio (their summed hits over
  their summed queries), the peers reuse at least hit_ratio_low, and the
  replica queried enough tokens to judge. The pool of the other replicas
  shows the reuse the traffic has when prefixes reach the replica that holds
  them; a fleet that lost affinity everywhere has no such pool to compare
  with, and the per-replica low-hit-rate rules speak for it.
- cold_replica: a replica restarted inside the window (the window's restart
  evidence) while its peers did not; it is refilling, so its low hit ratio is
  expected and lost affinity is not named for it.

Each rule reads the replicas' per-engine signals and findings at one step
and returns Findings with symptom `fleet`; `evidence["replica"]` names the
replica. The same definitions are the fleet alerts' PromQL (mixin/alerts.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any

from kvwatch.diagnose.thresholds import Thresholds, resolve_thresholds
from kvwatch.diagnose.vocabulary import NEXT_CHECK, Finding, severity_of

QUEUEING = ("queueing_kv_bound", "queueing_compute_bound")


# The signal values and counters of a replica that the fleet rules read: a
# row holding only these (ReplicaRow.slim) gives the same findings.
USAGE_PEAK = "kvwatch_kv_cache_usage_max_ratio"
WAITING = "kvwatch_requests_waiting"
ROW_VALUES = (USAGE_PEAK, WAITING)
ROW_COUNTERS = ("prefix_queries", "prefix_hits")


@dataclass
class ReplicaRow:
    """One replica's engine of a model at one step."""

    replica: str
    engine: str
    values: Mapping[str, Any]  # the per-engine signal values (kvwatch.signals.Evaluated.values)
    counters: dict[str, float]  # the window's counter increases
    findings: list = field(default_factory=list)
    restarted_at: float | None = None  # the latest restart inside the window, if any

    @property
    def usage_peak(self) -> float | None:
        return self.values.get(USAGE_PEAK)

    @property
    def waiting(self) -> float:
        return self.values.get(WAITING) or 0.0

    def slim(self) -> "ReplicaRow":
        """The row with only what the fleet rules read (ROW_VALUES,
        ROW_COUNTERS): what a history worker process sends back."""
        values, counters = self.values, self.counters
        return ReplicaRow(self.replica, self.engine, {k: values[k] for k in ROW_VALUES if k in values},
                          {k: counters[k] for k in ROW_COUNTERS if k in counters}, self.findings,
                          self.restarted_at)

    def hit_ratio(self) -> float | None:
        queries = self.counters.get("prefix_queries")
        hits = self.counters.get("prefix_hits")
        if not queries or hits is None or hits > queries:
            return None
        return hits / queries


def _pressed(row: ReplicaRow) -> str | None:
    for finding in row.findings:
        if finding.symptom == "exhaustion":
            return "exhausted"
        if finding.symptom == "slow_first_token" and finding.cause in QUEUEING:
            return "queueing"
    return None


def _has_room(row: ReplicaRow, room: float) -> bool:
    peak = row.usage_peak
    return (peak is not None and peak <= room and row.waiting <= 0
            and _pressed(row) is None)


def fleet_findings(model: str, rows: list[ReplicaRow], thresholds: Mapping[str, Any] | Thresholds | None = None) -> list[Finding]:
    """Findings across the replicas of `model` at one step (none with fewer than two)."""
    if len(rows) < 2:
        return []
    t = resolve_thresholds(thresholds)
    findings: list[Finding] = []
    room = t.fleet_room_usage_ratio
    # A pressed row has no room itself: its peers with room are all of them
    # (counted and their peak taken once, not again for each pressed row:
    # n * n in a fleet of n).
    peers = [row for row in rows if _has_room(row, room)]
    peers_peak = max((peer.usage_peak for peer in peers), default=None)  # type: ignore[type-var]  # _has_room: a peak
    for row in rows:
        state = _pressed(row)
        if state is None or not peers:
            continue
        findings.append(Finding(
            "fleet", "imbalance", severity_of("imbalance"), "high", model, row.engine,
            f"Replica {row.replica} is {state} while {len(peers)} of its {len(rows) - 1} peers of {model} have "
            f"room (usage peak at most {room:.0%}, nothing waiting): the load is unevenly routed, not too large.",
            {"replica": row.replica, "state": state, "usage_peak": row.usage_peak, "waiting": row.waiting,
             "peers_with_room": len(peers), "peers": len(rows) - 1,
             "peers_usage_peak_max": peers_peak},
            NEXT_CHECK["imbalance"]))

    restarted = [row for row in rows if row.restarted_at is not None]
    warm = [row for row in rows if row.restarted_at is None]
    pooled = _pooled(warm) if restarted and warm else None  # the same for every restarted row
    for row in restarted:
        if not warm:
            break
        findings.append(Finding(
            "fleet", "cold_replica", severity_of("cold_replica"), "high", model, row.engine,
            f"Replica {row.replica} restarted inside the window and is refilling its cache while its "
            f"{len(warm)} peers of {model} are warm.",
            {"replica": row.replica, "restarted_at": row.restarted_at, "hit_ratio": row.hit_ratio(),
             "peers_hit_ratio": pooled, "warm_peers": len(warm)},
            NEXT_CHECK["cold_replica"]))

    fraction, floor, min_tokens = t.fleet_affinity_fraction, t.hit_ratio_low, t.min_query_tokens
    pool = _PeerPool(warm)
    for index, row in enumerate(warm):
        ratio = row.hit_ratio()
        if ratio is None or (row.counters.get("prefix_queries") or 0.0) < min_tokens or _pressed(row) == "exhausted":
            continue
        pooled = pool.without(index)
        if pooled is None or pooled < floor or ratio >= fraction * pooled:
            continue
        findings.append(Finding(
            "fleet", "lost_prefix_affinity", severity_of("lost_prefix_affinity"), "medium", model, row.engine,
            f"Replica {row.replica} hits its prefix cache for {ratio:.0%} of queried tokens while its peers of "
            f"{model} together hit {pooled:.0%}: requests sharing a prefix no longer reach it.",
            {"replica": row.replica, "hit_ratio": ratio, "peers_hit_ratio": pooled,
             "query_tokens": row.counters.get("prefix_queries"), "peers": len(warm) - 1},
            NEXT_CHECK["lost_prefix_affinity"]))
    return findings


def _pooled(rows: list[ReplicaRow]) -> float | None:
    queries = sum(row.counters.get("prefix_queries") or 0.0 for row in rows)
    hits = sum(row.counters.get("prefix_hits") or 0.0 for row in rows)
    return _pooled_ratio(queries, hits)


def _pooled_ratio(queries: float, hits: float) -> float | None:
    if queries <= 0 or hits > queries:
        return None
    return hits / queries


class _PeerPool:
    """_pooled of every row but one, for each row in turn, without summing
    the peers again for each (a fleet of n replicas would cost n * n): the
    whole pool's sums less the row's own. Exact, so the same float as
    summing the peers, where every count is a whole number and the sums stay
    below 2**53 (token counters always are); otherwise each row's peers are
    summed one by one as _pooled does."""

    def __init__(self, rows: list[ReplicaRow]):
        self.rows = rows
        self.queries = [row.counters.get("prefix_queries") or 0.0 for row in rows]
        self.hits = [row.counters.get("prefix_hits") or 0.0 for row in rows]
        self.exact = all(_whole(v) for v in self.queries) and all(_whole(v) for v in self.hits) \
            and sum(map(abs, self.queries)) < _EXACT and sum(map(abs, self.hits)) < _EXACT
        if self.exact:
            self.total_queries = sum(self.queries)
            self.total_hits = sum(self.hits)

    def without(self, index: int) -> float | None:
        if not self.exact:
            return _pooled(self.rows[:index] + self.rows[index + 1:])
        return _pooled_ratio(self.total_queries - self.queries[index], self.total_hits - self.hits[index])


_EXACT = 2.0 ** 53


def _whole(value) -> bool:
    return isinstance(value, int) or (isinstance(value, float) and value.is_integer())
