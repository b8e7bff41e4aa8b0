"""SGLang's HiCache tiers weighed on the cache-tier view: does the host tier
(L2) pay for itself (the time its loads back to the GPU took against the
compute its tokens saved) and how many bytes it moves per token it serves;
the storage tier (L3) exports no time and no bytes, and says so.

The pages are tests/fixtures/handwritten/sglang-hicache-{a,b}.txt, two polls
60 s apart WRITTEN FROM SGLang'S SOURCE, not captured (the README there says
from which file and commit). Figures worked out by hand from the pages."""

from __future__ import annotations

import pytest
from page_support import polled
from test_recompute import spelled

from kvwatch.engines.coverage import dark_signals
from kvwatch.engines.sglang import SglangAdapter
from kvwatch.sidecar.collector import make_registry
from kvwatch.sidecar.report import signals_json
from kvwatch.sidecar.statuspage import render_status_page

IDENTITY = {"model_name": "qwen3-8b", "engine": "0"}
COST = "kvwatch_cache_tier_cost_ratio"
BYTES = "kvwatch_cache_tier_moved_bytes_per_token"
# KV bytes of one token of Qwen3-8B in bf16 (36 layers x 8 KV heads x 128 x K and V x 2 bytes).
TOKEN_BYTES = 147456


def pages(fixtures_dir, spelling="sglang:"):
    folder = fixtures_dir / "handwritten"
    return [spelled((folder / f"sglang-hicache-{x}.txt").read_text(), spelling) for x in "ab"]


@pytest.mark.parametrize("spelling", ["sglang:", "sglang_"])
def test_the_host_tier_says_whether_it_pays_for_itself(fixtures_dir, spelling):
    monitor = polled(pages(fixtures_dir, spelling))
    [row] = monitor.state.per_engine
    # Over the 60 s: 30,000 tokens computed (prefill_effective_tokens{mode="input"} 120,000 -> 150,000) in
    # 15 s of extend forward passes (forward_execution_seconds{category="forward_extend"} 60 -> 75): 0.5 ms a
    # token. The host tier served 30,000 (host_hit 50,000 -> 80,000), 15 s of compute saved, and its 600
    # loads back took 3 s (load_back_duration_seconds sum 5 -> 8): 0.2.
    assert row.values[COST] == pytest.approx({"host": 3 / 15})
    # It loaded back 30,000 tokens' KV and backed up 60,000 tokens': three tokens' bytes per token served.
    assert row.values[BYTES] == pytest.approx({"host": 3 * TOKEN_BYTES})
    assert row.values["kvwatch_prompt_tokens_by_tier_ratio"]["host"] == pytest.approx(0.3)

    registry = make_registry(monitor)
    assert registry.get_sample_value(COST, dict(IDENTITY, tier="host")) == pytest.approx(0.2)
    assert registry.get_sample_value(COST, dict(IDENTITY, tier="storage")) is None
    assert registry.get_sample_value(BYTES, dict(IDENTITY, tier="host")) == pytest.approx(3 * TOKEN_BYTES)
    assert registry.get_sample_value("kvwatch_model_cache_tier_cost_ratio",
                                     {"model_name": "qwen3-8b", "tier": "host"}) == pytest.approx(0.2)
    # The families re-exported (the radix cache's carry no model_name: the page's one model).
    assert registry.get_sample_value("kvwatch_engine_hicache_load_back_seconds_sum", IDENTITY) == pytest.approx(8.0)
    assert registry.get_sample_value("kvwatch_engine_hicache_load_back_seconds_count", IDENTITY) == 1600
    assert registry.get_sample_value("kvwatch_engine_hicache_load_back_bytes_total", IDENTITY) == 80000 * TOKEN_BYTES
    assert registry.get_sample_value("kvwatch_engine_hicache_backup_bytes_total", IDENTITY) == 260000 * TOKEN_BYTES
    assert registry.get_sample_value("kvwatch_engine_prefill_forward_seconds_total", IDENTITY) == 75

    body = signals_json(monitor.state, monitor.settings)
    [engine] = body["engines"]
    assert engine["signals"][COST] == pytest.approx({"host": 0.2})
    assert body["sources"]["hicache_load_back_time"] == f"{spelling}load_back_duration_seconds"
    assert body["sources"]["prefill_forward_seconds"] == (
        f'{spelling}forward_execution_seconds_total{{category="forward_extend"}}')
    # The storage tier served 10,000 tokens it cannot be weighed on: said beside both values.
    for name in (COST, BYTES):
        assert "storage tier (HiCache L3) served 10000 tokens" in engine["caveats"][name]
    dark = {d["signal"] for d in body["dark_signals"]}
    assert not dark & {COST, BYTES}
    html = render_status_page(monitor.state, monitor.settings)
    noscript = html[html.index("<noscript>\n"):]
    for display in ("Cache tier cost over compute saved (estimate)", "Cache tier bytes moved per token served"):
        assert display in noscript, display


