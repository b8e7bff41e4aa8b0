"""Stuck, busy and exhausted told apart.

- stuck: requests or KV blocks held, nothing moving, no token counted for
  `stuck_seconds` (the simulator's `stuck` scenario wedges its engine; a real
  idle vLLM 0.32 page with its usage set above 0 holds KV with nothing to do);
- busy: /metrics answers late, or not within the deadline, while requests run
  or wait (real vLLM 0.32 pages served late over HTTP): not unreachable;
- exhausted: a full cache that serves (the simulator's `exhaustion` scenario).
"""

from __future__ import annotations

import re

import pytest
from page_support import Pages, with_value

from kvwatch.sidecar.collector import make_registry
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sidecar.report import signals_json
from kvwatch.settings import load_settings
from pageserver import Answer, PageServer
from sim_support import sim_monitor


def symptoms(states) -> set[tuple[str, str]]:
    return {(f.symptom, f.cause) for state in states for f in state.findings}


def exported(monitor) -> dict[str, float]:
    return {s.name: s.value for family in make_registry(monitor).collect() for s in family.samples if not s.labels}


# --- stuck, on simulated pages --------------------------------------------


def test_a_wedged_engine_is_stuck_not_exhausted_nor_busy():
    states = []
    # 2 minutes of service, then the engine stops stepping; polled every 5 s.
    sim_monitor("stuck", until=420, on_state=states.append)
    serving = [s for s in states if s.snapshot.time - states[0].snapshot.time < 120]
    assert len(serving) >= 20 and not any(symptom == "stuck" for symptom, _ in symptoms(serving))
    last = states[-1]
    stuck = [f for f in last.findings if f.symptom == "stuck"]
    assert [f.cause for f in stuck] == ["requests_stalled"]
    evidence = stuck[0].evidence
    assert evidence["running"] > 0 and evidence["tokens_counted"] == 0
    assert evidence["stuck_seconds"] >= 180  # diagnosis.stuck_seconds, the default
    assert stuck[0].severity == "critical"
    # Its frozen, busy cache is no exhaustion, and its page answered on time: not busy.
    assert not any(f.symptom in ("exhaustion", "slow_first_token") for f in last.findings)
    assert all(state.busy is None for state in states)
    # The first poll that could see 180 s of stillness after the wedge (at 120 s) names it, not before.
    first = next(i for i, s in enumerate(states) if any(f.symptom == "stuck" for f in s.findings))
    wedged_for = states[first].snapshot.time - (states[0].snapshot.time - 5 + 120)
    assert 180 <= wedged_for <= 180 + 2 * 5


def test_a_full_cache_that_serves_is_exhausted_not_stuck():
    states = []
    sim_monitor("exhaustion", until=240, on_state=states.append)
    found = symptoms(states)
    assert any(symptom == "exhaustion" for symptom, _ in found)
    assert not any(symptom == "stuck" for symptom, _ in found)
    assert all(state.busy is None for state in states)


def test_a_stricter_stuck_time_is_read_from_the_thresholds():
    states = []
    sim_monitor("stuck", until=240, thresholds={"stuck_seconds": "60s", "max_num_seqs": 4}, on_state=states.append)
    assert ("stuck", "requests_stalled") in symptoms(states)
    states = []
    sim_monitor("stuck", until=240, on_state=states.append)  # 120 s wedged: under the default 180 s
    assert not any(symptom == "stuck" for symptom, _ in symptoms(states))


# --- stuck, on recorded pages ----------------------------------------------






def replayed(pages, every: float = 10.0, diagnosis: dict | None = None) -> list:
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "poll_interval": "1s",
                                        "window": "5m", **({"diagnosis": diagnosis} if diagnosis else {})},
                             environ={})
    times = iter(1000.0 + every * i for i in range(10_000))
    monitor = Monitor(settings, fetcher=Pages(pages), clock=lambda: next(times))
    return [monitor.poll_once() for _ in pages]


def test_kv_held_with_nothing_running_is_stuck(fixtures_dir):
    idle = (fixtures_dir / "vllm-0.32-cpu" / "metrics-idle.txt").read_text()
    held = with_value(idle, "vllm:kv_cache_usage_perc", "0.62")
    states = replayed([held] * 25)  # 240 s of the same page
    causes = [(f.symptom, f.cause) for f in states[-1].findings]
    assert ("stuck", "kv_held_idle") in causes
    assert not any(f.symptom == "stuck" for f in states[10].findings)  # 100 s: not yet
    # The same idle page with usage 0 is an idle engine, nothing held.
    states = replayed([idle] * 25)
    assert not any(f.symptom == "stuck" for f in states[-1].findings)


