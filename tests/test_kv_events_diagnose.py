"""The stream decides what the page cannot: the simulator publishes its
engines' KV-cache events in vLLM's wire format over ZMQ on loopback, kvwatch
polls the simulated page and reads the stream, on the simulation's clock.

A rotation over more prefixes than the cache holds is eviction before reuse
with high confidence; prompts that share nothing are no shared prefix; a
prefix that changes mid-run is a changed prefix; events that stop while the
page counts prompt tokens are a finding of their own."""

from __future__ import annotations

import socket
import time

import pytest
from sim_support import settle

from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.server import start_background

T0 = 1_800_000_000.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Live:
    """A simulator (frozen clock, moved by hand) publishing to kvwatch."""

    def __init__(self, scenario, tmp_path=None, publish=True, thresholds=None, wait="message",
                 kv_report=(0.0, False), lmcache_tokens=None):
        endpoint = f"tcp://127.0.0.1:{free_port()}"
        if isinstance(scenario, str) and "\n" in scenario:
            path = tmp_path / "scenario.yaml"
            path.write_text(scenario)
            scenario = load_scenario(str(path))
        self.sim = start_background(scenario, speed=0, kv_events=endpoint if publish else None, kv_report=kv_report,
                                    lmcache_tokens=lmcache_tokens)
        settings = load_settings(overrides={"target": self.sim.metrics_url, "poll_interval": "5s", "window": "5m",
                                            "kv_events": endpoint}, environ={})
        settings.diagnosis.update(thresholds or {})
        self.monitor = Monitor(settings, clock=lambda: T0 + self.sim.sim.now)
        self.source = self.monitor.kv_events
        self.source.start()
        if publish:
            # PUB/SUB keeps nothing for a subscriber not yet connected: move
            # the simulation until a first message arrives (or, for an engine
            # that stores nothing, until its publisher's handshake).
            deadline = time.monotonic() + 20
            while (self.source.messages if wait == "message" else self.source.connections) == 0:
                assert time.monotonic() < deadline, "no KV-cache event reached kvwatch"
                self.sim.advance(1.0)
                time.sleep(0.1)

    def settle(self):
        """Wait until what the simulation recorded reached the ledger."""
        settle(self.sim, self.source)

    def run(self, seconds, step=5.0):
        state = None
        for _ in range(int(seconds / step)):
            self.sim.advance(step)
            self.settle()
            state = self.monitor.poll_once()
        return state

    def close(self):
        self.source.stop()
        self.sim.stop()


def hit_rate(state):
    return [f for f in state.findings if f.symptom == "low_hit_rate"]


@pytest.fixture
def live():
    made = []

    def make(*args, **kwargs):
        made.append(Live(*args, **kwargs))
        return made[-1]

    yield make
    for item in made:
        item.close()


def test_a_rotation_over_more_prefixes_than_the_cache_holds_is_eviction_before_reuse(live):
    run = live("eviction-pressure")
    run.run(120)  # few tenants: their prefixes fit
    state = run.run(150)  # 60 tenants of 1k tokens through a 16k-token cache
    findings = hit_rate(state)
    assert [(f.cause, f.confidence) for f in findings] == [("eviction_before_reuse", "high")]
    evidence = findings[0].evidence
    assert evidence["decided_by"] == "kv_events"
    assert findings[0].alternatives == ()  # the stream told the causes apart: nothing left to decide
    assert evidence["kv_events_stored_again_ratio"] >= 0.1
    assert evidence["kv_events_blocks_stored_again"] > 0
    assert evidence["kv_events_extra_blocks_to_keep_half"] > 0
    assert "stored again after their eviction" in findings[0].summary
    window = state.kv_events["window"]
    assert window["stored_again"] > 0 and state.kv_events["intake"]["missed"] == 0


DISTINCT = """
name: distinct
description: every prompt its own
engine: {num_gpu_blocks: 1024, block_size: 16, max_num_seqs: 12, max_model_len: 4096}
workload:
  rate: 3.0
  prompt_tokens: {dist: lognormal, mean: 400, sigma: 0.3, min: 64, max: 1000}
  output_tokens: {dist: lognormal, mean: 60, sigma: 0.3, min: 8, max: 200}
  max_tokens: 300
  prefix: {share: 0.0}
phases:
  - {name: distinct, duration: 10m}
"""


