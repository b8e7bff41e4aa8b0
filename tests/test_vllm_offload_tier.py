"""vLLM's offload tier: the OffloadingConnector's lookup delays, allocation
failures and skipped stores, and a KV consumer's requests by fetch stage,
read, re-exported, and weighed on the cache-tier view (does the tier pay for
itself: the time it adds against the compute its tokens saved, and the bytes
it moves per token it serves).

The pages are tests/fixtures/handwritten/vllm-0.32-offload-{a,b}.txt, two
polls 60 s apart WRITTEN FROM vLLM'S SOURCE, not captured (no GPU here, and
the CPU wheel's OffloadingConnector needs one); the README there says from
which files. Figures worked out by hand from the pages."""

from __future__ import annotations

import re

import pytest
from page_support import polled

from kvwatch.sidecar.collector import make_registry
from kvwatch.sidecar.report import signals_json
from kvwatch.sidecar.statuspage import render_status_page

IDENTITY = {"model_name": "llama-3.1-8b", "engine": "0"}
COST = "kvwatch_cache_tier_cost_ratio"
BYTES = "kvwatch_cache_tier_moved_bytes_per_token"
DELAY = "kvwatch_kv_offload_lookup_delay_mean_seconds"
DROPPED = "kvwatch_kv_offload_stores_dropped_per_second"
FETCH = "kvwatch_requests_kv_fetch"
# KV bytes of one token of Llama 3.1 8B in bf16 (32 layers x 8 KV heads x 128 x K and V x 2 bytes).
TOKEN_BYTES = 131072


# The families of the offload pages no real capture carries (the byte counters and the CPU tier's gauge
# are in test_vllm_newer_families.OFFLOAD_NEW).
ADDED = ("kv_offload_load_time", "kv_offload_store_time", "kv_offload_allocation_failure", "kv_offload_stores_skipped",
         "kv_offload_lookup_sync_delay_seconds", "kv_offload_lookup_async_delay_seconds",
         "num_requests_kv_fetch_by_stage")


def offload_lines(fixtures_dir, model: str = "tiny-llama") -> str:
    """ADDED's lines of the second offload page (written from vLLM's source), for `model`."""
    text = (fixtures_dir / "handwritten" / "vllm-0.32-offload-b.txt").read_text()
    kept = [line for line in text.splitlines()
            if any(re.match(rf"(# (HELP|TYPE) )?vllm:{name}(_total|_bucket|_sum|_count)?[ {{]", line) for name in ADDED)]
    return "\n".join(kept).replace('model_name="llama-3.1-8b"', f'model_name="{model}"') + "\n"


@pytest.fixture
def monitor(fixtures_dir):
    folder = fixtures_dir / "handwritten"
    return polled([(folder / f"vllm-0.32-offload-{x}.txt").read_text() for x in "ab"], engine="vllm")


def test_the_offload_families_are_read_and_re_exported(monitor):
    registry = make_registry(monitor)

    def value(name, **labels):
        return registry.get_sample_value(name, dict(IDENTITY, **labels))

    assert value("kvwatch_engine_kv_offload_allocation_failures_total") == 120
    assert value("kvwatch_engine_kv_offload_stores_skipped_total") == 3000
    assert value("kvwatch_engine_kv_offload_lookup_sync_delay_seconds_count") == 6000
    assert value("kvwatch_engine_kv_offload_lookup_sync_delay_seconds_sum") == pytest.approx(3.0)
    assert value("kvwatch_engine_kv_offload_lookup_sync_delay_seconds_bucket", le="0.0005") == 6000
    assert value("kvwatch_engine_kv_offload_lookup_sync_delay_seconds_bucket", le="0.0001") == 0
    assert value("kvwatch_engine_kv_offload_lookup_async_delay_seconds_sum") == pytest.approx(12.0)
    assert value("kvwatch_engine_kv_offload_lookup_async_delay_seconds_count") == 400
    assert {stage: value("kvwatch_engine_requests_kv_fetch_by_stage", stage=stage)
            for stage in ("waiting_to_start", "in_progress", "completed_waiting")} == {
        "waiting_to_start": 2, "in_progress": 3, "completed_waiting": 1}
    sources = signals_json(monitor.state, monitor.settings)["sources"]
    assert sources["offload_lookup_sync_delay"] == "kv_offload_lookup_sync_delay_seconds"
    assert sources["offload_stores_skipped"] == "kv_offload_stores_skipped"


