"""Central mode's cost per replica as the fleet grows (`make bench`, section
`central`): simulated replicas (the history benchmark's: every series of a
real vLLM 0.32 page, traffic varying per step) backfilled into a real
Prometheus, then central mode's refresh loop run over them in a process of
its own per instance: 64 and 256 replicas in one instance, and the same
fleet over 4 shards (`--shard k/4`), the shards running at once as they
would be deployed. Per instance: CPU seconds and wall time of the first
refresh (it back-fills one window) and of the steady ones (one new step
each), resident memory, and whether every replica's findings were current
(from the refresh's own step) after each refresh. The union of the shards'
findings is compared with the unsharded instance's.

    .venv/bin/python benchmarks/central_cost.py [--quick]        # prints the figures
    .venv/bin/python benchmarks/central_cost.py child URL ...    # one instance (what the parent starts)

One instance reads the series API's list of every series it serves once per
window span, in one answer under central mode's 32 MiB cap: past about 400
replicas (256 series each) an unsharded instance refuses it ("an answer was
larger than kvwatch reads of one"), which is what the shards are for. The
unsharded 1,000-replica run that the shards' union is compared with reads
with the cap raised, and says so.
"""

from __future__ import annotations

import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

STEP, WINDOW = 30.0, 300.0


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def child(url: str, selector: str, shard: str, first: float, refreshes: int, max_replicas: int,
          max_bytes: int) -> dict:
    """One central instance refreshed `refreshes` times, the store's clock
    one step further each time; its figures as JSON."""
    from kvwatch.central.refresh import Central
    from kvwatch.history.query import CENTRAL_MAX_BYTES, PrometheusClient
    from kvwatch.history.shard import parse_shard
    from kvwatch.pipeline.monitor import tune_garbage_collector
    from kvwatch.settings import load_settings

    tune_garbage_collector()  # as kvwatch serve runs
    settings = load_settings(overrides={"poll_interval": f"{STEP:g}s", "window": f"{WINDOW:g}s"}, environ={})
    now = [first]
    central = Central(PrometheusClient(url, timeout=120, max_bytes=max_bytes or CENTRAL_MAX_BYTES), settings, selector,
                      clock=lambda: now[0], max_replicas=max_replicas, shard=parse_shard(shard))
    base = rss_mib()
    cpu, wall, current, age = [], [], [], []
    for _ in range(refreshes):
        began, began_cpu = time.monotonic(), time.process_time()
        state = central.refresh_once()
        cpu.append(time.process_time() - began_cpu)
        wall.append(time.monotonic() - began)
        if not state.up:
            return {"error": state.detail}
        # Every replica's findings are from this refresh's step.
        current.append(all(v.state.up and v.state.last_success_time == state.last_step
                            for v in state.replicas.values()))
        # The oldest replica's findings, in refreshes (0: from this refresh's step).
        age.append(max((round((state.last_step - (v.state.last_success_time or float("-inf"))) / STEP)
                        for v in state.replicas.values()), default=0))
        now[0] += STEP
    findings = sorted([name, f.cause] for name, view in state.replicas.items() for f in view.state.findings)
    return {"replicas": len(state.replicas), "cpu": cpu, "wall": wall, "current": current, "age": age,
            "rss_mib": rss_mib(), "start_rss_mib": base,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "findings": findings, "cost": state.cost}


def run_instances(url: str, selector: str, shards: int, first: float, refreshes: int,
                  max_bytes: int = 0) -> list[dict]:
    """`shards` instances at once (1: unsharded), each in its own process;
    an instance whose refresh failed answers {"error": its sentence}."""
    processes = []
    for k in range(shards):
        shard = f"{k}/{shards}" if shards > 1 else ""
        processes.append(subprocess.Popen(
            [sys.executable, __file__, "child", url, selector, shard, repr(first), str(refreshes), str(max_bytes)],
            stdout=subprocess.PIPE, text=True))
    results = []
    for process in processes:
        out, _ = process.communicate(timeout=3600)
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def instances_selector(replicas: int) -> str:
    """The first `replicas` of the bench fleet (run.write_history_openmetrics's instances)."""
    names = [f"10.1.{r // 250}.{r % 250}:8000" for r in range(replicas)]
    pattern = "|".join(re.escape(name) for name in names).replace("\\", "\\\\")
    return '{instance=~"' + pattern + '"}'


