"""The window is bounded in bytes across polls: rotating model
names (a gateway that sets one served name per request) brought max_series
new pairs every poll and a 5-minute window kept all of them (61,000 pairs at
max_series 1000: 493 MiB, against the pod's 384Mi). Memory and pairs are
counted here, never timed."""

from __future__ import annotations

import gc
import json
import random
import time
import tracemalloc
import types

import pytest

import kvwatch.pipeline.monitor
from kvwatch.snapshot import EngineSnapshot, Histogram, Snapshot
from kvwatch.window import Window, pair_bytes, step_between
from fuzz.pages import Engine, page
from fuzz.pipeline import Pipeline


@pytest.fixture
def clock(monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(kvwatch.pipeline.monitor, "time", types.SimpleNamespace(
        time=lambda: now[0], monotonic=lambda: now[0], thread_time=time.thread_time))
    return now


def _rotating_page(poll: int, names: int, steady_tokens: float) -> str:
    """`names` served model names never seen before, and one model that
    stays (10 prompt tokens a poll)."""
    engines = [Engine(model=f"request-{poll:04d}-{n:05d}", prompt_tokens=n, prefix_queries=100, prefix_hits=50,
                      ttft_cumulative=(1, 2, 3, 4, 5), ttft_sum=1.0, usage=0.5, running=1) for n in range(names)]
    engines.append(Engine(model="steady", prompt_tokens=steady_tokens, prefix_queries=steady_tokens,
                          prefix_hits=steady_tokens / 2, ttft_cumulative=(poll, poll, poll, poll, poll),
                          ttft_sum=0.05 * poll, usage=0.25, running=2))
    return page(*engines)


def test_rotating_model_names_keep_the_window_within_its_byte_bound(clock):
    """100 new names a poll, a window of 11 polls (50 s at 5 s) bounded at
    1 MiB. Unbounded, the window held every poll's 100 pairs (5.7 MiB traced
    here); the page and the API listed ten model_changed findings for every
    change in the window, and the hold kept each for a minute more. Bounded:
    the window's counted bytes stay under the bound after every poll, it
    holds far fewer pairs than 11 polls' worth, the model that stays keeps
    its whole window (rates exact over 50 s), live memory and every view
    stop growing once the window and the hold are full (poll 23), and the
    state says what was forgotten."""
    pipeline = Pipeline(max_series=1000, window="50s")
    window = pipeline.monitor.window
    # Two polls of 101 new pairs (the latest two, never trimmed) count
    # 1.8 MB with the diagnosis' per-pair tracks (window.NEW_PAIR_BYTES; the
    # now span keeps none of its own): the bound is 2 MiB.
    window.max_bytes = 2 ** 21
    names, polls = 100, 40
    tracemalloc.start()
    try:
        traced, sizes = {}, {}
        for poll in range(polls):
            clock[0] += 5
            state = pipeline.poll(_rotating_page(poll, names, steady_tokens=10.0 * poll))
            assert state.up and len(state.snapshot.engines) == names + 1
            assert window.bytes <= window.max_bytes, (poll, window.bytes)
            # The counted bytes are what the entries hold.
            assert window.bytes == sum(pair_bytes(key, engine, entry.steps.get(key)) for entry in window.entries
                                       for key, engine in entry.snapshot.engines.items())
            if poll in (25, polls - 1):
                views = pipeline.views(parse_back=False)
                sizes[poll] = {"exposition": len(views["exposition"]), "status_page": len(views["status_page"]),
                               "signals": len(json.dumps(views["signals"])),
                               "diagnosis": len(json.dumps(views["diagnosis"]))}
                del views
                gc.collect()
                traced[poll] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    held = sum(len(entry.snapshot.engines) for entry in window.entries)
    status = pipeline.views(parse_back=False)
    assert len(window.entries) == 11  # the whole 50 s, one poll at its start
    assert held < 3 * (names + 1) + len(window.entries), held  # 11 polls' worth is 1,111
    # The model that stays was never forgotten: its window is whole.
    steady = window.increase(("steady", "0"))
    assert steady.seconds == 50.0 and steady.counters["prompt_tokens"] == 100.0
    row = next(r for r in state.per_engine if r.model == "steady")
    assert row.values["kvwatch_prompt_tokens_per_second"] == pytest.approx(2.0)
    # Memory and views stop growing once the window and the hold are full
    # (the window alone grew by 100 pairs a poll until poll 11, and the
    # diagnosis until poll 23, by 150 KB).
    assert traced[polls - 1] - traced[25] < 2 ** 19, traced
    for view, size in sizes[polls - 1].items():
        assert size <= sizes[25][view] * 1.02, (view, sizes)
    findings = status["diagnosis"]["findings"]
    assert sum(f["cause"] == "model_changed" and not f["clearing_since"] for f in findings) == 10
    assert state.window_trimmed and "forgot" in state.window_trimmed and "no longer on the page" in state.window_trimmed
    assert window.forgotten_pairs > 0 and window.dropped_polls == 0
    assert status["signals"]["window_trimmed"] == state.window_trimmed
    assert "no longer on the page" in status["status_page"]


def test_what_the_window_counts_covers_what_its_readers_keep_per_name(clock):
    """A page of one counter per name, 200 new names a poll (the worst
    page's shape, benchmarks/worst_page_probe.py), over a 5-minute window
    bounded at 2 MiB, diagnosed every poll. The diagnosis keeps
    an EnginePolls per (model, engine) for as long as the pair is in the
    window: 8.4 KB of empty deques each, which the window did not count, so
    live memory grew to 3.6 times its bound (596 MiB peak RSS in the probe
    against the pod's 384Mi). Now what is live beyond the steady state stays
    within a quarter over the bound (the findings and events, bounded by
    count, are the rest), once the parser's and adapter's label caches
    (bounded on their own, and emptied when full) are set aside."""
    pipeline = Pipeline(max_series=1000, window="5m")
    window = pipeline.monitor.window
    window.max_bytes = 2 * 2 ** 20
    names, polls = 100, 61

    def rotating(poll: int) -> str:
        return "".join(f'vllm:prompt_tokens_total{{model_name="gateway-request-{poll:04d}-{n:08d}",engine="0"}} '
                       f"{n}.0\n" for n in range(names))

    clock[0] += 5
    assert pipeline.poll(page(Engine(model="steady", prompt_tokens=1.0))).up
    pipeline.views(parse_back=False)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for poll in range(polls):
            clock[0] += 5
            assert pipeline.poll(rotating(poll)).up
            assert window.bytes <= window.max_bytes
        adapter = pipeline.monitor.adapter
        adapter._series.clear()
        adapter.selector._label_cache.clear()
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert window.forgotten_pairs > 0  # the bound was reached
    assert held <= window.max_bytes * 5 // 4, (held, window.bytes, sum(len(e.snapshot.engines) for e in window.entries))


def _engine(model: str, poll: int, buckets: int = 40) -> EngineSnapshot:
    bounds = tuple(float(n) for n in range(1, buckets)) + (float("inf"),)
    return EngineSnapshot(model, "0", gauges={"kv_usage": 0.5, "running": float(poll % 7)},
                          counters={"prompt_tokens": 10.0 * poll, "prefix_queries": 4.0 * poll,
                                    "prefix_hits": 2.0 * poll},
                          histograms={"ttft": Histogram(bounds, tuple(float(poll) for _ in bounds), 0.5 * poll,
                                                        float(poll))})


def test_stable_pairs_over_the_bound_drop_the_oldest_polls_and_say_so():
    """Pairs that stay on every page cannot be forgotten: past the bound
    the window drops its oldest polls, spans less than its time, says so,
    and what it spans is still summed exactly."""
    window = Window(300.0)
    models = [f"m{n}" for n in range(20)]
    # What one steady poll holds: every pair with its snapshot and its step
    # (a pair without a step also counts what a reader keeps for a new pair,
    # window.NEW_PAIR_BYTES, which a steady pair no longer has).
    per_poll = sum(pair_bytes((m, "0"), _engine(m, 2), step_between(_engine(m, 1), _engine(m, 2), 5.0))
                   for m in models)
    window.max_bytes = 6 * per_poll  # room for about 6 polls
    for poll in range(61):
        window.add(Snapshot(1000.0 + 5 * poll, {(m, "0"): _engine(m, poll) for m in models}))
        assert window.bytes <= window.max_bytes or len(window.entries) == 2
    assert 2 < len(window.entries) < 10
    assert window.dropped_polls == 61 - len(window.entries)
    span = window.latest.time - window.earliest.time
    assert span < 300.0
    assert window.trimmed is not None and "oldest polls" in window.trimmed and f"spans {span:.0f} s" in window.trimmed
    increase = window.increase(("m3", "0"))
    assert increase.seconds == span and increase.counters["prompt_tokens"] == 10.0 * (len(window.entries) - 1)
    assert increase.histograms["ttft"].count == float(len(window.entries) - 1)


def test_forgetting_keeps_the_running_sums_exact():
    """Models come and go at random under a small bound: after every poll,
    each model on the page reads the same increase from the running sums as
    from its steps one by one (forgetting takes a pair's steps out of the
    sums as leaving the window does), and gauge maxima match a scan."""
    rng = random.Random(35)
    window = Window(60.0)
    window.max_bytes = 40 * pair_bytes(("m00", "0"), _engine("m00", 3, buckets=6), None)
    present = {f"m{n:02d}" for n in range(6)}
    for poll in range(120):
        if rng.random() < 0.5:
            present ^= {f"m{rng.randrange(20):02d}"}
        present = present or {"m00"}
        window.add(Snapshot(1000.0 + 5 * poll, {(m, "0"): _engine(m, poll + rng.randrange(3), buckets=6)
                                                for m in sorted(present)}))
        for key in window.latest.engines:
            fast, slow = window.increase(key), window._summed_step_by_step(key)
            assert (fast.seconds, fast.counters, fast.steps) == (slow.seconds, slow.counters, slow.steps), (poll, key)
            assert fast.histograms == slow.histograms
            assert window.gauge_max(key, "running") == max(value for _, value in window._gauge_series_scanned(
                key, "running"))
    assert window.forgotten_pairs > 0


def pair_bytes_written_out(key, engine, step) -> int:
    """window.pair_bytes as its definition writes it: every histogram measured."""
    import sys

    from kvwatch.window.sizes import DERIVED_PAIR_BYTES, NEW_PAIR_BYTES

    def histograms_bytes(histograms):
        return sys.getsizeof(histograms) + sum(
            sys.getsizeof(h) + sys.getsizeof(h.cumulative) + sys.getsizeof(0.0) * (len(h.cumulative) + 2)
            for h in histograms.values())

    total = (DERIVED_PAIR_BYTES + sum(map(sys.getsizeof, (key, key[0], key[1], engine, engine.gauges, engine.counters)))
             + sys.getsizeof(0.0) * (len(engine.gauges) + len(engine.counters)) + histograms_bytes(engine.histograms))
    if step is None:
        return total + NEW_PAIR_BYTES
    return total + (sys.getsizeof(step) + sys.getsizeof(step.counters) + sys.getsizeof(0.0) * len(step.counters)
                    + histograms_bytes(step.histograms))


def test_pair_bytes_of_every_pair_of_a_recording_as_written_out(fixtures_dir):
    """pair_bytes looks a histogram's size up by its bucket count: what
    measuring each one gives, on every pair of every poll of a recording,
    and for histograms whose counts are no tuple or that are no Histogram."""
    from kvwatch.capture.bundle import Capture
    from kvwatch.capture.replay import ReplaySource
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings

    path = fixtures_dir / "vllm-0.32-cpu-scenarios" / "restart" / "capture.tar.gz"
    settings = load_settings(overrides={"poll_interval": "1s", "window": "20s"}, environ={})
    source = ReplaySource(Capture(path).pages())
    monitor = Monitor(settings, fetcher=source, clock=source.now)
    checked = 0
    while not source.exhausted:
        monitor.poll_once()
        entry = monitor.window.entries[-1]
        for key, engine in entry.snapshot.engines.items():
            step = entry.steps.get(key)
            assert pair_bytes(key, engine, step) == pair_bytes_written_out(key, engine, step)
            checked += bool(engine.histograms)
    assert checked > 10

    class Odd(Histogram):
        __slots__ = ("extra",)

    engine = EngineSnapshot("m", "0", histograms={
        "listed": Histogram((1.0, float("inf")), [1.0, 2.0], 3.0, 2.0),
        "odd": Odd((1.0, float("inf")), (1.0, 2.0), 3.0, 2.0),
        "plain": Histogram((1.0, float("inf")), (1.0, 2.0), 3.0, 2.0)})
    for _ in range(2):
        assert pair_bytes(("m", "0"), engine, None) == pair_bytes_written_out(("m", "0"), engine, None)
