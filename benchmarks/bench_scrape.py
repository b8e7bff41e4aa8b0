"""The scrape section: /metrics of `kvwatch serve` under 50 concurrent
scrapers (benchmarks/burst.py in its own process), beside /healthz and the
client's own floor, and the CPU of one /metrics render."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import clock as simulated
from bench_support import (HERE, PageFetcher, Report, cpu_seconds, median, monitor_for, ms, page_server, percentile,
                           plain_table, table)
from pages import AdvancingPage, capture_text, scale


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 5.0, headers: str = "") -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}Connection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def scraped_value(body: bytes, name: str) -> float | None:
    for line in body.decode().splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def scrape_bursts(port: int, scrapers: int, rounds: int, path: str = "/metrics",
                  gzip: bool = False) -> tuple[list[float], int]:
    """The bursts, sent by benchmarks/burst.py in its own process (one thread,
    one selector over the keep-alive connections), so the client's work stays
    off the CPU time and the GIL of this process and of kvwatch."""
    command = [sys.executable, str(HERE / "burst.py"), "--port", str(port), "--path", path,
               "--scrapers", str(scrapers), "--rounds", str(rounds)] + (["--gzip"] if gzip else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=60 + rounds * 15)
    if done.returncode != 0:
        raise RuntimeError("burst client failed: " + done.stderr)
    result = json.loads(done.stdout)
    return result["latencies"], result["errors"]


@contextmanager
def bytes_server(size: int):
    """burst.py --serve-bytes: answers every request with size bytes made in
    advance, for the client's own floor."""
    process = subprocess.Popen([sys.executable, str(HERE / "burst.py"), "--serve-bytes", str(size)],
                               stdout=subprocess.PIPE, text=True)
    try:
        yield int(process.stdout.readline())
    finally:
        process.terminate()
        process.wait(10)


def render_cost(fixtures: Path, engines: int) -> tuple[float, float]:
    """CPU of one /metrics render after a few polls of an engines-wide page:
    kvwatch's Renderer, and prometheus_client's generate_latest over the same
    registry (the same bytes), interleaved."""
    from prometheus_client import generate_latest

    from kvwatch.sidecar.collector import Renderer, make_registry

    monitor = monitor_for("http://127.0.0.1:1/metrics")
    monitor.fetcher = PageFetcher(AdvancingPage(scale(capture_text(fixtures), engines)))
    clock = simulated.SimulatedClock()
    simulated.install(clock)
    try:
        for _ in range(5):
            clock.advance(1.0)
            monitor.fetcher.prepare()
            monitor.poll_once()
    finally:
        simulated.uninstall()
    registry = make_registry(monitor)
    renderer = Renderer(registry)
    renderer.render()
    ours, reference = [], []
    for _ in range(5):
        ours.append(cpu_seconds(lambda _: renderer.render(), None, 5))
        reference.append(cpu_seconds(generate_latest, registry, 5))
    return median(ours), median(reference)