def test_each_tier_says_whether_it_pays_for_itself(monitor):
    [row] = monitor.state.per_engine
    # Over the 60 s: the tier served 30,000 tokens (external_kv_transfer 300,000 -> 330,000), 40,000 were
    # computed (local_compute 400,000 -> 440,000) in 20 s of prefill (100 requests of 0.2 s): 0.5 ms a token,
    # so its tokens saved 15 s of compute. It added 3 s of loads (kv_offload_load_time 27 -> 30), 0.3 s of
    # sync lookups (600 calls of 0.5 ms) and 1.2 s of deferred lookups (40 of 30 ms): 4.5 s, 0.3 of 15 s.
    assert row.values[COST] == pytest.approx({"offload": 4.5 / 15})
    # It loaded 30,000 tokens' KV and stored 60,000 tokens': three tokens' bytes moved per token served.
    assert row.values[BYTES] == pytest.approx({"offload": 3 * TOKEN_BYTES})
    # The tier's share on the same view: host 0.3 beside device 0.3 and computed 0.4.
    assert row.values["kvwatch_prompt_tokens_by_tier_ratio"]["host"] == pytest.approx(0.3)
    assert row.values[DELAY] == pytest.approx({"sync": 0.0005, "async": 0.03})
    assert row.values[DROPPED] == pytest.approx({"allocation_failure": 12 / 60, "below_reuse_threshold": 300 / 60})
    assert row.values[FETCH] == {"waiting_to_start": 2, "in_progress": 3, "completed_waiting": 1}
    registry = make_registry(monitor)
    assert registry.get_sample_value(COST, dict(IDENTITY, tier="offload")) == pytest.approx(0.3)
    assert registry.get_sample_value("kvwatch_model_cache_tier_cost_ratio",
                                     {"model_name": "llama-3.1-8b", "tier": "offload"}) == pytest.approx(0.3)
    assert registry.get_sample_value(BYTES, dict(IDENTITY, tier="offload")) == pytest.approx(3 * TOKEN_BYTES)
    assert registry.get_sample_value(FETCH, dict(IDENTITY, stage="in_progress")) == 3
    body = signals_json(monitor.state, monitor.settings)
    assert body["engines"][0]["signals"][COST]["offload"] == pytest.approx(0.3)
    dark = {d["signal"] for d in body["dark_signals"]}
    assert not dark & {COST, BYTES, DELAY, DROPPED, FETCH}
    html = render_status_page(monitor.state, monitor.settings)
    noscript = html[html.index("<noscript>\n"):]
    for display in ("Cache tier cost over compute saved (estimate)", "Cache tier bytes moved per token served",
                    "KV offload lookup delay, mean", "Requests waiting on a KV fetch"):
        assert display in noscript, display


def test_a_tier_that_costs_more_than_it_saves_reads_above_one(fixtures_dir):
    """The same pages with the loads ten times slower (30 s more load time):
    34.5 s added against 15 s saved."""
    folder = fixtures_dir / "handwritten"
    a, b = [(folder / f"vllm-0.32-offload-{x}.txt").read_text() for x in "ab"]
    b = b.replace('vllm:kv_offload_load_time_total{engine="0",model_name="llama-3.1-8b"} 30.0',
                  'vllm:kv_offload_load_time_total{engine="0",model_name="llama-3.1-8b"} 60.0')
    [row] = polled([a, b], engine="vllm").state.per_engine
    assert row.values[COST] == pytest.approx({"offload": 34.5 / 15})


def test_without_the_offloading_connector_the_tier_signals_are_dark_and_say_why(fixtures_dir):
    folder = fixtures_dir / "vllm-0.32-cpu"
    monitor = polled([(folder / f"metrics-{x}.txt").read_text() for x in ("idle", "load")], engine="vllm")
    [row] = monitor.state.per_engine
    assert all(row.values[name] is None for name in (COST, BYTES, DELAY, DROPPED, FETCH))
    dark = {d["signal"]: d for d in signals_json(monitor.state, monitor.settings)["dark_signals"]}
    assert "OffloadingConnector" in dark[COST]["lit_by"][0]
    assert "consumer" in dark[FETCH]["lit_by"][0]
