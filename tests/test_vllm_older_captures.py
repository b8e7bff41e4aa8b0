"""kvwatch over real captures of older vLLM releases, 0.10.2 and 0.20.2 (CPU
builds, the tier's tiny model and 4,096-token cache; tests/fixtures/
vllm-0.10.2-cpu and vllm-0.20.2-cpu, README.md there for how they were
installed, started and loaded, and the ground truth read by hand).

Both count a request that waits for KV space in the prefix-cache lookup
counters again at every scheduling attempt (0.32 counts each prompt once), so
their hits over queries is a ratio of lookups, not the share of prompt tokens
served from the cache: kvwatch shows it marked, with the reason, in the API,
on the page and in the findings. 0.10.2 also counts a preemption late, and
lacks families and labels later releases have: each signal it leaves dark
says why."""

from __future__ import annotations

import pytest

from kvwatch.capture.bundle import Capture
from kvwatch.capture.replay import replay
from kvwatch.engines.vllm import LATE_PREEMPTIONS, RELOOKUPS, VllmAdapter
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sidecar.report import diagnosis_json, signals_json
from kvwatch.settings import load_settings
from kvwatch.sidecar.statuspage import render_status_page

HIT = "kvwatch_prefix_cache_hit_ratio"
CACHED = "kvwatch_prompt_tokens_cached_ratio"


def replayed(fixtures_dir, version: str, scenario: str, lit: dict[str, int] | None = None):
    """The monitor's last state after every recorded page of the scenario,
    with a window that holds the whole recording, and its settings; `lit`
    counts the polls on which each signal had a value."""
    path = fixtures_dir / f"vllm-{version}-cpu" / f"{scenario}.tar.gz"
    settings = load_settings(overrides={"poll_interval": "1s", "window": "600s"}, environ={})
    states = []

    def keep(state):
        if state.up:
            states.append(state)
            for name, value in (state.per_engine[0].values if lit is not None else {}).items():
                lit[name] = lit.get(name, 0) + (value is not None)

    replay(Capture(path), lambda source: Monitor(settings, fetcher=source, clock=source.now), on_state=keep)
    assert len(states) >= 5
    return states[-1], settings


def engine_row(signals: dict) -> dict:
    (row,) = signals["engines"]
    return row


def dark(signals: dict) -> dict[str, str]:
    return {item["signal"]: item["why"] for item in signals["dark_signals"]}


def findings_citing(diagnosis: dict, part: str) -> list[dict]:
    return [f for f in diagnosis["findings"] if any(part in key for key in f["evidence"])]


# --- which releases count differently: read from the page's families ---------


def test_the_counting_is_told_from_the_families_a_page_carries(fixtures_dir):
    def counting(path: str) -> dict[str, str]:
        return VllmAdapter().adapt((fixtures_dir / path).read_text(), at=0.0).counting

    assert counting("vllm-0.32-cpu/metrics-load.txt") == {}  # has prompt_tokens_cached_by_source: once per prompt
    assert counting("vllm-0.20.2-cpu/metrics-load.txt") == {"prefix_queries": RELOOKUPS, "prefix_hits": RELOOKUPS}
    assert counting("vllm-0.10.2-cpu/metrics-load.txt") == {
        "prefix_queries": RELOOKUPS, "prefix_hits": RELOOKUPS, "preemptions": LATE_PREEMPTIONS}
    # Public pages: 0.11 hides gpu_cache_usage_perc (no late preemptions), 0.25
    # predates 0.32; the V0 engine has no lookup counters at all.
    assert set(counting("public/vllm-0.11.0.txt")) == {"prefix_queries", "prefix_hits"}
    assert set(counting("public/vllm-0.25-deepseek-specdecode.txt")) == {"prefix_queries", "prefix_hits"}
    assert counting("public/vllm-v0-0.5.txt") == {}


# --- 0.20.2 ---------------------------------------------------------------------


