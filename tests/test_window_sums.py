"""The window's running sums answer what summing its steps one by one
answers: the same keys, bounds, restarts and step counts, and values equal to
the correctly rounded sum of the steps (so exactly the one-by-one sum when
that is exact, as it is for whole counts), through restarts, bucket layouts
that change, engines that come and go, evictions by time and by count, NaN
and infinite values, and entries changed behind the window's back."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvwatch.snapshot import EngineSnapshot, Histogram, Snapshot
from kvwatch.window import Window

ENGINES = [("m", "0"), ("m", "1"), ("n", "0")]
LAYOUTS = [(0.5, 1.0, math.inf), (1.0, math.inf)]

whole = st.integers(min_value=0, max_value=40).map(float)
fraction = st.sampled_from([0.1, 0.25, 1.7, 1e-9, 3.3333333333333335])
odd = st.sampled_from([math.nan, math.inf])


@st.composite
def engine_state(draw, values):
    """One engine's counters and histograms as increments over its last
    state; the test accumulates them into cumulative values."""
    counters = {key: draw(values) for key in draw(st.sets(st.sampled_from(["a", "b", "finished/x"]), min_size=1))}
    histograms = {}
    for key in draw(st.sets(st.sampled_from(["h1", "h2"]))):
        layout = draw(st.sampled_from(LAYOUTS)) if draw(st.integers(0, 3)) == 0 else LAYOUTS[0]
        histograms[key] = (layout, [draw(whole) for _ in layout], draw(values))
    gauges = {"kv_usage": draw(st.floats(0, 1)), "running": draw(whole)}
    return counters, histograms, gauges, draw(st.integers(0, 14)) == 0  # restart


@st.composite
def polls(draw):
    values = st.one_of(whole, whole, whole, fraction, odd) if draw(st.booleans()) else whole
    count = draw(st.integers(1, 30))
    return [
        (draw(st.floats(0.5, 3.0)),
         {key: draw(engine_state(values)) for key in draw(st.sets(st.sampled_from(ENGINES), min_size=1))},
         draw(st.integers(0, 19)) == 0)  # the page spells a key with another family
        for _ in range(count)
    ]


def same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def expected_values(window, key, attribute):
    """Each counter's (or histogram field's) steps, to compare with fsum."""
    found: dict = {}
    for entry in list(window.entries)[1:]:
        step = entry.steps.get(key)
        if step is not None:
            for name, value in attribute(step).items():
                found.setdefault(name, []).append(value)
    return found


def all_finite(window: Window) -> bool:
    """Whether every value of every counted step is finite (else the window
    sums step by step until the odd step has left)."""
    for entry in list(window.entries)[1:]:
        for step in entry.steps.values():
            values = [step.seconds, *step.counters.values()]
            for histogram in step.histograms.values():
                values += [*histogram.cumulative, histogram.sum, histogram.count]
            if not all(math.isfinite(v) for v in values):
                return False
    return True


def check(window: Window):
    exact = all_finite(window)
    for key in ENGINES:
        fast = window.increase(key)
        slow = window._summed_step_by_step(key)
        assert (fast.restarts, fast.steps) == (slow.restarts, slow.steps)
        assert list(fast.counters) == list(slow.counters) or set(fast.counters) == set(slow.counters)
        assert set(fast.histograms) == set(slow.histograms)
        steps = expected_values(window, key, lambda step: step.counters)
        for name, value in fast.counters.items():
            terms = steps[name]
            if exact:
                # Exactly the correctly rounded sum of the steps...
                assert value == math.fsum(terms)
                # ...which is the one-by-one sum whenever that is exact.
                if all(t.is_integer() for t in terms):
                    assert value == slow.counters[name]
            else:
                assert same(value, slow.counters[name])
        for name, histogram in fast.histograms.items():
            other = slow.histograms[name]
            assert histogram.bounds == other.bounds
            assert all(same(a, b) for a, b in zip(histogram.cumulative, other.cumulative))
            assert math.isclose(histogram.sum, other.sum, rel_tol=1e-9, abs_tol=1e-12) or same(histogram.sum, other.sum)
            assert same(histogram.count, other.count)
        assert math.isclose(fast.seconds, slow.seconds, rel_tol=1e-12)
        for gauge in ("kv_usage", "running"):
            series = window.gauge_series(key, gauge)
            assert series == window._gauge_series_scanned(key, gauge)
            assert window.gauge_max(key, gauge) == (max(v for _, v in series) if series else None)
            assert window.gauge_columns(key, gauge) == columns_scanned(window, key, gauge)


def columns_scanned(window: Window, key, gauge: str):
    """Window.gauge_columns written out: from a pass over the entries."""
    series = window._gauge_series_scanned(key, gauge)
    times, values = [t for t, _ in series], [v for _, v in series]
    return (times, values, all(a < b for a, b in zip(times, times[1:])),
            all(0.0 <= v <= 1.0 for v in values))


def snapshots_of(sequence):
    """The drawn polls as snapshots of cumulative counters and histograms."""
    cumulative: dict = {}
    now = 1000.0
    for index, (gap, engines, renamed) in enumerate(sequence):
        now += gap
        snapshot = Snapshot(now, {}, sources={"a": "family_b" if renamed and index % 2 else "family_a"})
        for key, (counters, histograms, gauges, restart) in engines.items():
            state = cumulative.setdefault(key, {"counters": {}, "histograms": {}})
            if restart:
                state["counters"].clear()
                state["histograms"].clear()
            engine = EngineSnapshot(*key, gauges=dict(gauges))
            for name, increment in counters.items():
                engine.counters[name] = state["counters"][name] = state["counters"].get(name, 0.0) + increment
            for name, (layout, buckets, total) in histograms.items():
                before = state["histograms"].get(name)
                if before is None or before.bounds != layout:
                    before = Histogram(layout, (0.0,) * len(layout), 0.0, 0.0)
                running, cumulative_counts = 0.0, []
                for previous, added in zip(before.cumulative, buckets):
                    running += added
                    cumulative_counts.append(previous + running)
                state["histograms"][name] = engine.histograms[name] = Histogram(
                    layout, tuple(cumulative_counts), before.sum + total, cumulative_counts[-1])
            snapshot.engines[key] = engine
        yield snapshot


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(polls(), st.sampled_from([5.0, 12.0, math.inf]), st.sampled_from([3, 7, 10_000]), st.integers(0, 40))
def test_running_sums_answer_what_step_by_step_sums_answer(sequence, seconds, max_entries, tamper_at):
    window = Window(seconds, max_entries=max_entries)
    for index, snapshot in enumerate(snapshots_of(sequence)):
        window.add(snapshot)
        if index == tamper_at and len(window.entries) > 2:
            window.entries.popleft()  # behind the window's back
        check(window)
    window.clear()
    assert window.increase(ENGINES[0]).steps == 0 and window.gauge_max(ENGINES[0], "running") is None



def test_bucket_layout_change_then_old_layout_steps_leave():
    """Steps of the old layout leave the window after the new layout's run
    began; the run keeps exactly its own steps."""
    window = Window(4.5)
    for second in range(12):
        layout = LAYOUTS[0] if second < 5 or second == 8 else LAYOUTS[1]
        counts = tuple(float(second * (i + 1)) for i in range(len(layout)))
        engine = EngineSnapshot("m", "0", histograms={"h": Histogram(layout, counts, second * 0.1, counts[-1])})
        window.add(Snapshot(float(second), {("m", "0"): engine}))
        check(window)
        if second:
            assert window.increase(("m", "0")).histograms["h"].bounds == layout


def test_a_nan_step_sums_step_by_step_until_it_leaves_then_exact_again():
    window = Window(5.5)
    counter = 0.0
    for second in range(16):
        counter += 0.1
        # One NaN counter value at second 3: its step (and the next, NaN - x)
        # leave the window by second 10.
        value = math.nan if second == 3 else counter
        engine = EngineSnapshot("m", "0", counters={"a": value, "b": counter})
        window.add(Snapshot(float(second), {("m", "0"): engine}))
        check(window)
        steps = [e.steps[("m", "0")].counters["b"] for e in list(window.entries)[1:]]
        if second >= 10:
            assert window.increase(("m", "0")).counters["b"] == math.fsum(steps)
            assert not math.isnan(window.increase(("m", "0")).counters["a"])
        elif 3 <= second <= 8:
            assert math.isnan(window.increase(("m", "0")).counters["a"])


# Bucket counts summed as floats while that is exact, else exactly as ints
# and fixed point: increments that keep them whole and small, and ones that
# break that (fractions, negatives, sums at and past 2**53).
increments = st.one_of(whole, whole, whole, st.sampled_from([2.0 ** 52, 2.0 ** 53 - 1, 2.0 ** 53, 3.0 ** 34]),
                       fraction, st.sampled_from([-3.0, -0.0, -(2.0 ** 53)]))


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.lists(increments, min_size=3, max_size=3), increments, st.integers(0, 9)),
                min_size=1, max_size=25),
       st.sampled_from([3.5, 8.5, math.inf]))
def test_histogram_sums_are_the_correctly_rounded_sums_of_the_steps(polls, seconds):
    """Whether the window sums a run's buckets (and counters, and a
    histogram's count) as floats or exactly, each bucket, the sum, the count
    and a counter equal math.fsum of the steps'."""
    key = ("m", "0")
    window = Window(seconds)
    buckets, total = [0.0] * 3, 0.0
    for second, (added, added_sum, restart) in enumerate(polls):
        if restart == 0:
            buckets, total = [0.0] * 3, 0.0
        buckets = [b + a for b, a in zip(buckets, added)]
        total += added_sum
        engine = EngineSnapshot(*key, counters={"c": total},
                                histograms={"h": Histogram(LAYOUTS[0], tuple(buckets), total, buckets[-1])})
        window.add(Snapshot(float(second), {key: engine}))
        steps = [entry.steps[key].histograms["h"] for entry in list(window.entries)[1:]]
        counter = [entry.steps[key].counters["c"] for entry in list(window.entries)[1:]]
        assert window.increase(key).counters.get("c") == (math.fsum(counter) if counter else None)
        summed = window.increase(key).histograms.get("h")
        if not steps:
            assert summed is None
            continue
        assert summed.cumulative == tuple(math.fsum(s.cumulative[i] for s in steps) for i in range(3))
        assert summed.sum == math.fsum(s.sum for s in steps)
        assert summed.count == math.fsum(s.count for s in steps)
        if all(v.is_integer() and abs(v) < 2 ** 40 for s in steps for v in s.cumulative):
            assert summed.cumulative == window._summed_step_by_step(key).histograms["h"].cumulative


