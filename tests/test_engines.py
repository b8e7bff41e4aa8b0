"""Engines beyond vLLM: each page through parser, adapter, window, signals and
diagnosis, with values worked out by hand from the fixture's numbers; each
engine's traps; the engine chosen from the page; the simulator's dialects
read back to the same canonical values as its vLLM page."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from kvwatch import diagnose
from kvwatch.engines import ENGINES, coverage, make_adapter, recognize
from kvwatch.engines.base import EngineAdapter
from kvwatch.engines.coverage import dark_signals
from kvwatch.engines.sglang import SglangAdapter
from kvwatch.engines.trtllm import STALE_AFTER
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sidecar.report import signals_json
from kvwatch.settings import SettingsError, load_settings
from kvwatch.signals import SIGNALS, evaluate_window
from kvwatch.sim.dialects import render_dialect
from kvwatch.sim.render import render_metrics
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.simulation import Simulation
from kvwatch.window import Window
from pageserver import Answer, PageServer


def spelled(page: str, spelling: str) -> str:
    """An SGLang page in `spelling`: "sglang_" is what OpenMetrics'
    escaping=underscores writes, sample lines only (HELP and TYPE keep `sglang:`)."""
    return re.sub(r"^sglang:", "sglang_", page, flags=re.M) if spelling == "sglang_" else page


SPELLINGS = ("sglang:", "sglang_")


def _window(adapter, pages: list[tuple[float, str]]) -> Window:
    window = Window(600.0)
    for at, text in pages:
        window.add(adapter.adapt(text, at=at))
    return window


def _values(window: Window) -> dict:
    per_engine, _ = evaluate_window(window)
    (row,) = per_engine
    return row.values


# --- SGLang: the public capture ---------------------------------------------


def _sglang_later(text: str) -> str:
    """The capture 10 s later, edited by hand: 4 more requests of 50 prompt
    tokens (200, of which 150 cached), 60 generated tokens, TTFT +4 (sum +0.2)."""
    edits = {
        'sglang:prompt_tokens_total{model_name="facebook/opt-125m",tp_rank="0"} 5':
            'sglang:prompt_tokens_total{model_name="facebook/opt-125m",tp_rank="0"} 205',
        'sglang:generation_tokens_total{model_name="facebook/opt-125m",tp_rank="0"} 32':
            'sglang:generation_tokens_total{model_name="facebook/opt-125m",tp_rank="0"} 92',
        'sglang:cached_tokens_total{model_name="facebook/opt-125m",tp_rank="0"} 1':
            'sglang:cached_tokens_total{model_name="facebook/opt-125m",tp_rank="0"} 151',
        'sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="facebook/opt-125m"} 1':
            'sglang:time_to_first_token_seconds_bucket{le="0.1",model_name="facebook/opt-125m"} 5',
        'sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="facebook/opt-125m"} 1':
            'sglang:time_to_first_token_seconds_bucket{le="+Inf",model_name="facebook/opt-125m"} 5',
        'sglang:time_to_first_token_seconds_count{model_name="facebook/opt-125m"} 1':
            'sglang:time_to_first_token_seconds_count{model_name="facebook/opt-125m"} 5',
        'sglang:time_to_first_token_seconds_sum{model_name="facebook/opt-125m"} 0.02':
            'sglang:time_to_first_token_seconds_sum{model_name="facebook/opt-125m"} 0.22',
    }
    for old, new in edits.items():
        assert old in text
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_sglang_capture_through_adapter_window_and_diagnosis(fixtures_dir, spelling):
    raw = (fixtures_dir / "public" / "sglang-0.5.10-trimmed.txt").read_text()
    text = spelled(raw, spelling)
    assert recognize(text) == "sglang"
    adapter = make_adapter("sglang")
    snapshot = adapter.adapt(text, at=0.0)
    assert snapshot.spelling == spelling
    (engine,) = snapshot.engines.values()
    assert (engine.model, engine.engine) == ("facebook/opt-125m", "0")
    # token_usage 0.25 on the page; cache_hit_rate (0.2) is never read.
    assert engine.gauges == {"kv_usage": 0.25, "running": 0.0, "waiting": 0.0}
    assert snapshot.cache_config["0"]["kv_cache_size_tokens"] == "430839"
    # This build has no realtime_tokens_total: hits and queries are cached and prompt tokens.
    assert snapshot.sources["prefix_hits"] == f"{spelling}cached_tokens_total"
    window = _window(adapter, [(0.0, text), (10.0, spelled(_sglang_later(raw), spelling))])
    values = _values(window)
    assert values["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(150 / 200)
    assert values["kvwatch_prompt_tokens_per_second"] == pytest.approx(20.0)
    assert values["kvwatch_generation_tokens_per_second"] == pytest.approx(6.0)
    assert values["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx(0.2 / 4)
    # 430839 x (1 - 0.25)
    assert values["kvwatch_kv_cache_free_tokens"] == pytest.approx(323129.25)
    assert values["kvwatch_preemptions_per_second"] is None  # no retraction family seen: unknown, not 0
    per_engine, _ = evaluate_window(window)
    findings = diagnose.diagnose(window, per_engine, [], {})
    assert not [f for f in findings if f.symptom == "exhaustion"]  # 25 % used, nothing waiting


def _sglang_page_native(usage_by_rank: dict[str, float], cache: float, compute: float, retracted: float | None,
                 cached_by_source: dict[str, float]) -> str:
    lines = ["# TYPE sglang:token_usage gauge"]
    for rank, usage in usage_by_rank.items():
        lines.append(f'sglang:token_usage{{dp_rank="0",model_name="m",tp_rank="{rank}"}} {usage}')
    lines.append("# TYPE sglang:cache_hit_rate gauge")
    lines.append('sglang:cache_hit_rate{dp_rank="0",model_name="m",tp_rank="0"} 0.99')
    lines.append("# TYPE sglang:realtime_tokens_total counter")
    for rank in usage_by_rank:
        for mode, value in (("prefill_cache", cache), ("prefill_compute", compute)):
            lines.append(f'sglang:realtime_tokens_total{{dp_rank="0",mode="{mode}",model_name="m",tp_rank="{rank}"}} '
                         f"{value}")
    if retracted is not None:
        lines.append("# TYPE sglang:num_retracted_requests_total counter")
        for rank in usage_by_rank:
            lines.append(f'sglang:num_retracted_requests_total{{dp_rank="0",model_name="m",tp_rank="{rank}"}} '
                         f"{retracted}")
    lines.append("# TYPE sglang:cached_tokens_total counter")
    for source, value in cached_by_source.items():
        lines.append(f'sglang:cached_tokens_total{{cache_source="{source}",model_name="m"}} {value}')
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_sglang_ranks_are_read_once_and_the_hit_ratio_comes_from_counters(spelling):
    def _sglang_page(*args):
        return spelled(_sglang_page_native(*args), spelling)

    adapter = SglangAdapter()
    # Two TP ranks repeat the scheduler's series: one is read, never the sum.
    first = adapter.adapt(_sglang_page({"0": 0.4, "1": 0.4}, 100, 300, None, {"device": 80, "host": 20}), at=0)
    engine = first.engines[("m", "0")]
    assert engine.gauges["kv_usage"] == 0.4
    assert engine.counters["prefix_hits"] == 100 and engine.counters["prefix_queries"] == 400
    # HiCache tiers are disjoint and summed; a `total` series alone is read alone.
    assert engine.counters["prompt_tokens_cached"] == 100
    assert "preemptions" not in engine.counters
    window = Window(600.0)
    window.add(first)
    window.add(adapter.adapt(_sglang_page({"0": 0.4, "1": 0.4}, 190, 310, 2, {"total": 190}), at=10))
    values = _values(window)
    # (190-100) / ((190+310) - (100+300)): the counters' window, not the 0.99 gauge.
    assert values["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(0.9)
    assert window.latest.engines[("m", "0")].counters["prompt_tokens_cached"] == 190
    # The retraction family appeared: its first value has no increase yet.
    assert values["kvwatch_preemptions_per_second"] is None
    window.add(adapter.adapt(_sglang_page({"0": 0.4, "1": 0.4}, 190, 310, 5, {"total": 190}), at=20))
    assert _values(window)["kvwatch_preemptions_per_second"] == pytest.approx(3 / 20)
    # Seen once on this target, the family's absence (a restart) reads 0.
    restarted = adapter.adapt(_sglang_page({"0": 0.1}, 0, 0, None, {"total": 0}), at=30)
    assert restarted.engines[("m", "0")].counters["preemptions"] == 0.0


def _hybrid_page(pools: dict[str, tuple[float, float, float]], usage: float | None) -> str:
    """A hybrid model's scheduler gauges: per pool (used, available, evictable)."""
    labels = 'dp_rank="0",model_name="m",tp_rank="0"'
    lines = []
    if usage is not None:
        lines += ["# TYPE sglang:token_usage gauge", f"sglang:token_usage{{{labels}}} {usage}"]
    for pool, values in pools.items():
        for state, value in zip(("used", "available", "evictable"), values):
            lines += [f"# TYPE sglang:{pool}_{state}_tokens gauge", f"sglang:{pool}_{state}_tokens{{{labels}}} {value}"]
    lines += ["# TYPE sglang:num_running_reqs gauge", f"sglang:num_running_reqs{{{labels}}} 4"]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_sglang_pools_read_per_pool_and_give_a_hybrid_models_usage(spelling):
    # The sliding-window pool is the fuller one: 600 of 1,000 slots held; the
    # full-attention pool 100 of 1,000 (its 300 evictable slots count as free).
    pools = {"kv": (100, 600, 300), "swa": (600, 400, 0), "mamba": (10, 40, 0)}
    adapter = SglangAdapter()
    snapshot = adapter.adapt(spelled(_hybrid_page(pools, None), spelling), at=0)
    engine = snapshot.engines[("m", "0")]
    assert engine.gauges["pool_used_tokens/swa"] == 600 and engine.gauges["pool_evictable_tokens/kv"] == 300
    # No token_usage on the page: the fullest pool's used / size, as SGLang's token_usage reads it.
    assert engine.gauges["kv_usage"] == pytest.approx(0.6)
    assert snapshot.sources["kv_usage"].startswith(f"{spelling}{{kv,swa,mamba}}_used_tokens")
    # With token_usage on the page, it is the KV usage and the pools ride beside it.
    snapshot = adapter.adapt(spelled(_hybrid_page(pools, 0.61), spelling), at=10)
    assert snapshot.engines[("m", "0")].gauges["kv_usage"] == 0.61
    assert snapshot.sources["kv_usage"] == f"{spelling}token_usage"
    assert snapshot.sources["pool_used_tokens"] == f"{spelling}{{kv,swa,mamba}}_used_tokens"


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_spelling_seen_is_reported_and_the_pools_re_exported(fixtures_dir, spelling):
    from page_support import Pages

    from kvwatch.sidecar.collector import make_registry
    from kvwatch.sidecar.statuspage import render_status_page

    pages = [spelled((fixtures_dir / "handwritten" / f"sglang-hicache-{x}.txt").read_text(), spelling) for x in "ab"]
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "poll_interval": "1s",
                                        "window": "5m"}, environ={})
    times = iter([1000.0, 1060.0])
    monitor = Monitor(settings, fetcher=Pages(pages), clock=lambda: next(times))
    for _ in pages:
        state = monitor.poll_once()
    body = signals_json(state, settings)
    assert body["engine"] == "sglang" and body["engine_spelling"] == spelling
    assert body["sources"]["prompt_tokens_cached"] == f"{spelling}cached_tokens_total"
    html = render_status_page(state, settings)
    assert f'names spelled <code data-spelling="{spelling}">{spelling}</code>' in html
    registry = make_registry(monitor)
    assert registry.get_sample_value("kvwatch_engine_spelling_info", {"spelling": spelling}) == 1.0
    identity = {"model_name": "qwen3-8b", "engine": "0"}
    assert registry.get_sample_value("kvwatch_engine_kv_pool_evictable_tokens", {**identity, "pool": "kv"}) == 18000
    assert registry.get_sample_value("kvwatch_engine_kv_pool_used_tokens", {**identity, "pool": "kv"}) > 0


