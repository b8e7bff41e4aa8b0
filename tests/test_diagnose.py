"""Diagnosis rules, each cause driven by a sequence of hand-built snapshots:
the finding appears, and the causes it could be mistaken for do not."""

from __future__ import annotations

import bisect
from dataclasses import asdict, replace
import math
import re
from collections import defaultdict

import pytest

from kvwatch.diagnose import (
    CAUSES,
    DEFAULT_THRESHOLDS,
    NEXT_CHECK,
    diagnose,
    is_actionable,
    resolve_thresholds,
    validate_thresholds,
)
from kvwatch.diagnose import Change, HitRateMemory, exhaustion, first_token, hit_rate
from kvwatch.diagnose.context import EngineContext
from kvwatch.diagnose.causes import SYMPTOMS, CatalogueError
from kvwatch.diagnose.judging import check_judges
from kvwatch.kvevents import wire
from kvwatch.kvevents.source import KVEventSource
from kvwatch.settings import SettingsError, load_settings
from kvwatch.signals import evaluate_window
from kvwatch.snapshot import EngineSnapshot, Histogram, Snapshot
from kvwatch.window import Window

# vLLM 0.32's default bounds (reference §1.2).
LATENCY = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0, math.inf)
TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0, math.inf)
TOKENS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, math.inf)
RESIDENCY = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200, 1800,
             math.inf)
BOUNDS = {"ttft": TTFT, "queue_time": LATENCY, "prefill_time": LATENCY, "prompt_len": TOKENS,
          "generation_len": TOKENS, "kv_block_idle_before_evict": RESIDENCY, "kv_block_reuse_gap": RESIDENCY}

CONFIG = {"block_size": "32", "num_gpu_blocks": "128", "kv_cache_size_tokens": "4096", "cache_dtype": "auto",
          "enable_prefix_caching": "True", "kv_cache_max_concurrency": "4.0", "engine": "0"}


class Engine:
    """A hand-driven engine: cumulative counters and histograms that each
    `step` advances, rendered into Snapshots on a synthetic clock."""

    def __init__(self, model: str = "tiny-llama", engine: str = "0", config: dict | None = None):
        self.model = model
        self.engine = engine
        self.config = dict(CONFIG if config is None else config)
        self.counters: dict[str, float] = defaultdict(float)
        self.buckets: dict[str, list[float]] = {}
        self.sums: dict[str, float] = defaultdict(float)
        self.created = 1000.0
        self.gauges: dict[str, float] = {}

    def observe(self, key: str, value: float, times: int = 1) -> None:
        bounds = BOUNDS[key]
        counts = self.buckets.setdefault(key, [0.0] * len(bounds))
        for index in range(bisect.bisect_left(bounds, value), len(bounds)):
            counts[index] += times
        self.sums[key] += value * times

    def restart(self) -> None:
        self.counters = defaultdict(float)
        self.buckets = {}
        self.sums = defaultdict(float)
        self.created += 1

    def snapshot(self) -> EngineSnapshot:
        histograms = {key: Histogram(BOUNDS[key], tuple(counts), self.sums[key], counts[-1])
                      for key, counts in self.buckets.items()}
        for key in BOUNDS:
            histograms.setdefault(key, Histogram(BOUNDS[key], (0.0,) * len(BOUNDS[key]), 0.0, 0.0))
        return EngineSnapshot(self.model, self.engine, dict(self.gauges), dict(self.counters), histograms, self.created)


class Run:
    """A window fed one poll per `step`, and the diagnosis over it."""

    def __init__(self, window_seconds: float = 300.0, thresholds: dict | None = None, interval: float = 10.0):
        self.window = Window(window_seconds)
        self.thresholds = thresholds or {}
        self.interval = interval
        self.now = 10_000.0
        self.events: list[Change] = []
        self.engines = [Engine()]

    @property
    def engine(self) -> Engine:
        return self.engines[0]

    def step(self, *, usage: float = 0.2, running: float = 2, waiting: float = 0, requests: int = 0,
             prompt: float = 500, generated: float = 100, hit_ratio: float | None = None, cached_ratio: float = 0.0,
             ttft: float | None = None, queue: float = 0.0, prefill: float = 0.05, preemptions: float = 0,
             extra_gauges: dict | None = None, engine: Engine | None = None, residency: tuple | None = None,
             poll: bool = True):
        """One interval of one engine: `requests` finish with these lengths
        and timings, their prompt tokens query the prefix cache with
        `hit_ratio`; then (with `poll`) one snapshot of every engine."""
        engine = engine or self.engine
        c = engine.counters
        if requests:
            queried = requests * prompt
            c["prompt_tokens"] += queried
            c["generation_tokens"] += requests * generated
            c["finished/length"] += requests
            c["preemptions"] += preemptions
            if hit_ratio is not None:
                c["prefix_queries"] += queried
                c["prefix_hits"] += queried * hit_ratio
                c["prompt_tokens_cached"] += queried * hit_ratio
            else:
                c["prefix_queries"] += 0
                c["prompt_tokens_cached"] += queried * cached_ratio
            engine.observe("prompt_len", prompt, requests)
            engine.observe("generation_len", generated, requests)
            engine.observe("queue_time", queue, requests)
            engine.observe("prefill_time", prefill, requests)
            engine.observe("ttft", queue + prefill + 0.02 if ttft is None else ttft, requests)
        else:
            c["preemptions"] += preemptions
        if residency:
            idle, gap = residency
            engine.observe("kv_block_idle_before_evict", idle, 50)
            engine.observe("kv_block_reuse_gap", gap, 50)
        engine.gauges = {"kv_usage": usage, "running": running, "waiting": waiting,
                         "waiting_by_reason/capacity": waiting, "waiting_by_reason/deferred": 0.0,
                         **(extra_gauges or {})}
        if poll:
            self.now += self.interval
            engines = {(e.model, e.engine): e.snapshot() for e in self.engines}
            self.window.add(Snapshot(self.now, engines, cache_config={e.engine: dict(e.config) for e in self.engines}))
        return self

    def steps(self, count: int, **kwargs):
        for _ in range(count):
            self.step(**kwargs)
        return self

    def findings(self, upstream=None):
        per_engine, per_model = evaluate_window(self.window)
        return diagnose(self.window, per_engine, tuple(self.events), self.thresholds, upstream)


def causes(findings, symptom: str | None = None) -> set[str]:
    return {f.cause for f in findings if symptom is None or f.symptom == symptom}


