"""The live loop's fast path gives what the full evaluation gives, at every
poll of every real recording: every signal (per engine and per model, with
its notes and pinned quantiles) and every finding with all its evidence.

The fast path is the diagnosis reading the window's kept per-engine polls
(diagnose/context.py EnginePolls: values summed in C, maxima kept in
monotonic queues, counters summed between two times by position) and the
signals' evaluation cache (signals.evaluate: values reused where a view's
inputs did not change). The full evaluation walks every poll in Python
(EngineContext.incremental off) and derives every signal afresh (the
window's evaluation cache emptied before each poll). Both replay the same
pages through the sidecar's own Monitor; the comparison is of repr(), so a
float must agree to the last bit (and -0.0 is not 0.0)."""

from __future__ import annotations

import pytest

from kvwatch.capture.bundle import Capture
from kvwatch.capture.replay import ReplaySource
from kvwatch.diagnose.context import EngineContext
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings


def recordings(fixtures_dir) -> list:
    found = sorted(fixtures_dir.glob("**/capture.tar.gz"))
    assert len(found) >= 14  # every scenario folder of vllm-0.32-cpu-scenarios
    return found


def polls_of(path, window: str, incremental: bool) -> list[str]:
    """repr() of every poll's signals and findings, replaying `path`."""
    settings = load_settings(overrides={"poll_interval": "1s", "window": window}, environ={})
    source = ReplaySource(Capture(path).pages())
    monitor = Monitor(settings, fetcher=source, clock=source.now)
    seen = []
    original = EngineContext.incremental
    EngineContext.incremental = incremental
    try:
        while not source.exhausted:
            if not incremental:
                monitor.window.evaluated = {}  # every signal derived afresh
                monitor.window.kept = {}  # nothing the diagnosis kept
            state = monitor.poll_once()
            rows = [(row.model, row.engine, row.values, row.notes, row.pinned)
                    for row in state.per_engine + state.per_model]
            seen.append(repr((state.last_poll_time, rows, state.findings)))
    finally:
        EngineContext.incremental = original
    return seen


@pytest.mark.parametrize("window", ["60s", "20s"])
def test_fast_path_gives_the_full_evaluation_at_every_poll_of_every_recording(fixtures_dir, window):
    findings_seen = set()
    for path in recordings(fixtures_dir):
        fast = polls_of(path, window, incremental=True)
        full = polls_of(path, window, incremental=False)
        assert len(fast) == len(full) > 10, path.parent.name
        for index, (a, b) in enumerate(zip(fast, full)):
            assert a == b, f"{path.parent.name}, poll {index}"
        findings_seen.update(part.split("'")[0] for part in "".join(fast).split("Finding(symptom='")[1:])
    # The recordings exercise what the fast path keeps: exhaustion (full
    # polls, peaks, shares), low hit rates (counters between two times,
    # usage), slow first tokens (waiting) and restarts.
    assert {"exhaustion", "low_hit_rate", "slow_first_token", "change"} <= findings_seen


def test_the_window_leaves_while_the_kept_polls_follow(fixtures_dir):
    """The kept polls are the window's polls after every poll, as entries
    arrive and leave (a 20 s window over recordings of minutes)."""
    from kvwatch.diagnose.context import polls_of as entry_polls, window_polls

    path = fixtures_dir / "vllm-0.32-cpu-scenarios" / "restart" / "capture.tar.gz"
    settings = load_settings(overrides={"poll_interval": "1s", "window": "20s"}, environ={})
    source = ReplaySource(Capture(path).pages())
    monitor = Monitor(settings, fetcher=source, clock=source.now)
    left = 0
    while not source.exhausted:
        before = monitor.window.earliest
        monitor.poll_once()
        left += before is not None and monitor.window.earliest is not before
        kept = window_polls(monitor.window)
        for key, track in kept.engines.items():
            walked = [poll for entry in monitor.window.entries if (poll := entry_polls(entry).get(key)) is not None]
            assert list(track.polls) == walked
            assert list(track.times) == [poll.time for poll in walked]
    assert left > 10