def measure(quick: bool) -> dict:
    import shutil
    import tempfile

    sys.path.insert(0, str(REPO / "tests"))
    from promstack import backfilled_prometheus
    from bench_history import write_history_openmetrics

    sizes = (16, 64) if quick else (64, 256, 1000)
    refreshes = 4 if quick else 6
    points = int(WINDOW / STEP) + refreshes + 2
    start = float((int(time.time()) // 3600 - 3) * 3600)
    first = start + WINDOW  # the first refresh back-fills [start, start + window]
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-central-"))
    figures = {"sizes": sizes, "refreshes": refreshes, "load_at_start": os.getloadavg()}
    try:
        began = time.monotonic()
        source = workdir / "fleet.om"
        with open(source, "w") as out:
            write_history_openmetrics(out, max(sizes), start, points, STEP)
        with backfilled_prometheus(source, timeout=3600) as prom:
            source.unlink()
            figures["setup_seconds"] = time.monotonic() - began
            for size in sizes:
                selector = instances_selector(size) if size < max(sizes) else '{job="vllm"}'
                for shards in ((1, 4) if size >= 256 or quick else (1,)):
                    label = f"{size} replicas, {shards} shard{'s' if shards > 1 else ''}"
                    results = run_instances(prom.url, selector, shards, first, refreshes)
                    if shards == 1 and "error" in results[0]:
                        print(f"  {label}: {results[0]['error']}", flush=True)
                        figures[f"{label}, refused"] = results[0]["error"]
                        label += ", cap raised"
                        results = run_instances(prom.url, selector, shards, first, refreshes, max_bytes=1 << 30)
                    figures[label] = results
                    print(f"  {label}: " + "; ".join(summary(r) for r in results), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return figures


def steady(result: dict) -> tuple[float, float]:
    """Median CPU and wall seconds of the refreshes after the first."""
    return statistics.median(result["cpu"][1:]), statistics.median(result["wall"][1:])


def summary(result: dict) -> str:
    if "error" in result:
        return result["error"]
    cpu, wall = steady(result)
    return (f"{result['replicas']} replicas: first refresh {result['cpu'][0]:.2f}s CPU ({result['wall'][0]:.2f}s wall), "
            f"then {cpu:.3f}s CPU ({wall:.2f}s wall) per refresh, {result['rss_mib']:.0f} MiB resident "
            f"(peak {result['peak_rss_mib']:.0f}), current after every refresh: {all(result['current'])}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        url, selector, shard, first, refreshes = sys.argv[2:7]
        print(json.dumps(child(url, selector, shard, float(first), int(refreshes), max_replicas=4096,
                               max_bytes=int(sys.argv[7]) if len(sys.argv) > 7 else 0)))
    else:
        print(json.dumps(measure("--quick" in sys.argv), default=str)[:2000])


def bench_central(report, quick: bool) -> None:
    """run.py's section: the figures and the details."""
    from bench_support import table

    found = measure(quick)
    sizes, refreshes = found["sizes"], found["refreshes"]
    interval = STEP

    def one(size: int) -> dict | None:
        for label in (f"{size} replicas, 1 shard", f"{size} replicas, 1 shard, cap raised"):
            if label in found and "error" not in found[label][0]:
                return found[label][0]
        return None

    rows = []
    per_replica = {}
    for size in sizes:
        for shards in (1, 4):
            label = f"{size} replicas, {shards} shard{'s' if shards > 1 else ''}"
            results = found.get(label) or found.get(label + ", cap raised")
            if not results or any("error" in r for r in results):
                continue
            cpu = sum(steady(r)[0] for r in results)
            wall = max(steady(r)[1] for r in results)
            memory = sum(r["rss_mib"] for r in results)
            if shards == 1:
                per_replica[size] = (cpu / size, memory / size)
            rows.append([f"{size:,}", str(shards) + (" (cap raised)" if label + ", cap raised" in found else ""),
                         f"{max(r['cpu'][0] for r in results):.2f} s", f"{cpu:.2f} s", f"{cpu / size * 1e3:.2f} ms",
                         f"{wall:.2f} s", " / ".join(f"{r['rss_mib']:.0f}" for r in results) + " MiB",
                         f"{memory / size:.2f} MiB",
                         "yes" if all(all(r["current"]) for r in results) else "NO"])
    header = ["replicas", "instances", "first refresh CPU (max)", "steady refresh CPU (all)", "per replica",
              "steady refresh wall (slowest)", "resident per instance", "per replica", "current every refresh"]
    print(plain_table_rows(header, rows), flush=True)
    small, large = min(per_replica), max(per_replica)
    growth = (per_replica[large][0] / per_replica[small][0]) if small != large else None
    report.figure(f"central: steady refresh CPU per replica, {small} to {large:,} replicas (one instance)",
                  " / ".join(f"{per_replica[s][0] * 1e3:.2f} ms" for s in sorted(per_replica))
                  + (f"; {large:,} vs {small}: {growth:.2f}x" if growth else ""),
                  f"{small} replicas", "linear (about 1x)", None if growth is None else growth <= 1.25)
    biggest = max(sizes)
    sharded = found.get(f"{biggest} replicas, 4 shards")
    if sharded and not any("error" in r for r in sharded):
        wall = max(max(r["wall"][1:]) for r in sharded)
        cpu = max(steady(r)[0] for r in sharded)
        memory = max(r["rss_mib"] for r in sharded)
        current = all(all(r["current"]) for r in sharded)
        peak = max(r["peak_rss_mib"] for r in sharded)
        oldest = max(max(r.get("age") or [0]) for r in sharded)
        report.figure(f"central: {biggest:,} replicas over 4 shards at once, each refresh within the interval",
                      f"slowest refresh {wall:.1f} s wall; per shard {cpu:.2f} s CPU per refresh, "
                      f"{memory:.0f} MiB resident (largest; peak {peak:.0f} MiB); every replica's findings at most "
                      f"{oldest} refreshes old",
                      f"interval {interval:g} s (findings at most two refreshes old)", f"<= {interval:g} s and <= 2 old",
                      wall <= interval and current and oldest <= 2)
    for size in sizes:
        whole, parts = one(size), found.get(f"{size} replicas, 4 shards")
        if whole is None or not parts or any("error" in r for r in parts):
            continue
        union = sorted(map(tuple, (f for r in parts for f in r["findings"])))
        same = union == sorted(map(tuple, whole["findings"])) and sum(r["replicas"] for r in parts) == whole["replicas"]
        report.figure(f"central: union of 4 shards' findings = one instance's, {size:,} replicas",
                      "yes" if same else "NO", f"one instance ({len(whole['findings'])} findings)", "identical", same)
    refused = [label for label in found if label.endswith(", refused")]
    load = " ".join(f"{v:.2f}" for v in found["load_at_start"])
    report.sections.append("\n".join([
        "### central mode: cost per replica, and 4 shards",
        "",
        f"The history benchmark's simulated replicas (every series of a real vLLM 0.32 page, 256 each) backfilled "
        f"into a real Prometheus ({found['setup_seconds']:.0f} s to write and backfill {biggest:,} replicas), "
        f"central mode refreshed {refreshes} times per instance at a {interval:g} s step with a {WINDOW:g} s window, "
        "each instance in a process of its own (CPU is the process's own, the store's not counted); the 4 shards "
        "run at once, as deployed. The first refresh back-fills one window; the steady ones read one new step. "
        f"Load average at start: {load} (the machine is shared: compare the per-replica ratios, not the seconds).",
        "",
        table(header, rows),
        "",
        ("One instance refused the fleet's series list: " + "; ".join(found[label] for label in refused)
         + " The run it is compared with raised the cap (1 GiB) for that alone." if refused else
         "No instance reached the 32 MiB cap on one answer."),
    ]))


def plain_table_rows(header: list[str], rows: list[list[str]]) -> str:
    from bench_support import plain_table

    return plain_table(header, rows)
