"""An engine that changes under kvwatch between polls: it restarts (counters
reset, `_created` moves, label sets change), it is upgraded (gpu_* names ->
current names, prefix cache in blocks -> tokens), its histogram bounds change.

kvwatch polls it over HTTP on loopback. What must hold: kvwatch stays up, the
change is recorded as an event, no windowed signal goes negative or spikes
(a reset counts the new value from zero, never the old total), and the
increases are exactly what one computes by hand from the pages.
"""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient

from fuzz.pages import Engine, page
from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from pageserver import Answer, PageServer
from test_reliability_faults import value


def run(pages: list[str]):
    """Poll each page once, in order; return the monitor, a client and the
    times kvwatch stamped on each successful poll."""
    with PageServer([Answer(p) for p in pages]) as server:
        settings = load_settings(overrides={"target": server.url, "poll_interval": "5s", "window": "10m"}, environ={})
        monitor = Monitor(settings)
        client = TestClient(create_app(monitor, settings))
        times = []
        for _ in pages:
            state = monitor.poll_once()
            if state.up:
                times.append(state.snapshot.time)
    return monitor, client, times


def assert_sane(state) -> None:
    """No derived signal is negative, not finite, or a ratio above one."""
    for row in state.per_engine + state.per_model:
        for name, found in row.values.items():
            numbers = found.values() if isinstance(found, dict) else [found]
            for number in numbers:
                if number is None:
                    continue
                assert math.isfinite(number) and number >= 0, (row.model, row.engine, name, number)
                if name.endswith("_ratio"):
                    assert number <= 1.0 + 1e-9, (row.model, row.engine, name, number)


def signals(state, model="m", engine="0"):
    return next(row.values for row in state.per_engine if (row.model, row.engine) == (model, engine))


def traffic(prompt, hits, queries, preemptions, finished, ttft, ttft_sum, created=None, **more):
    return Engine(prompt_tokens=prompt, generation_tokens=prompt / 2, prefix_hits=hits, prefix_queries=queries,
                  preemptions=preemptions, finished_stop=finished, ttft_cumulative=ttft, ttft_sum=ttft_sum,
                  created=created, **more)