def eta_written_out(series):
    """signals._eta as the definition writes it, point by point in Python."""
    from kvwatch.signals.catalogue import TREND_SECONDS, _clamp01

    if len(series) < 2:
        return None
    horizon = series[-1][0] - TREND_SECONDS
    series = [point for point in series if point[0] >= horizon]
    n = len(series)
    if n < 2:
        return None
    values = [v for _t, v in series]
    total = sum(values)
    if values[-1] < total / n:
        return None
    t0 = series[0][0]
    offsets = [t - t0 for t, _v in series]
    mean_t = sum(offsets) / n
    mean_v = total / n
    centred = [offset - mean_t for offset in offsets]
    var = sum([d ** 2 for d in centred])
    if var <= 0:
        return None
    slope = sum([d * (v - mean_v) for d, v in zip(centred, values)]) / var
    if slope <= 0:
        return None
    return max(0.0, 1.0 - _clamp01(series[-1][1])) / slope


def usage_sum_written_out(series):
    """_usage_total's sum of the clamped usage (BlockSums.add's input), point by point."""
    return sum([(v if v < 1.0 else 1.0) if v > 0.0 else 0.0 for _t, v in series])


def test_trend_and_block_sums_give_the_written_out_definition(fixtures_dir):
    """signals._eta and _usage_total (BlockSums.add's) map their arithmetic in C: the same
    float operations in the same order as the definition written out, on
    every usage series of every recording's windows and on series that
    leave the usual shape (unordered or repeated times, NaN, values outside
    0..1)."""
    import math
    import random

    from kvwatch.signals.evaluation import BlockSums, _EngineConfig, _eta, _eta_of, _usage_total, _usage_total_of

    def same(a, b):
        return repr(a) == repr(b)

    def block_sum(series):
        config = _EngineConfig(count=1001.0, block_size=16.0, memory=None, capacity=16000.0, blocks_hold=True)
        sums = BlockSums().add(config, 0.5, len(series), _usage_total(series))
        return sums.usage_weighted

    checked = rising = 0
    for path in recordings(fixtures_dir):
        settings = load_settings(overrides={"poll_interval": "1s", "window": "5m"}, environ={})
        source = ReplaySource(Capture(path).pages())
        monitor = Monitor(settings, fetcher=source, clock=source.now)
        while not source.exhausted:
            monitor.poll_once()
            for key in monitor.window.latest.engines if monitor.window.latest else ():
                series = monitor.window.gauge_series(key, "kv_usage")
                found = _eta(series)
                assert same(found, eta_written_out(series)), path.parent.name
                # As the live loop reads it: the window's columns and what it keeps about them.
                times, values, ordered, in_unit = monitor.window.gauge_columns(key, "kv_usage")
                assert same(_eta_of(times, values, ordered, sum(values)), found), path.parent.name
                assert same(_usage_total_of(values, sum(values), in_unit), usage_sum_written_out(series))
                if series:
                    assert same(block_sum(series), 1000.0 * usage_sum_written_out(series) / len(series))
                checked += 1
                rising += found is not None
    assert checked > 500 and rising > 10
    draw = random.Random(7)
    for case in range(400):
        n = draw.randint(0, 40)
        times = sorted(draw.uniform(0, 900) for _ in range(n))
        if case % 5 == 1:
            draw.shuffle(times)
        if case % 5 == 2 and n > 3:
            times[2] = times[1]
        values = [draw.uniform(-0.2, 1.2) if case % 3 else draw.uniform(0, 1) for _ in range(n)]
        if case % 7 == 3 and n:
            values[draw.randrange(n)] = math.nan
        if case % 11 == 4 and n:
            values[draw.randrange(n)] = -0.0
        series = list(zip(times, values))
        assert same(_eta(series), eta_written_out(series)), case
        times, values = [t for t, _v in series], [v for _t, v in series]
        ordered = all(a < b for a, b in zip(times, times[1:]))
        assert same(_eta_of(times, values, ordered, sum(values)), eta_written_out(series)), case
        in_unit = all(0.0 <= v <= 1.0 for v in values)
        assert same(_usage_total_of(values, sum(values), in_unit), usage_sum_written_out(series)), case
        if series:
            assert same(block_sum(series), 1000.0 * usage_sum_written_out(series) / len(series)), case


def tidy_written_out(evidence):
    """diagnose.context.tidy as the definition writes it: each figure formatted."""
    import math

    tidy = {}
    for key, value in evidence.items():
        if value is None:
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                continue
            value = float(round(value)) if abs(value) >= 1000 else float(f"{value:.4g}")
            if value.is_integer() and abs(value) < 1e15:
                value = int(value)
        tidy[key] = value
    return tidy


