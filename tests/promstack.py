"""Real Prometheus, VictoriaMetrics and Alertmanager (Debian packages) on
loopback for end-to-end tests: started in temp dirs on free ports, stopped
and removed after. Use `prometheus(...)`, `backfilled_prometheus(...)`,
`victoria_metrics(...)` and `alertmanager(...)` as context managers."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Iterator

import requests
import yaml


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    raise RuntimeError(f"none of {names} is installed (make test installs them: scripts/install-system-deps.sh)")


def wait_until(check, timeout: float, what: str, interval: float = 0.25):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})")


class Running:
    def __init__(self, url: str, process: subprocess.Popen, workdir: Path):
        self.url = url
        self.process = process
        self.workdir = workdir

    def log(self) -> str:
        path = self.workdir / "log.txt"
        return path.read_text()[-4000:] if path.exists() else ""


@contextlib.contextmanager
def _process(args: list[str], workdir: Path, ready_url: str, name: str) -> Iterator[subprocess.Popen]:
    log = open(workdir / "log.txt", "w")
    process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True)
    try:
        def ready():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited: {(workdir / 'log.txt').read_text()[-2000:]}")
            return requests.get(ready_url, timeout=1).status_code == 200
        wait_until(ready, 30, f"{name} at {ready_url}")
        yield process
    finally:
        stop_process(process)
        log.close()


def stop_process(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, and SIGKILL after `grace_s`: no child outlives its test."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


@contextlib.contextmanager
def _prometheus_in(workdir: Path, config: dict, retention: str) -> Iterator[Running]:
    """Prometheus with `config` on a free loopback port, its data under `workdir`."""
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        _binary("prometheus"), f"--config.file={workdir / 'prometheus.yml'}",
        f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
        f"--storage.tsdb.retention.time={retention}",
    ]
    with _process(args, workdir, f"{url}/-/ready", "prometheus") as process:
        yield Running(url, process, workdir)


@contextlib.contextmanager
def prometheus(targets: list[str], rule_files: list[Path] = (), interval: str = "1s",
               alertmanager_url: str | None = None, metrics_path: str = "/metrics",
               scrape_timeout: str | None = None) -> Iterator[Running]:
    """targets: host:port strings scraped every `interval`; a scrape times out
    after `scrape_timeout` (at most the interval, Prometheus' default then)."""
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-prom-"))
    try:
        rules = []
        for i, path in enumerate(rule_files):
            copy = workdir / f"rules-{i}.yaml"
            shutil.copy(path, copy)
            rules.append(str(copy))
        config = {
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       **({"scrape_timeout": scrape_timeout} if scrape_timeout else {})},
            "rule_files": rules,
            "scrape_configs": [{"job_name": "kvwatch", "metrics_path": metrics_path,
                                "static_configs": [{"targets": targets}]}],
        }
        if alertmanager_url:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager_url.split("//")[1]]}]}]}
        with _prometheus_in(workdir, config, "1h") as running:
            yield running
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def backfill(openmetrics: str | Path, data_dir: Path, block_hours: int = 2, timeout: float = 300) -> None:
    """Write OpenMetrics text with timestamps (or a file of it, left in
    place) into TSDB blocks under `data_dir` (`promtool tsdb
    create-blocks-from openmetrics`)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(openmetrics, Path):
        source = openmetrics
    else:
        source = data_dir.parent / "backfill.om"
        source.write_text(openmetrics)
    result = subprocess.run([_binary("promtool"), "tsdb", "create-blocks-from", "openmetrics",
                             f"--max-block-duration={block_hours}h", str(source), str(data_dir)],
                            capture_output=True, text=True, timeout=timeout)
    if source is not openmetrics:
        source.unlink()
    if result.returncode != 0:
        raise RuntimeError(f"promtool backfill failed: {result.stdout[-2000:]} {result.stderr[-2000:]}")


@contextlib.contextmanager
def backfilled_prometheus(openmetrics: str | Path, timeout: float = 300, block_hours: int = 2) -> Iterator[Running]:
    """A Prometheus with no targets over the blocks backfilled from
    `openmetrics` (text, or a file of it), kept however old they are
    (retention 100 years). promtool reads the whole input once per block
    span: a long range backfills faster in longer blocks (`block_hours`)."""
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-prom-"))
    try:
        backfill(openmetrics, workdir / "data", block_hours=block_hours, timeout=timeout)
        with _prometheus_in(workdir, {"global": {"scrape_interval": "1m"}}, "100y") as running:
            yield running
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?)\s+(\S+)\s+(\S+)$")


def _as_prometheus_text(openmetrics: str | Path, out: Path) -> tuple[int, float, float]:
    """OpenMetrics text with timestamps in seconds (what `backfill` reads)
    as the Prometheus text VictoriaMetrics imports, timestamps in
    milliseconds; (distinct series, first and last time)."""
    series: set[str] = set()
    first, last = float("inf"), float("-inf")
    lines = Path(openmetrics).open() if isinstance(openmetrics, Path) else io.StringIO(openmetrics)
    with lines, out.open("w") as sink:
        for line in lines:
            match = _SAMPLE.match(line.rstrip("\n"))
            if not match:
                continue  # # TYPE, # HELP, # EOF
            name, value, at = match.groups()
            seconds = float(at)
            first, last = min(first, seconds), max(last, seconds)
            series.add(name)
            sink.write(f"{name} {value} {int(round(seconds * 1000))}\n")
    return len(series), first, last


@contextlib.contextmanager
def victoria_metrics(openmetrics: str | Path, timeout: float = 300) -> Iterator[Running]:
    """A single-node VictoriaMetrics (Debian's victoria-metrics) on a free
    loopback port holding the samples of `openmetrics` (text, or a file of
    it: what `backfilled_prometheus` backfills), imported through its
    /api/v1/import/prometheus and flushed, so that the two stores hold the
    same samples. Limits raised for large fleets (the series API's 30,000
    series, a query's 300,000 unique series); the query cache off."""
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-vm-"))
    try:
        text = workdir / "import.prom"
        count, first, last = _as_prometheus_text(openmetrics, text)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        args = [_binary("victoria-metrics"), f"-storageDataPath={workdir / 'data'}",
                f"-httpListenAddr=127.0.0.1:{port}", "-retentionPeriod=100y", "-search.disableCache",
                "-search.maxSeries=10000000", "-search.maxUniqueTimeseries=10000000", "-loggerLevel=WARN"]
        with _process(args, workdir, f"{url}/health", "victoria-metrics") as process:
            with text.open("rb") as body:
                answer = requests.post(f"{url}/api/v1/import/prometheus", data=body, timeout=timeout)
            answer.raise_for_status()
            text.unlink()

            def stored() -> bool:
                requests.get(f"{url}/internal/force_flush", timeout=10)
                found = requests.post(f"{url}/api/v1/series", data={
                    "match[]": '{__name__=~".+"}', "start": f"{first:.3f}", "end": f"{last:.3f}"}, timeout=60)
                return len(found.json()["data"]) >= count
            wait_until(stored, 60, f"VictoriaMetrics to hold the {count} imported series", interval=1)
            yield Running(url, process, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def alertmanager(webhook_url: str) -> Iterator[Running]:
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-am-"))
    try:
        config = {
            "route": {"receiver": "test", "group_by": ["alertname", "cause"], "group_wait": "1s",
                      "group_interval": "1s", "repeat_interval": "1h"},
            "receivers": [{"name": "test", "webhook_configs": [{"url": webhook_url, "send_resolved": True}]}],
        }
        (workdir / "alertmanager.yml").write_text(yaml.safe_dump(config))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        args = [
            _binary("prometheus-alertmanager", "alertmanager"), f"--config.file={workdir / 'alertmanager.yml'}",
            f"--storage.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ]
        with _process(args, workdir, f"{url}/-/ready", "alertmanager") as process:
            yield Running(url, process, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def query(prometheus_url: str, expr: str, at: float | None = None, timeout: float = 5.0) -> list[dict]:
    """An instant query, at `at` (epoch seconds) or now."""
    params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
    body = requests.get(f"{prometheus_url}/api/v1/query", params=params, timeout=timeout).json()
    if body.get("status") != "success":
        raise AssertionError(f"query {expr!r} failed: {json.dumps(body)[:500]}")
    return body["data"]["result"]


def query_range(prometheus_url: str, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
    body = requests.post(f"{prometheus_url}/api/v1/query_range",
                         data={"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": str(step)},
                         timeout=30).json()
    assert body["status"] == "success", (expr[:200], body)
    return body["data"]["result"]
