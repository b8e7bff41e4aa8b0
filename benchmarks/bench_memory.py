"""The memory section: a fresh `kvwatch serve` process over a simulated hour
(benchmarks/memory_probe.py), and the worst page the body cap admits
(benchmarks/worst_page_probe.py) against the manifests' memory limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench_support import HERE, Report, page_server, plain_table, table


def bench_memory(report: Report, fixtures: Path, quick: bool) -> None:
    minutes = 20 if quick else 60
    with page_server(fixtures, 1) as url:
        result = subprocess.run([sys.executable, str(HERE / "memory_probe.py"), "--target", url,
                                 "--minutes", str(minutes)], capture_output=True, text=True, timeout=900)
    if result.returncode != 0:
        raise RuntimeError("memory probe failed: " + result.stderr[-2000:])
    found = json.loads(result.stdout.strip().splitlines()[-1])
    samples = {s["minute"]: s for s in found["samples"]}
    mib = 1 / 1024
    first = [samples[m]["rss_kib"] for m in range(1, 11)]
    last = [samples[m]["rss_kib"] for m in range(minutes - 9, minutes + 1)]
    growth = (max(last) - max(first)) * mib
    end = samples[minutes]["rss_kib"] * mib
    objects_growth = samples[minutes]["objects"] - samples[10]["objects"]
    rows = [[str(m), f"{samples[m]['rss_kib'] * mib:.1f} MiB", str(samples[m]["objects"])]
            for m in (0, 1, 5, 10, 20, 30, 40, 50, 60) if m in samples]
    report.figure(f"resident memory after {minutes} simulated min at 1 s", f"{end:.1f} MiB (peak {found['peak_rss_kib'] * mib:.1f})",
                  f"at start, before any poll: {samples[0]['rss_kib'] * mib:.1f} MiB", "<= 80 MiB",
                  end <= 80 and found["failed_polls"] == 0)
    report.figure(f"growth, first vs last 10 of {minutes} min", f"{growth:+.2f} MiB, {objects_growth:+d} objects",
                  "-", "none (<= 1 MiB)", growth <= 1.0)
    report.sections.append(
        "### Memory over a simulated hour\n\n"
        f"A fresh process built as `kvwatch serve` builds itself (settings, Monitor, the FastAPI app served by "
        f"uvicorn on loopback) polls the page server {found['polls']} times over loopback with a simulated wall "
        f"clock advancing 1 s per poll (so the 5 min window, the event ring and the caches see {minutes} minutes "
        f"of polls; it took {found['wall_seconds']:.0f} s), and scrapes its own /metrics every 15 simulated "
        f"seconds. RSS from /proc/self/status after each simulated minute; 'objects' counts the objects the "
        f"garbage collector tracks. Growth compares the highest RSS of minutes 1-10 with that of minutes "
        f"{minutes - 9}-{minutes}. At the end: {found['window_entries']} window entries, {found['label_cache']} "
        f"cached label sets, {found['events']} events, {found['failed_polls']} failed polls.\n\n"
        + table(["simulated minute", "RSS", "objects"], rows))
    print(plain_table(["simulated minute", "RSS", "objects"], rows), flush=True)
    bench_worst_page(report, quick)


def bench_worst_page(report: Report, quick: bool) -> None:
    """The worst page the default body cap admits, against the manifests'
    memory limit, which is derived from the engine's figure
    (kvwatch/mixin/config.py); then the same with the upstream and LMCache
    sources at the cap as well, against the same limit."""
    from kvwatch.mixin.config import KVWATCH_MEMORY_LIMIT_MIB

    # A full window of polls (61 at the defaults): the window's share of the
    # peak is only there once the window is full.
    polls = "8" if quick else "full"
    mib = 1 / 1024
    for sources, what in (("engine", "the engine's page"),
                          ("engine,upstream,lmcache", "the engine's, the upstream's and LMCache's pages")):
        result = subprocess.run([sys.executable, str(HERE / "worst_page_probe.py"), "--polls", polls,
                                 "--sources", sources], capture_output=True, text=True, timeout=1800)
        if result.returncode != 0:
            raise RuntimeError("worst-page probe failed: " + result.stderr[-2000:])
        found = json.loads(result.stdout.strip().splitlines()[-1])
        peak = found["peak_rss_kib"] * mib
        report.figure(f"peak RSS, worst page under the default cap ({found['cap_bytes'] * mib * mib:.0f} MiB) "
                      f"from {sources.replace(',', ', ')}, {found['polls']} polls",
                      f"{peak:.0f} MiB (last poll {found['rss_kib'][-1] * mib:.0f} MiB)",
                      f"at start: {found['rss_before_kib'] * mib:.0f} MiB",
                      f"< the manifests' limit, {KVWATCH_MEMORY_LIMIT_MIB} MiB", peak < KVWATCH_MEMORY_LIMIT_MIB)
        report.sections.append(
            f"### The worst page the body cap admits: {what}\n\n"
            f"A fresh process with kvwatch's default settings polls {found['polls']} times (its clock one poll "
            f"interval a poll, so the window is full), pages of {found['page_bytes']} bytes with one served model "
            "name per line and new names every poll (a gateway that sets one per request), from "
            f"{', '.join(found['sources'])} (the upstream's histogram with the most bucket bounds kvwatch sums), "
            "and reads /metrics and /api/v1/diagnosis after each poll (benchmarks/worst_page_probe.py). Peak RSS "
            f"(VmHWM): {peak:.0f} MiB, against the manifests' memory limit ({KVWATCH_MEMORY_LIMIT_MIB} MiB), "
            "which kvwatch/mixin/config.py derives from the engine's figure.\n")
        print(f"worst page ({sources}): peak {peak:.0f} MiB, limit {KVWATCH_MEMORY_LIMIT_MIB} MiB", flush=True)
