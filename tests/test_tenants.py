"""Tenants and adapters (kvwatch/routing/tenants.py): per-tenant reuse
bounded to the top K plus "other", and who evicts whom from the event stream
of a simulated engine serving two tenants, one churning."""

from __future__ import annotations

import json

import pytest

from kvwatch.routing.tenants import EvictionLedger, TenantTable
from kvwatch.sim.engine import Engine, EngineConfig, Request
from kvwatch.sim.kvevents import EventRecorder, block_hash


@pytest.mark.parametrize("k", [0, 3, 10])
def test_ten_thousand_tenants_give_at_most_k_plus_one_series_per_signal(k):
    table = TenantTable("cache_salt")
    for i in range(10_000):
        table.add(f"tenant-{i}", queries=1000 + i, hits=i % 700, stored=10, stored_again=i % 3, recomputed=i % 50)
    for signal in ("hit_ratio", "stored_again_share", "recomputed_tokens"):
        series = table.series(signal, k)
        assert len(series) <= k + 1
        assert "other" in series
    rows = table.top(k)
    # The heaviest by queried tokens lead, and "other" sums the rest: nothing is lost.
    assert [row.tenant for row in rows[:k]] == [f"tenant-{9999 - i}" for i in range(k)]
    assert rows[-1].tenants == 10_000 - k
    assert sum(row.queries for row in rows) == sum(1000 + i for i in range(10_000))


def test_names_past_the_table_bound_count_into_other_at_once():
    table = TenantTable("fairness_id", max_tenants=5)
    for i in range(8):
        table.add(f"t{i}", queries=100, hits=50)
    assert len(table.rows) == 5
    other = table.top(5)[-1]
    assert (other.tenant, other.tenants, other.queries) == ("other", 3, 300)


def test_unknown_counter_is_one_sentence():
    with pytest.raises(ValueError, match="unknown tenant counter"):
        TenantTable("lora").add("a", hitz=1)


def _serve(engine: Engine, ledger: EvictionLedger, tenant: str, uid: int, hashes: list, at: float) -> None:
    """One request of `tenant` run to the end; its allocation's evictions and its stores go to the ledger."""
    block = engine.config.block_size
    engine.add_request(Request(uid, len(hashes) * block + 1, 1, 1, hashes, at))
    engine.run_until(at + 5.0)
    recorder = engine.pool.events
    for kind, blocks in recorder.events:
        if kind == "stored":
            ledger.stored(blocks, tenant)
        else:
            ledger.removed(blocks)
    recorder.events.clear()
    recorder.pending_blocks = 0


def test_the_churning_tenant_is_named_as_the_evictor_with_its_share():
    engine = Engine(EngineConfig(num_gpu_blocks=64, block_size=16, max_model_len=63 * 16), 0)
    engine.pool.events = EventRecorder(16)
    ledger = EvictionLedger()
    steady = [[("steady", p, i) for i in range(8)] for p in range(3)]  # three system prompts it reuses
    uid = 0
    for turn in range(60):
        uid += 1
        _serve(engine, ledger, "steady", uid, steady[turn % 3], turn * 10.0)
        uid += 1  # the churning tenant: prompts of its own, never reused
        _serve(engine, ledger, "churn", uid, [("churn", uid, i) for i in range(12)], turn * 10.0 + 5.0)
    finding = ledger.finding()
    assert finding is not None and finding["evictor"] == "churn"
    assert set(finding["victims"]) == {"steady"}
    assert finding["share"] == finding["evicted_blocks"] / finding["reusable_evictions"]
    # The steady tenant evicts the churner's blocks too, but they never come back: no cost, not named.
    assert ledger.charged[("steady", "churn")] > 0
    assert ledger.reusable_evicted().get("steady", 0) == 0
    assert finding["share"] == 1.0


def test_block_hash_is_the_published_hash():
    ledger = EvictionLedger()
    ledger.stored([block_hash(("a", 0))], "a")
    ledger.removed([block_hash(("a", 0))])
    ledger.stored([block_hash(("b", 0))], "b")
    assert ledger.charged == {("b", "a"): 1} and ledger.returned == {}
    ledger.stored([block_hash(("a", 0))], "a")  # a's block comes back: b's eviction cost a recomputation
    assert ledger.returned == {("b", "a"): 1}


def _router_source(top_k: int = 10):
    from kvwatch.pipeline.router import RouterSource
    from kvwatch.settings import load_settings

    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics",
                                        "router_target": "http://127.0.0.1:9/router", "tenant_top_k": str(top_k)},
                             environ={})
    return RouterSource(settings, 300.0, clock=lambda: 0.0)