def only(findings, cause: str):
    matching = [f for f in findings if f.cause == cause]
    assert len(matching) == 1, [(f.symptom, f.cause) for f in findings]
    return matching[0]


def factor(findings, cause: str):
    """A cause carried as a contributing factor of its symptom's primary
    (diagnose/arbitration.py), as a Finding with its own numbers."""
    matching = [replace(f, cause=c["cause"], severity=c["severity"], confidence=c["confidence"],
                        summary=c["summary"], evidence=c["evidence"], contributing=())
                for f in findings for c in f.contributing if c["cause"] == cause]
    assert len(matching) == 1, [(f.symptom, f.cause, [c["cause"] for c in f.contributing]) for f in findings]
    return matching[0]


# --------------------------------------------------------------------------
# exhaustion
# --------------------------------------------------------------------------

# 300 + 100 tokens = 13 blocks of 32; 128 blocks hold 9 such requests.
SHORT = dict(prompt=300, generated=100)


def test_concurrency_beyond_capacity_with_kv_bound_queueing():
    run = Run(thresholds={"max_num_seqs": 9})
    run.steps(6, usage=0.4, running=3, requests=5, **SHORT, queue=0.01, prefill=0.05)
    run.steps(4, usage=0.97, running=8, waiting=20, requests=8, **SHORT, queue=4.0, prefill=0.05, preemptions=3)
    findings = run.findings()
    finding = only(findings, "concurrency_beyond_capacity")
    assert finding.symptom == "exhaustion" and finding.severity == "critical" and finding.confidence == "high"
    assert finding.evidence["kv_cache_capacity_requests"] == 9
    assert finding.evidence["demand_at_peak"] == 28
    assert finding.evidence["preemptions"] == 12
    assert finding.next_check
    assert "long_requests" not in causes(findings)
    assert "capacity_below_max_num_seqs" not in causes(findings)
    # The queue comes from the full cache: never called compute-bound.
    assert "queueing_kv_bound" in causes(findings, "slow_first_token")
    assert "queueing_compute_bound" not in causes(findings)


def test_full_cache_without_preemption_is_a_warning():
    run = Run(thresholds={"max_num_seqs": 9})
    run.steps(3, usage=0.95, running=8, waiting=6, requests=4, **SHORT)
    finding = only(run.findings(), "concurrency_beyond_capacity")
    assert finding.severity == "warning"
    assert finding.evidence["preemptions"] == 0


def test_long_requests():
    # 1000 + 200 tokens each: 3 running requests fill 95 % of the cache.
    run = Run()
    run.steps(8, usage=0.95, running=3, waiting=1, requests=1, prompt=1000, generated=200, preemptions=1)
    findings = run.findings()
    finding = only(findings, "long_requests")
    assert finding.symptom == "exhaustion"
    assert finding.evidence["capacity_share_per_running_request"] == pytest.approx(0.95 / 3, rel=1e-3)
    assert finding.evidence["running_at_peak"] == 3
    assert "concurrency_beyond_capacity" not in causes(findings)
    # 38 blocks each: the cache holds 3, and 3 ran; no inferred excess.
    assert "capacity_below_max_num_seqs" not in causes(findings)


def test_a_long_queue_of_large_requests_is_too_many_requests():
    # 400 + 400 tokens: 4 running hold 24 % of the cache each, but 20 more wait.
    run = Run()
    run.steps(6, usage=0.98, running=4, waiting=20, requests=2, prompt=400, generated=400, preemptions=1)
    findings = run.findings()
    assert only(findings, "concurrency_beyond_capacity").evidence["waiting_at_peak"] == 20
    assert "long_requests" not in causes(findings)


def test_one_exhaustion_cause_per_window_judged_on_its_means():
    # A burst of many short requests, then a few long ones: judged on the
    # window's means (as the alert rule judges its rate window), exactly one
    # cause at a time, and the cause moves with the window.
    run = Run(window_seconds=120)
    run.steps(6, usage=0.97, running=8, waiting=20, requests=8, **SHORT, preemptions=1)
    run.steps(6, usage=0.96, running=3, waiting=1, requests=1, prompt=1000, generated=200, preemptions=1)
    findings = run.findings()
    assert causes(findings, "exhaustion") == {"concurrency_beyond_capacity"}
    finding = only(findings, "concurrency_beyond_capacity")
    assert finding.evidence["waiting_mean"] > finding.evidence["running_mean"]
    run.steps(10, usage=0.96, running=3, waiting=1, requests=1, prompt=1000, generated=200, preemptions=1)
    findings = run.findings()
    assert causes(findings, "exhaustion") == {"long_requests"}
    assert only(findings, "long_requests").evidence["capacity_share_per_running_request"] == pytest.approx(0.32)


def test_a_large_share_with_a_long_queue_is_many_requests_even_when_preemption_thins_the_batch():
    # The real burst's shape: preemption leaves 4 running at 25 % each, 20 wait.
    run = Run()
    run.steps(6, usage=0.99, running=4, waiting=20, requests=4, prompt=400, generated=400, preemptions=2)
    finding = only(run.findings(), "concurrency_beyond_capacity")
    assert finding.evidence["capacity_share_per_running_request"] >= 0.2


def test_capacity_below_configured_max_num_seqs():
    run = Run(thresholds={"max_num_seqs": 16})
    run.steps(4, usage=0.96, running=9, waiting=4, requests=4, **SHORT, preemptions=2)
    findings = run.findings()
    # 13 requests at the peak against 9 that fit: too many requests is the
    # story, the scheduler's setting the reason it could happen.
    assert causes(findings, "exhaustion") == {"concurrency_beyond_capacity"}
    finding = factor(findings, "capacity_below_max_num_seqs")
    assert finding.severity == "warning" and finding.confidence == "high"
    assert finding.evidence["max_num_seqs"] == 16
    assert finding.evidence["kv_cache_capacity_requests"] == 9
    assert "configured" in finding.evidence["max_num_seqs_source"]
    assert finding.evidence["kv_cache_max_concurrency_at_max_model_len"] == 4


def test_capacity_below_max_num_seqs_inferred_from_running():
    # Without the setting, 12 requests seen running prove max_num_seqs >= 12.
    run = Run()
    run.steps(4, usage=0.93, running=12, waiting=3, requests=4, prompt=200, generated=200, preemptions=1)
    run.steps(2, usage=0.93, running=9, waiting=3, requests=4, **SHORT, preemptions=1)
    finding = factor(run.findings(), "capacity_below_max_num_seqs")
    assert finding.evidence["max_num_seqs"] == 12
    assert finding.confidence == "medium"
    assert "at least" in finding.evidence["max_num_seqs_source"]