def test_a_negative_bucket_step_keeps_the_bucket_sums_exact_when_it_leaves():
    """Steps -2**52 (a reset to a negative count), 2**53 - 1, 2**52, 0, 0: the
    sums while -2**52 counted stay below 2**53, but once it leaves, what is
    left (3 * 2**52 - 1) is no double: summed as floats it would round, and
    the next step leaving would leave that error behind."""
    key = ("m", "0")
    window = Window(2.5)
    for second, count in enumerate([0.0, -(2.0 ** 52), 2.0 ** 52 - 1, 2.0 ** 53 - 1, 2.0 ** 53 - 1, 2.0 ** 53 - 1]):
        engine = EngineSnapshot(*key, histograms={"h": Histogram((math.inf,), (count,), 0.0, count)})
        window.add(Snapshot(float(second), {key: engine}))
        steps = [entry.steps[key].histograms["h"] for entry in list(window.entries)[1:]]
        if steps:
            summed = window.increase(key).histograms["h"]
            assert summed.cumulative == (math.fsum(s.cumulative[0] for s in steps),)
            assert summed.count == math.fsum(s.count for s in steps)
    assert [s.cumulative for s in steps] == [(2.0 ** 52,), (0.0,), (0.0,)]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([1.0, 1.0, 2.5, 0.0, -1.0]),
                          st.one_of(st.floats(0, 1), st.sampled_from([-0.0, 1.5, -0.25, math.nan])),
                          st.booleans()), max_size=40),
       st.sampled_from([4.0, 10.0, math.inf]), st.integers(0, 40))
