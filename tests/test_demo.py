"""The demo as a newcomer meets it (`make run`, scripts/run-demo.sh): a finding
within the first minute, and a strip on the status page (and lines in the
terminal) naming the simulated phase now, the next and when.

The browser test plays the first minute in lockstep instead of waiting for it:
the simulator's clock is frozen (speed 0) and moved 2 s before each of
kvwatch's polls, and kvwatch's clock reads the simulator's. Every other part
is what `make run` runs: the shipped `demo` scenario at seed 0, kvwatch's
Monitor with the settings file, the targets and the KV-cache event stream
run-demo.sh passes, real HTTP and ZMQ between them (each poll waits until the
stream has delivered what the simulation published), the status page in
headless Chromium. So "within 60 s" is 60
simulated seconds, which are 60 wall seconds at SPEED=1 when the machine keeps
up; polls are counted, nothing waits on the wall clock."""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest

from sim_support import settle

from kvwatch.pipeline.demo import read_status
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sidecar.report import signals_json
from kvwatch.settings import load_settings
from kvwatch.sim.scenario import load_scenario, phase_line
from kvwatch.sim.server import start_background
from kvwatch.sim.simulation import Simulation

REPO = Path(__file__).resolve().parent.parent
RUN_DEMO = REPO / "scripts" / "run-demo.sh"
DEMO_CONFIG = REPO / "scripts" / "demo-kvwatch.yaml"


def test_phase_status_names_the_phase_now_the_next_and_when():
    sim = Simulation(load_scenario("demo"), seed=0)
    first = sim.scenario.phases[0]
    status = sim.phase_status()
    assert (status["phase"], status["next"]) == ("healthy", "eviction-pressure")
    assert status["next_in_seconds"] == first.duration
    assert phase_line(status) == "now: healthy, next: eviction-pressure in 0:30"
    sim.advance_to(first.duration + 1)
    status = sim.phase_status()
    assert (status["phase"], status["next"]) == ("eviction-pressure", "exhaustion")
    assert phase_line(status) == "now: eviction-pressure, next: exhaustion in 2:59"
    # The demo loops: after the last phase comes the first again.
    sim.advance_to(sim.scenario.cycle_seconds - 5)
    assert (sim.phase_status()["next"], round(sim.phase_status()["next_in_seconds"])) == ("healthy", 5)
    sim.advance_to(sim.scenario.cycle_seconds + 1)
    assert (sim.phase_status()["phase"], sim.phase_status()["cycle"]) == ("healthy", 1)
    # A scenario that does not loop says its last phase lasts.
    single = Simulation(load_scenario("exhaustion"), seed=0)
    single.advance_to(single.scenario.cycle_seconds + 1)
    assert single.phase_status()["next"] is None
    assert "last phase" in phase_line(single.phase_status())


def test_the_loop_length_the_readme_and_run_demo_state_is_the_scenario_s():
    minutes = load_scenario("demo").cycle_seconds / 60
    assert minutes == 27
    for text in (RUN_DEMO.read_text(), (REPO / "README.md").read_text()[:3000]):
        assert "27 minutes" in text
        assert "SPEED=" in text


def test_sim_phase_is_served_over_http_and_read_back_bounded():
    with start_background("demo", speed=0) as server:
        server.advance(10)
        from kvwatch.pipeline.demo import DemoSource

        status = DemoSource(server.url + "/sim/phase", 5.0).poll()
    assert status["phase"] == "healthy" and status["next"] == "eviction-pressure"
    assert status["next_in_seconds"] == pytest.approx(20)
    assert status["clock"] == "simulated"  # speed 0: the clock moves by hand
    assert status["cycle_seconds"] == 27 * 60


@pytest.mark.parametrize("body", [None, "", "not json\n", "[1, 2]\n", '{"next": "x"}\n', '{"phase": 3}\n'])
def test_a_phase_page_that_is_not_one_is_dropped(body):
    assert read_status(body) is None