def test_capacity_below_max_num_seqs_without_exhaustion_is_info():
    run = Run(thresholds={"max_num_seqs": 16})
    run.steps(4, usage=0.5, running=4, requests=4, **SHORT)
    findings = run.findings()
    assert only(findings, "capacity_below_max_num_seqs").severity == "info"
    assert not causes(findings) - {"capacity_below_max_num_seqs"}


def test_each_exhaustion_cause_has_its_judge_asked_in_the_symptoms_ranking(monkeypatch):
    ranking = SYMPTOMS["exhaustion"].ranking
    assert set(exhaustion.JUDGES) == set(ranking)
    with pytest.raises(CatalogueError, match=r"exhaustion: no judge for \['made_up'\]"):
        check_judges("exhaustion", exhaustion.JUDGES, ranking + ("made_up",))
    with pytest.raises(CatalogueError, match=re.escape(f"no ranked cause for the judges of {[ranking[-1]]}")):
        check_judges("exhaustion", exhaustion.JUDGES, ranking[:-1])
    asked: list[str] = []

    def recording(cause, judge):
        def ask(ctx, judging):
            asked.append(cause)
            return judge(ctx, judging)
        return ask

    for cause, judge in list(exhaustion.JUDGES.items()):
        monkeypatch.setitem(exhaustion.JUDGES, cause, recording(cause, judge))
    run = Run(thresholds={"max_num_seqs": 16})
    run.steps(4, usage=0.96, running=9, waiting=4, requests=4, **SHORT, preemptions=2)
    findings = run.findings()
    # Every verdict kept: the load shape and, beside it, the sizing advice.
    assert causes(findings, "exhaustion") == {"concurrency_beyond_capacity"}
    assert factor(findings, "capacity_below_max_num_seqs").severity == "warning"
    assert tuple(asked) == ranking
    asked.clear()
    monkeypatch.setitem(SYMPTOMS, "exhaustion", replace(SYMPTOMS["exhaustion"], ranking=ranking[::-1]))
    run.findings()
    assert tuple(asked) == ranking[::-1]


def test_high_usage_alone_is_not_exhaustion():
    # A busy cache with nobody waiting and no preemption is working, not full.
    run = Run()
    run.steps(5, usage=0.98, running=9, waiting=0, requests=4, **SHORT)
    assert not causes(run.findings(), "exhaustion")


def test_batch_at_max_num_seqs_waits_for_slots_not_blocks():
    # A full batch of 12 with the cache at 93 %: requests wait for a slot.
    run = Run(thresholds={"max_num_seqs": 12})
    run.steps(10, usage=0.93, running=12, waiting=8, requests=6, prompt=200, generated=100, queue=3.0, hit_ratio=0.6)
    findings = run.findings()
    assert not causes(findings, "exhaustion")
    assert "queueing_compute_bound" in causes(findings)
    assert "queueing_kv_bound" not in causes(findings)


def test_preemption_without_a_full_poll_is_still_exhaustion():
    run = Run()
    run.steps(3, usage=0.6, running=12, waiting=0, requests=4, **SHORT, preemptions=2)
    finding = only(run.findings(), "concurrency_beyond_capacity")
    assert finding.severity == "critical" and finding.confidence == "medium"


# --------------------------------------------------------------------------
# low hit rate
# --------------------------------------------------------------------------


def test_caching_disabled():
    run = Run()
    run.engine.config["enable_prefix_caching"] = "False"
    run.steps(6, usage=0.3, running=2, requests=4, hit_ratio=None)
    findings = run.findings()
    finding = only(findings, "caching_disabled")
    assert finding.symptom == "low_hit_rate" and finding.severity == "info"
    assert causes(findings, "low_hit_rate") == {"caching_disabled"}


def test_cold_cache_after_restart():
    run = Run()
    run.steps(6, usage=0.4, running=3, requests=4, hit_ratio=0.8)
    run.engine.restart()
    run.steps(4, usage=0.4, running=3, requests=4, hit_ratio=0.05)
    findings = run.findings()
    finding = only(findings, "cold_cache")
    assert finding.evidence["hit_ratio_since_restart"] == pytest.approx(0.05, rel=1e-3)
    assert finding.evidence["hit_ratio_before_restart"] == pytest.approx(0.8, rel=1e-3)
    assert causes(findings, "low_hit_rate") == {"cold_cache"}
    assert "engine_restarted" in causes(findings, "change")


def test_each_low_hit_rate_cause_has_its_judge_asked_in_the_symptoms_ranking(monkeypatch):
    ranking = SYMPTOMS["low_hit_rate"].ranking
    assert set(hit_rate.JUDGES) == set(ranking)
    with pytest.raises(CatalogueError, match=r"no judge for \['made_up'\]"):
        check_judges("low_hit_rate", hit_rate.JUDGES, ranking + ("made_up",))
    with pytest.raises(CatalogueError, match=r"no ranked cause for the judges of \['no_reuse'\]"):
        check_judges("low_hit_rate", hit_rate.JUDGES, ranking[:-1])
    run = Run()
    run.steps(6, usage=0.4, running=3, requests=4, hit_ratio=0.8)
    run.engine.restart()
    run.steps(4, usage=0.4, running=3, requests=4, hit_ratio=0.05)
    assert causes(run.findings(), "low_hit_rate") == {"cold_cache"}
    # The workload's judge asked before the cold cache's reads the window's two halves, not the restart.
    workload_first = tuple(c for c in ranking if c != "cold_cache") + ("cold_cache",)
    monkeypatch.setitem(SYMPTOMS, "low_hit_rate",
                        replace(SYMPTOMS["low_hit_rate"], ranking=workload_first))
    assert causes(run.findings(), "low_hit_rate") != {"cold_cache"}


def test_prefix_changed_step_drop_with_moderate_usage():
    run = Run()
    run.steps(12, usage=0.4, running=3, requests=4, hit_ratio=0.8)
    run.steps(6, usage=0.45, running=3, requests=4, hit_ratio=0.05)
    findings = run.findings()
    finding = only(findings, "prefix_changed")
    # Without residency histograms a working set evicted before reuse reads
    # the same at any usage (idle cached blocks count as free): low
    # confidence, and the finding names the other cause and what tells.
    assert finding.severity == "warning" and finding.confidence == "low"
    assert finding.evidence["cannot_tell_apart"] == "prefix_changed, eviction_before_reuse"
    assert finding.evidence["tells_them_apart"].startswith("--kv-cache-metrics")
    # The first sentence (the status page's banner "Next:") is a thing to do.
    assert finding.next_check.startswith("Look first for a prompt template or system prompt deployed at that time, "
                                         "then for idle prefixes evicted before reuse")
    assert finding.evidence["hit_ratio_baseline"] == pytest.approx(0.8, rel=1e-3)
    assert finding.evidence["hit_ratio_recent"] == pytest.approx(0.05, rel=1e-3)
    assert causes(findings, "low_hit_rate") == {"prefix_changed"}


