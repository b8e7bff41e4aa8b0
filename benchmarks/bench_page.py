"""The page section: what the status page at / costs, its bytes and the CPU
to build the state it draws."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import clock as simulated
from bench_support import PageFetcher, Report, cpu_seconds, median, monitor_for, ms, table
from kvwatch.pipeline.monitor import Monitor
from pages import AdvancingPage, capture_text, scale


def page_monitor(fixtures: Path, engines: int, interval: float) -> Monitor:
    """A monitor whose 5-minute window is full of an engines-wide page polled
    every `interval` simulated seconds."""
    monitor = monitor_for("http://127.0.0.1:1/metrics")
    monitor.settings.poll_interval = interval
    monitor.fetcher = PageFetcher(AdvancingPage(scale(capture_text(fixtures), engines)))
    clock = simulated.SimulatedClock()
    simulated.install(clock)
    try:
        for _ in range(int(monitor.settings.window / interval) + 2):
            clock.advance(interval)
            monitor.fetcher.prepare()
            monitor.poll_once()
    finally:
        simulated.uninstall()
    return monitor


def bench_page(report: Report, fixtures: Path, quick: bool) -> None:
    """What the page at / costs: its bytes (the page carries the state it
    draws first; each refresh then fetches the three JSON routes), and the
    CPU to build that state JSON, once per refresh after a poll (the trend
    points of the newest poll computed, the rest kept on their entries) and
    cold (every point computed, as after a start)."""
    from kvwatch.sidecar import series as series_module
    from kvwatch.sidecar.report import diagnosis_json, signals_json
    from kvwatch.sidecar.statuspage import page_state, render_status_page

    rows = []
    for engines, interval in ((1, 5.0), (8, 5.0), (8, 1.0)):
        monitor = page_monitor(fixtures, engines, interval)
        state, settings = monitor.state, monitor.settings
        html = render_status_page(state, settings).encode()
        html_bytes = len(html)
        gzip_bytes = len(gzip.compress(html, compresslevel=1))
        refresh_bytes = sum(len(json.dumps(body).encode()) for body in (
            signals_json(state, settings), diagnosis_json(state, settings), series_module.series_json(state, settings)))

        def build(_):
            return json.dumps(page_state(state, settings))

        def build_cold(_):
            for entry in state.entries:
                entry.derived.pop(series_module._CACHE_KEY, None)
            return json.dumps(page_state(state, settings))

        rounds = 3 if quick else 7
        warm = median([cpu_seconds(build, None, 3) for _ in range(rounds)])
        cold = median([cpu_seconds(build_cold, None, 1) for _ in range(rounds)])
        rows.append([str(engines), f"{interval:g} s", str(len(state.entries)),
                     f"{html_bytes / 1024:.1f} KB ({gzip_bytes / 1024:.1f} KB gzipped)",
                     f"{refresh_bytes / 1024:.1f} KB", ms(warm), ms(cold)])
        print(f"  {engines} engines, poll {interval:g} s, {len(state.entries)} window entries: page "
              f"{html_bytes / 1024:.1f} KB ({gzip_bytes / 1024:.1f} KB gzipped), refresh JSON {refresh_bytes / 1024:.1f} KB, state JSON build "
              f"{ms(warm)} (cold {ms(cold)})", flush=True)
        if engines == 8 and interval == 5.0:
            report.figure("status page size, 8 engines", f"{html_bytes / 1024:.1f} KB", "-", "< 200 KB",
                          html_bytes < 200 * 1024)
            report.figure("status page transferred (gzip), 8 engines", f"{gzip_bytes / 1024:.1f} KB", "-",
                          "< 200 KB", gzip_bytes < 200 * 1024)
            report.figure("page state JSON build, 8 engines", ms(warm), "-", "< 100 ms", warm < 0.1)
            report.figure("page state JSON build, 8 engines, cold", ms(cold), "-", "< 100 ms", cold < 0.1)
    report.sections.append(
        "### Status page\n\n"
        "The page at `/` carries the state it draws first (signals, findings, the trend series); each refresh "
        "fetches `/api/v1/signals`, `/api/v1/diagnosis` and `/api/v1/series` (all served gzipped to clients "
        "that accept it). Build: CPU of `page_state` plus "
        "`json.dumps` after a poll (trend points of the new entry computed, the others kept on their entries), "
        "and cold (every point computed). A 5-minute window of the scaled real capture.\n\n"
        + table(["engines", "poll", "window entries", "page", "refresh JSON", "state JSON build", "cold build"], rows))
