"""Diagnosis reads each window entry once (its per-engine Polls and what
changed since the entry before it) and keeps that on the entry for every
later poll. Those kept views must never make a finding differ from reading
the same window afresh: checked at every poll of scenarios that exhaust the
cache, lose their prefix hits, restart and change configuration, while the
window slides and drops its oldest entries."""

from __future__ import annotations

from kvwatch.diagnose import diagnose
from kvwatch.engines.vllm import VllmAdapter
from kvwatch.signals import evaluate_window
from kvwatch.sim.render import render_metrics
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.simulation import Simulation
from kvwatch.window import Window

from fuzz.pages import Engine, page

BASE = 1_700_000_000.0


def fresh_findings(window: Window, thresholds: dict) -> list:
    """The findings with every entry's kept views, and what the diagnosis
    keeps on the window (its per-engine polls), set aside (and put back)."""
    kept = [entry.derived for entry in window.entries]
    kept_on_window = window.kept
    try:
        for entry in window.entries:
            entry.derived = {}
        window.kept = {}
        per_engine, per_model = evaluate_window(window)
        return diagnose(window, per_engine, (), thresholds)
    finally:
        for entry, derived in zip(window.entries, kept):
            entry.derived = derived
        window.kept = kept_on_window


def diagnose_each_poll(pages, window_seconds: float, every: float, thresholds: dict | None = None) -> list:
    adapter = VllmAdapter()
    window = Window(window_seconds)
    seen = []
    for index, text in enumerate(pages):
        window.add(adapter.adapt(text, at=BASE + index * every))
        per_engine, per_model = evaluate_window(window)
        kept = diagnose(window, per_engine, (), thresholds or {})
        assert kept == fresh_findings(window, thresholds or {}), f"poll {index}"
        seen.extend(kept)
    return seen


def scenario_pages(name: str, every: float = 5.0):
    scenario = load_scenario(name)
    sim = Simulation(scenario, seed=0, created_unix=BASE)
    while sim.now < scenario.cycle_seconds - 1e-9:
        sim.advance_to(min(scenario.cycle_seconds, sim.now + every))
        yield render_metrics(sim.engines, sim.model_name, BASE, include_process=False)


def test_kept_views_match_a_fresh_read_through_exhaustion():
    name = "exhaustion"
    found = diagnose_each_poll(scenario_pages(name), 120.0, 5.0,
                               {"max_num_seqs": load_scenario(name).engine.max_num_seqs})
    # The scenario did what it is for: the comparison covered exhaustion findings.
    assert any(f.symptom == "exhaustion" for f in found)


def test_kept_views_match_a_fresh_read_through_a_prefix_change():
    found = diagnose_each_poll(scenario_pages("prefix-change"), 120.0, 5.0)
    assert any(f.symptom == "low_hit_rate" for f in found)


def traffic(step: int, created: float) -> Engine:
    return Engine(prompt_tokens=1000 + 100 * step, generation_tokens=500 + 50 * step, prefix_hits=400 + 40 * step,
                  prefix_queries=1000 + 100 * step, preemptions=step, finished_stop=50 + 5 * step,
                  ttft_cumulative=(5 + step, 10 + step, 20 + step, 30 + step, 40 + step),
                  ttft_sum=30.0 + step, created=created)


def test_kept_views_match_a_fresh_read_across_restarts_and_config_changes():
    pages = []
    for step in range(40):
        restarted = step >= 15  # counters restart from zero and _created moves
        engine = traffic(step - 15 if restarted else step, 200.0 if restarted else 100.0)
        pages.append(page(engine, num_gpu_blocks=256 if step >= 25 else 128))
    # A 60 s window at 5 s: the restart and the config change enter the
    # window, are reported, then slide out of it.
    found = diagnose_each_poll(pages, 60.0, 5.0)
    causes = {f.cause for f in found}
    assert {"engine_restarted", "cache_config_changed"} <= causes