def test_0_20_burst_hit_ratio_is_marked_with_the_share_the_version_counts(fixtures_dir):
    # By hand (README): over the burst the lookups grew 28,224 -> 91,424
    # (+63,200 tokens) while prompt tokens grew 28,224 -> 38,624 (+10,400):
    # waiting requests were looked up again on every scheduling attempt. None
    # hit (+0), and vllm:prompt_tokens_cached_total did not move either.
    state, settings = replayed(fixtures_dir, "0.20.2", "load")
    row = engine_row(signals_json(state, settings))
    assert row["signals"][HIT] == 0.0
    assert row["signals"][CACHED] == 0.0
    caveat = row["caveats"][HIT]
    assert caveat.startswith("the window's lookups (63200 tokens) exceed its prompt tokens (10400): ")
    assert RELOOKUPS in caveat and caveat.endswith(
        "the share of prompt tokens served from a cache in the window is 0 (kvwatch_prompt_tokens_cached_ratio)")
    # 0.20 counts preemptions when they happen (+12 here): no caveat on them.
    assert row["signals"]["kvwatch_preemptions_per_second"] > 0
    assert "kvwatch_preemptions_per_second" not in row["caveats"]
    # Its families are there: waiting by reason (0.20+) and the cache's bytes are lit.
    assert row["signals"]["kvwatch_requests_waiting_by_reason"] is not None
    assert row["signals"]["kvwatch_kv_cache_used_bytes"] is not None
    assert "kvwatch_requests_waiting_by_reason" not in dark(signals_json(state, settings))
    # The finding that cites the ratio carries the same sentence.
    diagnosis = diagnosis_json(state, settings)
    citing = findings_citing(diagnosis, "hit_ratio")
    assert citing and all(f["notes"]["hit_ratio_counting"] == RELOOKUPS for f in citing)
    # The diagnosis judges what this release counts as served from the prefix
    # cache (prompt_tokens_by_source local_cache_hit over prompt tokens: 0 of
    # 10,400), and says so.
    from kvwatch.diagnose.hit_rate import SERVED_BASIS

    (exhaustion,) = [f for f in diagnosis["findings"] if f["symptom"] == "exhaustion"]
    assert exhaustion["evidence"]["prefix_cache_hit_ratio"] == 0.0
    assert exhaustion["notes"]["hit_ratio_basis"] == SERVED_BASIS


def test_0_20_shared_prefix_ratio_is_the_served_share_and_still_marked(fixtures_dir):
    # 49 requests of 576 tokens, 48 of them hitting the 512-token prefix: no
    # request waited, so lookups = prompt tokens = 28,224 and hits = cached =
    # 24,576. The ratio is right here, but the release counts re-lookups, so
    # it stays marked (without the "exceed" evidence).
    state, settings = replayed(fixtures_dir, "0.20.2", "prefix-load")
    row = engine_row(signals_json(state, settings))
    assert row["signals"][HIT] == pytest.approx(24576 / 28224)
    assert row["signals"][CACHED] == pytest.approx(24576 / 28224)
    assert row["caveats"][HIT].startswith(RELOOKUPS)
    assert "exceed" not in row["caveats"][HIT]


# --- 0.10.2 ---------------------------------------------------------------------


def test_0_10_burst_hit_ratio_is_marked_inflated_and_its_fallback_refused_with_the_reason(fixtures_dir):
    # By hand (README): one wave of 24 distinct 401-token prompts. Prompt
    # tokens grew 92,897 -> 102,521 (+9,624 = 24 x 401) while the lookups grew
    # 92,897 -> 618,169 (+525,272) and the hits 81,920 -> 290,656 (+208,736):
    # the waiting requests' re-lookups hit the blocks they had computed before.
    # Hits over lookups reads 0.397 for prompts that share nothing; hits over
    # prompt tokens would read 21.7.
    state, settings = replayed(fixtures_dir, "0.10.2", "load")
    signals = signals_json(state, settings)
    row = engine_row(signals)
    assert row["signals"][HIT] == pytest.approx(208736 / 525272)
    assert row["caveats"][HIT] == (
        "the window's lookups (525272 tokens) exceed its prompt tokens (9624): " + RELOOKUPS
        + "; this version counts no prompt tokens served from a cache (vllm:prompt_tokens_cached_total is 0.16+), "
        "so that share is unknown")
    # The fallback is not dropped silently: dark, with the figures and the reason.
    assert row["signals"][CACHED] is None
    assert dark(signals)[CACHED] == (
        "this page has no vllm:prompt_tokens_cached_total (vLLM 0.16+), and the fallback, prefix hits over prompt "
        "tokens (208736 / 9624 = 21.7 in the window), is refused: " + RELOOKUPS)
    # 12 preemptions counted, late (README: running fell 8 -> 5 and waiting rose
    # 16 -> 19 by 7.0 s while the counter read 0 until 11.5 s).
    assert row["signals"]["kvwatch_preemptions_per_second"] > 0
    assert row["caveats"]["kvwatch_preemptions_per_second"] == LATE_PREEMPTIONS


