"""Recomputation's cost: the share of prefill work spent computing again the
prompts of preempted (SGLang: retracted) requests, per engine, from a
fixture of each (SGLang's counter, written from its source; vLLM's estimate,
from a real vLLM 0.32 capture). Figures worked out by hand from the pages."""

from __future__ import annotations

import re

import pytest
from page_support import polled

from kvwatch.sidecar.collector import make_registry
from kvwatch.sidecar.report import signals_json
from kvwatch.sidecar.statuspage import render_status_page
from kvwatch.signals import SIGNALS_BY_NAME

SIGNAL = "kvwatch_prefill_recomputed_ratio"


def spelled(page: str, spelling: str) -> str:
    return re.sub(r"^sglang:", "sglang_", page, flags=re.M) if spelling == "sglang_" else page


@pytest.mark.parametrize("spelling", ["sglang:", "sglang_"])
def test_sglang_counts_the_recomputed_prompt_tokens(fixtures_dir, spelling):
    pages = [spelled((fixtures_dir / "handwritten" / f"sglang-hicache-{x}.txt").read_text(), spelling) for x in "ab"]
    monitor = polled(pages)
    [row] = monitor.state.per_engine
    # Over the 60 s: num_retracted_input_tokens 4,000 -> 7,000 (3,000 recomputed); prefill_effective_tokens
    # {mode="input"} 120,000 -> 150,000 (30,000 computed once, retracted re-counts excluded).
    assert row.values[SIGNAL] == pytest.approx(3000 / 33000)
    registry = make_registry(monitor)
    identity = {"model_name": "qwen3-8b", "engine": "0"}
    assert registry.get_sample_value(SIGNAL, identity) == pytest.approx(3000 / 33000)
    assert registry.get_sample_value("kvwatch_engine_retracted_prompt_tokens_total", identity) == 7000
    assert signals_json(monitor.state, monitor.settings)["sources"]["retracted_prompt_tokens"] == (
        f"{spelling}num_retracted_input_tokens_total")


def test_vllm_estimates_it_from_preemptions_and_the_mean_prompt(fixtures_dir):
    folder = fixtures_dir / "vllm-0.32-cpu"
    load, long_load = [(folder / f"metrics-{name}.txt").read_text() for name in ("load", "long-load")]
    monitor = polled([load, long_load], engine="vllm")
    [row] = monitor.state.per_engine
    # num_preemptions 0 -> 12; request_prompt_tokens sum 4,224 -> 13,824 over count 8 -> 32: a mean of
    # 9,600 / 24 = 400 tokens, so about 12 x 400 = 4,800 recomputed; local_compute 3,840 -> 13,840 (10,000).
    assert row.values[SIGNAL] == pytest.approx(4800 / 14800)
    html = render_status_page(monitor.state, monitor.settings)
    assert "Prefill recomputed after preemption" in html
    # Its documentation (docs/metrics.md) says it is an estimate on vLLM, and how.
    help_text = SIGNALS_BY_NAME[SIGNAL].doc
    assert "ESTIMATE" in help_text and "mean prompt length" in help_text and "upper bound" in help_text


def test_no_preemption_is_zero_and_no_preemption_family_is_unknown(fixtures_dir):
    folder = fixtures_dir / "vllm-0.32-cpu"
    idle, load = [(folder / f"metrics-{name}.txt").read_text() for name in ("idle", "load")]
    [row] = polled([idle, load], engine="vllm").state.per_engine
    assert row.values[SIGNAL] == 0.0  # prompts computed, none preempted
    # An SGLang page before its first retraction has no retraction family: unknown, not 0.
    page = (fixtures_dir / "handwritten" / "sglang-hicache-a.txt").read_text()
    without = re.sub(r"^(# (HELP|TYPE) )?sglang:num_retracted_\w+.*\n", "", page, flags=re.M)
    assert "num_retracted" not in without
    [row] = polled([without, without]).state.per_engine
    assert row.values[SIGNAL] is None
    # Seen once, then gone (a restart): its absence reads 0 while prompts are computed.
    later = (fixtures_dir / "handwritten" / "sglang-hicache-b.txt").read_text()
    later = re.sub(r"^(# (HELP|TYPE) )?sglang:num_retracted_\w+.*\n", "", later, flags=re.M)
    monitor = polled([page, without, later])
    assert monitor.state.per_engine[0].values[SIGNAL] == 0.0
