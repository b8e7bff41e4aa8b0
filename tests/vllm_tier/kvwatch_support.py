"""kvwatch running against the real vLLM of the tier, and what the tests need to judge it.

- `PageRecorder`: a loopback HTTP proxy between kvwatch and vLLM that passes
  each /metrics page through unchanged and keeps a copy with the time it was
  asked for, so a test can read the very pages kvwatch polled.
- `running_kvwatch`: a Monitor polling in the background and kvwatch's HTTP
  app served by uvicorn in a thread, as `kvwatch serve` runs them.
- `parse_page`, `read_kvwatch_metrics`: pages parsed by prometheus_client's
  parser, independently of kvwatch's own exposition parser;
  `read_kvwatch_diagnosis`: kvwatch's /api/v1/diagnosis.
- `generate_rules`: `kvwatch generate` run with a mixin config YAML, for a test
  copy of the alert rules.

Standard library, prometheus_client, uvicorn, kvwatch and tests/pageserver.py
only: it runs under kvwatch's own virtual environment.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sim.score import settings_for
from pageserver import Answer, LoopbackServer, Request, serving

from .harness import Metrics, _open

# Pages kept by the recorder: at 0.5 s per poll, two minutes of polls, far
# more than any window the tests use, and bounded memory (pages are ~30 KB).
RECORDED_PAGES = 240


@dataclass(frozen=True)
class RecordedPage:
    requested_at: float  # time.time() when kvwatch's request arrived
    status: int
    body: bytes
    answered_at: float = 0.0  # time.time() when the answer had been sent

    def metrics(self) -> Metrics:
        return parse_page(self.body.decode())


class PageRecorder(LoopbackServer):
    """Forwards GET requests to `upstream` (a base URL) and records every answer."""

    def __init__(self, upstream: str, keep: int = RECORDED_PAGES, timeout_s: float = 10.0):
        self.upstream = upstream.rstrip("/")
        self.timeout_s = timeout_s
        self._pages: deque[RecordedPage] = deque(maxlen=keep)
        self._lock = threading.Lock()
        super().__init__(name="page-recorder")
        self.url = self.base_url + "/metrics"

    def respond(self, request: Request) -> Answer:
        try:
            with _open(self.upstream + request.path, timeout=self.timeout_s) as answer:
                status, body = answer.status, answer.read()
                content_type = answer.headers.get("Content-Type", "text/plain")
        except urllib.error.HTTPError as err:
            status, body, content_type = err.code, err.read(), "text/plain"
        except OSError as err:
            status, body, content_type = 502, f"upstream failed: {err}".encode(), "text/plain"
        return Answer(body, status, headers={"Content-Type": content_type})

    def answered(self, request: Request, answer: Answer) -> None:
        with self._lock:
            self._pages.append(RecordedPage(request.received_at, answer.status, answer.body, time.time()))

    @property
    def pages(self) -> list[RecordedPage]:
        with self._lock:
            return list(self._pages)

    def page_of_poll(self, poll_stamp: float, slack_s: float = 0.8) -> RecordedPage:
        """The page kvwatch read in the poll stamped `poll_stamp` (its snapshot
        time).

        kvwatch stamps a page at the time it asked for it (just before its
        request arrived here), or, when the page came later than a tenth of
        the interval, at the time it was answered (between the request's
        arrival and kvwatch reading the answer's end). The page is the one
        whose span from request to answer lies nearest the stamp; kvwatch's
        polls are sequential and start at least an interval apart (1 s or
        more in the tier), so a neighbour's span lies farther.
        """

        def distance(page: RecordedPage) -> float:
            if page.requested_at <= poll_stamp <= page.answered_at + 0.05:
                return 0.0
            return page.requested_at - poll_stamp if poll_stamp < page.requested_at else poll_stamp - page.answered_at

        # A page is recorded once its answer has been sent (its answered_at),
        # so kvwatch may have read it, polled and published before it is
        # here: wait a little for it rather than call it missing.
        deadline = time.monotonic() + 2.0
        while True:
            near = [page for page in self.pages if distance(page) <= slack_s]
            if near or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not near:
            raise AssertionError(f"no recorded page was requested or answered within {slack_s} s of "
                                 f"{poll_stamp:.3f} (recorded: {len(self.pages)} pages)")
        return min(near, key=distance)


def parse_page(text: str) -> Metrics:
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return Metrics(samples)


def read_kvwatch_metrics(kvwatch_url: str, timeout_s: float = 5.0) -> Metrics:
    with _open(kvwatch_url + "/metrics", timeout=timeout_s) as response:
        return parse_page(response.read().decode())


def read_kvwatch_diagnosis(kvwatch_url: str, timeout_s: float = 5.0) -> dict:
    """kvwatch's /api/v1/diagnosis, its `findings` the causes kvwatch names
    now: a finding whose condition has cleared is held for
    finding_hold_seconds marked `clearing_since` (as its alert keeps firing),
    and those are moved to `clearing`, so a scenario that follows another
    within one test is judged on what kvwatch says of it."""
    with _open(kvwatch_url + "/api/v1/diagnosis", timeout=timeout_s) as response:
        diagnosis = json.loads(response.read())
    found = diagnosis.get("findings", [])
    diagnosis["findings"] = [f for f in found if not f.get("clearing_since")]
    diagnosis["clearing"] = [f for f in found if f.get("clearing_since")]
    return diagnosis


@dataclass
class RunningKvwatch:
    url: str
    port: int
    monitor: Monitor


@contextlib.contextmanager
def running_kvwatch(target: str, poll_interval: str | None = "0.5s", window: str | None = "20s",
                    start_timeout_s: float = 10.0, diagnosis: dict | None = None,
                    upstream: tuple[str, str] | None = None,
                    kv_events: str | None = None) -> Iterator[RunningKvwatch]:
    """kvwatch polling `target` in the background and serving its HTTP app on
    loopback; `diagnosis` sets thresholds as the config's `diagnosis:` does,
    `upstream` the second source of the slow-first-token diagnosis;
    `poll_interval` or `window` None: kvwatch's default."""
    # Port 0 lets the OS choose; uvicorn reports the port it bound.
    overrides: dict = {"port": 0, **{key: value for key, value in (("poll_interval", poll_interval),
                                                                   ("window", window)) if value}}
    if diagnosis:
        overrides["diagnosis"] = diagnosis
    sources = {"target": target}
    if upstream:  # (its /metrics URL, the histogram measuring time before the engine)
        sources["upstream_target"], sources["upstream_histogram"] = upstream
    if kv_events:  # the ZMQ endpoint kvwatch binds for vLLM's KV-cache events
        sources["kv_events"] = kv_events
    # The settings the simulated timeline runs the Monitor with, the tier's engine as its source.
    settings = settings_for(overrides=overrides, sources=sources)
    monitor = Monitor(settings)
    with serving(create_app(monitor, settings), lifespan="off", start_timeout_s=start_timeout_s) as kvwatch:
        monitor.start()
        try:
            yield RunningKvwatch(kvwatch.url, kvwatch.port, monitor)
        finally:
            monitor.stop()


# A new kvwatch's first poll and the engine's publisher reconnecting to it (ZMQ retries every 0.1 s).
LISTEN_TIMEOUT_S = 15.0


@contextlib.contextmanager
def listening_kvwatch(metrics_url: str, endpoint: str, window: str = "30s") -> Iterator[RunningKvwatch]:
    """A kvwatch bound to a running engine's KV-event `endpoint`, yielded
    once it has polled the engine and the engine's publisher has connected,
    so a load started then is read from its first event."""
    with running_kvwatch(metrics_url, window=window, kv_events=endpoint) as kvwatch:
        events = kvwatch.monitor.kv_events
        if events is None:
            raise AssertionError("kvwatch started without its KV-event source")
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while not (kvwatch.monitor.state.up and events.publishers > 0):
            if time.monotonic() > deadline:
                raise AssertionError(f"within {LISTEN_TIMEOUT_S:g} s: kvwatch up {kvwatch.monitor.state.up}, "
                                     f"publishers connected {events.publishers}")
            time.sleep(0.1)
        yield kvwatch


def generate_rules(out_dir: Path, config: dict) -> Path:
    """Runs `kvwatch generate --config <config as YAML> --out <out_dir>`; returns the rules file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "mixin-test.yaml"
    config_path.write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "kvwatch", "generate", "--config", str(config_path),
                             "--out", str(out_dir)], capture_output=True, text=True, timeout=120)
    if result.returncode:
        raise AssertionError(f"kvwatch generate failed ({result.returncode}):\n{result.stderr[-3000:]}")
    rules = out_dir / "alerts" / "kvwatch-rules.yaml"
    if not rules.is_file():
        raise AssertionError(f"kvwatch generate wrote no {rules.relative_to(out_dir)}:\n{result.stderr[-2000:]}")
    return rules


def tier_reporter(config, prefix: str = "vllm-tier"):
    """Prints a line past pytest's output capture (measured figures go to the tier's log)."""
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")

    def report(message: str) -> None:
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            if terminal is not None:
                terminal.write_line(f"[{prefix}] {message}")
            else:
                print(f"[{prefix}] {message}", flush=True)

    return report
