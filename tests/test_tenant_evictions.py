"""Who evicts whom, live: the simulator serves two tenants (their blocks
published under each tenant's LoRA adapter, as vLLM's BlockStored names a
request's adapter), one reusing a few system prompts and one churning prompts
of its own that are never reused; it publishes its KV-cache events over ZMQ on
loopback, kvwatch's sidecar subscribes (its event source -> Monitor -> the
diagnosis) and polls the simulated page on the simulation's clock."""

from __future__ import annotations

import pytest

from test_kv_events_diagnose import Live, hit_rate

TWO_TENANTS = """
name: two-tenants
description: a steady tenant's system prompts evicted by a churning tenant's own prompts
engine: {num_gpu_blocks: 1024, block_size: 16, max_num_seqs: 12, max_model_len: 4096}
workload:
  rate: 3.0
  prompt_tokens: {dist: lognormal, mean: 700, sigma: 0.3, min: 64, max: 2000}
  output_tokens: {dist: lognormal, mean: 60, sigma: 0.3, min: 8, max: 200}
  max_tokens: 300
  prefix: {share: 0.3, tokens: 1024, count: 12, version: 1}
  tenants: {shared: team-a, own: batch}
phases:
  - {name: mixed, duration: 10m}
"""


@pytest.fixture
def run(tmp_path):
    live = Live(TWO_TENANTS, tmp_path)
    yield live
    live.close()


def test_the_churning_tenant_is_named_the_evictor_with_its_share_from_the_live_stream(run):
    state = run.run(240)
    evictor = state.kv_events["evictor"]
    print("evictor:", evictor)
    assert evictor is not None and evictor["evictor"] == "batch"
    assert set(evictor["victims"]) == {"team-a"}
    assert evictor["share"] == evictor["evicted_blocks"] / evictor["reusable_evictions"] > 0.5
    [finding] = hit_rate(state)
    print(finding.summary)
    assert finding.cause == "eviction_before_reuse"
    assert finding.evidence["evictor_tenant"] == "batch"
    assert finding.evidence["evictor_share"] == evictor["share"]
    assert "Tenant batch" in finding.summary and f"{evictor['share']:.0%}" in finding.summary
    # Recomputation per tenant, as exported: the steady tenant's prefixes came back, the churner's never do.
    from kvwatch.sidecar.collector import KvwatchCollector

    families = {f.name: f for f in KvwatchCollector(run.monitor)._adapters(state.kv_events)}
    recomputed = {s.labels["tenant"]: s.value for s in families["kvwatch_tenant_recomputed_tokens"].samples}
    by_label = {row["lora_name"]: row for row in state.kv_events["window"]["by_label"] if row["medium"] == "GPU"}
    print("recomputed tokens per tenant:", recomputed)
    assert recomputed["team-a"] == by_label["team-a"]["stored_again"] * 16 > 0
    assert recomputed["batch"] == 0
    # Priced at the rate the window's lost is: the steady tenant's recomputation costs it prefill seconds.
    from kvwatch.signals import worth

    rate = worth.priced_rate(state.kv_events)
    lost = {s.labels["tenant"]: s.value for s in families["kvwatch_tenant_lost_prefill_seconds"].samples}
    print("lost prefill seconds per tenant:", lost, "at", rate)
    assert rate is not None and lost == pytest.approx({tenant: tokens * rate for tenant, tokens in recomputed.items()})
    assert lost["team-a"] > 0 == lost["batch"]


def test_a_window_counts_only_the_evictions_since_its_start():
    from kvwatch.routing.tenants import EvictionLedger

    ledger = EvictionLedger()
    for round_ in range(40):  # b evicts a's block, a stores it again: 40 reusable evictions by b
        ledger.stored([round_], "a")
        ledger.removed([round_])
        ledger.stored([1000 + round_], "b")
        ledger.stored([round_], "a")
    mark = ledger.snapshot()
    assert ledger.finding()["evictor"] == "b"
    assert ledger.finding(since=mark) is None  # nothing since the mark
    for round_ in range(40):  # now c evicts b's blocks
        ledger.stored([5000 + round_], "b")
        ledger.removed([5000 + round_])
        ledger.stored([9000 + round_], "c")
        ledger.stored([5000 + round_], "b")
    found = ledger.finding(since=mark)
    assert (found["evictor"], found["share"], found["victims"]) == ("c", 1.0, {"b": 40})


@pytest.mark.parametrize("tenants, said", [
    ({"shared": "a"}, "exactly shared and own"),
    ({"shared": "a", "own": "a"}, "distinct names"),
    ({"shared": "a", "own": ""}, "distinct names"),
])
def test_bad_tenants_in_a_scenario_are_one_sentence(tmp_path, tenants, said):
    import yaml

    from kvwatch.sim.scenario import ScenarioError, load_scenario

    raw = yaml.safe_load(TWO_TENANTS)
    raw["workload"]["tenants"] = tenants
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ScenarioError, match=said):
        load_scenario(str(path))


@pytest.mark.parametrize("k", [0, 3, 10])
def test_recomputation_of_ten_thousand_tenants_is_at_most_k_plus_one_series(k):
    from kvwatch.sidecar.collector import KvwatchCollector

    class Settings:
        tenant_top_k = k

    class Monitor:
        settings = Settings()

    by_label = [{"medium": "GPU", "lora_name": f"t{i}", "stored": 1000 + i, "stored_again": i % 7}
                for i in range(10_000)]
    by_label.append({"medium": "CPU", "lora_name": "t9999", "stored": 5, "stored_again": 5})  # a tier's: no recompute
    report = {"up": True, "block_size": 16, "window": {"by_label": by_label}}
    families = {f.name: f for f in KvwatchCollector(Monitor())._adapters(report)}
    samples = {s.labels["tenant"]: s.value for s in families["kvwatch_tenant_recomputed_tokens"].samples}
    assert len(samples) == k + 1
    assert set(samples) == {f"t{9999 - i}" for i in range(k)} | {"other"}
    if k:
        assert samples["t9999"] == (9999 % 7) * 16
    # "other" sums the rest: no recomputed token is lost.
    assert sum(samples.values()) == sum((i % 7) * 16 for i in range(10_000))


def test_recomputation_without_a_block_size_counts_none():
    from kvwatch.routing.tenants import lora_rows

    rows = lora_rows({"up": True, "window": {"by_label": [{"medium": "GPU", "lora_name": "a", "stored": 10,
                                                           "stored_again": 4}]}})
    assert [(row["tenant"], row["recomputed_tokens"]) for row in rows] == [("a", 0.0)]