# A value outside 0..1 and a time that goes back, each leaving the window after.
@example([(1.0, 1.5, True)] + [(1.0, 0.5, True)] * 8, 4.0, 40)
@example([(1.0, 0.5, True), (-1.0, 0.5, True)] + [(1.0, 0.5, True)] * 8, 4.0, 40)
def test_gauge_columns_keep_order_and_range_as_points_arrive_and_leave(points, seconds, tamper_at):
    """What the window keeps about a gauge's series as it moves (whether its
    times strictly increase, whether every value lies within 0..1) is what a
    pass over the series says: through times that repeat or go back, values
    outside 0..1 or NaN, polls without the gauge, and entries changed behind
    the window's back."""
    window = Window(seconds, max_entries=12)
    now = 1000.0
    for index, (gap, usage, has_gauge) in enumerate(points):
        now += gap
        engine = EngineSnapshot("m", "0", gauges={"kv_usage": usage} if has_gauge else {})
        window.add(Snapshot(now, {("m", "0"): engine}))
        if index == tamper_at and len(window.entries) > 2:
            window.entries.popleft()  # behind the window's back
        assert repr(window.gauge_columns(("m", "0"), "kv_usage")) == repr(columns_scanned(window, ("m", "0"),
                                                                                          "kv_usage"))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(polls(), st.sampled_from([2.0, 5.0]), st.sampled_from([None, 4_000]), st.integers(0, 40))