def test_restart_resets_counters_and_moves_created():
    monitor, client, t = run([
        page(traffic(1000, 400, 1000, 10, 50, (5, 10, 20, 30, 40), 30.0, created=100.0)),
        page(traffic(1100, 450, 1100, 12, 55, (6, 12, 23, 34, 45), 34.0, created=100.0)),
        # restarted: everything fell, and _created moved
        page(traffic(30, 10, 20, 0, 2, (1, 1, 2, 2, 2), 1.0, created=200.0)),
        page(traffic(130, 60, 120, 1, 7, (2, 3, 5, 6, 7), 5.0, created=200.0)),
    ])
    state = monitor.state
    assert state.up and [e.kind for e in state.events] == ["restart"]
    assert_sane(state)
    v = signals(state)
    span = t[3] - t[0]
    # increases: 100 + 30 (the new value, from zero) + 100
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(230 / span)
    assert v["kvwatch_prefix_cache_hit_ratio"] == pytest.approx((50 + 10 + 50) / (100 + 20 + 100))
    assert v["kvwatch_preemptions_per_second"] == pytest.approx((2 + 0 + 1) / span)
    assert v["kvwatch_requests_finished_per_second"]["stop"] == pytest.approx((5 + 2 + 5) / span)
    assert v["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx((4 + 1 + 4) / (5 + 2 + 5))
    # The re-exported engine counters pass the reset through for Prometheus' rate().
    body = client.get("/metrics").text
    assert value(body, "kvwatch_engine_prompt_tokens_total", model_name="m", engine="0") == 130
    assert value(body, "kvwatch_prompt_tokens_per_second", model_name="m", engine="0") == pytest.approx(230 / span)


def test_restart_seen_by_the_process_start_when_counters_already_climbed_past():
    monitor, _, t = run([
        page(traffic(100, 40, 100, 1, 5, (1, 2, 3, 4, 5), 3.0, created=100.0), process_start=90.0),
        page(traffic(500, 200, 500, 4, 20, (4, 8, 12, 16, 20), 12.0, created=300.0), process_start=290.0),
    ])
    assert [e.kind for e in monitor.state.events] == ["restart"]
    assert_sane(monitor.state)
    v = signals(monitor.state)
    # From zero at the restart: the increase is the new value, not 500 - 100.
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(500 / (t[1] - t[0]))
    assert v["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx(12 / 20)


def test_restart_with_an_outage_in_between_loses_nothing_on_either_side():
    monitor, _, t = run([
        page(traffic(1000, 400, 1000, 10, 50, (5, 10, 20, 30, 40), 30.0, created=100.0)),
        page(traffic(1200, 500, 1200, 12, 60, (6, 12, 23, 34, 50), 40.0, created=100.0)),
        "restarting\n",  # the engine's proxy answers while it is down...
        "restarting\n",
        page(traffic(80, 30, 60, 1, 3, (1, 2, 3, 3, 3), 2.0, created=500.0)),  # ...and it is back, reset
    ])
    assert monitor.state.up and monitor.state.errors_by_reason == {"no_engine_metrics": 2}
    assert_sane(monitor.state)
    v = signals(monitor.state)
    assert len(t) == 3
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx((200 + 80) / (t[2] - t[0]))
    assert v["kvwatch_prefix_cache_hit_ratio"] == pytest.approx((100 + 30) / (200 + 60))


def test_label_sets_change_across_a_restart():
    """Restarted with data parallelism and a new served name: the old series
    vanish, the new ones have no increase until their second poll."""
    before = dict(created=100.0)
    after = dict(created=200.0)
    monitor, client, t = run([
        page(traffic(1000, 400, 1000, 10, 50, (5, 10, 20, 30, 40), 30.0, **before)),
        page(traffic(1100, 450, 1100, 12, 55, (6, 12, 23, 34, 45), 34.0, **before)),
        page(traffic(10, 5, 10, 0, 1, (1, 1, 1, 1, 1), 0.5, model="m2", engine="0", **after),
             traffic(20, 5, 20, 0, 2, (1, 2, 2, 2, 2), 1.0, model="m2", engine="1", **after)),
    ])
    state = monitor.state
    assert {(row.model, row.engine) for row in state.per_engine} == {("m2", "0"), ("m2", "1")}
    assert "models" in {e.kind for e in state.events}
    assert_sane(state)
    for engine in ("0", "1"):
        v = signals(state, "m2", engine)
        assert v["kvwatch_prompt_tokens_per_second"] is None  # one poll: no increase yet, not a spike
        assert v["kvwatch_prefix_cache_hit_ratio"] is None
    body = client.get("/metrics").text
    assert value(body, "kvwatch_engine_prompt_tokens_total", model_name="m", engine="0") is None
    assert value(body, "kvwatch_engine_prompt_tokens_total", model_name="m2", engine="1") == 20

    monitor, client, t = run([
        page(traffic(1100, 450, 1100, 12, 55, (6, 12, 23, 34, 45), 34.0, **before)),
        page(traffic(10, 5, 10, 0, 1, (1, 1, 1, 1, 1), 0.5, model="m2", engine="0", **after),
             traffic(20, 5, 20, 0, 2, (1, 2, 2, 2, 2), 1.0, model="m2", engine="1", **after)),
        page(traffic(60, 25, 60, 0, 3, (2, 3, 3, 3, 3), 1.5, model="m2", engine="0", **after),
             traffic(120, 45, 100, 0, 6, (3, 5, 6, 6, 6), 3.0, model="m2", engine="1", **after)),
    ])
    assert_sane(monitor.state)
    step = t[2] - t[1]
    assert signals(monitor.state, "m2", "0")["kvwatch_prompt_tokens_per_second"] == pytest.approx(50 / step)
    assert signals(monitor.state, "m2", "1")["kvwatch_prompt_tokens_per_second"] == pytest.approx(100 / step)
    model = next(row.values for row in monitor.state.per_model if row.model == "m2")
    assert model["kvwatch_prompt_tokens_per_second"] == pytest.approx(150 / step)
    assert model["kvwatch_prefix_cache_hit_ratio"] == pytest.approx((20 + 40) / (50 + 80))


@pytest.mark.parametrize("upgraded", [
    # (prompt, hits, queries) after the upgrade: already past the old values
    # (no _created in multiprocess mode, so only the names tell), or reset.
    (1300, 3300, 4200),
    (40, 16, 32),
], ids=["counters-past-old", "counters-reset"])
def test_upgrade_renames_families_and_switches_prefix_cache_units(upgraded):
    """vLLM before 0.9 counts the prefix cache in blocks under gpu_* names;
    after the upgrade it counts tokens under new names. A step across the
    upgrade compares blocks with tokens: it must count nothing, not a spike."""
    prompt, hits, queries = upgraded
    monitor, client, t = run([
        page(traffic(1000, 40, 100, 10, 50, (5, 10, 20, 30, 40), 30.0, usage=0.5), names="old"),
        page(traffic(1100, 50, 110, 12, 55, (6, 12, 23, 34, 45), 34.0, usage=0.6), names="old"),
        page(traffic(prompt, hits, queries, 12, 55, (6, 12, 23, 34, 45), 34.0, usage=0.2), names="new"),
        page(traffic(prompt + 1600, hits + 800, queries + 1600, 12, 60, (7, 14, 26, 38, 50), 38.0, usage=0.3), names="new"),
    ])
    state = monitor.state
    assert state.up
    assert "restart" in {e.kind for e in state.events}
    assert state.snapshot.sources["kv_usage"] == "kv_cache_usage_perc"
    assert state.snapshot.sources["prefix_queries"] == "prefix_cache_queries"
    assert_sane(state)
    v = signals(state)
    counted = (t[1] - t[0]) + (t[3] - t[2])  # the step across the upgrade counts no time either
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx((100 + 1600) / counted)
    # blocks before (10 of 10 hit), tokens after (800 of 1600): never blocks minus tokens
    assert v["kvwatch_prefix_cache_hit_ratio"] == pytest.approx((10 + 800) / (10 + 1600))
    assert v["kvwatch_kv_cache_usage_ratio"] == pytest.approx(0.3)
    assert v["kvwatch_kv_cache_usage_max_ratio"] == pytest.approx(0.6)  # the gauge is the same across names
    body = client.get("/metrics").text
    assert value(body, "kvwatch_engine_prefix_cache_queries_total", model_name="m", engine="0") == queries + 1600


def test_histogram_bounds_change_on_restart():
    """vLLM 0.32+ lets an operator change bucket bounds; across the restart
    the old and new buckets are not comparable and the newer ones win."""
    old_bounds = (0.1, 0.5, 1.0, 5.0)
    new_bounds = (0.25, 2.5, 10.0, 60.0)
    monitor, client, _ = run([
        page(traffic(100, 0, 0, 0, 10, (2, 5, 8, 10, 10), 4.0, created=1.0, ttft_bounds=old_bounds)),
        page(traffic(200, 0, 0, 0, 20, (4, 10, 16, 20, 20), 8.0, created=1.0, ttft_bounds=old_bounds)),
        page(traffic(50, 0, 0, 0, 5, (1, 3, 5, 5, 5), 6.0, created=2.0, ttft_bounds=new_bounds)),
        page(traffic(150, 0, 0, 0, 15, (2, 8, 14, 15, 15), 20.0, created=2.0, ttft_bounds=new_bounds)),
    ])
    assert_sane(monitor.state)
    v = signals(monitor.state)
    # Only the new buckets: 5 (new value at the restart) + 10 observations.
    assert v["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx(20 / 15)
    p50 = v["kvwatch_time_to_first_token_seconds"]["0.5"]
    assert 0.25 <= p50 <= 2.5  # rank 7.5 of 15 falls in the new (0.25, 2.5] bucket
    body = client.get("/metrics").text
    assert value(body, "kvwatch_engine_time_to_first_token_seconds_bucket", model_name="m", engine="0", le="2.5") == 8
    assert value(body, "kvwatch_engine_time_to_first_token_seconds_bucket", model_name="m", engine="0", le="0.5") is None


def test_wall_clock_stepping_back_an_hour_changes_no_rate(monkeypatch):
    """An NTP step or a resumed VM: the wall clock goes back an hour between
    polls. The window runs on a monotonic clock, so rates and the window's
    span carry on; only the displayed times step back."""
    import time as time_module

    pages = [page(traffic(1000 + 2640 * i, 400 + 1000 * i, 1000 + 2640 * i, 10, 50, (5, 10, 20, 30, 40), 30.0,
                          created=100.0)) for i in range(4)]
    real_time = time_module.time
    with PageServer([Answer(p) for p in pages]) as server:
        settings = load_settings(overrides={"target": server.url, "poll_interval": "5s", "window": "10m"}, environ={})
        monitor = Monitor(settings)
        client = TestClient(create_app(monitor, settings))
        assert monitor.poll_once().up and monitor.poll_once().up
        monkeypatch.setattr(time_module, "time", lambda: real_time() - 3600)
        assert monitor.poll_once().up and monitor.poll_once().up
    state = monitor.state
    entries = list(monitor.window.entries)
    assert len(entries) == 4
    span = entries[-1].snapshot.time - entries[0].snapshot.time
    assert 0 < state.window_seconds == pytest.approx(span)
    assert signals(state)["kvwatch_prompt_tokens_per_second"] == pytest.approx(3 * 2640 / span)
    body = client.get("/metrics").text
    assert value(body, "kvwatch_window_seconds") > 0
    assert value(body, "kvwatch_prompt_tokens_per_second", model_name="m", engine="0") == pytest.approx(3 * 2640 / span)
    assert client.get("/readyz").status_code == 200


def test_a_folded_replica_going_away_is_not_a_reset_of_the_sum():
    """Two Ray replicas of one engine (a WorkerId label, folded by summing):
    replica b disappears, then a restarts (its own counters fall). The sum's
    increase is the replicas' own increases, never a lifetime total, and the
    re-exported summed counter never drops (Prometheus' rate() would spike)."""
    def replicas(*counts):
        return page(*(traffic(prompt, prompt // 4, prompt, 0, prompt // 100, (0, 0, 0, 0, prompt // 100),
                              prompt / 1000, extra_labels={"WorkerId": worker})
                      for worker, prompt in counts))
    monitor, client, t = run([
        replicas(("a", 50_000), ("b", 30_000)),
        replicas(("a", 50_100), ("b", 30_100)),  # +200
        replicas(("a", 50_200)),                  # +100 (b gone)
        replicas(("a", 300)),                     # a restarted: +300
        replicas(("a", 400)),                     # +100
    ])
    state = monitor.state
    assert_sane(state)
    assert not [e for e in state.events if e.kind == "restart"]
    v = signals(state)
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(700 / (t[-1] - t[0]))
    body = client.get("/metrics").text
    # 80,000 + 700: the sum carried on from what every replica had counted.
    assert value(body, "kvwatch_engine_prompt_tokens_total", model_name="m", engine="0") == 80_700
    assert not [f for f in state.findings if f.severity == "critical"]
