"""What a pod pays for `kvwatch serve`: the whole process's CPU (user + system,
as a container's cgroup bills it) and resident memory per poll, beside the
poll thread's CPU, from one run.

Starts `kvwatch serve` as a child process with the default settings but a
1 s poll against `--target`, through a wrapper that names the process's
threads (Python's thread names are not the kernel's: it writes
{name: native id} once, before the measurement, then exits). After the
warm-up it reads /proc/PID/stat (utime + stime of every thread, those that
ended included) and /proc/PID/task/TID/schedstat (nanoseconds on a CPU, per
thread) before and after `--polls` polls, counted by kvwatch's own
kvwatch_polls_total read by a scrape just before and just after, and prints
one JSON line. Nothing reads the process over the window (a scrape is CPU of
its event loop: the scrape section measures that), so this is the cost of
polling alone, what a pod pays between Prometheus' scrapes.

    .venv/bin/python benchmarks/process_probe.py --target http://127.0.0.1:PORT/metrics [--polls 60]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")
READ_LIMIT = 8 << 20
WRAPPER = """
import json, sys, threading, time
def names(path):
    time.sleep(float(sys.argv[2]))
    with open(path + ".part", "w") as out:
        json.dump({t.name: t.native_id for t in threading.enumerate()}, out)
    import os; os.replace(path + ".part", path)
threading.Thread(target=names, args=(sys.argv[1],), name="probe-names", daemon=True).start()
from kvwatch.cli import main
sys.exit(main(["serve", *sys.argv[3:]]))
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


def polls_done(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        text = answer.read(READ_LIMIT).decode()
    return int(sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith(("kvwatch_polls_total ", "kvwatch_polls_total{"))))


def wait_polls(port: int, count: int, deadline: float) -> int:
    while time.monotonic() < deadline:
        try:
            done = polls_done(port)
            if done >= count:
                return done
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"kvwatch serve did not reach {count} polls in time")


def measure(target: str, polls: int, warmup: int, extra: list[str]) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as work:
        names_file = os.path.join(work, "threads.json")
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        child = subprocess.Popen([sys.executable, "-c", WRAPPER, names_file, "2", "--target", target,
                                  "--poll-interval", "1s", "--port", str(port), *extra],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            start_polls = wait_polls(port, warmup, time.monotonic() + 120)
            cpu0, threads0, t0 = process_cpu(child.pid), threads_cpu(child.pid), time.monotonic()
            # Asleep over the window: a reading is a scrape, which the event loop would pay for.
            time.sleep(polls * 1.0)
            cpu1, threads1, t1 = process_cpu(child.pid), threads_cpu(child.pid), time.monotonic()
            end_polls = polls_done(port)
            rss, hwm = status_kib(child.pid, "VmRSS"), status_kib(child.pid, "VmHWM")
            names = json.loads(Path(names_file).read_text())
        finally:
            child.terminate()
            try:
                child.wait(10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)
    # The poll count is read just before and just after the window, by a scrape outside it.
    done = end_polls - start_polls
    by_id = {tid: name for name, tid in names.items()}
    per_thread: dict[str, float] = {}
    for tid, seconds in threads1.items():
        name = "main (event loop)" if tid == child.pid else by_id.get(tid, "other")
        per_thread[name] = per_thread.get(name, 0.0) + seconds - threads0.get(tid, 0.0)
    return {"polls": done, "wall_seconds": t1 - t0, "process_cpu_seconds": cpu1 - cpu0,
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
