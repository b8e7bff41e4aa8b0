"""Sharded central mode (`kvwatch serve --prometheus URL --shard k/N`):
rendezvous hashing spreads replicas evenly and moves only the new shard's
share when N grows; `--shard` and `ordinal/N` parse or fail in one sentence;
and against a real Prometheus over backfilled replicas, N shards each read
only their own replicas (the selector is in their queries), and the union
of their findings and of their exported series is one unsharded instance's
at every refresh; and two shards' exports, stored in a real Prometheus, give
the generated fleet records and VllmFleetReplicaOutlier alerts exactly one
unsharded instance's figures."""

from __future__ import annotations

import re
import time
from collections import Counter

import pytest
import yaml

from kvwatch.central.refresh import Central
from kvwatch.history.query import PrometheusClient
from kvwatch.history.shard import (MAX_SHARD_MATCHER_BYTES, Shard, ShardError, identity, owner, parse_shard,
                                   shard_matcher)
from kvwatch.central.app import CentralCollector, create_central_app
from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.mixin.config import config_from_mapping
from kvwatch.settings import load_settings
from promstack import backfilled_prometheus, query_range
from sim_support import fleet_openmetrics
from test_history_prometheus import fleet

LABELS = ("job", "instance", "namespace", "pod")
DURATION, STEP, WINDOW = 480, 15, 120


def identities(count: int) -> list[str]:
    return [identity(LABELS, ("vllm", f"10.1.{i // 250}.{i % 250}:8000", "llm", f"vllm-{i:05d}"))
            for i in range(count)]


def test_replicas_spread_evenly_and_growing_by_one_shard_moves_only_its_share():
    names = identities(8000)
    for count in (2, 4, 7):
        shares = Counter(owner(name, count) for name in names)
        assert set(shares) == set(range(count))
        # Each shard within 10% of an even share (binomial spread at 8,000
        # replicas is under 2%: a biased hash would not pass).
        assert all(abs(n - len(names) / count) < 0.1 * len(names) / count for n in shares.values()), shares
    for count in (1, 3, 4, 9):
        before = {name: owner(name, count) for name in names}
        after = {name: owner(name, count + 1) for name in names}
        moved = [name for name in names if before[name] != after[name]]
        # Only to the new shard, and about 1/(N+1) of them (a modulo hash
        # would move about N/(N+1)).
        assert all(after[name] == count for name in moved)
        assert abs(len(moved) / len(names) - 1 / (count + 1)) < 0.02, (count, len(moved))
        # And back: shrinking moves only the removed shard's replicas.
        assert all(before[name] == after[name] for name in names if after[name] != count)


def test_identity_is_the_labels_whatever_their_order_and_a_shard_owns_exactly_its_replicas():
    key = ("vllm", "10.0.0.1:8000", "llm", "")
    assert identity(LABELS, key) == identity(tuple(reversed(LABELS)), tuple(reversed(key)))
    assert identity(LABELS, key) != identity(LABELS, ("vllm", "10.0.0.2:8000", "llm", ""))
    names = identities(500)
    for name in names:
        assert [Shard(k, 5).owns(name) for k in range(5)].count(True) == 1


def test_shard_flag_and_the_statefulset_ordinal():
    assert parse_shard("2/4") == Shard(2, 4)
    assert parse_shard(None) is None and parse_shard("") is None and parse_shard("0/1") is None
    assert parse_shard("ordinal/4", {"POD_NAME": "kvwatch-central-3"}) == Shard(3, 4)
    assert parse_shard("ordinal/4", {"HOSTNAME": "kvwatch-central-1"}) == Shard(1, 4)
    for text, environ, said in (("4/4", {}, "shard 4 of 4 does not exist"), ("a/4", {}, "expected k/N"),
                                ("1/0", {}, "must be 1 to"), ("3", {}, "expected k/N"),
                                ("ordinal/4", {"HOSTNAME": "central"}, "does not end in -<ordinal>"),
                                ("ordinal/4", {}, "neither POD_NAME nor HOSTNAME")):
        with pytest.raises(ShardError, match=said):
            parse_shard(text, environ)


def test_the_shard_matcher_names_the_label_that_tells_replicas_apart_escaped():
    keys = [("vllm", "10.0.0.1:8000", "llm", ""), ("vllm", "10.0.0.2:8000", "llm", "")]
    assert shard_matcher(LABELS, keys) == r'instance=~"10\\.0\\.0\\.1:8000|10\\.0\\.0\\.2:8000"'
    pods = [("vllm", "", "llm", f"vllm-{i}") for i in range(3)] + [("vllm", "", "llm", 'a"b')]
    assert shard_matcher(LABELS, pods) == r'pod=~"a\"b|vllm\\-0|vllm\\-1|vllm\\-2"'
    many = [("vllm", f"10.0.{i // 250}.{i % 250}:8000", "", "") for i in range(2000)]
    assert shard_matcher(LABELS, many) == ""  # past MAX_SHARD_MATCHER_BYTES: the reader filters
    assert len(shard_matcher(LABELS, many[:100])) < MAX_SHARD_MATCHER_BYTES