def test_prompts_that_share_nothing_are_no_shared_prefix(live, tmp_path):
    run = live(DISTINCT, tmp_path)
    state = run.run(200)
    findings = hit_rate(state)
    assert [(f.cause, f.confidence) for f in findings] == [("no_reuse", "high")]
    assert findings[0].evidence["kv_events_blocks_stored_again"] == 0
    assert findings[0].evidence["decided_by"] == "kv_events"


def test_a_prefix_change_mid_run_is_a_changed_prefix(live):
    run = live("prefix-change")
    run.run(180)
    state = run.run(60)
    findings = hit_rate(state)
    assert [(f.cause, f.confidence) for f in findings] == [("prefix_changed", "high")]
    assert findings[0].evidence["decided_by"] == "kv_events"


def test_a_stream_no_publisher_ever_reached_is_never_connected(live, tmp_path):
    run = live(DISTINCT, tmp_path, publish=False)
    state = run.run(90)
    found = [f for f in state.findings if f.symptom == "kv_events"]
    assert [(f.cause, f.severity) for f in found] == [("events_never_connected", "warning")]
    assert found[0].evidence["connections"] == 0
    # The page's own diagnosis is unaffected: the hit-rate finding is the page's, undecided by the stream.
    assert all(f.evidence.get("decided_by") != "kv_events" for f in hit_rate(state))


def test_events_that_stop_while_the_engine_stores_blocks_are_a_finding(live, tmp_path):
    run = live(DISTINCT, tmp_path)
    run.run(30)
    run.sim.kv_publisher.stop()  # the engine keeps serving; its events no longer reach kvwatch
    state = None
    for _ in range(18):
        run.sim.advance(5.0)
        state = run.monitor.poll_once()
    found = [f for f in state.findings if f.symptom == "kv_events"]
    assert [(f.cause, f.severity) for f in found] == [("events_stopped", "warning")]
    assert "the last KV-cache event came" in found[0].summary
    silence = state.kv_events["silence"]
    assert silence["blocks"] >= 1 and silence["blocks"] == found[0].evidence["blocks_unseen"]
    assert silence["blocks"] <= (silence["prompt_tokens"] - silence["cached_tokens"]) / 16


QUIET = """
name: quiet
description: prompts shorter than a block, so the engine serves and stores no block
engine: {num_gpu_blocks: 1024, block_size: 16, max_num_seqs: 12, max_model_len: 4096}
workload:
  rate: 3.0
  prompt_tokens: {dist: uniform, min: 4, max: 10}
  output_tokens: {dist: uniform, min: 1, max: 4}
  max_tokens: 4
  prefix: {share: 0.0}
phases:
  - {name: quiet, duration: 10m}
"""


def test_an_engine_that_stores_no_block_raises_no_events_stopped(live, tmp_path):
    run = live(QUIET, tmp_path, wait="connection")
    state = run.run(120)
    intake = state.kv_events["intake"]
    assert intake["messages"] == 0 and intake["connections"] >= 1
    # The page counts prompt tokens: the old rule called that a stop.
    assert state.kv_events["silence"]["prompt_tokens"] > 0
    assert state.kv_events["silence"]["blocks"] == 0
    assert [f.cause for f in state.findings if f.symptom == "kv_events"] == []


# --- vLLM's full report mode: the simulator announces its requests' hits as stored too -----------------------

@pytest.mark.parametrize("kv_report", [(1.0, False), (0.5, False), (1.0, True)])
def test_a_rotation_in_full_report_mode_is_eviction_before_reuse_as_in_incremental_mode(live, kv_report):
    # Every request in full mode, or half of them (one stream, mixed); the events naming their origin or not.
    states = []
    for report in ((0.0, False), kv_report):
        run = live("eviction-pressure", kv_report=report)
        run.run(120)
        states.append(run.run(150))
    incremental, full = states
    for state in states:
        assert [(f.cause, f.confidence) for f in hit_rate(state)] == [("eviction_before_reuse", "high")]
    before, after = incremental.kv_events["window"], full.kv_events["window"]
    assert before["reused"] == 0 and after["reused"] > 0.1 * after["stored"]
    # The hits are no new work: what was stored and stored again reads as without them (the two runs
    # start their clocks a second or two apart, as the first message arrives).
    assert after["stored"] == pytest.approx(before["stored"], rel=0.05)
    assert after["stored_again_ratio"] == pytest.approx(before["stored_again_ratio"], abs=0.03)