def test_prefix_changed_at_a_recorded_change():
    run = Run()
    run.steps(12, usage=0.4, running=3, requests=4, hit_ratio=0.8)
    run.events.append(Change(run.now + 10, "lora", None, None, "new LoRA adapters: sql-v2"))
    # The change at the drop explains it even with a busy cache.
    run.steps(6, usage=0.9, running=3, requests=4, hit_ratio=0.05)
    findings = run.findings()
    finding = only(findings, "prefix_changed")
    assert finding.confidence == "high"
    assert "sql-v2" in finding.evidence["changes_at_drop"]
    assert "eviction_before_reuse" not in causes(findings)
    assert "lora_changed" in causes(findings, "change")


def test_eviction_before_reuse_from_usage():
    run = Run()
    run.steps(12, usage=0.5, running=3, requests=4, hit_ratio=0.7)
    run.steps(6, usage=0.93, running=8, requests=4, hit_ratio=0.15)
    findings = run.findings()
    finding = only(findings, "eviction_before_reuse")
    assert finding.confidence == "medium"
    assert finding.evidence["kv_usage_recent_max"] == pytest.approx(0.93)
    assert causes(findings, "low_hit_rate") == {"eviction_before_reuse"}


def test_eviction_before_reuse_from_residency_histograms():
    # Blocks sit idle 0.5 s before eviction, but reuse comes after 30 s.
    run = Run()
    run.steps(8, usage=0.5, running=3, requests=4, hit_ratio=0.08, residency=(0.5, 30.0))
    findings = run.findings()
    finding = only(findings, "eviction_before_reuse")
    assert finding.evidence["kv_block_idle_before_evict_p50_seconds"] < finding.evidence["kv_block_reuse_gap_p50_seconds"]
    assert "no_reuse" not in causes(findings)


def test_no_reuse():
    run = Run()
    run.steps(18, usage=0.4, running=3, requests=4, hit_ratio=0.03)
    findings = run.findings()
    finding = only(findings, "no_reuse")
    assert finding.severity == "info"
    assert causes(findings, "low_hit_rate") == {"no_reuse"}
    assert not [f for f in findings if is_actionable(f)]


def _reset_10s_ago() -> dict:
    """A stream report of the engine's KV-cache events: the whole cache cleared 10 s before its end."""
    source = KVEventSource("tcp://127.0.0.1:1")  # fed by hand: nothing listens
    source.feed(0, wire.encode_batch(1.0, [wire.stored(list(range(200)), 16)]), now=100.0)
    source.feed(1, wire.encode_batch(1.0, [wire.cleared()]), now=110.0)
    source.feed(2, wire.encode_batch(1.0, [wire.stored(list(range(200, 400)), 16)]), now=115.0)
    return {**source.report(now=120.0), "page_engine": {"model_name": "tiny-llama", "engine": "0"}}


def test_a_low_hit_rate_after_a_reset_the_stream_saw_is_a_cache_reset_not_a_workload():
    """The page reads a low, stable ratio (no reuse); the engine's KV-cache
    events saw the whole cache cleared 10 s ago: the hit-rate rule names the
    reset, decided by the stream."""
    run = Run()
    run.steps(18, usage=0.4, running=3, requests=4, hit_ratio=0.03)
    per_engine, _ = evaluate_window(run.window)
    assert causes(diagnose(run.window, per_engine, (), {}), "low_hit_rate") == {"no_reuse"}
    findings = diagnose(run.window, per_engine, (), {}, kv_events=_reset_10s_ago())
    finding = only(findings, "cache_reset")
    assert (finding.confidence, finding.severity, finding.evidence["decided_by"]) == ("high", "info", "kv_events")
    assert finding.evidence["kv_cache_cleared_seconds_ago"] == 10.0 and "cleared its prefix cache 10s ago" in finding.summary
    assert finding.evidence["hit_ratio_since_reset"] == pytest.approx(0.03, rel=1e-3)
    assert finding.next_check == NEXT_CHECK["cache_reset"]
    assert causes(findings, "low_hit_rate") == {"cache_reset"}


def test_a_reset_the_cache_already_refilled_from_is_no_cache_reset():
    """Healthy before the reset and back since it: no low-hit-rate finding,
    and a reset with a ratio that fell before it is not what explains it."""
    run = Run()
    run.steps(18, usage=0.4, running=3, requests=4, hit_ratio=0.8)
    per_engine, _ = evaluate_window(run.window)
    assert not causes(diagnose(run.window, per_engine, (), {}, kv_events=_reset_10s_ago()), "low_hit_rate")
    run = Run()
    run.steps(6, usage=0.4, running=3, requests=4, hit_ratio=0.8)
    run.steps(12, usage=0.4, running=3, requests=4, hit_ratio=0.05)
    run.steps(1, usage=0.4, running=3, requests=4, hit_ratio=0.8)  # the poll since the reset: warm
    per_engine, _ = evaluate_window(run.window)
    assert "cache_reset" not in causes(diagnose(run.window, per_engine, (), {}, kv_events=_reset_10s_ago()))


def test_residency_that_keeps_blocks_long_enough_is_no_reuse():
    run = Run()
    run.steps(8, usage=0.85, running=3, requests=4, hit_ratio=0.05, residency=(120.0, 5.0))
    assert causes(run.findings(), "low_hit_rate") == {"no_reuse"}


def test_a_low_ratio_for_a_moment_is_not_no_reuse():
    # The first polls of traffic: low, but nothing earlier says it stays low.
    run = Run()
    run.steps(6, usage=0.1, running=0)
    run.steps(2, usage=0.4, running=3, requests=4, hit_ratio=0.0)
    assert not causes(run.findings(), "low_hit_rate")


def test_no_reuse_on_a_crowded_cache_says_what_it_cannot_tell():
    # High usage, nobody waits: not exhausted; without residency histograms a
    # workload without shared prefixes and evicted prefixes look the same.
    run = Run()
    run.steps(18, usage=0.88, running=8, requests=4, hit_ratio=0.03)
    finding = only(run.findings(), "no_reuse")
    assert finding.confidence == "low" and "--kv-cache-metrics" in finding.summary
    assert "eviction_before_reuse" not in causes(run.findings())


