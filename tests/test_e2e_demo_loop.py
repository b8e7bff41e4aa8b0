"""The demo loop through a real Prometheus and Alertmanager, and an engine
that loads for 15 minutes, end to end on loopback with time scaled down.

One stack (Debian `prometheus` and `prometheus-alertmanager`, the generated
rules and the generated example Alertmanager configuration, its receivers
pointed at this test's webhook), three deployments told apart by a
`deployment` target label:

    demo       `kvwatch sim` (the demo scenario, one engine) at SPEED times
               wall time, one whole loop, polled by `kvwatch serve`
    loading    `kvwatch serve` polling a port nobody serves for the
               (scaled) 15 minutes a large model takes to load, within the
               default load grace (30 minutes, scaled); then a simulated
               engine comes up on that port
    no-engine  the control: the same, with no grace and no engine ever, so
               that the loading deployment's silence is the grace's doing

Every span the rules read is divided by SPEED (tests/time_scale.py), and
kvwatch's window, hold and load grace with them. The demo's phases last
3 minutes (15 s here), shorter than the default `for:` of the cause alerts
(10-15 minutes): the cause alerts' `for:` is set to 90 s (before scaling),
as an operator whose incidents last minutes would. Only the fast-burn pair
(1h/5m) pages: the slower pairs' windows are longer than the loop.

What must hold: every page starts during a user-facing incident (a phase
whose story leads with a slow first token) or within the page's lag after
one (the short window plus `for:`), never in a healthy phase; the demo's
incidents follow each other within the page's short window, so to the
objective a loop is one incident: the first loop pages, and no loop pages
twice; the cause alerts of the paged engine reach their team in the page's
notification group. The
loading deployment notifies nothing, the control does. The counts per phase
are printed (docs/alerts.md quotes them)."""

from __future__ import annotations

import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import requests
import yaml

from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.mixin import alertmanager
from kvwatch.sim.scenario import load_scenario
from promstack import free_port, query, query_range, wait_until
from test_e2e_alerting import ALERTMANAGER, PROMETHEUS, RECEIVERS, Processes, Webhook, _ready
from time_scale import scaled_config

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not (PROMETHEUS and ALERTMANAGER),
                                 reason="prometheus and alertmanager not installed (make system-deps)")]

SPEED = 12  # simulated seconds per wall second, and the factor every span is divided by
DEMO = load_scenario("demo")
LOOP_S = DEMO.cycle_seconds / SPEED
CONFIG = {
    # kvwatch's window in `make run` (scripts/demo-kvwatch.yaml): the rules judge the same span.
    "rate_window": "1m",
    "group_labels": ["namespace", "job", "deployment"],
    "for_durations": {"VllmTimeToFirstTokenSlow": "90s", "VllmKvCacheExhausted": "90s",
                      "VllmPrefixCacheHitRateLow": "90s"},
    "burn_rate_windows": [{"long": "1h", "short": "5m", "factor": 14.4, "severity": "critical"}],
    "upstream_histogram": "app_retrieval_seconds",
    "upstream_selector": 'job="rag-app"',
    "upstream_join_labels": ["deployment"],
}
PAGE = "VllmTimeToFirstTokenBudgetBurn"
LOAD_S = 15 * 60 / SPEED  # the engine's load time, scaled
# The page's lag after its incident ends: its short window still burns, then its `for:`, then a scrape or two.
PAGE_LAG_S = (5 * 60 + 2 * 60) / SPEED + 3
TAIL_S = 15.0  # wall seconds watched after the loop: the first page's resolution, a late notification


def incidents() -> set[str]:
    """The demo's user-facing incidents: the phases whose story leads with a slow first token."""
    return {phase.name for phase in DEMO.phases
            if phase.story is not None and (phase.story.lead or "").startswith("slow_first_token")}


class PhaseLog:
    """Reads the simulator's /sim/phase twice a second: (wall time, phase) at each change."""

    def __init__(self, url: str):
        self.url, self.changes = url, []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="phase-log", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                answer = requests.get(self.url, timeout=2).json()
            except (requests.RequestException, ValueError):
                continue
            name = f"{answer['phase']}#{answer['cycle']}"
            if not self.changes or self.changes[-1][1] != name:
                self.changes.append((time.time(), name))

    def at(self, when: float) -> str:
        """The phase running at `when` ('' before the first reading)."""
        current = ""
        for start, name in self.changes:
            if start <= when:
                current = name
        return current

    def ended_within(self, when: float, span: float) -> list[str]:
        """The phases that ended in the `span` seconds before `when`."""
        return [name for (_, name), (end, _) in zip(self.changes, self.changes[1:]) if when - span <= end <= when]


def _kvwatch(processes: Processes, name: str, target: str, port: int, extra: list[str]) -> None:
    processes.start(name, [sys.executable, "-m", "kvwatch", "serve", "--config", str(processes.workdir / "kvwatch.yaml"),
                           "--target", target, "--port", str(port), *extra])


