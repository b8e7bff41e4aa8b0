"""Derived signals from pairs and sequences of snapshots, resets included,
checked against values computed by hand from the captures' counter deltas."""

import pytest

from kvwatch.engines.vllm import VllmAdapter
from kvwatch.signals import evaluate_window
from kvwatch.snapshot import Histogram
from kvwatch.window import Window

KEY = ("tiny-llama", "0")


def window_of(fixtures_dir, names, spacing=10.0, seconds=3600):
    adapter = VllmAdapter()
    window = Window(seconds)
    for i, name in enumerate(names):
        window.add(adapter.adapt((fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text(), at=1000 + i * spacing))
    return window


def values(window, engine=True):
    per_engine, per_model = evaluate_window(window)
    return (per_engine if engine else per_model)[0].values


def test_burst_to_long_load_pair_matches_hand_computed_deltas(fixtures_dir):
    v = values(window_of(fixtures_dir, ["load", "long-load"], spacing=10.0))
    # preemptions 0 -> 12 over 10 s
    assert v["kvwatch_preemptions_per_second"] == pytest.approx(1.2)
    # prefix hits 3584 -> 3584, queries 7424 -> 17424: no hit in the window
    assert v["kvwatch_prefix_cache_hit_ratio"] == 0.0
    # TTFT count 16 -> 36, sum 0.45321393 -> 30.49546957
    assert v["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx((30.495469570159912 - 0.4532139301300049) / 20)
    # bucket deltas: le=1.0 -> 4, le=2.5 -> 16, le=5.0 -> 20 of 20
    # p50: rank 10 in (1.0, 2.5]: 1.0 + 1.5 * (10 - 4) / 12 = 1.75
    # p95: rank 19 in (2.5, 5.0]: 2.5 + 2.5 * (19 - 16) / 4 = 4.375
    assert v["kvwatch_time_to_first_token_seconds"]["0.5"] == pytest.approx(1.75)
    assert v["kvwatch_time_to_first_token_seconds"]["0.95"] == pytest.approx(4.375)
    assert v["kvwatch_kv_cache_usage_ratio"] == pytest.approx(0.9685039370078741)
    assert v["kvwatch_kv_cache_usage_max_ratio"] == pytest.approx(0.9921259842519685)
    assert v["kvwatch_kv_cache_free_tokens"] == 129  # 4096 x (1 - 0.9685) = 129.0, rounded down
    # prompt tokens 7424 -> 17424, generation 1856 -> 9976 over 10 s
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(1000.0)
    assert v["kvwatch_generation_tokens_per_second"] == pytest.approx(812.0)
    assert v["kvwatch_requests_finished_per_second"]["length"] == pytest.approx(2.4)


def test_prefix_load_window_hit_ratio_is_windowed_not_lifetime(fixtures_dir):
    v = values(window_of(fixtures_dir, ["idle", "prefix-load"]))
    assert v["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(2048 / 2640)
    # Over the whole run the lifetime ratio would be 3584/19224; the window
    # holding only load -> after says something else again.
    v = values(window_of(fixtures_dir, ["long-load", "after"]))
    assert v["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(0.0)


def test_window_drops_old_snapshots_and_keeps_one_at_the_horizon(fixtures_dir):
    window = window_of(fixtures_dir, ["idle", "prefix-load", "load", "long-load", "after"], spacing=10, seconds=15)
    # The horizon is 1025: 1020 stays as the start of the step that crosses it,
    # so the window covers at least its length; 1000 and 1010 are gone.
    assert [round(e.snapshot.time) for e in window.entries] == [1020, 1030, 1040]
    v = values(window)
    assert v["kvwatch_kv_cache_usage_max_ratio"] == pytest.approx(0.9921259842519685)
    assert v["kvwatch_preemptions_per_second"] == pytest.approx(13 / 20)


def page(prompt_tokens, hits, queries, preemptions, created=1.0, ttft_counts=(0, 0), ttft_sum=0.0,
         process_start=None):
    return (
        (f"process_start_time_seconds {process_start}\n" if process_start is not None else "") +
        f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt_tokens}\n'
        f'vllm:prompt_tokens_created{{engine="0",model_name="m"}} {created}\n'
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {hits}\n'
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {queries}\n'
        f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preemptions}\n'
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="1.0",model_name="m"}} {ttft_counts[0]}\n'
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="+Inf",model_name="m"}} {ttft_counts[1]}\n'
        f'vllm:time_to_first_token_seconds_count{{engine="0",model_name="m"}} {ttft_counts[1]}\n'
        f'vllm:time_to_first_token_seconds_sum{{engine="0",model_name="m"}} {ttft_sum}\n'
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} 0.5\n'
    )


