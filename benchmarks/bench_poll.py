"""The poll section: Monitor.poll_once over loopback against a page server
in another process, each stage's CPU beside prometheus_client's parse of
the same page (the yardstick)."""

from __future__ import annotations

import gc
import time
import types
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import clock as simulated
import kvwatch.diagnose
import kvwatch.diagnose.now
import kvwatch.pipeline.monitor
from bench_support import Report, median, monitor_for, ms, page_server, percentile, plain_table, table
from kvwatch.pipeline.monitor import Monitor
from pages import scale


class StageTimer:
    """Wraps the monitor's stages to add up each one's thread CPU time."""

    def __init__(self, monitor: Monitor):
        self.totals: dict[str, float] = {}
        self._restore = []
        self._wrap(monitor.fetcher, "fetch", "fetch")
        self._wrap(monitor.adapter, "adapt", "parse + adapt")
        self._wrap(monitor.window, "add", "window")
        self._wrap(kvwatch.pipeline.monitor, "evaluate_window", "signals")
        self._wrap(kvwatch.diagnose, "diagnose", "diagnosis")
        # The now span's judgment (diagnose/now.py) runs the same two stages over its span.
        self._wrap(kvwatch.diagnose.now, "evaluate_window", "signals")
        self._wrap(kvwatch.diagnose.now, "diagnose", "diagnosis")

    def _wrap(self, owner, attribute: str, stage: str) -> None:
        original = getattr(owner, attribute)
        totals = self.totals

        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                totals[stage] = totals.get(stage, 0.0) + time.thread_time() - started

        setattr(owner, attribute, timed)
        self._restore.append((owner, attribute, original))

    def take(self) -> dict[str, float]:
        found = dict(self.totals)
        self.totals.clear()
        return found

    def reset(self) -> None:
        self.totals.clear()

    def close(self) -> None:
        for owner, attribute, original in reversed(self._restore):
            if isinstance(owner, types.ModuleType):
                setattr(owner, attribute, original)
            else:
                delattr(owner, attribute)  # back to the class's method


def reference_parse_once(text: str) -> float:
    """Thread CPU of one prometheus_client parse of `text`, the garbage
    collected before and after so the polls around it do not pay for it."""
    gc.collect()
    started = time.thread_time()
    list(text_string_to_metric_families(text))
    spent = time.thread_time() - started
    gc.collect()
    return spent


def poll_cycle(url: str, polls: int, window_polls: int, window: str = "5m",
               yardstick: str | None = None) -> tuple[list[float], list[dict], list[float]]:
    """Polls with a full window; every 10th poll is followed by one
    prometheus_client parse of `yardstick` (the machine's speed, measured
    alongside the polls)."""
    monitor = monitor_for(url, window)
    clock = simulated.SimulatedClock()
    simulated.install(clock)
    try:
        for _ in range(window_polls):  # fill the window: the steady state of a running sidecar
            clock.advance(1.0)
            monitor.poll_once()
        timer = StageTimer(monitor)
        totals, stages, reference = [], [], []
        try:
            for index in range(polls):
                clock.advance(1.0)
                timer.reset()
                state = monitor.poll_once()
                if not state.up:
                    raise RuntimeError(f"poll failed: {state.reason} {state.detail}")
                totals.append(state.poll_cpu_seconds)
                stages.append(timer.take())
                if yardstick is not None and index % 10 == 9:
                    reference.append(reference_parse_once(yardstick))
        finally:
            timer.close()
        return totals, stages, reference
    finally:
        simulated.uninstall()


STAGES = ["fetch", "parse + adapt", "window", "signals", "diagnosis"]


# Issue 40's targets for a whole poll, as shares of the yardstick
# (prometheus_client's parse of the same page, measured in the same run):
# about 2 ms and 10 ms on the machine of its first measurements. Issue 9's
# were 0.78x and 0.60x (5 ms and 25 ms where that parse took 6.4 and 42 ms).
POLL_TARGETS = {1: 0.15, 8: 0.13}


def bench_poll(report: Report, capture: str, fixtures: Path, quick: bool) -> None:
    rows = []
    for engines, allowed in POLL_TARGETS.items():
        with page_server(fixtures, engines) as url:
            totals, stages, reference = poll_cycle(url, polls=40 if quick else 120, window_polls=301,
                                                   yardstick=scale(capture, engines))
        total = median(totals)
        yardstick = median(reference)
        ratio = total / yardstick
        share = total / 1.0 * 100
        stage_medians = {s: median([st.get(s, 0.0) for st in stages]) for s in STAGES}
        rest = max(0.0, total - sum(stage_medians.values()))
        rows.append([str(engines), ms(total), ms(percentile(totals, 0.9)), f"{share:.2f} %", ms(yardstick),
                     f"{ratio:.2f}x"] + [ms(stage_medians[s]) for s in STAGES] + [ms(rest)])
        report.figure(f"poll cycle CPU, {engines} engine{'s' if engines > 1 else ''} (5 min window full)",
                      f"{ms(total)} = {share:.2f} % of a core at 1 s; {ratio:.2f}x the yardstick",
                      f"yardstick: prometheus_client's parse of the page, {ms(yardstick)} here",
                      f"<= {allowed:.2f}x the yardstick", ratio <= allowed)
    header = ["engines", "median CPU", "p90 CPU", "core share at 1 s", "yardstick", "CPU / yardstick"] + STAGES + ["rest"]
    report.sections.append(
        "### Whole poll cycle\n\n"
        "Monitor.poll_once over loopback against a page server in another process (counters advancing every "
        "poll), thread CPU time as the monitor records it (state.poll_cpu_seconds), with the default 5 min "
        "window already full (301 polls at a simulated 1 s), median over the measured polls. Stages are "
        "medians of each stage's own CPU time; 'rest' is the monitor's own bookkeeping. The yardstick is "
        "prometheus_client's parse of the same page, measured after every 10th poll: the targets (at "
        "most 0.15x of it at 1 engine and 0.13x at 8) scale with it, so a slower or busier machine "
        "does not fail them, nor a faster one pass them.\n\n" + table(header, rows))
    print(plain_table(header, rows), flush=True)
