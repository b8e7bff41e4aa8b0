"""`kvwatch diagnose --prometheus` against a real Prometheus: a fleet of
simulated vLLM replicas, their pages backfilled into its TSDB with promtool
(ten minutes of 15 s scrapes, so nothing waits on a clock), read back through
the query API and diagnosed with the sidecar's pipeline plus the fleet rules.

Four models of four replicas each: one exhausted while three idle
(imbalance), one whose prefix routing is lost (lost_prefix_affinity), one
restarted half-way (cold_replica), and a balanced one that raises no fleet
finding."""

from __future__ import annotations

import json
import time

import pytest

from kvwatch.cli import main
from kvwatch.diagnose import DEFAULT_THRESHOLDS
from kvwatch.history.matrix import pairs_of
from kvwatch.history.query import PrometheusClient
from kvwatch.history.run import diagnose_history
from kvwatch.sim.scenario import parse_scenario
from promstack import backfilled_prometheus
from sim_support import Replica, fleet_openmetrics

DURATION, INTERVAL, WINDOW = 600, 15, 120
ENGINE = {"num_gpu_blocks": 1024, "block_size": 16, "max_num_seqs": 32, "max_model_len": 4096}
SHARED = {"rate": 2.0, "prompt_tokens": {"dist": "lognormal", "mean": 150, "sigma": 0.5, "min": 8, "max": 1500},
          "output_tokens": {"dist": "lognormal", "mean": 60, "sigma": 0.5, "min": 4, "max": 400},
          "max_tokens": 512, "prefix": {"share": 0.9, "tokens": 1024, "count": 2, "version": 1}}


def scenario(name: str, engine: dict, workload: dict):
    return parse_scenario({"name": name, "engine": engine, "workload": workload,
                           "phases": [{"name": "steady", "duration": "1h"}]}, name)


HEALTHY = scenario("healthy", ENGINE, SHARED)
NO_AFFINITY = scenario("no-affinity", ENGINE, {**SHARED, "prefix": {"share": 0.0, "tokens": 1024, "count": 2,
                                                                      "version": 1}})
IDLE = scenario("idle", ENGINE, {**SHARED, "rate": 0.1, "prefix": {"share": 0.0, "tokens": 16, "count": 1,
                                                                    "version": 1}})
OVERLOADED = scenario("overloaded", {"num_gpu_blocks": 512, "block_size": 16, "max_num_seqs": 32,
                                     "max_model_len": 4096},
                      {"rate": 0.7, "prompt_tokens": {"dist": "uniform", "min": 600, "max": 1400},
                       "output_tokens": {"dist": "uniform", "min": 500, "max": 1000}, "max_tokens": 900})


def fleet() -> list[Replica]:
    replicas = [Replica("10.0.1.1:8000", "imbalanced", OVERLOADED, 1)]
    replicas += [Replica(f"10.0.1.{i}:8000", "imbalanced", IDLE, i) for i in (2, 3, 4)]
    replicas += [Replica(f"10.0.2.{i}:8000", "affinity", HEALTHY, 10 + i) for i in (1, 2, 3)]
    replicas += [Replica("10.0.2.4:8000", "affinity", NO_AFFINITY, 14)]
    replicas += [Replica(f"10.0.3.{i}:8000", "restart", HEALTHY, 20 + i) for i in (1, 2, 3)]
    replicas += [Replica("10.0.3.4:8000", "restart", HEALTHY, 24, restarts=(300.0,))]
    replicas += [Replica(f"10.0.4.{i}:8000", "balanced", HEALTHY, 30 + i) for i in (1, 2, 3, 4)]
    return replicas