def run(pages, seconds=3600, spacing=5.0):
    adapter = VllmAdapter()
    window = Window(seconds)
    for i, text in enumerate(pages):
        window.add(adapter.adapt(text, at=i * spacing))
    return window, values(window)


def test_counter_reset_counts_the_new_value_from_zero_never_negative():
    window, v = run([
        page(1000, 400, 800, 10, ttft_counts=(5, 10), ttft_sum=20),
        page(1100, 450, 900, 12, ttft_counts=(6, 12), ttft_sum=22),
        # restart: everything fell
        page(30, 10, 20, 1, ttft_counts=(1, 1), ttft_sum=0.5),
        page(130, 60, 120, 2, ttft_counts=(2, 3), ttft_sum=1.5),
    ])
    # increases: 100 + 30 + 100 prompt tokens over 15 s
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(230 / 15)
    # hits 50 + 10 + 50, queries 100 + 20 + 100
    assert v["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(110 / 220)
    assert v["kvwatch_preemptions_per_second"] == pytest.approx((2 + 1 + 1) / 15)
    # TTFT: 2 + 1 + 2 observations, sum 2 + 0.5 + 1
    assert v["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx(3.5 / 5)
    assert [e.steps.get(("m", "0")).restarted for e in list(window.entries)[1:]] == [False, True, False]


def test_restart_detected_from_a_new_process_start_even_when_counters_climbed_past():
    window, v = run([page(100, 0, 100, 0, created=1.0, process_start=1.0),
                     page(500, 0, 500, 0, created=2.0, process_start=2.0)])
    # Prometheus semantics after a restart: the increase is the new value.
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(500 / 5)
    assert window.entries[-1].steps[("m", "0")].restarted


def test_created_moving_while_counters_climb_is_not_a_restart():
    """A page that moves `_created` on every poll (hostile, or a broken
    exporter) while every counter climbs: `_created` alone is no evidence."""
    window, v = run([page(1000 + 100 * i, 10 * i, 100 * i, i, created=1000.0 + i) for i in range(4)])
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(300 / 15)
    assert not any(step.restarted for entry in window.entries for step in entry.steps.values())


def test_one_counter_going_down_resets_that_series_only():
    """Preemptions fall by 0.001 each poll while the rest climb: that series
    restarted (its increase is its new value), the engine did not, and no
    other series counts its lifetime total."""
    window, v = run([
        page(100_000 + 2640 * i, 1000 * i, 2640 * i, 50 - 0.001 * i, created=1.0,
             ttft_counts=(100 + i, 200 + 2 * i), ttft_sum=50.0 + i)
        for i in range(5)])
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(2640 / 5)
    assert v["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(1000 / 2640)
    assert v["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx(4 / 8)
    # Each step counts the fallen series' new value, as Prometheus' increase() does.
    assert v["kvwatch_preemptions_per_second"] == pytest.approx(sum(50 - 0.001 * i for i in range(1, 5)) / 20)
    assert not any(step.restarted for entry in window.entries for step in entry.steps.values())


def test_a_counter_falling_within_rounding_is_not_a_reset():
    """Preemptions (50) fall by 1e-6 each poll, less than a 32-bit float's
    rounding of the value: no reset, so no increase, while the rest climb
    (counted as a reset, each poll added the whole 50: 10 preemptions/s and
    a false critical finding). A fall of 0.001 still is one (the test above)."""
    window, v = run([
        page(100_000 + 2640 * i, 1000 * i, 2640 * i, 50 - 1e-6 * i, created=1.0,
             ttft_counts=(100 + i, 200 + 2 * i), ttft_sum=50.0 + i)
        for i in range(5)])
    assert v["kvwatch_preemptions_per_second"] == 0.0
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(2640 / 5)
    assert not any(step.restarted for entry in window.entries for step in entry.steps.values())


def test_created_with_a_counter_that_fell_is_a_restart():
    window, v = run([page(1000, 400, 1000, 10, created=1.0), page(1500, 20, 40, 0, created=2.0)])
    assert window.entries[-1].steps[("m", "0")].restarted
    assert v["kvwatch_prompt_tokens_per_second"] == pytest.approx(1500 / 5)


def test_no_traffic_gives_no_ratio_rather_than_zero():
    _, v = run([page(100, 50, 100, 0), page(100, 50, 100, 0)])
    assert v["kvwatch_prefix_cache_hit_ratio"] is None
    assert v["kvwatch_preemptions_per_second"] == 0.0
    assert v["kvwatch_time_to_first_token_seconds"] is None


def test_quantile_pinned_in_last_bucket_is_flagged():
    _, v = run([page(0, 0, 0, 0, ttft_counts=(0, 0)), page(0, 0, 0, 0, ttft_counts=(0, 4), ttft_sum=40)])
    per_engine, _ = evaluate_window(run([page(0, 0, 0, 0, ttft_counts=(0, 0)), page(0, 0, 0, 0, ttft_counts=(0, 4), ttft_sum=40)])[0])
    assert v["kvwatch_time_to_first_token_seconds"]["0.95"] == 1.0
    assert any("at least 1" in note for note in per_engine[0].notes)


def test_pinned_quantiles_are_bounds_with_their_side_in_pinned():
    """Every observation in the first bucket (le=1): each quantile is only
    known to be at most 1 s, so its value is that bound (histogram_quantile's
    interpolation, 0.5/0.95/0.99 s, would claim what the buckets cannot say)
    and `pinned` says "<"; every observation past the last finite bound: ">"."""
    first = evaluate_window(run([page(0, 0, 0, 0), page(0, 0, 0, 0, ttft_counts=(4, 4), ttft_sum=0.04)])[0])[0][0]
    assert first.values["kvwatch_time_to_first_token_seconds"] == {"0.5": 1.0, "0.95": 1.0, "0.99": 1.0}
    assert first.pinned == {"kvwatch_time_to_first_token_seconds": {"0.5": "<", "0.95": "<", "0.99": "<"}}
    last = evaluate_window(run([page(0, 0, 0, 0), page(0, 0, 0, 0, ttft_counts=(0, 4), ttft_sum=40)])[0])[0][0]
    assert last.pinned == {"kvwatch_time_to_first_token_seconds": {"0.5": ">", "0.95": ">", "0.99": ">"}}
    # Half in the first bucket: the median is pinned, p95 and p99 are past the last bound.
    mixed = evaluate_window(run([page(0, 0, 0, 0), page(0, 0, 0, 0, ttft_counts=(2, 4), ttft_sum=4)])[0])[0][0]
    assert mixed.pinned["kvwatch_time_to_first_token_seconds"] == {"0.5": "<", "0.95": ">", "0.99": ">"}
    none = evaluate_window(run([page(0, 0, 0, 0), page(0, 0, 0, 0)])[0])[0][0]
    assert none.pinned == {}


def test_per_model_aggregates_sum_counters_and_take_max_usage():
    def two(prompt0, prompt1, usage0, usage1):
        return (
            f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} {prompt0}\n'
            f'vllm:prompt_tokens_total{{engine="1",model_name="m"}} {prompt1}\n'
            f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {usage0}\n'
            f'vllm:kv_cache_usage_perc{{engine="1",model_name="m"}} {usage1}\n'
            f'vllm:num_requests_running{{engine="0",model_name="m"}} 2\n'
            f'vllm:num_requests_running{{engine="1",model_name="m"}} 3\n'
        )
    adapter = VllmAdapter()
    window = Window(600)
    window.add(adapter.adapt(two(0, 0, 0.1, 0.2), at=0))
    window.add(adapter.adapt(two(100, 300, 0.4, 0.9), at=10))
    per_engine, per_model = evaluate_window(window)
    assert [row.engine for row in per_engine] == ["0", "1"]
    (model,) = per_model
    assert model.values["kvwatch_prompt_tokens_per_second"] == pytest.approx(40.0)
    assert model.values["kvwatch_kv_cache_usage_ratio"] == 0.9
    assert model.values["kvwatch_requests_running"] == 5


def test_histogram_quantile_matches_prometheus_interpolation():
    h = Histogram((0.1, 0.5, 1.0, float("inf")), (2.0, 6.0, 10.0, 10.0), 4.0, 10.0)
    # rank 5 in (0.1, 0.5] holding 4: 0.1 + 0.4 * (5 - 2) / 4 = 0.4
    assert h.quantile(0.5).value == pytest.approx(0.4)
    assert h.quantile(0.1).pinned == "first"
    assert h.quantile(0.99).pinned is None


def test_duplicate_series_are_parse_errors_and_never_added():
    """The same series twice on one page, with conflicting values (two
    exporters writing one name, a proxy that concatenated pages): the first
    value counts and each duplicate is a parse error, where the values used
    to be added as if they were two replicas."""
    text = page(1000, 400, 800, 10, ttft_counts=(5, 10), ttft_sum=20) + (
        'vllm:prompt_tokens_total{model_name="m",engine="0"} 999999\n'  # same labels, another order
        'vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="m"} 77\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.9\n'
    )
    snapshot = VllmAdapter().adapt(text, at=0.0)
    engine = snapshot.engines[("m", "0")]
    assert engine.counters["prompt_tokens"] == 1000
    assert engine.histograms["ttft"].cumulative == (5.0, 10.0)
    assert engine.gauges["kv_usage"] == 0.5
    assert len(snapshot.parse_errors) == 3
    assert all("duplicate" in str(error) for error in snapshot.parse_errors)


def test_kv_bytes_in_use_is_usage_times_the_cache_s_bytes_and_absent_without_them(fixtures_dir):
    # metrics-long-load: usage 123/127 blocks = 0.9685039370078741 of kv_cache_memory_bytes 4194304
    v = values(window_of(fixtures_dir, ["load", "long-load"]))
    assert v["kvwatch_kv_cache_used_bytes"] == round(0.9685039370078741 * 4194304) == 4062200
    assert values(window_of(fixtures_dir, ["load", "long-load"]), engine=False)["kvwatch_kv_cache_used_bytes"] == 4062200
    # vLLM 0.11 states no kv_cache_memory_bytes: unknown, not zero.
    window = Window(3600)
    window.add(VllmAdapter().adapt((fixtures_dir / "public" / "vllm-0.11.0.txt").read_text(), at=1000))
    assert evaluate_window(window)[0][0].values.get("kvwatch_kv_cache_used_bytes") is None


def test_counts_of_tokens_blocks_and_requests_are_whole_numbers_with_the_rounding_stated(fixtures_dir):
    # kvwatch_kv_cache_free_tokens read 12027.74; a count is whole. Means and
    # rates of counts may be fractional; counts may not.
    from kvwatch.signals import SIGNALS

    names = ["load", "long-load"]
    v = values(window_of(fixtures_dir, names, spacing=10.0))
    counts = [s for s in SIGNALS if s.unit in ("tokens", "requests", "bytes") and "mean" not in s.name]
    assert {"kvwatch_kv_cache_free_tokens", "kvwatch_kv_cache_capacity_requests"} <= {s.name for s in counts}
    for signal in counts:
        value = v.get(signal.name)
        for item in (value.values() if isinstance(value, dict) else [value]):
            assert item is None or float(item).is_integer(), (signal.name, item)
    for name in ("kvwatch_kv_cache_free_tokens", "kvwatch_kv_cache_capacity_requests"):
        signal = next(s for s in SIGNALS if s.name == name)
        assert "round" in signal.doc and "floor(" in signal.promql, name


def test_unchanged_inputs_give_the_values_again_without_deriving_them(fixtures_dir, monkeypatch):
    """An idle engine polled again: the same view inputs (counters that did
    not move, the same gauges), so the window's next evaluation returns the
    values derived last time, equal to a fresh derivation and independent
    of what a caller did to the earlier answer; a changed input derives anew."""
    import kvwatch.signals.evaluation as signals

    text = (fixtures_dir / "vllm-0.32-cpu" / "metrics-idle.txt").read_text()
    adapter = VllmAdapter()
    window = Window(15)
    for i in range(4):  # the window full: each step drops one and adds one
        window.add(adapter.adapt(text, at=1000 + i * 10))
    first = evaluate_window(window)[0][0]
    fresh = signals.evaluate(signals._view(window, [KEY]), *KEY)
    assert first.values == fresh.values and first.notes == fresh.notes and first.pinned == fresh.pinned
    first.values.clear()  # a caller's change does not reach what was kept
    derived = []
    original = signals._evaluate_watched  # what the window's evaluation derives with
    monkeypatch.setattr(signals, "_evaluate_watched", lambda *a: derived.append(a) or original(*a))
    window.add(adapter.adapt(text, at=1040))
    again = evaluate_window(window)[0][0]
    assert derived == [] and again.values == fresh.values and again.notes == fresh.notes
    moved = adapter.adapt(text, at=1050)
    moved.engines[KEY].gauges["kv_usage"] = 0.5
    window.add(moved)
    assert evaluate_window(window)[0][0].values["kvwatch_kv_cache_usage_ratio"] == 0.5
    assert len(derived) == 1


# The fast forms in kvwatch.signals against the forms they stand for, on the
# inputs where the two could part: NaN, signed zeros, ints, values past 0..1.
EDGES = [float("nan"), -0.0, 0.0, 1.0, 1, 0, -1, 2, 0.5, 1e-300, -1e-300, float("inf"), float("-inf"),
         0.9999999999999999, 1.0000000000000002, True, False]


def same(a, b) -> bool:
    """Equal to the bit: NaN, the sign of zero and int against float included."""
    return repr(a) == repr(b) and type(a) is type(b)


def test_the_clamp_spelled_out_is_min_of_max_on_every_edge():
    from kvwatch.signals import evaluation as signals
    from kvwatch.snapshot import config_number

    for value in EDGES:
        assert same(signals._clamp01(value), min(1.0, max(0.0, value))), value
    assert signals._clamp01(None) is None
    # BlockSums clamps the window's usages inline: its mean is the definition's.
    labels = {"num_gpu_blocks": "101", "block_size": "16"}
    series = [(1000.0 + i, value) for i, value in enumerate(EDGES)]
    from kvwatch.signals.evaluation import _usage_total
    sums = signals.BlockSums().add(signals._engine_config(labels), 0.5, len(series), _usage_total(series))
    usable = config_number(labels, "num_gpu_blocks") - 1
    expected = usable * sum(min(1.0, max(0.0, v)) for _t, v in series) / len(series)
    assert same(sums.usage_weighted, expected)


def _eta_as_defined(series):
    """kvwatch.signals.evaluation._eta as the definition reads, one generator per sum."""
    from kvwatch.signals import TREND_SECONDS

    if len(series) < 2:
        return None
    series = [(t, v) for t, v in series if t >= series[-1][0] - TREND_SECONDS]
    if len(series) < 2 or series[-1][1] < sum(v for _t, v in series) / len(series):
        return None
    n = len(series)
    t0 = series[0][0]
    mean_t = sum(t - t0 for t, _v in series) / n
    mean_v = sum(v for _t, v in series) / n
    var = sum((t - t0 - mean_t) ** 2 for t, _v in series)
    if var <= 0:
        return None
    slope = sum((t - t0 - mean_t) * (v - mean_v) for t, v in series) / var
    if slope <= 0:
        return None
    return max(0.0, 1.0 - min(1.0, max(0.0, series[-1][1]))) / slope


def test_the_exhaustion_trend_equals_its_definition_to_the_bit():
    import random

    from kvwatch.signals.evaluation import _eta

    rng = random.Random(7)
    cases = [
        [], [(1000.0, 0.5)], [(1000.0, 0.5), (1000.0, 0.6)],  # one point; no time between two
        [(1000, 0.1), (1010, 0.2), (1020, 0.4)],  # int times
        [(1000.0, 0.1), (1400.0, 0.2), (1410.0, 0.3)],  # the first point older than the trend's span
        [(1400.0, 0.3), (1000.0, 0.1), (1410.0, 0.5)],  # out of order
        [(1000.0, 0.2), (1010.0, float("nan")), (1020.0, 0.4)],
        [(1000.0, 0.9), (1010.0, 1.3), (1020.0, 1.7)],  # past full
        [(1000.0, -0.0), (1010.0, 0.0), (1020.0, 1)],
    ]
    for _ in range(300):
        start = rng.choice([0.0, 1.7e9, 1_700_000_000])
        step = rng.choice([1, 10.0, 15.0, 30.0, 0.37])
        usage = rng.random()
        series = []
        for i in range(rng.randint(2, 40)):
            usage = min(1.2, max(-0.1, usage + rng.uniform(-0.05, 0.08)))
            series.append((start + i * step, round(usage, rng.choice([2, 6, 17]))))
        cases.append(series)
    for series in cases:
        assert same(_eta(list(series)), _eta_as_defined(list(series))), series


def test_a_view_of_one_engine_merges_as_the_general_loop_does():
    from kvwatch.signals import evaluation as signals
    from kvwatch.window import Increase

    gauges = {"running": -0.0, "kv_usage": -0.0, "waiting": 3, "v0_prefix_hit_rate": 1,
              "waiting_by_reason/capacity": float("nan"), "sleep_state/awake": 1.0}
    general: dict = {}
    signals._merge_gauges(general, gauges)
    fast = signals._first_gauges(gauges)
    assert list(fast) == list(general) and all(same(fast[k], general[k]) for k in general)

    histogram = Histogram((1.0, float("inf")), (1.0, 2.0), 3.0, 2.0)
    window_answer = Increase(12.5, {"prompt_tokens": -0.0, "preemptions": 3, "prefix_hits": float("nan"),
                                    "finished/stop": 4.0}, {"ttft": histogram}, True, 2)
    general_increase = Increase()
    general_increase.add(window_answer)
    fast_increase = signals._first_increase(window_answer)
    assert repr(fast_increase) == repr(general_increase)
    assert [type(v) for v in fast_increase.counters.values()] == [type(v) for v in general_increase.counters.values()]
    assert fast_increase.counters is not window_answer.counters
    assert fast_increase.histograms is not window_answer.histograms
    assert same(window_answer.counters["prompt_tokens"], -0.0)  # the window's answer is left as it was


def test_parsed_engine_configuration_is_the_labels_parsed_each_time():
    from kvwatch.signals import evaluation as signals
    from kvwatch.snapshot import capacity_tokens, config_number

    configs = [{}, {"num_gpu_blocks": "2048", "block_size": "16"},
               {"num_gpu_blocks": "2048", "block_size": "16", "kv_cache_size_tokens": "40000"},  # hybrid
               {"num_gpu_blocks": "None", "block_size": "auto", "kv_cache_memory_bytes": "4194304"},
               {"num_gpu_blocks": "4096", "block_size": "16", "kv_cache_memory_bytes": "8388608"}]
    for labels in configs + configs:  # parsed, then found again
        parsed = signals._engine_config(dict(labels))
        assert parsed == signals._EngineConfig(
            config_number(labels, "num_gpu_blocks"), config_number(labels, "block_size"),
            config_number(labels, "kv_cache_memory_bytes"), capacity_tokens(labels),
            signals.blocks_hold_capacity(labels)), labels


def test_kept_values_are_copied_down_to_their_dicts():
    from kvwatch.signals import evaluation as signals

    values = {"a": 1.0, "b": None, "c": {"0.5": 1.0}, "d": {"load": 2.0}, "e": 3}
    copy = signals._copied(values)
    assert copy == values and copy is not values
    assert copy["c"] is not values["c"] and copy["d"] is not values["d"]


def test_lazy_values_are_the_evaluated_ones_read_in_any_order(fixtures_dir):
    """evaluate_window(lazy=True) (the history diagnosis) derives a signal
    where it is read: over every real recording, at every poll, each value,
    read in a shuffled order, is the one the full evaluation gives, and so
    are the notes and pinned quantiles once all are read, and the findings."""
    import random

    from kvwatch import diagnose
    from kvwatch.capture.bundle import Capture
    from kvwatch.signals import LazyValues

    draw = random.Random(5)
    recordings = sorted((fixtures_dir / "vllm-0.32-cpu-scenarios").glob("*/capture.tar.gz"))
    assert len(recordings) >= 10
    compared = pinned_seen = 0
    for path in recordings:
        adapter, eager_window, lazy_window = VllmAdapter(), Window(60.0), Window(60.0)
        for entry, text in Capture(path).pages():
            if text is None:
                continue
            snapshot = adapter.adapt(text, at=entry.time)
            if not snapshot.engines:
                continue
            eager_window.add(snapshot)
            lazy_window.add(snapshot)
            eager, eager_models = evaluate_window(eager_window)
            lazy, lazy_models = evaluate_window(lazy_window, lazy=True)
            assert diagnose.diagnose(lazy_window, lazy, (), {}) == diagnose.diagnose(eager_window, eager, (), {})
            for full, read in zip(eager + eager_models, lazy + lazy_models):
                assert isinstance(read.values, LazyValues)
                names = list(full.values)
                draw.shuffle(names)
                for name in names:
                    assert repr(read.values[name]) == repr(full.values[name]), (path.parent.name, name)
                assert sorted(read.notes) == sorted(full.notes) and read.pinned == full.pinned
                compared += 1
                pinned_seen += bool(full.pinned)
    assert compared > 500 and pinned_seen > 50


def test_the_now_span_evaluates_engines_alone(fixtures_dir):
    """models=False (the now span's rules judge engines): the same engine
    values, and no model view derived."""
    window = window_of(fixtures_dir, ["load", "long-load"], spacing=10.0)
    per_engine, per_model = evaluate_window(window, lazy=True, models=False)
    assert per_model == []
    assert dict(per_engine[0].values) == dict(evaluate_window(window)[0][0].values)
