"""The status page in headless Chromium: it renders, its script refreshes the
findings from /api/v1/* by itself, and the console stays silent (no errors, no
CSP violations, no failed loads)."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import threading
import time

import pytest
import uvicorn

from kvwatch.sidecar.app import create_app
from kvwatch.sidecar.monitor import Monitor
from kvwatch.sidecar.settings import load_settings
from pageserver import Answer, PageServer

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0")


def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (make test installs it)")
    return path


def page(fixtures_dir, name: str) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


class SwitchingMonitor:
    """Serves the first state once (the page's own render), then the second:
    what the browser shows in the end can only come from its script."""

    def __init__(self, first, second):
        self.settings = first.settings
        self._states = [first.state, second.state]
        self.after_poll = []  # the app hooks its render-ahead here; this monitor never polls

    @property
    def state(self):
        return self._states.pop(0) if len(self._states) > 1 else self._states[0]

    def ready(self):
        return True, "ok"


def polled(fixtures_dir, names, settings):
    with PageServer([Answer(page(fixtures_dir, n)) for n in names]) as server:
        settings.target = server.url
        monitor = Monitor(settings)
        for _ in names:
            monitor.poll_once()
    return monitor


def serve(app):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    return server, thread, port


def dump_dom(url: str, tmp_path) -> tuple[str, str]:
    result = subprocess.run(
        [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
         # Virtual time: 12 s of page time covers two 5 s refreshes without waiting for them.
         "--virtual-time-budget=12000", "--dump-dom", url],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, result.stderr


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line]


def test_page_refreshes_findings_live_without_console_errors(fixtures_dir, tmp_path):
    settings = load_settings(environ={})
    idle = polled(fixtures_dir, ["idle"], settings)
    burst = polled(fixtures_dir, ["idle", "prefix-load", "load"], settings)
    app = create_app(SwitchingMonitor(idle, burst), settings)
    server, thread, port = serve(app)
    try:
        dom, stderr = dump_dom(f"http://127.0.0.1:{port}/", tmp_path)
    finally:
        server.should_exit = True
        thread.join(10)

    assert console_lines(stderr) == []
    updates = int(re.search(r'data-updates="(\d+)"', dom).group(1))
    assert updates >= 1, "the page's script never refreshed from the API"
    assert "Live: refreshed" in dom
    # Rendered with no findings (idle), the page now shows the burst's finding.
    assert re.search(r"Findings \(\d+ active\)", dom) and "Findings (0 active)" not in dom
    row = re.search(r'<tr class="finding" data-symptom="exhaustion" data-cause="concurrency_beyond_capacity">(.*?)</tr>',
                    dom, re.S)
    assert row is not None
    assert 'class="sev warning"' in row.group(1) and "waiting_at_peak=18" in row.group(1)
    assert "<th>tiny-llama / 0</th>" in dom and "99.2%" in dom and "4,096" in dom
    assert re.search(r'<span class="up">up</span>', dom)


def test_page_with_engine_down_renders_cleanly(tmp_path):
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "timeout": 0.5}, environ={})
    monitor = Monitor(settings)
    monitor.poll_once()  # refused
    server, thread, port = serve(create_app(monitor, settings))
    try:
        dom, stderr = dump_dom(f"http://127.0.0.1:{port}/", tmp_path)
    finally:
        server.should_exit = True
        thread.join(10)
    assert console_lines(stderr) == []
    assert "down: refused" in dom
    assert "No findings while the engine is not polled." in dom
    assert int(re.search(r'data-updates="(\d+)"', dom).group(1)) >= 1