@pytest.fixture(scope="module")
def store():
    # Whole hours in the past, so the blocks are complete and the range is fixed.
    start = float((int(time.time()) // 3600 - 3) * 3600)
    with backfilled_prometheus(fleet_openmetrics(fleet(), start, DURATION, INTERVAL)) as prom:
        yield prom, start


def _fleet(history, model: str) -> set[tuple[str, str]]:
    return {(e.cause, e.replica) for e in history.timeline.episodes if e.symptom == "fleet" and e.model == model}


def test_the_three_fleet_findings_and_none_on_a_balanced_fleet(store):
    prom, start = store
    history = diagnose_history(PrometheusClient(prom.url), start, start + DURATION, INTERVAL, window=WINDOW)
    assert history.source == "vllm"
    assert len(history.replicas) == 16
    assert _fleet(history, "imbalanced") == {("imbalance", "vllm/10.0.1.1:8000")}
    assert _fleet(history, "affinity") == {("lost_prefix_affinity", "vllm/10.0.2.4:8000")}
    assert _fleet(history, "restart") == {("cold_replica", "vllm/10.0.3.4:8000")}
    assert _fleet(history, "balanced") == set()
    cold = next(e for e in history.timeline.episodes if e.cause == "cold_replica")
    # Found from the step of the restart for one window, then held for the
    # finding hold as every finding is (within one step).
    hold = DEFAULT_THRESHOLDS.finding_hold_seconds
    assert abs(cold.start - (start + 300)) <= INTERVAL
    assert abs(cold.end - (start + 300 + WINDOW + hold)) <= INTERVAL
    lost = next(e for e in history.timeline.episodes if e.cause == "lost_prefix_affinity")
    assert lost.worst["evidence"]["hit_ratio"] < 0.5 * lost.worst["evidence"]["peers_hit_ratio"]
    # The cost is counted: every query, and every sample read back.
    assert history.cost["queries"] >= 10 and history.cost["samples"] > 16 * (DURATION // INTERVAL)


def test_chunked_reads_give_the_same_timeline(store):
    """A sample budget small enough to split the range into many queries
    changes the cost, never the findings."""
    prom, start = store
    whole = diagnose_history(PrometheusClient(prom.url), start, start + DURATION, INTERVAL, window=WINDOW)
    small = PrometheusClient(prom.url, max_samples=20_000, concurrency=2)
    chunked = diagnose_history(small, start, start + DURATION, INTERVAL, window=WINDOW)
    assert chunked.cost["queries"] > 3 * whole.cost["queries"]
    assert chunked.timeline.outline(INTERVAL) == whole.timeline.outline(INTERVAL)


def test_snapshots_from_query_results_give_the_timeline_of_written_pages(store):
    """Building each step's Snapshot from the query results (the default)
    and writing each page's text for the adapter to parse give the same
    findings, episode for episode, and the same trends."""
    prom, start = store
    fast = diagnose_history(PrometheusClient(prom.url), start, start + DURATION, INTERVAL, window=WINDOW)
    text = diagnose_history(PrometheusClient(prom.url), start, start + DURATION, INTERVAL, window=WINDOW,
                            pages_as_text=True)
    assert fast.timeline.outline(INTERVAL) == text.timeline.outline(INTERVAL)
    assert fast.timeline.episodes == text.timeline.episodes
    assert {n: r.trend for n, r in fast.replicas.items()} == {n: r.trend for n, r in text.replicas.items()}
    assert len(fast.timeline.episodes) >= 3


def test_worker_processes_give_the_diagnosis_of_one_process(store):
    """Replicas diagnosed in worker processes, each keeping its replicas'
    adapter and window from one chunk of steps to the next, give the
    timeline, gaps, trends and replica states of one process."""
    prom, start = store
    one = diagnose_history(PrometheusClient(prom.url, max_samples=20_000), start, start + DURATION, INTERVAL,
                           window=WINDOW)
    many = diagnose_history(PrometheusClient(prom.url, max_samples=20_000), start, start + DURATION, INTERVAL,
                            window=WINDOW, workers=3)
    assert many.cost["queries"] == one.cost["queries"] > 30  # several chunks of steps
    assert len(one.timeline.episodes) >= 3
    assert many.timeline.episodes == one.timeline.episodes
    assert many.timeline.gaps == one.timeline.gaps
    assert list(many.replicas) == list(one.replicas)
    for name, state in one.replicas.items():
        other = many.replicas[name]
        assert (other.labels, other.models, other.steps, other.trend, other.restarted_at) == \
            (state.labels, state.models, state.steps, state.trend, state.restarted_at)
        assert list(other.events) == list(state.events)
        assert [entry.snapshot for entry in other.window.entries] == [entry.snapshot for entry in state.window.entries]


def test_the_command_prints_json_and_writes_an_html_report(store, tmp_path, capsys):
    prom, start = store
    report = tmp_path / "report.html"
    code = main(["diagnose", "--prometheus", prom.url, "--from", str(start), "--to", str(start + DURATION),
                 "--step", "15s", "--window", "2m", "--selector", '{job="vllm"}', "--json", "--html", str(report)])
    out = json.loads(capsys.readouterr().out)
    assert code == 1  # imbalance and lost affinity are warnings
    assert out["source"] == "vllm" and out["step_seconds"] == 15
    causes = {(f["cause"], f["model_name"]) for f in out["findings"] if f["symptom"] == "fleet"}
    assert causes == {("imbalance", "imbalanced"), ("lost_prefix_affinity", "affinity"),
                      ("cold_replica", "restart")}
    assert set(out["cost"]) >= {"queries", "samples", "seconds"}
    assert len(out["replicas"]) == 16
    html = report.read_text()
    assert "<svg" in html and "lost_prefix_affinity" in html and "10.0.2.4:8000" in html
    # Self-contained: no script, no stylesheet or image fetched from elsewhere.
    assert "<script" not in html and "src=" not in html and "<link" not in html


def test_a_query_split_into_time_chunks_reads_each_series_whole(store):
    """read_ranges joins one query's time chunks back per series, in time
    order: the values of a read split into many chunks are those of one read."""
    prom, start = store
    query = [('{__name__="vllm:num_requests_running"}', 16)]
    (whole,) = PrometheusClient(prom.url).read_ranges(query, start, start + DURATION, INTERVAL)
    split = PrometheusClient(prom.url, max_samples=16 * 7, concurrency=2)
    (pieces,) = split.read_ranges(query, start, start + DURATION, INTERVAL)
    assert split.cost.queries >= DURATION // INTERVAL // 7
    by_labels = {tuple(sorted(s["metric"].items())): pairs_of(s["values"]) for s in whole}
    assert len(by_labels) >= 2 and all(len(v) > 7 for v in by_labels.values())
    assert {tuple(sorted(s["metric"].items())): pairs_of(s["values"]) for s in pieces} == by_labels


def test_replica_after_replica_gives_the_timeline_of_step_after_step(store):
    """History diagnoses a chunk one replica after another (_diagnose_chunk,
    for the CPU's caches); central mode, a few steps at a time, every replica
    at one step (diagnose_step). The replicas' states are their own, so both
    orders give the same timeline."""
    from kvwatch.diagnose.timeline import Timeline
    from kvwatch.history.pages import Pages, family_query
    from kvwatch.history.run import diagnose_step, discover

    prom, start = store
    client = PrometheusClient(prom.url)
    history = diagnose_history(client, start, start + DURATION, INTERVAL, window=WINDOW)
    source, families, counts, inner = discover(client, "", start, start + DURATION, "auto", diagnosed_only=True)
    points = DURATION // INTERVAL + 1
    pages = Pages(start, INTERVAL, points, source)
    queries = [(family_query(f, names, inner), counts[f]) for f, names in sorted(families.items())]
    for result in client.read_ranges(queries, start, start + DURATION, INTERVAL):
        pages.add(result)
    ordered, states, timeline, holds = sorted(pages.replicas.items()), {}, Timeline(), {}
    for index in range(points):
        diagnose_step(start + index * INTERVAL, index, ordered, states, timeline, WINDOW, None, INTERVAL, holds)
    timeline.finish()
    assert len(history.timeline.episodes) >= 3
    assert timeline.episodes == history.timeline.episodes and timeline.gaps == history.timeline.gaps


def test_workers_fork_beside_the_deadlines_thread_and_spawn_beside_any_other():
    """A process that fetched before (the deadlines' thread waiting) still
    forks its workers (spawned, each would import kvwatch again); beside a
    thread of anyone else's it spawns them."""
    import threading

    from kvwatch.history.run import _Workers
    from kvwatch.scrape import _DEADLINES, _Watchdog

    with _Watchdog(5.0):  # what a fetch does: the deadlines' thread starts
        pass
    assert _DEADLINES._thread is not None and _DEADLINES._thread.is_alive()
    pool = _Workers(2, 300.0, None, True)
    try:
        assert pool.method == "fork"
    finally:
        pool.close()
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, daemon=True)
    other.start()
    try:
        pool = _Workers(1, 300.0, None, True)
        try:
            assert pool.method == "spawn"
        finally:
            pool.close()
    finally:
        stop.set()
        other.join()