def test_a_window_that_follows_another_shares_its_entries_and_sums_its_span(sequence, seconds, max_bytes, tamper_at):
    """The now span (Window.follow): the last `seconds` of another window's
    very entries (steps computed once), summed as its own window, through
    the source forgetting pairs and dropping polls for its byte bound and a
    follower that missed polls."""
    source = Window(30.0, max_bytes=max_bytes)
    follower = Window(seconds, max_bytes=None)
    for index, snapshot in enumerate(snapshots_of(sequence)):
        source.add(snapshot)
        if index != tamper_at:  # a poll the follower missed
            follower.follow(source)
        else:
            continue
        check(follower)
        shared = list(source.entries)[-len(follower.entries):]
        assert all(a is b for a, b in zip(follower.entries, shared))
        first = follower.entries[0]
        assert first is source.entries[0] or first.snapshot.time <= snapshot.time - seconds
        if len(follower.entries) > 1:
            assert follower.entries[1].snapshot.time > snapshot.time - seconds
        assert follower.bytes == 0


def _restarted(counters, histograms=None):
    return counters, histograms or {}, {"kv_usage": 0.0, "running": 0.0}, True


# Found by the test in a CI run: the windows met counters a and b in other orders (a restart of the engine
# whose odd histogram only the wider window sums step by step), and the dicts' reprs differed in order alone.
_M0, _M1, _N0 = ENGINES
_A = _restarted({"a": 0.0})
KEY_ORDER = ([(1.0, {_M0: _A, _M1: _A}, True), (1.0, {_M0: _A, _N0: _A, _M1: _A}, True)]
             + [(1.0, {_M0: _A}, True)] * 5 + [(1.0, {_M0: _A, _N0: _A, _M1: _A}, True)] * 2
             + [(1.0, {_M1: _restarted({"b": 0.0, "a": 0.0}, {"h1": ((1.0, math.inf), [0.0, 0.0], 0.0),
                                                           "h2": ((1.0, math.inf), [0.0, 0.0], 0.0)})}, False),
                (1.0, {_M0: _A, _N0: _A,
                       _M1: _restarted({"b": 0.0, "a": 0.0}, {"h2": ((1.0, math.inf), [0.0, 0.0], math.nan)})}, True),
                (1.0, {_M0: _A}, True)])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(polls(), st.sampled_from([2.0, 5.0]))
@example(KEY_ORDER, 2.0)
def test_a_window_that_leaves_histograms_out_sums_the_rest_alike(sequence, seconds):
    """The now span leaves out the histograms no rule reads (Window's
    `left_out`): its increases are those of a window that sums everything,
    less those histograms, through restarts, layout changes and odd values,
    summed running or step by step."""
    source = Window(30.0)
    everything = Window(seconds, max_bytes=None)
    fewer = Window(seconds, max_bytes=None, left_out=frozenset({"h2"}))
    for snapshot in snapshots_of(sequence):
        source.add(snapshot)
        everything.follow(source)
        fewer.follow(source)
        check(fewer)
        for key in ENGINES:
            whole, trimmed = everything.increase(key), fewer.increase(key)
            assert "h2" not in trimmed.histograms and "h2" not in fewer._summed_step_by_step(key).histograms
            # repr: NaN equals NaN and -0.0 is told from 0.0; sorted: the two windows may meet the keys in
            # another order (a restart's step summed step by step), which no reader depends on.
            assert repr(sorted(trimmed.counters.items())) == repr(sorted(whole.counters.items()))
            assert repr(sorted(trimmed.histograms.items())) == repr(sorted(
                (k, v) for k, v in whole.histograms.items() if k != "h2"))
            assert (trimmed.seconds, trimmed.restarts, trimmed.steps) == (whole.seconds, whole.restarts, whole.steps)