# --------------------------------------------------------------------------
# low hit rate while the cache is exhausted
# --------------------------------------------------------------------------

# The documented real burst: 400 distinct prompt tokens + 400 generated each,
# far more requests than fit, no shared prefix.
BURST = dict(usage=0.99, running=6, waiting=18, requests=6, prompt=400, generated=400, hit_ratio=0.0, preemptions=2)


def test_exhaustion_without_shared_prefixes_is_not_a_low_hit_rate():
    run = Run(window_seconds=60, interval=2.0)
    run.steps(5, usage=0.0, running=0)
    for count in range(1, 30):
        run.step(**BURST)
        findings = run.findings()
        assert not causes(findings, "low_hit_rate"), (count, findings)
    finding = only(findings, "concurrency_beyond_capacity")
    assert finding.severity == "critical"
    assert finding.evidence["prefix_cache_hit_ratio"] == 0
    assert finding.evidence["hit_ratio_note"] == (
        "With the cache exhausted, a low hit rate from a workload without shared prefixes is not a separate problem.")


def test_a_drop_that_came_with_the_exhaustion_names_no_hit_rate_cause():
    # Evicted by the load or changed prompts: the counters cannot tell which.
    run = Run()
    run.steps(12, usage=0.5, running=3, requests=4, hit_ratio=0.7)
    run.steps(6, **{**BURST, "hit_ratio": 0.05})
    findings = run.findings()
    assert not causes(findings, "low_hit_rate")
    note = only(findings, "concurrency_beyond_capacity").evidence["hit_ratio_note"]
    assert "fell from 70% to 5%" in note and "--kv-cache-metrics" in note


def test_a_drop_before_the_exhaustion_is_a_changed_prefix():
    run = Run()
    run.steps(12, usage=0.5, running=3, requests=4, hit_ratio=0.7)
    run.steps(7, usage=0.5, running=3, requests=4, hit_ratio=0.05)
    run.steps(3, **{**BURST, "hit_ratio": 0.05})
    findings = run.findings()
    finding = only(findings, "prefix_changed")
    # The baseline: the polls before the last minute before the exhaustion.
    assert finding.evidence["hit_ratio_baseline_before_exhaustion"] == pytest.approx((11 * 0.7 + 0.05) / 12, rel=1e-3)
    assert finding.evidence["hit_ratio_recent_before_exhaustion"] == pytest.approx(0.05, rel=1e-3)
    assert finding.evidence["kv_cache_exhausted"] is True
    assert "concurrency_beyond_capacity" in causes(findings)
    assert "eviction_before_reuse" not in causes(findings)


def test_residency_histograms_prove_eviction_under_exhaustion():
    run = Run()
    run.steps(12, usage=0.5, running=3, requests=4, hit_ratio=0.7)
    run.steps(6, **{**BURST, "hit_ratio": 0.05}, residency=(0.5, 30.0))
    findings = run.findings()
    finding = only(findings, "eviction_before_reuse")
    assert finding.confidence == "high" and finding.evidence["kv_cache_exhausted"] is True
    assert "concurrency_beyond_capacity" in causes(findings)


def test_residency_that_keeps_blocks_rules_eviction_out_under_exhaustion():
    run = Run()
    run.steps(12, usage=0.5, running=3, requests=4, hit_ratio=0.7)
    run.steps(6, **{**BURST, "hit_ratio": 0.05}, residency=(120.0, 5.0))
    assert causes(run.findings(), "low_hit_rate") == {"prefix_changed"}


def test_a_restart_under_exhaustion_is_still_a_cold_cache():
    run = Run()
    run.steps(6, usage=0.5, running=3, requests=4, hit_ratio=0.7)
    run.engine.restart()
    run.steps(6, **BURST)
    findings = run.findings()
    assert causes(findings, "low_hit_rate") == {"cold_cache"}
    assert "concurrency_beyond_capacity" in causes(findings)


def test_caching_disabled_under_exhaustion_is_still_reported():
    run = Run()
    run.engine.config["enable_prefix_caching"] = "False"
    run.steps(6, **{**BURST, "hit_ratio": None})
    findings = run.findings()
    assert causes(findings, "low_hit_rate") == {"caching_disabled"}
    assert "concurrency_beyond_capacity" in causes(findings)


def test_healthy_hit_ratio_has_no_finding():
    run = Run()
    run.steps(18, usage=0.4, running=3, requests=4, hit_ratio=0.75)
    assert not run.findings()


def test_too_few_queries_to_judge():
    run = Run()
    run.steps(4, usage=0.4, running=1, requests=1, prompt=100, hit_ratio=0.0)
    assert not causes(run.findings(), "low_hit_rate")


# --------------------------------------------------------------------------
# slow first token
# --------------------------------------------------------------------------


def test_queueing_compute_bound_is_not_exhaustion():
    # Scheduler slots, not KV blocks: usage 50 % while 30 requests wait.
    run = Run(thresholds={"max_num_seqs": 8})
    run.steps(10, usage=0.5, running=8, waiting=30, requests=8, prompt=100, generated=50, queue=3.0, prefill=0.05,
              hit_ratio=0.5)
    findings = run.findings()
    finding = only(findings, "queueing_compute_bound")
    assert finding.symptom == "slow_first_token"
    assert finding.evidence["kv_usage_max_while_waiting"] == pytest.approx(0.5)
    assert finding.evidence["queue_share"] > 0.9
    assert "bigger cache does not" in finding.summary
    assert not causes(findings, "exhaustion")
    assert "queueing_kv_bound" not in causes(findings)


def test_a_queue_that_waited_with_room_stays_compute_bound_when_a_long_request_is_preempted():
    """The demo's slow-prefill (seed 1): the queueing phase's queue, which
    waited with the cache at most 38 % full, was named KV-bound at once when
    one long document was preempted, since the exhaustion detector held.
    KV-bound is decided by the cache while the requests waited."""
    run = Run(thresholds={"max_num_seqs": 12})
    run.steps(8, usage=0.38, running=12, waiting=30, requests=8, prompt=300, generated=300, queue=3.0, prefill=0.05)
    run.steps(2, usage=0.97, running=3, waiting=0, requests=2, prompt=300, generated=300, queue=3.0, prefill=0.05,
              preemptions=1)
    findings = run.findings()
    assert causes(findings, "exhaustion")  # the preemption: the detector holds
    finding = only(findings, "queueing_compute_bound")
    assert finding.evidence["kv_usage_max_while_waiting"] == pytest.approx(0.38)
    assert "not exhausted" not in finding.summary and "had room while they waited" in finding.summary
    assert "queueing_kv_bound" not in causes(findings)
    # The same preemption while the queue waited on a cache under pressure (85 %, below the full line): KV-bound.
    run = Run(thresholds={"max_num_seqs": 12})
    run.steps(10, usage=0.85, running=8, waiting=30, requests=8, prompt=300, generated=300, queue=3.0, prefill=0.05,
              preemptions=1)
    assert "queueing_kv_bound" in causes(run.findings(), "slow_first_token")