@pytest.fixture(scope="module")
def loop():
    config = scaled_config(CONFIG, SPEED)
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-e2e-demo-"))
    processes = Processes(workdir)
    python = sys.executable
    phases = None
    try:
        with Webhook() as webhook:
            (workdir / "rules.yaml").write_text(render_all(config)[RULES_FILE])
            example = alertmanager.example(config, {name: f"{webhook.base_url}/{name}" for name in RECEIVERS})
            # A group is notified again only when it changes: a second notification is a change, not a repeat.
            example["route"].update({"group_wait": "1s", "group_interval": "1s", "repeat_interval": "1h"})
            for route in example["route"]["routes"]:
                route.pop("repeat_interval", None)
            (workdir / "alertmanager.yml").write_text(yaml.safe_dump(example))
            # kvwatch's own spans scaled as the rules' are: the demo's window and hold, the default load grace.
            (workdir / "kvwatch.yaml").write_text(yaml.safe_dump({
                "poll_interval": "1s", "window": f"{60 / SPEED:g}s", "load_grace": f"{1800 / SPEED:g}s",
                "diagnosis": {"max_num_seqs": 12, "finding_hold_seconds": 60 / SPEED}}))
            am_port, prom_port, sim_port = free_port(), free_port(), free_port()
            processes.start("alertmanager", [
                ALERTMANAGER, f"--config.file={workdir / 'alertmanager.yml'}",
                f"--storage.path={workdir / 'am-data'}", f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address="])
            processes.start("sim-demo", [python, "-m", "kvwatch", "sim", "--scenario", "demo", "--port", str(sim_port),
                                         "--speed", str(SPEED), "--duration", f"{LOOP_S + 60:.0f}"])
            ports = {name: free_port() for name in ("demo", "loading", "no-engine")}
            loading_engine, dead_engine = free_port(), free_port()
            _kvwatch(processes, "kvwatch-demo", f"http://127.0.0.1:{sim_port}", ports["demo"], [])
            _kvwatch(processes, "kvwatch-loading", f"http://127.0.0.1:{loading_engine}", ports["loading"], [])
            _kvwatch(processes, "kvwatch-no-engine", f"http://127.0.0.1:{dead_engine}", ports["no-engine"],
                     ["--load-grace", "0"])
            loading_since = time.time()
            (workdir / "prometheus.yml").write_text(yaml.safe_dump({
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
                "rule_files": [str(workdir / "rules.yaml")],
                "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
                "scrape_configs": [
                    {"job_name": "kvwatch", "static_configs": [
                        {"targets": [f"127.0.0.1:{port}"], "labels": {"deployment": name}} for name, port in ports.items()]},
                    {"job_name": "rag-app", "metrics_path": "/app/metrics", "static_configs": [
                        {"targets": [f"127.0.0.1:{sim_port}"], "labels": {"deployment": "demo"}}]}]}))
            processes.start("prometheus", [
                PROMETHEUS, f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'prom-data'}", f"--web.listen-address=127.0.0.1:{prom_port}"])
            prometheus = f"http://127.0.0.1:{prom_port}"
            wait_until(lambda: _ready(f"http://127.0.0.1:{am_port}/-/ready"), 30, "alertmanager ready")
            wait_until(lambda: _ready(f"{prometheus}/-/ready"), 30, "prometheus ready")
            phases = PhaseLog(f"http://127.0.0.1:{sim_port}/sim/phase")
            phases.thread.start()
            wait_until(lambda: phases.changes, 30, "the simulator's first phase")
            # The engine still loading: kvwatch says so, and Prometheus has it.
            wait_until(lambda: query(prometheus, 'kvwatch_starting{deployment="loading"} == 1'), 30,
                       "the loading kvwatch's kvwatch_starting")
            threading.Event().wait(max(0.0, loading_since + LOAD_S - time.time()))
            processes.start("sim-loading", [python, "-m", "kvwatch", "sim", "--scenario", "healthy",
                                            "--port", str(loading_engine), "--speed", str(SPEED)])
            loaded = time.time()
            wait_until(lambda: query(prometheus, 'kvwatch_up{deployment="loading"} == 1'), 30,
                       "the loaded engine polled")
            # One whole loop, then a little of the next.
            loop_end = phases.changes[0][0] + LOOP_S
            threading.Event().wait(max(0.0, loop_end + TAIL_S - time.time()))
            yield {"webhook": webhook, "phases": phases, "prometheus": prometheus, "loading": (loading_since, loaded),
                   "loop_end": loop_end, "processes": processes}
    finally:
        if phases is not None:
            phases.stop.set()
            phases.thread.join(5)
        processes.stop_all()
        shutil.rmtree(workdir, ignore_errors=True)


def _pages(webhook: Webhook, deployment: str) -> list[tuple[float, dict]]:
    """(first firing notification time, alert) of each distinct page: one firing spell of the page alert."""
    seen: dict[tuple, tuple[float, dict]] = {}
    for at, payload in webhook.sent_to("pager"):
        for alert in payload["alerts"]:
            if (alert["labels"]["alertname"] == PAGE and alert["labels"].get("deployment") == deployment
                    and alert["status"] == "firing"):
                seen.setdefault((alert["fingerprint"], alert["startsAt"]), (at, alert))
    return sorted(seen.values(), key=lambda item: item[0])


def test_the_demo_loop_pages_once_per_incident_with_its_cause(loop):
    webhook, phases = loop["webhook"], loop["phases"]
    pages = _pages(webhook, "demo")
    per_phase: dict[str, dict[str, int]] = {}
    for path, at, payload in webhook.notifications:
        if payload["groupLabels"].get("deployment") == "demo":
            counts = per_phase.setdefault(phases.at(at), {})
            counts[path] = counts.get(path, 0) + 1
    paged_in = [phases.at(at) for at, _ in pages]
    print(f"demo loop at {SPEED}x ({LOOP_S:.0f} s): phases {[(round(t - phases.changes[0][0], 1), n) for t, n in phases.changes]}")
    print(f"pages: {len(pages)}, by the phase running when each was notified: {paged_in}")
    print("notifications by phase and receiver:", per_phase)
    start = phases.changes[0][0]
    spells = query_range(loop["prometheus"], f'ALERTS{{alertname="{PAGE}",alertstate="firing",deployment="demo"}}',
                         start - 5, time.time())
    for series in spells:
        times = [float(t) for t, _ in series["values"]]
        runs = [(a, b) for a, b in zip([times[0]] + [t for p, t in zip(times, times[1:]) if t - p > 1.5],
                                       [p for p, t in zip(times, times[1:]) if t - p > 1.5] + [times[-1]])]
        print("page firing, s from loop start (phase at start .. at end):",
              [(round(a - start), round(b - start), phases.at(a), phases.at(b)) for a, b in runs])
    print("pager notifications:", [(round(at - start, 1), [(a["labels"]["alertname"], a["labels"].get("cause"),
                                                             a["status"]) for a in payload["alerts"]])
                                   for at, payload in webhook.sent_to("pager")])
    names = incidents()
    # Each page belongs to an incident: it starts during one or within the page's lag after one.
    per_loop: dict[str, list[str]] = {}
    for at, alert in pages:
        running = phases.at(at)
        recent = [running] + list(reversed(phases.ended_within(at, PAGE_LAG_S)))
        owner = next((name for name in recent if name.split("#")[0] in names), None)
        assert owner, (f"a page outside any incident: notified in {running}", alert["startsAt"])
        per_loop.setdefault(owner.split("#")[1], []).append(owner)
    print("pages per loop, by the incident each belongs to:", per_loop)
    # Never in the healthy phase.
    assert not [p for p in paged_in if p.startswith("healthy#")]
    # Once per incident. The demo's incidents follow each other within 1.5-4.5 minutes, inside the
    # page's short window (5 minutes): to the objective one loop is one incident, paged once, and
    # the first loop (run whole) did page.
    assert per_loop.get("0") and all(len(owners) == 1 for owners in per_loop.values()), per_loop
    # The cause beside each page: the same group (model and group labels) reaches the platform team
    # with a cause alert of the demo's engine while the page fires.
    group = next(payload["groupLabels"] for _, payload in webhook.sent_to("pager")
                 if payload["groupLabels"].get("deployment") == "demo")
    assert {"model_name", "deployment"} <= set(group) and not {"instance", "engine"} & set(group), group
    causes = {a["labels"].get("cause") for _, payload in webhook.sent_to("platform")
              if payload["groupLabels"] == group for a in payload["alerts"] if a["status"] == "firing"}
    print("causes notified in the page's group:", sorted(c for c in causes if c))
    assert causes - {None}, "no cause alert in the page's notification group"


def test_an_engine_loading_for_15_minutes_pages_nothing(loop):
    webhook, prometheus = loop["webhook"], loop["prometheus"]
    since, loaded = loop["loading"]
    by_deployment: dict[str, int] = {}
    for _, _, payload in webhook.notifications:
        name = payload["groupLabels"].get("deployment", "")
        by_deployment[name] = by_deployment.get(name, 0) + 1
    print(f"loading {loaded - since:.0f} s (15 min at {SPEED}x), then up: notifications by deployment {by_deployment}")
    assert "loading" not in by_deployment
    # Not even pending while it loaded: no alert of the loading deployment was in ALERTS before it came up.
    assert not query(prometheus, f'max_over_time(ALERTS{{deployment="loading"}}[{loaded - since + 5:.0f}s])', at=loaded)
    # The control, with no grace and no engine, is reported unreachable through the same stack.
    assert any(a["labels"]["alertname"] == "KvwatchEngineUnreachable" and a["labels"].get("deployment") == "no-engine"
               for a in webhook.received())
