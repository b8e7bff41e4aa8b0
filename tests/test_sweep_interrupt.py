"""Ctrl-C during `kvwatch sweep`: a sweep run as a subprocess against the
in-process simulator gets SIGINT while a cell runs. It must keep the cells
already measured (files complete and parseable), drop the running one, cut the
requests still in flight so the server stops working on them, and exit with
status 130 without a traceback."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvwatch.sim.server import start_background

REPO = Path(__file__).resolve().parent.parent
# Four cells: two short (32 output tokens), then two whose requests take about
# 5 s of wall time at speed 2 (900 tokens x ~12 ms simulated per decode step),
# longer than the sweep's grace period for requests in flight.
GRID = ["--input-tokens", "64", "--output-tokens", "32,900", "--concurrency", "1,2",
        "--requests", "2"]


def _running(sim) -> int:
    with sim.cond:
        return sum(len(engine.running) for engine in sim.sim.engines)


class StderrReader:
    """Collects a subprocess's stderr lines in a thread, so waits can be bounded."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.ended = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.ended = True
            self._cond.notify_all()

    def wait_for(self, predicate, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(predicate(line) for line in self.lines):
                left = deadline - time.monotonic()
                if left <= 0 or self.ended:
                    return False
                self._cond.wait(left)
            return True

    def text(self) -> str:
        with self._cond:
            return "\n".join(self.lines)


def _start_sweep(sim, out: Path) -> tuple[subprocess.Popen, StderrReader]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvwatch", "sweep", "--base-url", sim.url, "--model", "tiny-llama",
         *GRID, "--poll-interval", "0.05s", "--timeout", "60s", "--warmup", "0",
         "--out", str(out)],
        cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    return proc, StderrReader(proc.stderr)


def _wait_until(condition, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture
def sim():
    with start_background("idle", speed=2) as handle:
        yield handle


@pytest.fixture
def sweep_process():
    started: list[subprocess.Popen] = []

    def start(sim, out):
        proc, reader = _start_sweep(sim, out)
        started.append(proc)
        return proc, reader

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_ctrl_c_keeps_measured_cells_and_abandons_requests_in_flight(sim, sweep_process, tmp_path):
    out = tmp_path / "sweep"
    proc, stderr = sweep_process(sim, out)
    assert stderr.wait_for(lambda line: line.startswith("[2/4]"), timeout=60), stderr.text()
    # The third cell's long requests are running in the engine.
    assert _wait_until(lambda: _running(sim) >= 1, timeout=30), stderr.text()
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=30)
    text = stderr.text()
    assert code == 130, text
    assert "Traceback" not in text
    assert "SIGINT received" in text
    assert "abandoned 1 request(s) in flight" in text
    assert "interrupted; 2 of 4 cell(s) kept" in text

    report = json.loads((out / "sweep.json").read_text())
    assert report["interrupted"] is True
    assert [(c["output_tokens"], c["concurrency"]) for c in report["cells"]] == [(32, 1), (32, 2)]
    assert all(c["completed"] == 2 and c["failed"] == 0 for c in report["cells"])
    with open(out / "sweep.csv", newline="") as handle:
        assert [row["cell"] for row in csv.DictReader(handle)] == ["1", "2"]
    with open(out / "requests.csv", newline="") as handle:
        assert len(list(csv.DictReader(handle))) == 4  # the dropped cell's requests are not kept
    assert "**interrupted**" in (out / "summary.md").read_text()
    assert (out / "kv_usage_peak.png").exists()
    # The cut connection made the simulated engine abort the abandoned request.
    assert _wait_until(lambda: _running(sim) == 0, timeout=10)


def test_a_second_ctrl_c_quits_at_once_still_cleanly(sim, sweep_process, tmp_path):
    out = tmp_path / "sweep"
    proc, stderr = sweep_process(sim, out)
    assert stderr.wait_for(lambda line: line.startswith("[2/4]"), timeout=60), stderr.text()
    assert _wait_until(lambda: _running(sim) >= 1, timeout=30), stderr.text()
    proc.send_signal(signal.SIGINT)
    assert stderr.wait_for(lambda line: "SIGINT received" in line, timeout=10), stderr.text()
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=30)
    text = stderr.text()
    assert code == 130, text
    assert "Traceback" not in text and "stopped at once; 2 cell(s) kept" in text
    report = json.loads((out / "sweep.json").read_text())
    assert len(report["cells"]) == 2 and report["interrupted"] is True