def test_a_phase_page_s_odd_fields_are_dropped_field_by_field():
    status = read_status(json.dumps({"phase": "p" * 5000, "next": 7, "next_in_seconds": -3, "cycle_seconds": "1",
                                     "phases": True, "speed": float("nan"), "clock": "x"}))
    assert status["phase"] == "p" * 200
    assert status["next"] is None and status["next_in_seconds"] is None and status["cycle_seconds"] is None
    assert status["phases"] is None and status["speed"] is None and status["clock"] == "wall"


def test_demo_target_takes_a_bare_simulator_url_and_is_in_the_api_only_when_set():
    settings = load_settings(overrides={"demo_target": "http://127.0.0.1:8000"}, environ={})
    assert settings.demo_target == "http://127.0.0.1:8000/sim/phase"
    plain = load_settings(environ={})
    monitor = Monitor(plain)
    assert "demo" not in signals_json(monitor.state, plain)


def test_a_silent_simulator_leaves_the_engine_s_poll_alone():
    with start_background("demo", speed=0) as server:
        settings = load_settings(overrides={"target": server.metrics_url, "demo_target": "http://127.0.0.1:9/sim/phase"},
                                 environ={})
        monitor = Monitor(settings)
        state = monitor.poll_once()
    assert state.up and state.demo is None
    assert signals_json(state, settings)["demo"] is None


def free_endpoint() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def demo_settings(server, kv_events: str):
    """The settings run-demo.sh gives `kvwatch serve`: its config file, the
    three targets and the KV-cache event stream."""
    script = RUN_DEMO.read_text()
    serve = script[script.index('"$KVWATCH" serve'):]
    serve = serve[:serve.index("&\n")]
    flags = set(re.findall(r"--([a-z-]+)", serve))
    assert flags == {"config", "target", "port", "upstream-target", "demo-target", "kv-events"}, flags
    assert "--router-target" in script  # only with ROUTER set (kvwatch sim --router)
    assert "--config scripts/demo-kvwatch.yaml" in serve
    sim = script[script.index('"$KVWATCH" sim'):]
    assert set(re.findall(r"--([a-z-]+)", sim[:sim.index("&\n")])) == {"scenario", "speed", "port", "host", "kv-events"}
    return load_settings(str(DEMO_CONFIG), {"target": server.metrics_url, "upstream_target": server.app_metrics_url,
                                            "demo_target": server.url + "/sim/phase", "kv_events": kv_events},
                         environ={})


def lockstep(server, monitor, until: float, stop=lambda state: False):
    """Poll as `kvwatch serve` does, the simulator moved one interval before each poll."""
    interval = monitor.settings.poll_interval
    state = monitor.state
    while server.sim.now < until - 1e-9:
        server.advance(interval)
        settle(server, monitor.kv_events)
        state = monitor.poll_once()
        if stop(state):
            break
    return state


PAGE_FACTS = """(() => ({
  phase: (document.querySelector("#phase") || {dataset: {}}).dataset.phase || null,
  next: (document.querySelector("#phase") || {dataset: {}}).dataset.next || null,
  strip: (document.querySelector("#phase") || {}).textContent || "",
  cards: Array.from(document.querySelectorAll("#findings article.card")).map(c => c.dataset.cause),
  banner: document.querySelector("#banner").dataset.cause || null,
  layout: Array.from(document.querySelectorAll("#findings article.card")).map(c => ({
    chips: c.querySelectorAll(".deciding .num-chip").length,
    next: (c.querySelector(":scope > p.next") || {}).textContent || null,
    folded: !!c.querySelector(":scope > details.more:not([open])"),
    // Prose outside the fold: every <p> a card shows unfolded.
    open_prose: Array.from(c.querySelectorAll(":scope > p")).map(p => p.className || p.textContent.slice(0, 20)),
  })),
}))()"""