def test_0_10_every_dark_signal_says_why(fixtures_dir):
    lit: dict[str, int] = {}
    state, settings = replayed(fixtures_dir, "0.10.2", "load", lit)
    signals = signals_json(state, settings)
    why = dark(signals)
    # A family this release lacks, with the releases that have it.
    assert why["kvwatch_requests_waiting_by_reason"] == (
        "not exported by this engine's version (num_requests_waiting_by_reason: 0.20+)")
    assert why["kvwatch_prompt_tokens_from_cache_ratio"] == (
        "not exported by this engine's version (prompt_tokens_by_source: 0.16+)")
    assert why["kvwatch_external_prefix_cache_hit_ratio"].startswith(
        "not exported by this engine's version (external_prefix_cache_queries: 0.11.1+")
    # A label the page sets to "None".
    assert why["kvwatch_kv_cache_used_bytes"] == (
        'cache_config_info of engine 0 says kv_cache_memory_bytes="None": the engine states no size of its KV '
        "cache in bytes")
    # Every signal without a value at the end is listed with a reason, or is
    # one that reads the moment and had a value earlier in the recording: the
    # time until full (usage is not rising once the wave is over) and the
    # requests that fit at current lengths (nothing runs at the last poll).
    row = engine_row(signals)
    unexplained = {name for name, value in row["signals"].items() if value is None} - set(why)
    assert unexplained == {"kvwatch_kv_cache_exhaustion_eta_seconds", "kvwatch_kv_cache_requests_fit_now"}
    assert all(lit[name] > 0 for name in unexplained)
    assert all(item["why"] for item in signals["dark_signals"])
    assert not any(lit[name] for name in why)  # dark on every poll, not only at the end


def test_0_10_findings_and_the_page_carry_the_reasons(fixtures_dir):
    from html import unescape

    state, settings = replayed(fixtures_dir, "0.10.2", "load")
    diagnosis = diagnosis_json(state, settings)
    citing_hits = findings_citing(diagnosis, "hit_ratio")
    citing_preemptions = findings_citing(diagnosis, "preemptions")
    assert citing_hits and citing_preemptions
    assert all(f["notes"]["hit_ratio_counting"] == RELOOKUPS for f in citing_hits)
    assert all(f["notes"]["preemptions_counting"] == LATE_PREEMPTIONS for f in citing_preemptions)
    # No count of prompt tokens served from the cache in 0.10: judged on the lookups, marked.
    assert not any("hit_ratio_basis" in f["notes"] for f in diagnosis["findings"])
    page = unescape(render_status_page(state, settings).split("<script")[0])
    assert "Prefix cache hit ratio:" in page and RELOOKUPS in page and LATE_PREEMPTIONS in page
    assert 'says kv_cache_memory_bytes="None"' in page
    assert "(num_requests_waiting_by_reason: 0.20+)" in page


def test_0_32_reads_unmarked(fixtures_dir):
    # Each prompt counted once: no caveat, the fallback's absence is no refusal.
    from test_statuspage import page, polled

    monitor, settings = polled([page(fixtures_dir, n) for n in ("idle", "prefix-load", "load")])
    signals = signals_json(monitor.state, settings)
    assert engine_row(signals)["caveats"] == {}
    assert engine_row(signals)["signals"][HIT] is not None
    assert {item["signal"] for item in signals["dark_signals"]}.isdisjoint({HIT, CACHED, "kvwatch_kv_cache_used_bytes"})
