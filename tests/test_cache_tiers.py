"""One view of every cache tier: per engine, the share of the window's prompt
tokens each tier served and the share computed, token-weighted, from
whichever family the engine has (vLLM 0.32's prompt_tokens_cached_by_source
with prompt_tokens_by_source{local_compute}; SGLang's
prefill_effective_tokens{mode}), in the API, re-exported and on the page."""

from __future__ import annotations

import re

import pytest
from page_support import polled

from kvwatch.sidecar.collector import make_registry
from kvwatch.sidecar.report import signals_json
from kvwatch.sidecar.statuspage import render_status_page
from kvwatch.signals.catalogue import prompt_tokens_by_tier

TIER = "kvwatch_prompt_tokens_by_tier_ratio"


def underscored(page: str) -> str:
    """The page as OpenMetrics' escaping=underscores writes it: sample lines
    spelled `sglang_`, HELP and TYPE lines keeping `sglang:`."""
    return re.sub(r"^sglang:", "sglang_", page, flags=re.M)


def sglang_pages(fixtures_dir):
    folder = fixtures_dir / "handwritten"
    return [(folder / f"sglang-hicache-{x}.txt").read_text() for x in "ab"]


def exported(monitor) -> dict:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in make_registry(monitor).collect() for s in family.samples}


@pytest.mark.parametrize("spelling", ["sglang:", "sglang_"])
def test_sglang_tiers_from_prefill_effective_tokens(fixtures_dir, spelling):
    pages = sglang_pages(fixtures_dir)
    if spelling == "sglang_":
        pages = [underscored(page) for page in pages]
    monitor = polled(pages)
    state = monitor.state
    assert state.engine == "sglang"
    [row] = state.per_engine
    # Over the 60 s: device 30,000, host 30,000, storage 10,000 served, 30,000 computed.
    assert row.values[TIER] == pytest.approx({"device": 0.3, "host": 0.3, "storage": 0.1, "computed": 0.3})
    assert sum(row.values[TIER].values()) == pytest.approx(1.0)
    # The same tokens say the share from a cache (local: HiCache's tiers are the engine's own).
    assert row.values["kvwatch_prompt_tokens_from_cache_ratio"] == pytest.approx({"local": 0.7, "external": 0.0})
    samples = exported(monitor)
    identity = (("engine", "0"), ("model_name", "qwen3-8b"))
    assert samples[(TIER, identity + (("tier", "storage"),))] == pytest.approx(0.1)
    assert samples[("kvwatch_engine_prompt_tokens_cached_by_source_total",
                    tuple(sorted(identity + (("source", "host"),))))] == 80000
    assert samples[("kvwatch_engine_prompt_tokens_by_source_total",
                    tuple(sorted(identity + (("source", "local_compute"),))))] == 150000
    body = signals_json(state, monitor.settings)
    assert body["engines"][0]["signals"][TIER]["storage"] == pytest.approx(0.1)
    assert TIER not in {d["signal"] for d in body["dark_signals"]}


def test_vllm_032_tiers_from_cached_by_source(fixtures_dir):
    folder = fixtures_dir / "vllm-0.32-cpu"
    idle, load = (folder / "metrics-idle.txt").read_text(), (folder / "metrics-load.txt").read_text()

    def value(page, series):
        return float(re.search(rf"^{re.escape(series)} (\S+)$", page, re.M).group(1))

    identity = 'engine="0",model_name="tiny-llama"'
    device = value(load, f'vllm:prompt_tokens_cached_by_source_total{{{identity},source="device"}}')
    computed = value(load, f'vllm:prompt_tokens_by_source_total{{{identity},source="local_compute"}}')
    assert device > 0 and computed > 0  # the capture served some tokens from the GPU and computed others
    monitor = polled([idle, load], engine="vllm")
    [row] = monitor.state.per_engine
    shares = row.values[TIER]
    assert set(shares) == {"device", "host", "p2p", "disk", "external_unspecified", "computed"}
    assert shares["device"] == pytest.approx(device / (device + computed))
    assert shares["computed"] == pytest.approx(computed / (device + computed))
    assert shares["host"] == shares["disk"] == 0.0
    html = render_status_page(monitor.state, monitor.settings)
    noscript = html[html.index("<noscript>\n"):]
    assert "Prompt tokens by cache tier" in noscript and "computed" in noscript


def test_a_vllm_without_the_tier_family_leaves_the_view_dark_and_says_why(fixtures_dir):
    page = (fixtures_dir / "public" / "vllm-0.25-deepseek-specdecode.txt").read_text()
    monitor = polled([page, page], engine="vllm")
    [row] = [r for r in monitor.state.per_engine][:1]
    assert row.values[TIER] is None
    dark = {d["signal"]: d for d in signals_json(monitor.state, monitor.settings)["dark_signals"]}
    assert "prompt_tokens_cached_by_source" in dark[TIER]["missing_families"]


def test_the_shares_are_token_weighted_not_averaged():
    """Two engines of one model: a busy one mostly computed, an idle one all
    from the device. The model's shares weigh each engine's tokens; an average
    of the two engines' shares would say 0.5 computed."""
    from kvwatch.snapshot import EngineSnapshot
    from kvwatch.signals import View
    from kvwatch.window import Increase

    busy = {"prompt_tokens_cached_by_source/device": 100.0, "prompt_tokens_by_source/local_compute": 900.0}
    idle = {"prompt_tokens_cached_by_source/device": 10.0, "prompt_tokens_by_source/local_compute": 0.0}
    merged = Increase(60.0)
    for counters in (busy, idle):
        merged.add(Increase(60.0, dict(counters)))
    view = View(EngineSnapshot("m", "*"), merged, None, None, None, None)
    shares = prompt_tokens_by_tier(view)
    assert shares == pytest.approx({"device": 110 / 1010, "computed": 900 / 1010})
    # Nothing in the window: unknown, not 0.
    assert prompt_tokens_by_tier(View(EngineSnapshot("m", "0"), Increase(60.0, {
        "prompt_tokens_cached_by_source/device": 0.0, "prompt_tokens_by_source/local_compute": 0.0}),
        None, None, None, None)) is None