def test_within_the_first_minute_the_page_shows_a_finding_and_the_next_phase(tmp_path):
    from browser import Browser, chromium_path
    from kvwatch.sidecar.app import create_app
    from pageserver import serving

    if chromium_path() is None:
        pytest.skip("chromium is not installed (make test installs it)")
    endpoint = free_endpoint()
    with start_background("demo", speed=0, seed=0, kv_events=endpoint) as server:
        settings = demo_settings(server, endpoint)
        # kvwatch reads the simulated time, counted from when the simulated engine started.
        monitor = Monitor(settings, clock=lambda: server.sim.created_unix + server.sim.now)
        monitor.kv_events.start()
        # PUB/SUB keeps nothing for a subscriber not yet connected (make run
        # loses the same first events): move the simulation by tenths of a
        # second until a first event arrives.
        deadline = time.monotonic() + 20
        while monitor.kv_events.messages == 0:
            assert time.monotonic() < deadline, "no KV-cache event reached kvwatch"
            server.advance(0.1)
            time.sleep(0.05)
        try:
            with serving(create_app(monitor, settings), lifespan="off", start_timeout_s=10) as kvwatch, \
                    Browser() as browser:
                # Ten seconds in: healthy, and the strip says what comes and when.
                lockstep(server, monitor, 10)
                left = 30 - server.sim.now
                page = browser.page(1400, 900)
                page.goto(kvwatch.url + "/")
                page.wait_for("document.body.dataset.rendered === '1'")
                facts = page.evaluate(PAGE_FACTS)
                assert (facts["phase"], facts["next"]) == ("healthy", "eviction-pressure"), facts
                assert f"next: eviction-pressure in 0:{round(left):02d}" in facts["strip"], facts["strip"]
                # Then poll until the demo's first symptom shows, at most a minute in.
                state = lockstep(server, monitor, 60,
                                 stop=lambda s: any(f.cause == "eviction_before_reuse" for f in s.findings))
                assert state.findings, f"no finding within 60 s; the phase is {state.demo}"
                shown_at = server.sim.now
                page.goto(kvwatch.url + "/")
                page.wait_for("document.body.dataset.rendered === '1'")
                facts = page.evaluate(PAGE_FACTS)
                assert page.messages() == []
                page.screenshot(tmp_path / "demo-first-finding.png")
        finally:
            monitor.kv_events.stop()
    assert shown_at <= 60
    assert "eviction_before_reuse" in facts["cards"], facts
    assert facts["banner"] in facts["cards"], facts
    assert (facts["phase"], facts["next"]) == ("eviction-pressure", "exhaustion"), facts
    assert re.search(r"next: exhaustion in 2:\d\d", facts["strip"]), facts["strip"]
    # Each card: the headline, at most three deciding numbers, one next action and its
    # runbook; the prose, the other causes and every value folded.
    from kvwatch.diagnose.vocabulary import NEXT_ACTION

    for card, cause in zip(facts["layout"], facts["cards"]):
        assert 1 <= card["chips"] <= 3, card
        assert card["next"] == "Next: " + NEXT_ACTION[cause], card
        assert card["folded"], card
        assert card["open_prose"] in (["next", "runbook"], ["next"]), card


def test_kvwatch_sim_prints_the_loop_and_the_phase_now_and_next(capsys):
    from kvwatch.cli import main

    # Speed 0: the clock stands, so the lines are exactly these (make run's are in wall time).
    assert main(["sim", "--scenario", "demo", "--port", "0", "--speed", "0", "--duration", "0.3s"]) == 0
    out = capsys.readouterr().out
    assert "kvwatch sim: 11 phases, 27:00 of simulated time (speed 0: the clock moves by hand), then loops" in out
    assert ("kvwatch sim: now: healthy, next: eviction-pressure in 0:30 (simulated time) "
            "(two shared system prompts, ample cache)") in out
    # One phase: nothing to announce.
    assert main(["sim", "--scenario", "idle", "--port", "0", "--speed", "0", "--duration", "0.3s"]) == 0
    assert "now:" not in capsys.readouterr().out