WARM = """
name: warm-prefix
description: one shared prefix of 512 tokens kept warm, a short question of its own after it
engine: {num_gpu_blocks: 2048, block_size: 16, max_num_seqs: 12, max_model_len: 4096}
workload:
  rate: 3.0
  prompt_tokens: {dist: uniform, min: 18, max: 48}
  output_tokens: {dist: uniform, min: 8, max: 16}
  max_tokens: 16
  prefix: {share: 1.0, tokens: 512, count: 1}
phases:
  - {name: warm, duration: 10m}
"""


def test_a_warm_shared_prefix_in_full_mode_reads_as_hits_beside_the_pages(live, tmp_path):
    run = live(WARM, tmp_path, kv_report=(1.0, False))
    state = run.run(150)
    window, hits = state.kv_events["window"], state.kv_events["hits"]
    # 32 shared blocks a request hit, 1 or 2 of its own stored: not "stored again", not new work.
    assert window["stored_again"] == 0
    assert window["reused"] > 10 * window["stored"]
    assert [f.cause for f in hit_rate(state)] == []  # the page's hit ratio is high: nothing to explain
    # Every request asks for full reports: the stream's hit tokens are the page's.
    assert hits["stream_share_of_page"] == pytest.approx(1.0, abs=0.02)


# --- other publishers' layouts, and a store-only lower tier -------------------------------------------------

@pytest.mark.parametrize("layout", ["sglang", "trtllm"])
def test_sglangs_and_tensorrt_llms_layouts_read_as_vllms(live, layout):
    run = live("eviction-pressure", kv_report=(0.0, False, layout))
    run.run(120)
    state = run.run(150)
    assert [(f.cause, f.confidence) for f in hit_rate(state)] == [("eviction_before_reuse", "high")]
    assert state.kv_events["intake"]["malformed"] == 0
    assert state.kv_events["ranks"] == ([] if layout == "sglang" else [0])


def test_an_lmcache_tier_publishing_store_only_events_serves_returns_as_its_hits(live):
    # The simulated LMCache keeps what the GPU evicts and loads it back; its connector says what it
    # stored, never what it let go (LMCache PR 5076).
    run = live("eviction-pressure", lmcache_tokens=65536)
    run.run(120)
    state = run.run(150)
    tiers = {r["medium"]: r for r in state.kv_events["window"]["tiers"]}
    assert tiers["CPU"]["store_only"] and tiers["CPU"]["stored"] > 0 and tiers["CPU"]["evicted"] == 0
    assert tiers["CPU"]["returned"] > 0  # GPU blocks back from the tier: its hits, not recomputation
    assert tiers["GPU"]["returned"] >= tiers["CPU"]["returned"] + state.kv_events["window"]["stored_again"] - 1


WARM_QUIET_DISTINCT = """
name: warm-quiet-distinct
description: a warm shared prefix, a pause longer than the judged part, then prompts that share nothing
engine: {num_gpu_blocks: 1024, block_size: 16, max_num_seqs: 12, max_model_len: 4096}
workload:
  rate: 3.0
  prompt_tokens: {dist: lognormal, mean: 150, sigma: 0.4, min: 8, max: 600}
  output_tokens: {dist: lognormal, mean: 60, sigma: 0.3, min: 8, max: 200}
  max_tokens: 300
  prefix: {share: 1.0, tokens: 1024, count: 4, version: 1}
phases:
  - {name: warm, duration: 2m}
  - {name: quiet, duration: 2m, workload: {rate: 0.0}}
  - name: distinct
    duration: 4m
    workload:
      rate: 3.0
      prompt_tokens: {dist: lognormal, mean: 400, sigma: 0.3, min: 64, max: 1000}
      prefix: {share: 0.0}
"""


def test_distinct_prompts_after_a_pause_are_no_shared_prefix_not_a_changed_prefix(live, tmp_path):
    # The page compares the new load with the warm one before the pause (a drop, then a remembered
    # healthy ratio); the stream saw the engine store nothing between them: a new load, not a changed prefix.
    run = live(WARM_QUIET_DISTINCT, tmp_path)
    run.run(240)
    seen = []
    for _ in range(6):
        state = run.run(30)
        seen.append([(f.cause, f.confidence, f.evidence.get("decided_by")) for f in hit_rate(state)])
    assert all(found in ([], [("no_reuse", "high", "kv_events")]) for found in seen), seen
    assert seen[-1] == [("no_reuse", "high", "kv_events")]
    finding = hit_rate(state)[0]
    assert finding.evidence["kv_events_quiet_seconds"] >= 60
    assert "stored nothing" in finding.summary