def bench_scrape(report: Report, fixtures: Path, quick: bool) -> None:
    rows = []
    scrapers = 50
    rounds = 30 if quick else 60

    def p50_p99(latencies: list[float]) -> str:
        return f"{ms(percentile(latencies, 0.5))} / {ms(percentile(latencies, 0.99))}"

    for engines in (1, 8):
        with page_server(fixtures, engines) as url:
            port = free_port()
            process = subprocess.Popen(
                [sys.executable, "-m", "kvwatch", "serve", "--target", url, "--port", str(port),
                 "--poll-interval", "1s", "--log-level", "warning"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if http_get(port, "/readyz")[0] == 200:
                            break
                    except OSError:
                        pass
                    if time.monotonic() > deadline or process.poll() is not None:
                        raise RuntimeError("kvwatch serve did not become ready: " + (process.stderr.read() if process.poll() is not None else "timeout"))
                    time.sleep(0.1)
                size = len(http_get(port, "/metrics")[1])
                gzip_size = len(http_get(port, "/metrics", headers="Accept-Encoding: gzip\r\n")[1])
                # The client's own floor: the same bursts against a server that
                # answers bytes made in advance, of /metrics' size, while
                # kvwatch and the page server go on polling beside it.
                with bytes_server(size) as floor_port:
                    client_floor, floor_errors = scrape_bursts(floor_port, scrapers, max(10, rounds // 3))
                # The same bursts on /healthz: what the HTTP stack costs with no work behind it.
                health, health_errors = scrape_bursts(port, scrapers, max(10, rounds // 3), "/healthz")
                before = http_get(port, "/metrics")[1]
                started = time.monotonic()
                latencies, errors = scrape_bursts(port, scrapers, rounds)
                # As Prometheus asks: Accept-Encoding: gzip.
                gzipped, gzip_errors = scrape_bursts(port, scrapers, rounds, gzip=True)
                seconds = time.monotonic() - started
                after = http_get(port, "/metrics")[1]
            finally:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
        polls = (scraped_value(after, "kvwatch_polls_total") or 0) - (scraped_value(before, "kvwatch_polls_total") or 0)
        p50, p99 = percentile(latencies, 0.5), percentile(latencies, 0.99)
        baseline = f"/healthz p99 {ms(percentile(health, 0.99))}, client floor p99 {ms(percentile(client_floor, 0.99))}"
        render, render_reference = render_cost(fixtures, engines)
        rows.append([str(engines), f"{size / 1024:.0f} KB ({gzip_size / 1024:.0f} KB gzip)",
                     f"{ms(render)} ({ms(render_reference)})", str(len(latencies)), str(errors), ms(p50), ms(p99),
                     ms(max(latencies)), f"{p50_p99(gzipped)} ({gzip_errors} errors)", p50_p99(health),
                     p50_p99(client_floor), f"{polls:.0f} in {seconds:.0f} s",
                     ms(scraped_value(after, "kvwatch_poll_cpu_seconds"))])
        report.figure(f"/metrics p99, {scrapers} concurrent scrapers, {engines} engine{'s' if engines > 1 else ''}",
                      f"{ms(p99)} (p50 {ms(p50)}, {errors} errors; gzip p99 {ms(percentile(gzipped, 0.99))})",
                      baseline, "< 20 ms", p99 < 0.020 and errors == 0)
        if health_errors or floor_errors:
            print(f"errors: /healthz {health_errors}, client floor {floor_errors}", file=sys.stderr, flush=True)
    header = ["engines", "/metrics size", "render CPU (generate_latest)", "requests", "errors", "p50", "p99", "max",
              "gzip p50 / p99", "/healthz p50 / p99", "client floor p50 / p99", "polls during the test",
              "last poll CPU"]
    report.sections.append(
        "### /metrics under 50 concurrent scrapers\n\n"
        f"`kvwatch serve` (uvicorn) as a subprocess, polling a page server every 1 s; {scrapers} scrapers, each "
        "on its own keep-alive connection, send GET /metrics at the same instant, "
        f"{rounds} times (a burst every 50-290 ms after the last answer, so bursts land on every phase of the "
        "poll); latency is from writing the request to the last byte of the answer. The scrapers are one "
        "thread with one selector in a process of their own (benchmarks/burst.py), which writes the 50 "
        "requests in a row and stamps each answer as its last byte is read. 'gzip' is the same bursts with "
        "Accept-Encoding: gzip, as Prometheus sends. Baselines: the same bursts on /healthz (no work behind "
        "it: the HTTP stack alone), and the client's floor, the same bursts against a server that answers "
        "bytes made in advance of /metrics' size (also burst.py), run while kvwatch and the page server go on "
        "polling. 'render CPU' is one render of kvwatch's registry by kvwatch's Renderer, which /metrics runs "
        "once per poll, beside prometheus_client's generate_latest writing the same bytes.\n\n"
        + table(header, rows))
    print(plain_table(header, rows), flush=True)