# --- llama.cpp: pages written from the source ---------------------------------


def test_llamacpp_recent_build_counts_cached_tokens_apart(fixtures_dir):
    pages = [(fixtures_dir / "handwritten" / f"llamacpp-2026-{p}.txt").read_text() for p in "ab"]
    assert recognize(pages[0]) == "llamacpp"
    adapter = make_adapter("llamacpp")
    window = _window(adapter, [(0.0, pages[0]), (10.0, pages[1])])
    engine = window.latest.engines[("unknown", "0")]
    # prompt_tokens_total excludes cached tokens: 1500 + 4500.
    assert engine.counters["prompt_tokens"] == 6000 and engine.counters["prompt_tokens_cached"] == 4500
    # n_tokens_max and n_busy_slots_per_decode are typed counters but not counters: never read.
    assert set(engine.counters) == {"prompt_tokens", "prompt_tokens_cached", "prefix_hits", "prefix_queries",
                                    "generation_tokens"}
    assert engine.gauges == {"running": 4.0, "waiting": 3.0}
    values = _values(window)
    # +900 cached of +300 processed + 900 cached.
    assert values["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(0.75)
    assert values["kvwatch_prompt_tokens_per_second"] == pytest.approx(120.0)
    assert values["kvwatch_generation_tokens_per_second"] == pytest.approx(20.0)
    # No usage gauge in 2026 builds and no histograms: absent, never 0.
    for dark in ("kvwatch_kv_cache_usage_ratio", "kvwatch_time_to_first_token_mean_seconds",
                 "kvwatch_preemptions_per_second", "kvwatch_kv_cache_capacity_tokens"):
        assert values[dark] is None
    per_engine, _ = evaluate_window(window)
    findings = diagnose.diagnose(window, per_engine, [], {})
    assert not [f for f in findings if f.symptom in ("exhaustion", "low_hit_rate")]


def test_llamacpp_older_build_without_the_cached_counter(fixtures_dir):
    pages = [(fixtures_dir / "handwritten" / f"llamacpp-2024-{p}.txt").read_text() for p in "ab"]
    window = _window(make_adapter("llamacpp"), [(0.0, pages[0]), (10.0, pages[1])])
    values = _values(window)
    # Cached tokens are counted nowhere: the processed tokens alone would read a 0 % hit ratio.
    assert values["kvwatch_prefix_cache_hit_ratio"] is None
    assert values["kvwatch_prompt_tokens_per_second"] is None
    assert values["kvwatch_kv_cache_usage_ratio"] == 0.97
    assert values["kvwatch_requests_waiting"] == 3.0


# --- llama.cpp: pages from the real server of the tier -------------------------

REAL_LLAMACPP = "llamacpp-b11434-cpu"


def test_llamacpp_real_pages_hit_ratio_from_both_counters(fixtures_dir):
    """The shared-prefix load between two idle pages of a real llama-server b11434
    (README of the fixture): 551 requests of 288 prompt tokens, 16 generated."""
    a, b = [(fixtures_dir / REAL_LLAMACPP / f"metrics-prefix-{p}.txt").read_text() for p in "ab"]
    assert recognize(b) == "llamacpp"
    adapter = make_adapter("llamacpp")
    window = _window(adapter, [(0.0, a), (10.0, b)])
    engine = window.latest.engines[("unknown", "0")]
    # 18,396 processed + 140,292 cached = 551 x 288, what the responses' usage summed.
    assert engine.counters == {"prompt_tokens": 158688.0, "prefix_queries": 158688.0,
                               "prompt_tokens_cached": 140292.0, "prefix_hits": 140292.0,
                               "generation_tokens": 8816.0}
    assert engine.gauges == {"running": 0.0, "waiting": 0.0}
    values = _values(window)
    assert values["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(140292 / 158688)
    assert values["kvwatch_prompt_tokens_per_second"] == pytest.approx(15868.8)
    assert values["kvwatch_generation_tokens_per_second"] == pytest.approx(881.6)
    for dark in ("kvwatch_kv_cache_usage_ratio", "kvwatch_time_to_first_token_mean_seconds",
                 "kvwatch_preemptions_per_second", "kvwatch_kv_cache_capacity_tokens"):
        assert values[dark] is None
    per_engine, _ = evaluate_window(window)
    assert not diagnose.diagnose(window, per_engine, [], {})


def test_llamacpp_real_page_with_every_slot_busy(fixtures_dir):
    """1 s after the idle page, 8 distinct 200-token requests on the 4 slots: 4
    processing, 4 deferred, each reusing only its <s> from the slot's cache."""
    b, full = [(fixtures_dir / REAL_LLAMACPP / f"metrics-{p}.txt").read_text() for p in ("prefix-b", "full")]
    window = _window(make_adapter("llamacpp"), [(0.0, b), (1.0, full)])
    values = _values(window)
    assert values["kvwatch_requests_running"] == 4.0 and values["kvwatch_requests_waiting"] == 4.0
    # +8 cached of +1,592 processed + 8 cached = 8 x 200.
    assert values["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(8 / 1600)
    # prompt_tokens_seconds reads 32,067 on this page (decode steps since the previous
    # read); kvwatch's rate comes from the counters: 1,600 tokens in 1 s.
    assert values["kvwatch_prompt_tokens_per_second"] == pytest.approx(1600.0)
    # No usage gauge: a full slot pool is a queue, not an exhausted cache.
    per_engine, _ = evaluate_window(window)
    assert not [f for f in diagnose.diagnose(window, per_engine, [], {}) if f.symptom == "exhaustion"]


# --- TensorRT-LLM: pages written from the source ------------------------------


def test_trtllm_blocks_and_gauges_held_since_the_last_completion(fixtures_dir):
    a, b = [(fixtures_dir / "handwritten" / f"trtllm-{p}.txt").read_text() for p in "ab"]
    assert recognize(a) == "trtllm"
    adapter = make_adapter("trtllm")
    first = adapter.adapt(a, at=0.0)
    # First poll: nothing says how old the iteration gauges are.
    assert "kv_usage" not in first.engines[("llama-3.1-8b", "0")].gauges
    assert first.capacity_tokens("0") == 2048 * 32
    window = Window(600.0)
    window.add(first)
    window.add(adapter.adapt(b, at=10.0))
    values = _values(window)
    # Reused +250 of (250 + 500) blocks; the 0.99 hit-rate gauge is not read.
    assert values["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(250 / 750)
    assert values["kvwatch_prompt_tokens_cached_ratio"] == pytest.approx(8000 / 24000)
    assert values["kvwatch_kv_cache_usage_ratio"] == 0.71  # 18 requests completed since: current
    assert values["kvwatch_requests_finished_per_second"] == {"stop": 1.8, "length": 0.0}
    assert values["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx(3.6 / 18)
    assert values["kvwatch_preemptions_per_second"] is None
    # The same page STALE_AFTER seconds later: nothing completed, so the gauges are stale.
    window.add(adapter.adapt(b, at=10.0 + STALE_AFTER + 1))
    values = _values(window)
    assert values["kvwatch_kv_cache_usage_ratio"] is None and values["kvwatch_requests_running"] is None
    per_engine, _ = evaluate_window(window)
    assert not [f for f in diagnose.diagnose(window, per_engine, [], {}) if f.symptom == "exhaustion"]


# --- choosing the engine ------------------------------------------------------


def test_engine_setting_is_validated():
    assert load_settings(environ={}).engine == "auto"
    assert load_settings(environ={"KVWATCH_ENGINE": "SGLang"}).engine == "sglang"
    with pytest.raises(SettingsError) as error:
        load_settings(overrides={"engine": "tgi"}, environ={})
    assert "'tgi' is not an engine (auto, vllm, sglang, llamacpp, trtllm)" in str(error.value)


def test_monitor_picks_the_engine_from_the_first_page_and_says_so(fixtures_dir):
    page = (fixtures_dir / "handwritten" / "llamacpp-2026-a.txt").read_text()
    with PageServer([Answer("not metrics\n"), Answer(page)]) as server:
        settings = load_settings(overrides={"target": server.url, "poll_interval": "1s"}, environ={})
        monitor = Monitor(settings)
        assert monitor.poll_once().reason == "no_engine_metrics"
        state = monitor.poll_once()
    assert state.up and state.engine == "llamacpp"
    body = signals_json(state, settings)
    assert body["engine"] == "llamacpp"
    dark = {item["signal"]: item for item in body["dark_signals"]}
    assert "llama.cpp does not export" in dark["kvwatch_time_to_first_token_mean_seconds"]["why"]
    assert "kvwatch_prefix_cache_hit_ratio" not in dark


def test_a_pinned_engine_reads_only_its_own_families(fixtures_dir):
    page = (fixtures_dir / "handwritten" / "llamacpp-2026-a.txt").read_text()
    with PageServer([Answer(page)]) as server:
        monitor = Monitor(load_settings(overrides={"target": server.url, "engine": "vllm"}, environ={}))
        state = monitor.poll_once()
    assert not state.up and state.reason == "no_engine_metrics" and "no vLLM engine metrics" in state.detail


def test_dark_signals_follow_each_adapters_table():
    assert dark_signals(ENGINES["vllm"]) == ()
    assert "kvwatch_requests_finished_per_second" in dark_signals(ENGINES["sglang"])
    assert "kvwatch_prefix_cache_hit_ratio" not in dark_signals(ENGINES["sglang"])
    assert "kvwatch_preemptions_per_second" in dark_signals(ENGINES["trtllm"])
    assert "kvwatch_kv_cache_capacity_tokens" in dark_signals(ENGINES["llamacpp"])


def test_dark_signals_come_from_what_each_adapter_declares(fixtures_dir):
    """The coverage reads EngineAdapter.provides and nothing engine-specific:
    vLLM is lit everywhere because it declares its alias tables, every key a
    real vLLM page fills is declared, and an adapter that declares nothing
    lights nothing."""
    for function in (coverage.provided, coverage.dark_signals):
        source = inspect.getsource(function)
        assert "vllm" not in source.lower() and "TableAdapter" not in source, function.__name__
    declared = ENGINES["vllm"].provides()
    pages = sorted(fixtures_dir.glob("vllm-*/metrics-*.txt"))
    assert len(pages) >= 4
    for page in pages:
        for engine in make_adapter("vllm").adapt(page.read_text(), 1.0).engines.values():
            for key in [*engine.gauges, *engine.counters, *engine.histograms]:
                assert key in declared or key.split("/", 1)[0] + "/*" in declared, (page.name, key)
    for adapter in ENGINES.values():
        assert set(adapter.provides(older_builds=False)) <= set(adapter.provides()), adapter.name

    class Bare(EngineAdapter):
        name = "bare"

        def adapt(self, text, at=None):
            raise NotImplementedError

    assert set(dark_signals(Bare)) == {signal.name for signal in SIGNALS}


# --- the simulator's dialects -------------------------------------------------


@pytest.mark.parametrize("dialect, spelling", [("sglang", "sglang:"), ("sglang", "sglang_"), ("llamacpp", None),
                                               ("trtllm", None)])
def test_each_dialect_reads_back_to_the_vllm_pages_values(dialect, spelling):
    """The same simulated engine rendered as vLLM and as `dialect`: wherever
    the dialect provides a signal, it equals vLLM's (blocks round TensorRT-LLM's
    block counters)."""
    sim = Simulation(load_scenario("eviction-pressure"), seed=1)
    vllm_adapter, other = make_adapter("vllm"), make_adapter(dialect)
    vllm_window, other_window = Window(600.0), Window(600.0)
    from kvwatch.sim.dialects import TrtllmGauges

    held = TrtllmGauges()
    for step in range(12):
        sim.advance_to(sim.now + 10.0)
        vllm_window.add(vllm_adapter.adapt(render_metrics(sim.engines, sim.model_name, sim.created_unix,
                                                          include_process=False), at=step * 10.0))
        text = render_dialect(dialect, sim.engines, sim.model_name, held)
        if spelling:
            text = spelled(text, spelling)
        assert recognize(text) == dialect
        other_window.add(other.adapt(text, at=step * 10.0))
        assert other_window.latest.spelling == (spelling or other.prefixes[0])
    expected, got = _values(vllm_window), _values(other_window)
    dark = set(dark_signals(ENGINES[dialect]))
    compared = 0
    for name in ("kvwatch_prefix_cache_hit_ratio", "kvwatch_prompt_tokens_cached_ratio",
                 "kvwatch_generation_tokens_per_second", "kvwatch_prompt_tokens_per_second",
                 "kvwatch_requests_waiting", "kvwatch_kv_cache_capacity_tokens",
                 "kvwatch_time_to_first_token_mean_seconds", "kvwatch_preemptions_per_second"):
        if name in dark or (dialect == "trtllm" and name == "kvwatch_requests_waiting"):
            continue
        if dialect == "sglang" and name == "kvwatch_preemptions_per_second" and not expected[name]:
            assert got[name] is None  # no retraction yet: the family is not on the page, so unknown
            continue
        tolerance = 0.02 if dialect == "trtllm" and name == "kvwatch_prefix_cache_hit_ratio" else 1e-9
        assert got[name] == pytest.approx(expected[name], rel=tolerance, abs=1e-9), name
        compared += 1
    assert compared >= 4
    if dialect == "sglang":  # llama.cpp 2026 has no usage gauge; TensorRT-LLM holds it until a completion
        assert got["kvwatch_kv_cache_usage_ratio"] == pytest.approx(expected["kvwatch_kv_cache_usage_ratio"])
        # Every cache tier in one view, from SGLang's prefill_effective_tokens{mode} as from vLLM's by-source
        # counters: the device's and the computed shares agree (the tiers SGLang lacks, vLLM reads 0).
        tiers, vllm_tiers = got["kvwatch_prompt_tokens_by_tier_ratio"], expected["kvwatch_prompt_tokens_by_tier_ratio"]
        assert set(tiers) == {"device", "host", "storage", "computed"}
        for tier in ("device", "computed"):
            assert tiers[tier] == pytest.approx(vllm_tiers[tier]), tier
        assert tiers["device"] > 0 and tiers["computed"] > 0
        # The token pool: used / (used + available + evictable) is the usage token_usage states.
        engine = other_window.latest.engines[(sim.model_name, "0")]
        pool = [engine.gauges[f"pool_{state}_tokens/kv"] for state in ("used", "available", "evictable")]
        assert pool[0] / sum(pool) == pytest.approx(engine.gauges["kv_usage"])
        assert sum(pool) == sim.engines[0].config.kv_cache_size_tokens - sim.engines[0].config.block_size
        assert pool[2] > 0  # eviction pressure keeps radix-cached, reclaimable slots


def test_the_engines_doc_is_the_adapters_tables():
    from kvwatch.commands.generate import render_all
    from kvwatch.engines.coverage import engines_markdown
    from kvwatch.mixin.config import MixinConfig

    table = render_all(MixinConfig())["docs/engines-signals.md"]
    assert table.endswith(engines_markdown())
    assert "| `kvwatch_prefix_cache_hit_ratio` | yes |" in table
    committed = (Path(__file__).resolve().parent.parent / "docs" / "engines-signals.md").read_text()
    assert committed == table


@pytest.mark.parametrize("spelling", ["vllm:", "vllm_"])
def test_vllms_spelling_is_reported_too(fixtures_dir, spelling):
    from kvwatch.sidecar.collector import make_registry

    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    if spelling == "vllm_":
        page = re.sub(r"^vllm:", "vllm_", page, flags=re.M)
    adapter = make_adapter("vllm")
    snapshot = adapter.adapt(page, at=0)
    assert snapshot.spelling == spelling and snapshot.engines
    with PageServer([Answer(page)]) as server:
        monitor = Monitor(load_settings(overrides={"target": server.url, "engine": "vllm"}, environ={}))
        state = monitor.poll_once()
    assert signals_json(state, monitor.settings)["engine_spelling"] == spelling
    assert make_registry(monitor).get_sample_value("kvwatch_engine_spelling_info", {"spelling": spelling}) == 1.0


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_simulators_sglang_dialect_serves_its_tiers_and_pools_in_either_spelling(spelling):
    """`kvwatch sim --dialect sglang --spelling ...`, as a demo runs it: a kvwatch polling it reports the
    spelling seen, every cache tier's share, the token pool and the recomputation's cost, under both."""
    from kvwatch.sidecar.collector import make_registry
    from kvwatch.sim.server import start_background

    # The exhaustion scenario's overload retracts requests from about 90 simulated seconds on.
    with start_background("exhaustion", speed=0, dialect="sglang", spelling=spelling, model_name="m-sglang") as sim:
        text = sim.metrics_text()
        assert (f"{spelling}kv_evictable_tokens{{" in text) and (f"{spelling}prefill_effective_tokens_total{{" in text)
        monitor = Monitor(load_settings(overrides={"target": sim.metrics_url, "poll_interval": "1s",
                                                   "window": "5m"}, environ={}))
        for _ in range(8):
            sim.advance(30.0)
            monitor.poll_once()
    state = monitor.state
    assert state.engine == "sglang"
    assert signals_json(state, monitor.settings)["engine_spelling"] == spelling
    registry = make_registry(monitor)
    assert registry.get_sample_value("kvwatch_engine_spelling_info", {"spelling": spelling}) == 1.0
    identity = {"model_name": "m-sglang", "engine": "0"}
    pools = {state_: registry.get_sample_value(f"kvwatch_engine_kv_pool_{state_}_tokens", {**identity, "pool": "kv"})
             for state_ in ("used", "available", "evictable")}
    assert None not in pools.values() and sum(pools.values()) > 0
    shares = {tier: registry.get_sample_value("kvwatch_prompt_tokens_by_tier_ratio", {**identity, "tier": tier})
              for tier in ("device", "host", "storage", "computed")}
    assert None not in shares.values() and sum(shares.values()) == pytest.approx(1.0)
    assert registry.get_sample_value("kvwatch_engine_retracted_prompt_tokens_total", identity) > 0
    assert 0 < registry.get_sample_value("kvwatch_prefill_recomputed_ratio", identity) < 1