# ----------------------------------------------------------------- a real store


class Recording(PrometheusClient):
    """The client, keeping each query's text (what the store was asked)."""

    def __init__(self, url: str):
        super().__init__(url, timeout=10)
        self.queries: list[str] = []

    def query_range(self, query, start, end, step):
        self.queries.append(query)
        return super().query_range(query, start, end, step)


@pytest.fixture(scope="module")
def store():
    start = float((int(time.time()) // 3600 - 3) * 3600)
    with backfilled_prometheus(fleet_openmetrics(fleet(), start, DURATION, STEP)) as prom:
        yield prom, start


def replica_samples(central) -> set:
    """The replicas' series as /metrics exports them (the store's fleet
    rules read these), without central mode's own health and process."""
    return {(s.name, tuple(sorted(s.labels.items())), s.value)
            for family in CentralCollector(central).collect() if not family.name.startswith("kvwatch_central_")
            for s in family.samples}


def test_shards_read_their_own_replicas_and_together_give_the_unsharded_findings(store):
    prom, start = store
    settings = load_settings(overrides={"poll_interval": f"{STEP}s", "window": f"{WINDOW}s"}, environ={})
    now = [start]
    whole = Central(Recording(prom.url), settings, '{job="vllm"}', clock=lambda: now[0])
    count = 3
    shards = [Central(Recording(prom.url), settings, '{job="vllm"}', clock=lambda: now[0], shard=Shard(k, count))
              for k in range(count)]
    refreshes = 0
    while now[0] <= start + DURATION:
        expected = whole.refresh_once()
        parts = [shard.refresh_once() for shard in shards]
        assert expected.up and all(part.up for part in parts)
        names = [set(part.replicas) for part in parts]
        assert set().union(*names) == set(expected.replicas) and sum(map(len, names)) == len(expected.replicas)
        for part in parts:
            for name, view in part.replicas.items():
                mine = expected.replicas[name].state
                assert view.state.up == mine.up
                assert [(f.cause, f.severity, f.summary) for f in view.state.findings] == \
                       [(f.cause, f.severity, f.summary) for f in mine.findings]
            assert part.fleet == () and part.shard is not None and part.store_replicas == 16
        assert set().union(*(replica_samples(shard) for shard in shards)) == replica_samples(whole)
        refreshes += 1
        now[0] += STEP
    assert refreshes == DURATION // STEP + 1
    assert len(whole.state.replicas) == 16 and all(len(s.state.replicas) < 16 for s in shards)
    # The run had findings to compare, fleet ones among the unsharded's.
    assert any(v.state.findings for v in whole.state.replicas.values()) and whole.state.fleet

    # Each shard's range queries select its replicas in the store: what it
    # read holds only its own series, and the shards read no more together
    # than one instance reading everything.
    for shard, part in zip(shards, (s.state for s in shards)):
        assert all('instance=~"' in query for query in shard.client.queries)
        assert part.cost["series_read"] < whole.state.cost["series_read"]
    assert whole.client.queries and not any("instance=~" in query for query in whole.client.queries)

    # The page and the JSON say which shard and where the fleet's findings are.
    from fastapi.testclient import TestClient

    with TestClient(create_central_app(shards[0], settings)) as http:
        body = http.get("/api/v1/diagnosis").json()
        assert body["shard"] == f"0/{count}" and body["store_replicas"] == 16 and body["fleet"] == []
        assert "VllmFleetReplicaOutlier" in http.get("/").text
        assert http.get("/readyz").status_code == 200


def test_a_shard_owning_no_replica_is_ready_and_says_so(store):
    prom, start = store
    settings = load_settings(overrides={"poll_interval": f"{STEP}s", "window": f"{WINDOW}s"}, environ={})
    names = [identity(LABELS, ("vllm", replica.instance, "", "")) for replica in fleet()]
    count = 40  # more shards than replicas: some own none
    empty = next(k for k in range(count) if all(owner(name, count) != k for name in names))
    central = Central(PrometheusClient(prom.url, timeout=10), settings, '{job="vllm"}',
                      clock=lambda: start + 240, shard=Shard(empty, count))
    state = central.refresh_once()
    assert state.up and state.replicas == {} and state.store_replicas == 16
    ready, text = central.ready()
    assert ready and f"shard {empty}/{count} owns none of the 16 replicas" in text


# ----------------------------------------------------------------- the store's fleet rules over the shards


def _openmetrics_of(exports: list[tuple[float, set]]) -> str:
    """Central mode's exported replica samples at each refresh, as the store
    scraping them (honorLabels: the replica's own labels) would hold them."""
    def text(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    series: dict[tuple, list[str]] = {}
    for at, samples in exports:
        for name, labels, value in samples:
            rendered = ",".join(f'{key}="{text(val)}"' for key, val in labels)
            number = "NaN" if value != value else ("+Inf" if value == float("inf") else
                                                   "-Inf" if value == float("-inf") else repr(float(value)))
            series.setdefault((name, labels), []).append(f"{name}{{{rendered}}} {number} {at:.3f}")
    return "\n".join(line for key in sorted(series) for line in series[key]) + "\n# EOF\n"


def _fleet_queries() -> dict[str, str]:
    """The generated rules that make the fleet's figures and alert, for a
    central mode whose series carry the engines' job (mode: central, its
    --selector {job="vllm"}: the rules select its matchers): the fleet group's
    records, and each VllmFleetReplicaOutlier alert with the records it reads
    written out (a backfilled store evaluates no rules over its past; the
    expressions are the rules' own)."""
    central = config_from_mapping({"mode": "central", "deploy": {"central_selector": '{job="vllm"}'}})
    groups = yaml.safe_load(render_all(central)[RULES_FILE])["groups"]
    records = {rule["record"]: rule["expr"] for group in groups for rule in group["rules"] if "record" in rule}
    record_name = re.compile(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+\b")

    def written_out(expr: str) -> str:
        return record_name.sub(lambda m: f"({written_out(records[m[0]])})" if m[0] in records else m[0], expr)

    queries = {}
    for group in groups:
        for rule in group["rules"]:
            if group["name"] == "kvwatch-fleet.rules":
                queries[rule["record"]] = rule["expr"]
            elif rule.get("alert") == "VllmFleetReplicaOutlier":
                queries[f"VllmFleetReplicaOutlier/{rule['labels']['cause']}"] = written_out(rule["expr"])
    assert len(queries) == 6 and all('job="vllm"' in q and "kvwatch_engine_" in q for q in queries.values())
    assert not {name for q in queries.values() for name in record_name.findall(q) if name in records}
    return queries


def test_the_stores_fleet_rules_over_two_shards_exports_are_one_instances(store):
    """Fleet findings over shards, end to end: what two shards export, stored
    as a Prometheus scraping them stores it, gives the generated fleet
    records and the VllmFleetReplicaOutlier alerts exactly the figures one
    unsharded instance's exports give, at every step, in a real Prometheus."""
    prom, start = store
    settings = load_settings(overrides={"poll_interval": f"{STEP}s", "window": f"{WINDOW}s"}, environ={})
    now = [start]
    whole = Central(PrometheusClient(prom.url, timeout=10), settings, '{job="vllm"}', clock=lambda: now[0])
    shards = [Central(PrometheusClient(prom.url, timeout=10), settings, '{job="vllm"}', clock=lambda: now[0],
                      shard=Shard(k, 2)) for k in range(2)]
    one, two, alone = [], [], []
    while now[0] <= start + DURATION:
        whole.refresh_once()
        for shard in shards:
            shard.refresh_once()
        parts = [replica_samples(shard) for shard in shards]
        # Each series from one shard only: two targets never write the same series.
        assert all(parts) and not ({(name, labels) for name, labels, _ in parts[0]} & {(name, labels) for name, labels, _ in parts[1]})
        one.append((now[0], replica_samples(whole)))
        two.append((now[0], parts[0] | parts[1]))
        alone.append((now[0], parts[0]))
        now[0] += STEP

    queries = _fleet_queries()
    first, last = start + WINDOW, start + DURATION
    with backfilled_prometheus(_openmetrics_of(one)) as unsharded, \
            backfilled_prometheus(_openmetrics_of(two)) as sharded, \
            backfilled_prometheus(_openmetrics_of(alone)) as one_shard:
        fired, differs = set(), set()
        for name, expr in queries.items():
            figures = []
            for store_ in (unsharded, sharded, one_shard):
                result = query_range(store_.url, expr, first, last, step=STEP)
                figures.append({tuple(sorted(r["metric"].items())): r["values"] for r in result})
            assert figures[0] == figures[1], name
            if figures[0]:
                fired.add(name)
            if figures[2] != figures[0]:
                differs.add(name)
        # The comparison sees a difference: one shard alone is not the fleet.
        assert differs, "one shard's exports gave the whole fleet's figures"
        # Not vacuous: the fleet's three findings fire, and the fleet counts are there.
        assert {"VllmFleetReplicaOutlier/imbalance", "VllmFleetReplicaOutlier/lost_prefix_affinity",
                "VllmFleetReplicaOutlier/cold_replica"} <= fired, fired
        assert "model_name:kvwatch_fleet_replicas_pressed:count5m" in fired, fired