def test_without_the_device_timer_the_cost_is_dark_and_says_why(fixtures_dir):
    """SGLang times its forward passes only with SGLANG_ENABLE_METRICS_DEVICE_TIMER=1: without it, no
    compute seconds to weigh the tier against; the bytes per token stay lit."""
    stripped = ["\n".join(line for line in page.splitlines() if "forward_execution_seconds" not in line) + "\n"
                for page in pages(fixtures_dir)]
    monitor = polled(stripped)
    [row] = monitor.state.per_engine
    assert row.values[COST] is None
    assert row.values[BYTES] == pytest.approx({"host": 3 * TOKEN_BYTES})
    dark = {d["signal"]: d for d in signals_json(monitor.state, monitor.settings)["dark_signals"]}
    assert dark[COST]["missing_families"] == ["prefill_forward_seconds"]
    assert BYTES not in dark


def test_sglang_lights_the_tier_signals_and_names_the_storage_tier_gap():
    assert COST not in dark_signals(SglangAdapter)
    assert BYTES not in dark_signals(SglangAdapter)
    assert "L3" in SglangAdapter.MISSING["hicache_storage_time"]


def test_newer_builds_rank_labels_on_the_radix_cache_read_the_same(fixtures_dir):
    """Newer builds label the radix cache's series with tp_rank, pp_rank and dp_rank (still no model_name):
    one rank is read, dp_rank is the engine."""
    ranked = []
    for page in pages(fixtures_dir):
        lines = []
        for line in page.splitlines():
            if 'cache_type="HiRadixCache"' in line:
                line = line.replace('cache_type="HiRadixCache"', 'cache_type="HiRadixCache",tp_rank="0",pp_rank="0"')
                lines.append(line)
                lines.append(line.replace('tp_rank="0"', 'tp_rank="1"'))
            else:
                lines.append(line)
        ranked.append("\n".join(lines) + "\n")
    [row] = polled(ranked).state.per_engine
    assert row.values[COST] == pytest.approx({"host": 0.2})
    assert row.values[BYTES] == pytest.approx({"host": 3 * TOKEN_BYTES})


def test_a_page_of_two_models_leaves_the_radix_cache_unread(fixtures_dir):
    """With two models on the page, the radix cache's series (no model_name) belong to neither: unread, and no
    model "unknown" made up for them."""
    two = [page + "\n".join(line.replace('model_name="qwen3-8b"', 'model_name="other"')
                            for line in page.splitlines() if line.startswith("sglang:num_running_reqs")) + "\n"
           for page in pages(fixtures_dir)]
    monitor = polled(two)
    rows = {row.model: row for row in monitor.state.per_engine}
    assert sorted(rows) == ["other", "qwen3-8b"]
    assert rows["qwen3-8b"].values[COST] is None


@pytest.mark.parametrize("spelling", ["sglang:", "sglang_"])
def test_the_simulators_sglang_dialect_weighs_its_host_tier(spelling):
    """`kvwatch sim --dialect sglang --lmcache N`: the tier stands for HiCache's host tier, its loads back
    (tier_load_s_per_token a token, a fifth of prefill's 0.0001) and its bytes served as SGLang's radix cache
    serves them, so a kvwatch polling it weighs the host tier under either spelling."""
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings
    from kvwatch.sim.server import start_background

    with start_background("demo", speed=0, dialect="sglang", spelling=spelling, model_name="m-sglang",
                          lmcache_tokens=16384) as sim:
        monitor = Monitor(load_settings(overrides={"target": sim.metrics_url, "poll_interval": "1s",
                                                   "window": "5m"}, environ={}))
        for _ in range(10):
            sim.advance(30.0)
            monitor.poll_once()
        text = sim.metrics_text()
    assert f'{spelling}load_back_duration_seconds_sum{{cache_type="HiRadixCache"' in text
    [row] = monitor.state.per_engine
    assert row.values["kvwatch_prompt_tokens_by_tier_ratio"]["host"] > 0
    # Loads at a fifth of prefill's cost a token: the tier costs well under what it saves.
    assert 0 < row.values[COST]["host"] < 0.5
    # At least the served tokens' own bytes (1,024 a token), more with stores never served.
    assert row.values[BYTES]["host"] >= 1024
