"""The curve section: parse + adapt, and the whole poll with its page handed
over in memory, from 1 to 64 engines."""

from __future__ import annotations

import gc

import clock as simulated
from bench_support import PageFetcher, Report, cpu_seconds, median, monitor_for, ms, plain_table, table
from kvwatch.engines.vllm import VllmAdapter
from kvwatch.pipeline.monitor import GC_GEN0_THRESHOLD
from pages import AdvancingPage, sample_count, scale


def linear_fit(points: list[tuple[float, float]]) -> tuple[float, float, float]:
    """Least squares y = slope * x + intercept, and r squared."""
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
    slope = sxy / sxx
    intercept = mean_y - slope * mean_x
    total = sum((y - mean_y) ** 2 for _, y in points)
    residual = sum((y - slope * x - intercept) ** 2 for x, y in points)
    return slope, intercept, 1 - residual / total if total else 1.0


def poll_in_memory(text: str, window_polls: int, polls: int) -> float:
    """Median poll CPU with the page handed over in memory, after
    `window_polls` polls filled the window."""
    gc.collect()
    monitor = monitor_for("http://127.0.0.1:1/metrics", window="1m")
    monitor.fetcher = PageFetcher(AdvancingPage(text))
    clock = simulated.SimulatedClock()
    simulated.install(clock)
    try:
        spent = []
        for poll in range(window_polls + polls):
            clock.advance(1.0)
            monitor.fetcher.prepare()
            state = monitor.poll_once()
            if poll >= window_polls:
                spent.append(state.poll_cpu_seconds)
    finally:
        simulated.uninstall()
    return median(spent)


def bench_curve(report: Report, capture: str, quick: bool) -> None:
    counts = (1, 2, 4, 8, 16, 32, 64)
    window_polls = 31 if quick else 61
    rounds = 5 if quick else 9
    texts = {engines: scale(capture, engines) for engines in counts}
    adapters = {engines: VllmAdapter() for engines in counts}
    for engines in counts:
        adapters[engines].adapt(texts[engines], at=0.0)
    # Every engine count in every round, so a busy spell of the machine
    # weighs on all of them alike.
    parse = {engines: [] for engines in counts}
    for _ in range(rounds):
        for engines in counts:
            adapter = adapters[engines]
            parse[engines].append(cpu_seconds(lambda t: adapter.adapt(t, at=0.0), texts[engines], max(1, 64 // engines)))
    del adapters
    # The poll with its page handed over in memory (adapt, window, signals,
    # diagnosis), one engine count at a time with its window already full,
    # with kvwatch serve's collector setting and with CPython's default.
    cycle = {engines: poll_in_memory(texts[engines], window_polls, 7 if engines >= 32 else 15) for engines in counts}
    tuned = gc.get_threshold()
    gc.set_threshold(700, *tuned[1:])
    try:
        default_gc = {engines: poll_in_memory(texts[engines], window_polls, 7 if engines >= 32 else 15)
                      for engines in counts}
    finally:
        gc.set_threshold(*tuned)
    rows = []
    per_sample = {}
    for engines in counts:
        samples = sample_count(texts[engines])
        p, c = median(parse[engines]), cycle[engines]
        per_sample[engines] = p / samples
        rows.append([str(engines), str(samples), ms(p, 3), f"{p / samples * 1e6:.2f} us",
                     f"{per_sample[engines] / per_sample[1]:.2f}", ms(c, 2), f"{c / engines * 1e3:.2f} ms",
                     ms(default_gc[engines], 2)])
    # Linearity: the cost per sample at 64 engines against 8 (1 engine carries fixed costs).
    drift = per_sample[64] / per_sample[8]
    fit = linear_fit([(sample_count(texts[e]), median(parse[e])) for e in counts])
    report.figure("parse+adapt, 1 to 64 engines", f"{fit[0] * 1e6:.2f} us per sample + {ms(fit[1], 2)}, r2 {fit[2]:.3f}",
                  "-", "linear", None)
    report.figure("parse+adapt cost per sample, 64 vs 8 engines", f"{drift:.2f}x", "-", "1x if linear", None)
    header = ["engines", "samples", "parse+adapt", "per sample", "per sample vs 1 engine", "poll, page in memory",
              "per engine", "poll, CPython's default collector"]
    report.sections.append(
        "### Cost from 1 to 64 engines\n\n"
        f"Parse + adapt CPU per page (warm caches; medians of {rounds} rounds, each measuring every engine count "
        f"in turn), and the whole poll with its page handed over in memory (adapt, window, signals, diagnosis; "
        f"median of the polls after a 1 min window filled at a simulated 1 s). The diagnosis reads every poll "
        "in the window, so a 5 min window costs more there (see the poll cycle above). The last column is the "
        f"same poll with CPython's default collector threshold (700 allocations) instead of kvwatch serve's "
        f"({GC_GEN0_THRESHOLD}): the collector then runs dozens of times per poll and re-scans the window's "
        "objects each time.\n\n" + table(header, rows))
    print(plain_table(header, rows), flush=True)