def test_tidy_rounds_every_figure_as_written_out_seen_again_or_not():
    """tidy looks up the figures it rounded before: the same result, to the
    type and the sign, for figures seen again or not, across its emptying."""
    import math
    import random

    from kvwatch.diagnose import context

    draw = random.Random(11)
    figures = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e15, -1e15, 999.95, 999.9999, 1000.0, 0.30000000000000004,
               1e-300, 5e-324, 123456.5, 2.5, -2.5, 1.0, 7, True, "text", None, 10 ** 20, 1.7976931348623157e308]
    figures += [draw.uniform(-2000, 2000) for _ in range(3000)] + [draw.random() * 10 ** draw.randint(-12, 18)
                                                                      for _ in range(3000)]
    for round_ in range(3):  # new, then seen again, then after the lookups emptied
        if round_ == 2:
            context._ROUNDED.clear()
        for start in range(0, len(figures), 40):
            evidence = {f"k{i}": figure for i, figure in enumerate(figures[start:start + 40])}
            assert repr(context.tidy(evidence)) == repr(tidy_written_out(evidence))


def _bench_pages():
    """benchmarks/pages.py, loaded from its file (benchmarks/ on sys.path
    would shadow tests/pageserver.py)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "bench_pages", Path(__file__).resolve().parent.parent / "benchmarks" / "pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Pages:
    """The Monitor's fetcher and clock over (time, page text) pairs."""

    def __init__(self, timed: list[tuple[float, str]]):
        self.timed, self.index = timed, 0

    @property
    def exhausted(self) -> bool:
        return self.index >= len(self.timed)

    def now(self) -> float:
        return self.timed[min(self.index, len(self.timed) - 1)][0]

    def fetch(self):
        from kvwatch.scrape import FetchResult

        text = self.timed[self.index][1]
        self.index += 1
        return FetchResult(text, size=len(text))


def test_signals_kept_while_only_the_span_moves_give_the_full_evaluation(fixtures_dir, monkeypatch):
    """A steady load (every counter advancing by the same step each poll,
    as the benchmark's page does) and an idle engine (the same page) keep
    the window's increases equal from poll to poll while its span moves
    with the poll times: the signals that did not read the span keep their
    values and the rest are derived anew; with times a whole second apart
    (the span equal too) every value is kept. Each poll, at 1 and 3
    engines, gives what deriving every signal afresh gives, and both paths
    are taken."""
    import random

    from kvwatch.signals import evaluation

    taken = {"kept": 0, "derived": 0, "span moved": 0}
    original_evaluate, original_inner = evaluation.evaluate, evaluation._evaluate_watched

    def inner(view, model, engine, then):
        taken["derived"] += 1
        taken["span moved"] += then is not None
        return original_inner(view, model, engine, then)

    def evaluate(view, model, engine, remembered=None, kept=None):
        taken["kept"] += kept is not None
        return original_evaluate(view, model, engine, remembered, kept)

    monkeypatch.setattr(evaluation, "_evaluate_watched", inner)
    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    pages = _bench_pages()
    text = (fixtures_dir / pages.CAPTURE).read_text()
    draw = random.Random(3)
    for engines in (1, 3):
        advancing = pages.AdvancingPage(pages.scale(text, engines))
        rendered = ([advancing.render(k) for k in range(45)] + [advancing.render(44)] * 45
                    + [advancing.render(44 + k) for k in range(1, 45)])
        now, timed = 1.8e9, []
        for index, page in enumerate(rendered):
            # Jittered, as a live poll's times are; whole seconds apart for a stretch of each phase.
            now += 1.0 if index % 45 >= 15 else draw.uniform(0.9, 1.1)
            timed.append((now, page))
        seen = {}
        for incremental in (True, False):
            settings = load_settings(overrides={"poll_interval": "1s", "window": "20s", "engine": "vllm"}, environ={})
            source = _Pages(timed)
            monitor = Monitor(settings, fetcher=source, clock=source.now)
            seen[incremental] = []
            while not source.exhausted:
                if not incremental:
                    monitor.window.evaluated = {}  # every signal derived afresh
                state = monitor.poll_once()
                assert state.up
                rows = [(row.model, row.engine, row.values, row.notes, row.pinned)
                        for row in state.per_engine + state.per_model]
                seen[incremental].append(repr((state.last_poll_time, rows, state.findings)))
        for index, (a, b) in enumerate(zip(seen[True], seen[False])):
            assert a == b, f"{engines} engines, poll {index}"
    all_kept = taken["kept"] - taken["derived"]  # evaluations that derived nothing
    assert taken["span moved"] > 50 and all_kept > 20, taken