def test_each_first_token_cause_has_its_judge_asked_in_the_symptoms_ranking(monkeypatch):
    ranking = SYMPTOMS["slow_first_token"].ranking
    assert set(first_token.JUDGES) == set(ranking)
    with pytest.raises(CatalogueError, match=r"slow_first_token: no judge for \['made_up'\]"):
        check_judges("slow_first_token", first_token.JUDGES, ranking + ("made_up",))
    asked: list[str] = []

    def recording(judge):
        def ask(ctx, judging):
            asked.append(judge.__name__)
            return judge(ctx, judging)
        ask.__name__ = judge.__name__
        return ask

    # One recorder per judge: causes told apart by one comparison share it, and it is asked once.
    recorders = {judge: recording(judge) for judge in set(first_token.JUDGES.values())}
    for cause, judge in list(first_token.JUDGES.items()):
        monkeypatch.setitem(first_token.JUDGES, cause, recorders[judge])
    # Upstream, a queue and prefill all slow (the queue the larger part): every verdict kept, upstream's
    # first and the engine's parts by their share, whatever order the judges were asked in.
    run = Run(thresholds={"max_num_seqs": 8})
    run.steps(10, usage=0.5, running=8, waiting=30, requests=8, prompt=100, generated=50, queue=1.6, prefill=1.3,
              hit_ratio=0.5)
    upstream = {"histogram": "app_retrieval_seconds", "up": True, "mean_seconds": 4.0, "p95_seconds": 6.0,
                "count": 40}
    per_engine, _ = evaluate_window(run.window)
    (row,) = [row for row in per_engine if row.engine is not None]

    def judged():
        ctx = EngineContext(run.window, row, resolve_thresholds(run.thresholds), [], None)
        return [f.cause for f in first_token.slow_first_token_findings(ctx, upstream)]

    found = judged()
    assert found == ["upstream", "queueing_compute_bound", "prefill"]
    assert asked == ["_upstream", "_queue", "_prefill", "_residual"]
    asked.clear()
    monkeypatch.setitem(SYMPTOMS, "slow_first_token", replace(SYMPTOMS["slow_first_token"], ranking=ranking[::-1]))
    assert judged() == found
    assert asked == ["_residual", "_prefill", "_queue", "_upstream"]


def test_prefill():
    run = Run()
    run.steps(10, usage=0.5, running=2, requests=3, prompt=8000, generated=50, queue=0.05, prefill=2.4,
              hit_ratio=0.3)
    findings = run.findings()
    finding = only(findings, "prefill")
    assert finding.evidence["prefill_share"] > 0.9
    assert finding.evidence["uncached_prompt_tokens_mean"] == pytest.approx(8000 * 0.7, rel=1e-3)
    assert causes(findings, "slow_first_token") == {"prefill"}


def test_front_end():
    run = Run()
    run.steps(10, usage=0.3, running=2, requests=4, prompt=300, queue=0.01, prefill=0.05, ttft=2.2, hit_ratio=0.5)
    findings = run.findings()
    finding = only(findings, "front_end")
    assert finding.evidence["other_share"] > 0.9
    assert causes(findings, "slow_first_token") == {"front_end"}


def test_upstream_is_the_larger_part():
    run = Run()
    run.steps(10, usage=0.3, running=2, requests=4, prompt=300, queue=0.01, prefill=0.1, hit_ratio=0.5)
    upstream = {"histogram": "app_retrieval_seconds", "up": True, "mean_seconds": 2.5, "p95_seconds": 4.0,
                "count": 40}
    findings = run.findings(upstream)
    finding = only(findings, "upstream")
    assert finding.evidence["upstream_share"] > 0.9
    assert "does not repair" in finding.next_check
    # The engine's own TTFT is fast: no engine-side cause.
    assert causes(findings, "slow_first_token") == {"upstream"}


def test_upstream_down_is_not_a_cause():
    run = Run()
    run.steps(10, usage=0.3, running=2, requests=4, prompt=300, queue=0.01, prefill=0.1, hit_ratio=0.5)
    upstream = {"histogram": "app_retrieval_seconds", "up": False, "mean_seconds": 2.5, "count": 40}
    assert not run.findings(upstream)


def test_fast_first_token_has_no_finding():
    run = Run()
    run.steps(10, usage=0.3, running=2, requests=4, prompt=300, queue=0.01, prefill=0.1, hit_ratio=0.5)
    assert not run.findings()


def test_ttft_objective_is_configurable():
    run = Run(thresholds={"ttft_p95_seconds": "100ms", "ttft_mean_seconds": "50ms"})
    run.steps(10, usage=0.3, running=2, requests=4, prompt=300, queue=0.01, prefill=0.1, hit_ratio=0.5)
    assert causes(run.findings(), "slow_first_token") == {"prefill"}


# --------------------------------------------------------------------------
# changes
# --------------------------------------------------------------------------


def test_model_changed():
    run = Run()
    run.steps(3, requests=2, hit_ratio=0.5)
    run.engines = [Engine(model="llama-3-8b")]
    run.steps(2, requests=2, hit_ratio=0.5)
    finding = only(run.findings(), "model_changed")
    assert finding.symptom == "change" and finding.severity == "info"
    assert finding.model == "llama-3-8b"
    assert finding.evidence["models_before"] == "tiny-llama"


def test_lora_changed():
    run = Run()
    run.steps(3, requests=2, hit_ratio=0.5)
    run.events.append(Change(run.now, "lora", None, None, "new LoRA adapters: sql"))
    finding = only(run.findings(), "lora_changed")
    assert finding.model == "tiny-llama"  # the only served model