def _tenant_page(tenants: int, scale: float) -> str:
    lines = ["# TYPE llm_d_epp_prefix_predicted_cached_tokens histogram",
             f"llm_d_epp_prefix_predicted_cached_tokens_sum 0\nllm_d_epp_prefix_predicted_cached_tokens_count {scale}",
             "# TYPE llm_d_epp_request_input_tokens histogram", "# TYPE llm_d_epp_request_cached_tokens histogram"]
    for i in range(tenants):
        lines.append(f'llm_d_epp_request_input_tokens_sum{{fairness_id="f{i}"}} {scale * (100 + i)}')
        lines.append(f'llm_d_epp_request_cached_tokens_sum{{fairness_id="f{i}"}} {scale * (i % 100)}')
    return "\n".join(lines) + "\n"


def test_ten_thousand_fairness_ids_on_a_router_page_export_at_most_k_plus_one_series():
    from kvwatch.sidecar.collector import KvwatchCollector
    from kvwatch.window import Window

    source = _router_source(top_k=7)
    source.poll(Window(300.0), at=0.0, text=_tenant_page(10_000, 1.0))
    source.poll(Window(300.0), at=10.0, text=_tenant_page(10_000, 2.0))
    families = {f.name: f for f in KvwatchCollector(None)._tenants(source.last)}
    samples = families["kvwatch_tenant_hit_ratio"].samples
    assert len(samples) == 8  # the 7 heaviest by name, and "other"
    assert {s.labels["tenant"] for s in samples} == {f"f{9999 - i}" for i in range(7)} | {"other"}
    heaviest = next(s for s in samples if s.labels["tenant"] == "f9999")
    assert heaviest.value == pytest.approx(99 / 10_099)  # its window: cached over sent, both doubled


def test_fairness_ids_of_the_llm_d_fixture(fixtures_dir):
    from kvwatch.routing.page import read_router_page

    reading = read_router_page((fixtures_dir / "handwritten" / "router-llm-d.txt").read_text())
    assert reading.tenants == {"team-a": [48000, 36000], "team-b": [32000, 4000]}


def test_lmcache_multiprocess_cache_salts_are_tenants_over_the_window(fixtures_dir):
    from kvwatch.pipeline.lmcache import LMCacheSource
    from kvwatch.settings import Settings
    from kvwatch.sidecar.collector import KvwatchCollector

    pages = {name: (fixtures_dir / "handwritten" / f"lmcache-mp-{name}.txt").read_text() for name in "ab"}
    tier = LMCacheSource(Settings(target="http://127.0.0.1:9/metrics", lmcache_target="http://127.0.0.1:9/m"), 300.0)
    tier.ingest(pages["a"], 1000.0)
    report = tier.ingest(pages["b"], 1010.0)
    rows = {row["tenant"]: row for row in report["tenants"]["cache_salt"]}
    # By hand from the two pages: tenant-a 29,000 of 36,000 tokens found, tenant-b 19,000 of 24,000.
    assert rows["tenant-a"]["hit_ratio"] == pytest.approx(29000 / 36000)
    assert rows["tenant-b"]["hit_ratio"] == pytest.approx(19000 / 24000)
    json.dumps(report)  # the report is what the JSON API carries
    [family] = KvwatchCollector(None)._tenants(report)
    assert {(s.labels["kind"], s.labels["tenant"]) for s in family.samples} == {("cache_salt", "tenant-a"),
                                                                                  ("cache_salt", "tenant-b")}


def test_lora_adapters_stored_again_share_from_the_stream_window_bounded_to_k_plus_one():
    from kvwatch.routing.tenants import lora_rows
    from kvwatch.sidecar.collector import KvwatchCollector

    by_label = [{"medium": "GPU", "lora_name": None, "stored": 50_000, "stored_again": 25_000},
                {"medium": "CPU", "lora_name": None, "stored": 10_000, "stored_again": 0}]
    by_label += [{"medium": "GPU", "lora_name": f"adapter-{i}", "stored": 100 + i, "stored_again": i % 10}
                 for i in range(10_000)]  # the last past the table's 10,000 names: counted in other at once
    report = {"up": True, "window": {"by_label": by_label}}
    rows = lora_rows(report, k=3)
    assert [row["tenant"] for row in rows] == ["(base)", "adapter-9998", "adapter-9997", "other"]
    assert rows[0]["stored_again_share"] == pytest.approx(25_000 / 60_000)  # summed over the media
    # The stored-again share and the recomputed tokens (no block size here: none counted).
    families = list(KvwatchCollector(None)._adapters(report))
    assert [f.name for f in families] == ["kvwatch_tenant_stored_again_ratio", "kvwatch_tenant_recomputed_tokens"]
    for family in families:
        assert len(family.samples) <= 10 + 1  # the default K without settings
        assert {s.labels["kind"] for s in family.samples} == {"lora"}
