"""What a pod pays for `kvwatch serve`: the whole process's CPU (user + system,
as a container's cgroup bills it) and resident memory per poll, beside the
poll thread's CPU, from one run.

Starts `kvwatch serve` as a child process with the default settings but a
1 s poll against `--target`, through a wrapper that adds one listener after
each poll (counting polls and adding up each poll's CPU as the monitor records
it, state.poll_cpu_seconds: the figure of the bench's poll section) and, on
SIGUSR1, writes those sums and the threads' names with their kernel ids
(Python's thread names are not the kernel's). After the warm-up it reads
/proc/PID/stat (utime + stime of every thread, those that ended included),
/proc/PID/task/TID/schedstat (nanoseconds on a CPU, per thread) and the
wrapper's sums before and after `--polls` polls, and prints one JSON line.
Nothing else reads the process: no scrape (a scrape is CPU of its event loop,
the scrape section's figure), so this is what a pod pays between scrapes.

    .venv/bin/python benchmarks/process_probe.py --target http://127.0.0.1:PORT/metrics [--polls 60]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
WRAPPER = """
import json, os, signal, sys, threading, time
from kvwatch.pipeline.monitor import Monitor
polls = {"count": 0, "cpu": 0.0}
def count(state):
    polls["count"] += 1
    polls["cpu"] += state.poll_cpu_seconds
start = Monitor.start
def start_counting(self):
    self.after_poll.insert(0, count)
    start(self)
Monitor.start = start_counting
def dump(signum, frame):
    with open(sys.argv[1] + ".part", "w") as out:
        json.dump({"polls": dict(polls), "threads": {t.name: t.native_id for t in threading.enumerate()}}, out)
    os.replace(sys.argv[1] + ".part", sys.argv[1])
signal.signal(signal.SIGUSR1, dump)
from kvwatch.cli import main
sys.exit(main(["serve", *sys.argv[2:]]))
"""

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_cpu(pid: int) -> float:
    """utime + stime of the whole process, every thread's, ended ones included (seconds, tick resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def threads_cpu(pid: int) -> dict[int, float]:
    """Seconds on a CPU of each live thread (schedstat: nanoseconds, what the scheduler charges the cgroup)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return out


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/{pid}/status")


def sums(pid: int, path: Path, deadline: float) -> dict:
    """The wrapper's poll count and poll CPU and the thread names, asked for by SIGUSR1."""
    path.unlink(missing_ok=True)
    os.kill(pid, signal.SIGUSR1)
    while not path.exists():
        if time.monotonic() > deadline:
            raise SystemExit("kvwatch serve did not answer SIGUSR1 in time")
        time.sleep(0.05)
    return json.loads(path.read_text())


def wait_polls(pid: int, path: Path, count: int, deadline: float) -> dict:
    while True:
        found = sums(pid, path, deadline)
        if found["polls"]["count"] >= count:
            return found
        if time.monotonic() > deadline:
            raise SystemExit(f"kvwatch serve did not reach {count} polls in time")
        time.sleep(1.0)


def measure(target: str, polls: int, warmup: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "sums.json"
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        child = subprocess.Popen([sys.executable, "-c", WRAPPER, str(path), "--target", target,
                                  "--poll-interval", "1s", "--port", str(free_port()), *extra],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(2)  # the wrapper's handler is set before kvwatch starts; Python's start-up comes first
            first = wait_polls(child.pid, path, warmup, time.monotonic() + 120)
            cpu0, threads0, t0 = process_cpu(child.pid), threads_cpu(child.pid), time.monotonic()
            time.sleep(polls * 1.0)
            cpu1, threads1, t1 = process_cpu(child.pid), threads_cpu(child.pid), time.monotonic()
            last = sums(child.pid, path, time.monotonic() + 30)
            rss, hwm = status_kib(child.pid, "VmRSS"), status_kib(child.pid, "VmHWM")
        finally:
            child.terminate()
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
    by_id = {tid: name for name, tid in last["threads"].items()}
    per_thread: dict[str, float] = {}
    for tid, seconds in threads1.items():
        name = "main (event loop)" if tid == child.pid else by_id.get(tid, "other")
        per_thread[name] = per_thread.get(name, 0.0) + seconds - threads0.get(tid, 0.0)
    return {"polls": last["polls"]["count"] - first["polls"]["count"],
            "poll_cpu_seconds": last["polls"]["cpu"] - first["polls"]["cpu"],
            "wall_seconds": t1 - t0, "process_cpu_seconds": cpu1 - cpu0,
            "threads_cpu_seconds": per_thread, "rss_kib": rss, "hwm_kib": hwm}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--polls", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10, help="polls before the measurement starts")
    parser.add_argument("serve_args", nargs="*", help="more flags of kvwatch serve (after --)")
    args = parser.parse_args()
    print(json.dumps(measure(args.target, args.polls, args.warmup, args.serve_args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