def test_cache_dtype_changed():
    run = Run()
    run.steps(3, requests=2, hit_ratio=0.5)
    run.engine.config["cache_dtype"] = "fp8_e4m3"
    run.steps(2, requests=2, hit_ratio=0.5)
    findings = run.findings()
    finding = only(findings, "cache_dtype_changed")
    assert finding.severity == "info"
    assert "accuracy" in finding.summary and "accuracy" in finding.next_check
    assert "auto -> fp8_e4m3" in finding.evidence["detail"]
    assert "cache_config_changed" not in causes(findings)


def test_cache_config_changed():
    run = Run()
    run.steps(3, requests=2, hit_ratio=0.5)
    run.engine.config.update(num_gpu_blocks="256", kv_cache_size_tokens="8192")
    run.steps(2, requests=2, hit_ratio=0.5)
    findings = run.findings()
    finding = only(findings, "cache_config_changed")
    assert finding.evidence["changed_keys"] == "kv_cache_size_tokens,num_gpu_blocks"
    assert "cache_dtype_changed" not in causes(findings)


def test_engine_restarted():
    run = Run()
    run.steps(3, requests=2, hit_ratio=0.5)
    run.engine.restart()
    run.steps(2, requests=2, hit_ratio=0.5)
    finding = only(run.findings(), "engine_restarted")
    assert finding.engine == "0" and finding.evidence["seconds_ago"] == 10


def test_changes_leave_the_window():
    run = Run(window_seconds=60)
    run.steps(3, requests=2, hit_ratio=0.5)
    run.engine.restart()
    run.steps(2, requests=2, hit_ratio=0.5)
    assert "engine_restarted" in causes(run.findings())
    run.steps(8, requests=2, hit_ratio=0.5)
    assert not run.findings()


# --------------------------------------------------------------------------
# structure, thresholds
# --------------------------------------------------------------------------


def test_every_cause_in_the_vocabulary_has_a_next_check():
    from kvwatch.diagnose import NEXT_CHECK

    assert {cause for group in CAUSES.values() for cause in group} == set(NEXT_CHECK)


def test_per_engine_findings_name_their_engine():
    run = Run(thresholds={"max_num_seqs": 9})
    second = Engine(engine="1")
    run.engines.append(second)
    for _ in range(4):
        run.step(usage=0.3, running=2, requests=2, **SHORT, engine=second, poll=False)
        run.step(usage=0.97, running=8, waiting=20, requests=8, **SHORT, preemptions=1)
    exhausted = [f for f in run.findings() if f.symptom == "exhaustion"]
    assert {f.engine for f in exhausted} == {"0"}


def test_a_failing_rule_drops_only_its_findings(monkeypatch):
    import kvwatch.diagnose as module

    run = Run(thresholds={"max_num_seqs": 9})
    run.steps(4, usage=0.97, running=8, waiting=20, requests=8, **SHORT, queue=4.0, preemptions=1)

    def broken(ctx):
        raise RuntimeError("bug")

    monkeypatch.setattr(module, "exhaustion_findings", broken)
    findings = run.findings()
    assert not causes(findings, "exhaustion")
    assert "queueing_kv_bound" in causes(findings)


def test_validate_thresholds_reports_everything_at_once():
    problems = validate_thresholds({"hit_ratio_lo": 0.1, "hit_ratio_low": 1.5, "ttft_p95_seconds": "soon",
                                    "max_num_seqs": 0, "ttft_min_requests": True, "exhaustion_usage_ratio": 0.95})
    assert len(problems) == 5
    assert any("unknown threshold 'hit_ratio_lo'" in p and "hit_ratio_low" in p for p in problems)
    assert any(p.startswith("hit_ratio_low:") for p in problems)
    assert any(p.startswith("ttft_p95_seconds:") for p in problems)
    assert any(p.startswith("max_num_seqs:") for p in problems)
    assert any(p.startswith("ttft_min_requests:") for p in problems)


def test_thresholds_accept_durations_and_defaults_fill_in():
    assert validate_thresholds({"ttft_p95_seconds": "500ms", "hit_recent_seconds": "2m", "max_num_seqs": None}) == []
    resolved = resolve_thresholds({"ttft_p95_seconds": "500ms", "hit_recent_seconds": "2m"})
    assert resolved.ttft_p95_seconds == 0.5 and resolved.hit_recent_seconds == 120.0
    assert resolved.hit_ratio_low == DEFAULT_THRESHOLDS.hit_ratio_low


def test_settings_reject_bad_diagnosis_thresholds(tmp_path):
    config = tmp_path / "kvwatch.yaml"
    config.write_text("diagnosis:\n  hit_ratio_low: 3\n  bogus: 1\n")
    with pytest.raises(SettingsError) as raised:
        load_settings(str(config), environ={})
    assert len([p for p in raised.value.problems if p.startswith("diagnosis:")]) == 2


def test_docs_name_every_threshold_and_cause():
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "diagnosis.md").read_text()
    missing = [key for key in asdict(DEFAULT_THRESHOLDS) if f"`{key}`" not in text]
    missing += [cause for group in CAUSES.values() for cause in group if f"`{cause}`" not in text]
    assert not missing, missing


def test_a_prefix_regression_stays_one_after_the_low_ratio_fills_the_window():
    # The monitor diagnoses every poll and keeps the last healthy ratio
    # beyond the window: once the drop has left the window, the finding is
    # still a changed prefix (warning), not no_reuse (info, "nothing to repair").
    memory = HitRateMemory()
    run = Run(window_seconds=60.0)
    for _ in range(8):
        run.step(usage=0.4, running=3, requests=4, hit_ratio=0.8)
        diagnose_with(run, memory)
    for _ in range(20):  # 200 s of a low ratio: the window holds nothing else
        run.step(usage=0.4, running=3, requests=4, hit_ratio=0.03)
        findings = diagnose_with(run, memory)
    finding = only(findings, "prefix_changed")
    assert finding.severity == "warning"
    assert 0.6 < finding.evidence["hit_ratio_last_healthy"] <= 0.8 + 1e-9  # the last healthy window
    assert finding.evidence["hit_ratio_last_healthy_seconds_ago"] >= 190
    # Without the memory (one-shot `kvwatch diagnose`) the window alone decides.
    assert causes(run.findings(), "low_hit_rate") == {"no_reuse"}
    # Reuse that comes back ends it.
    for _ in range(8):
        run.step(usage=0.4, running=3, requests=4, hit_ratio=0.8)
        findings = diagnose_with(run, memory)
    assert not causes(findings, "low_hit_rate")