def test_counting_tokens_is_never_stuck(fixtures_dir):
    """The real load page repeated, but its generated-token counter climbing
    by one each poll: frozen gauges with progress are no stuck engine."""
    load = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    base = float(re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", load, re.M).group(1))
    pages = [with_value(load, "vllm:generation_tokens_total", f"{base + i:.1f}") for i in range(25)]
    assert not any(f.symptom == "stuck" for f in replayed(pages)[-1].findings)
    # Without the climb, the same pages are stuck.
    assert ("stuck", "requests_stalled") in {(f.symptom, f.cause) for f in replayed([load] * 25)[-1].findings}


# --- busy, on real pages served late over HTTP -----------------------------


def page(fixtures_dir, name):
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def busy_settings(url: str, **diagnosis):
    return load_settings(overrides={"target": url, "poll_interval": "2s", "window": "60s", "timeout": "0.4s",
                                    "diagnosis": {"busy_late_seconds": "0.2s", **diagnosis}}, environ={})


def test_a_late_page_under_load_is_busy_with_the_lateness_measured(fixtures_dir):
    with PageServer([Answer(page(fixtures_dir, "load"), delay=0.3)]) as engine:
        monitor = Monitor(busy_settings(engine.url))
        state = monitor.poll_once()
    assert state.up and state.busy is not None
    assert state.busy["late_seconds"] >= 0.3 and not state.busy["timed_out"]
    assert (state.busy["running"], state.busy["waiting"]) == (6, 18)  # the page's own gauges
    assert "busy" in state.busy["sentence"]
    values = exported(monitor)
    assert values["kvwatch_busy"] == 1 and values["kvwatch_up"] == 1
    assert values["kvwatch_page_late_seconds"] == pytest.approx(state.busy["late_seconds"])
    body = signals_json(state, monitor.settings)
    assert body["busy"]["late_seconds"] >= 0.3


def test_a_timeout_after_a_loaded_page_is_busy_not_unreachable(fixtures_dir):
    load = page(fixtures_dir, "load")
    with PageServer([Answer(load), Answer(load, delay=1.5)]) as engine:
        monitor = Monitor(busy_settings(engine.url))
        assert monitor.poll_once().up
        state = monitor.poll_once()
    assert not state.up and state.reason == "timeout"  # the poll failed, and is counted so
    assert state.busy is not None and state.busy["timed_out"]
    assert state.busy["late_seconds"] >= 0.4  # the deadline waited: at least that late
    assert "busy, not down" in state.detail
    values = exported(monitor)
    assert values["kvwatch_busy"] == 1 and values["kvwatch_up"] == 0
    body = signals_json(state, monitor.settings)
    assert body["busy"]["timed_out"] is True and "busy" in body["detail"]


def test_a_timeout_after_an_idle_page_is_unreachable(fixtures_dir):
    idle = page(fixtures_dir, "idle")
    with PageServer([Answer(idle), Answer(idle, delay=1.5)]) as engine:
        monitor = Monitor(busy_settings(engine.url))
        assert monitor.poll_once().up
        state = monitor.poll_once()
    assert not state.up and state.busy is None
    assert exported(monitor)["kvwatch_busy"] == 0
    # A late page with nothing running is late, not busy.
    with PageServer([Answer(idle, delay=0.3)]) as engine:
        monitor = Monitor(busy_settings(engine.url))
        state = monitor.poll_once()
    assert state.up and state.busy is None


def test_a_timeout_long_after_the_last_loaded_page_is_unreachable(fixtures_dir):
    load = page(fixtures_dir, "load")
    with PageServer([Answer(load), Answer(load, delay=1.5)]) as engine:
        monitor = Monitor(busy_settings(engine.url, busy_timeout_seconds="1s"))
        assert monitor.poll_once().up
        monitor._last_load = (monitor._last_load[0] - 5.0, *monitor._last_load[1:])  # that page was 5 s ago
        state = monitor.poll_once()
    assert not state.up and state.busy is None
