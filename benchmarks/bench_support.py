"""What every section of the benchmark (benchmarks/run.py) measures with:
CPU time and medians, the report's figures and tables, the machine it ran
on, a page server in its own process, a monitor and a fetcher that hands it
pages from memory."""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvwatch.pipeline.monitor import Monitor
from kvwatch.scrape import FetchResult
from kvwatch.settings import load_settings
from pages import AdvancingPage

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------


def cpu_seconds(fn, arg, number: int) -> float:
    """Thread CPU seconds per call of fn(arg), over `number` calls. The
    garbage collector starts each batch clean, so no batch pays for the
    garbage another one left (prometheus_client's parser leaves plenty)."""
    gc.collect()
    started = time.thread_time()
    for _ in range(number):
        fn(arg)
    return (time.thread_time() - started) / number


def calls_for(seconds_per_call: float, budget: float = 0.05) -> int:
    return max(1, min(200, int(budget / max(seconds_per_call, 1e-6))))


def median(values) -> float:
    return statistics.median(values)


def percentile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def ms(seconds: float | None, digits: int = 2) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.{digits}f} ms"


@dataclass
class Figure:
    name: str
    value: str
    baseline: str
    target: str
    met: bool | None  # None: no target, shown for context


@dataclass
class Report:
    figures: list[Figure] = field(default_factory=list)
    sections: list[str] = field(default_factory=list)  # markdown detail, one block per section
    # Sections asked for but not measured in this run: name -> why (RESULTS.md lists them under "## Not rerun").
    not_run: dict[str, str] = field(default_factory=dict)

    def figure(self, *args) -> None:
        self.figures.append(Figure(*args))


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def plain_table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    fmt = "  ".join("{:<%d}" % width for width in widths)
    return "\n".join([fmt.format(*header), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows])


# --------------------------------------------------------------------------
# The machine
# --------------------------------------------------------------------------


def machine() -> dict[str, str]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "kvwatch", "benchmarks",
                                ":!benchmarks/RESULTS.md"], cwd=REPO, capture_output=True,
                               text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "unknown", ""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    try:
        from importlib.metadata import version
        client_version = version("prometheus-client")
    except Exception:  # noqa: BLE001 - only a label
        client_version = "?"
    return {
        "CPU": model,
        "cores": f"{os.cpu_count()} ({usable} usable)",
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "OS": f"{platform.system()} {platform.release()}",
        "prometheus_client": client_version,
        "kvwatch commit": commit + (" (kvwatch/ or benchmarks/ modified)" if dirty else ""),
        "load average at start": " ".join(f"{x:.2f}" for x in load),
        "garbage collector": f"as kvwatch serve runs it: start-up frozen, gen0 threshold {gc.get_threshold()[0]}",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


# --------------------------------------------------------------------------
# A page server in its own process
# --------------------------------------------------------------------------


@contextmanager
def page_server(fixtures: Path, engines: int):
    process = subprocess.Popen([sys.executable, str(HERE / "pageserver.py"), "--fixtures", str(fixtures),
                                "--engines", str(engines)], stdout=subprocess.PIPE, text=True)
    try:
        url = process.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError("page server did not start")
        yield url
    finally:
        process.terminate()
        process.wait(10)


# --------------------------------------------------------------------------
# A monitor, and pages handed to it from memory
# --------------------------------------------------------------------------


def monitor_for(url: str, window: str = "5m") -> Monitor:
    settings = load_settings(overrides={"target": url, "engine": "vllm", "poll_interval": "1s", "window": window,
                                        "log_level": "warning"}, environ={})
    return Monitor(settings)


class PageFetcher:
    """Stands in for the HTTP fetch: hands the monitor the next page, which
    `prepare` renders beforehand (the stand-in engine's work, not kvwatch's)."""

    def __init__(self, page: AdvancingPage):
        self.page, self.poll, self.text = page, 0, ""

    def prepare(self) -> None:
        self.text = self.page.render(self.poll)
        self.poll += 1

    def fetch(self):
        return FetchResult(self.text, size=len(self.text))