def test_the_hit_rate_memory_is_bounded_in_bytes():
    """Engines with model names of 100 KB (a label value is as long as the
    page admits): the memory keeps at most max_bytes of them, the newest, and
    one engine whose names alone are over the bound is not remembered."""
    memory = HitRateMemory(max_engines=1024, max_bytes=1024 * 1024)
    for n in range(200):
        memory.remember((f"model-{n}-" + "m" * 100_000, "0"), 0.5, float(n))
        assert memory.bytes == sum(HitRateMemory.entry_bytes(key) for key in memory._healthy) <= 1024 * 1024
    assert 0 < len(memory._healthy) <= 10
    assert memory.recall(("model-199-" + "m" * 100_000, "0")) == (0.5, 199.0)
    assert memory.recall(("model-0-" + "m" * 100_000, "0")) is None
    memory.remember(("huge", "e" * (2 * 1024 * 1024)), 0.9, 300.0)
    assert memory.recall(("huge", "e" * (2 * 1024 * 1024))) is None
    assert memory.recall(("model-199-" + "m" * 100_000, "0")) == (0.5, 199.0)
    for n in range(2000):  # short names: the engine count still bounds it
        memory.remember((f"m{n}", "0"), 0.5, float(n))
    assert len(memory._healthy) == 1024


def diagnose_with(run, memory):
    per_engine, _ = evaluate_window(run.window)
    return diagnose(run.window, per_engine, tuple(run.events), run.thresholds, None, memory)


def test_finding_json_uses_metric_label_names_keeps_notes_apart_and_links_its_runbook():
    from kvwatch.sidecar.report import finding_json

    run = Run()
    run.steps(12, usage=0.4, running=3, requests=4, hit_ratio=0.8)
    run.events.append(Change(run.now + 10, "lora", None, None, "new LoRA adapters: sql-v2"))
    run.steps(6, usage=0.9, running=3, requests=4, hit_ratio=0.05)
    finding = only(run.findings(), "prefix_changed")
    data = finding_json(finding, since=1234.0)
    assert data["model_name"] == "tiny-llama" and data["since"] == 1234.0
    assert all(not isinstance(v, str) for v in data["evidence"].values())
    assert "sql-v2" in data["notes"]["changes_at_drop"]
    assert data["runbook"] == "runbooks#vllmprefixcachehitratelow-prefix-changed"


def test_ttft_shares_sum_to_at_most_one_and_the_finding_uses_the_signals_shares():
    # Queue and prefill observed at finish exceed the TTFT observed at first
    # token (changing load): the finding's shares were min(1, each) and
    # summed past 1 (queue 100 %, prefill 16 %) beside a signal of 63 %.
    from kvwatch.signals import ttft_decomposition

    run = Run()
    run.steps(12, usage=0.5, running=8, waiting=10, requests=6, queue=2.5, prefill=0.6, ttft=2.0)
    finding = next(f for f in run.findings() if f.symptom == "slow_first_token")
    per_engine, _ = evaluate_window(run.window)
    shares = per_engine[0].values["kvwatch_time_to_first_token_share_ratio"]
    evidence = finding.evidence
    total = sum(evidence[k] for k in ("queue_share", "prefill_share", "other_share") if k in evidence)
    assert total <= 1.0 + 1e-6
    assert evidence["queue_share"] == pytest.approx(shares["queue"], abs=1e-3)
    assert "disagree" in evidence["histograms_disagree"]
    assert ttft_decomposition(per_engine[0].view).parts_over_ttft > 1
    assert any("disagree" in note for note in per_engine[0].notes)


def test_exhaustion_wording_follows_the_current_usage():
    # Peak earlier, but the cache is still above the threshold now: "full now",
    # never "full earlier in the window" beside a current 99.2 %.
    run = Run()
    run.steps(3, usage=0.999, running=8, waiting=6, requests=4, preemptions=2, **SHORT)
    run.steps(2, usage=0.992, running=8, waiting=6, requests=4, preemptions=2, **SHORT)
    finding = only(run.findings(), "concurrency_beyond_capacity")
    assert "full now (99.2%)" in finding.summary and "earlier" not in finding.summary
    run.steps(2, usage=0.5, running=2, waiting=0, requests=4, **SHORT)
    finding = only(run.findings(), "concurrency_beyond_capacity")
    assert "earlier in the window (now 50.0%)" in finding.summary


def test_evidence_keeps_every_digit_of_counts_and_capacities():
    # The CLI printed kv_cache_capacity_tokens=16380 under a signal table that said 16,384,
    # and /api/v1/diagnosis sent prefix_queries 111800 for 111812.
    from kvwatch.diagnose.context import tidy

    assert tidy({"capacity": 16384.0, "queries": 111812.0, "tokens": 1269.4, "share": 0.30000000000000004,
                 "small": 0.071849, "unknown": None, "nan": math.nan}) == {
        "capacity": 16384, "queries": 111812, "tokens": 1269, "share": 0.3, "small": 0.07185}


def test_last_healthy_wording_follows_the_timing():
    """"last healthy 56s ago (before the window)" was printed in a 62 s
    window: "before the window" only when it was."""
    memory = HitRateMemory()
    run = Run(window_seconds=60.0)
    for _ in range(8):
        run.step(usage=0.4, running=3, requests=4, hit_ratio=0.8)
        diagnose_with(run, memory)
    seen = {"before": 0, "within": 0}
    for _ in range(10):
        run.step(usage=0.4, running=3, requests=4, hit_ratio=0.03)
        for finding in diagnose_with(run, memory):
            ago = finding.evidence.get("hit_ratio_last_healthy_seconds_ago")
            if ago is None:
                continue
            covered = run.window.latest.time - run.window.entries[0].snapshot.time
            before = "(before the window)" in finding.summary
            assert before == (ago > covered), (ago, covered, finding.summary)
            seen["before" if before else "within"] += 1
            if not before:
                assert f"within the {covered:.0f}s window" in finding.summary
    assert seen["before"] and seen["within"]


def test_ttft_parts_are_unknown_while_no_request_finished_to_time_its_queue_and_prefill():
    # First tokens came (long requests still generating) but none finished: vLLM observes the queue and
    # prefill times at a request's end, so they have no observation in the window. The split was queue 0 %,
    # prefill 0 %, other 100 %, read by the page as a front end eating the whole first-token time.
    run = Run()
    run.steps(2, requests=4, queue=0.5, prefill=0.2)
    run.window = Window(300.0)
    for _ in range(3):
        run.engine.observe("ttft", 3.0, 4)
        run.step(requests=0, running=8)
    per_engine, _ = evaluate_window(run.window)
    assert per_engine[0].values.get("kvwatch_time_to_first_token_share_ratio") is None
    assert per_engine[0].values["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx(3.0)
