"""Builds the `promtool test rules` files in this directory from readable case
definitions: one case per alert and cause branch, each with the series that
should trigger it, and negative cases (the wrong cause, a blip shorter than
`for:`, deferred waiting, too little traffic) that must not fire. Every case
checks every alert name, so an alert firing where it should not fails too.

    python tests/promtool/cases.py      # rewrite the .test.yaml files

The test files load `rules.yaml`, which tests/test_rules_promtool.py writes
beside them from the generated alert rules with their annotations removed
(promtool compares rendered annotations verbatim; the expressions are what is
tested here, and `promtool check rules` checks the annotation templates).
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvwatch.diagnose.causes import ALERT_LIST, CAUSE
from kvwatch.mixin.paging import DEFAULT_SEVERITIES, PREEMPTING_SUFFIX

HERE = Path(__file__).resolve().parent
# The alert names, symptoms and severities come from the records the rules
# are generated from (kvwatch/diagnose/causes.py): the cases say only when
# an alert should fire, never what the catalogue already says.
ALERT_NAMES = tuple(alert.name for alert in ALERT_LIST)
SYMPTOM = {alert.name: alert.symptom for alert in ALERT_LIST if alert.symptom}
SEVERITY = DEFAULT_SEVERITIES
# An expectation's severity for an exhaustion cause while vLLM preempts: its
# `<cause>_preempting` severity (by default the same as without).
PREEMPTING = "preempting"
# An expectation for the finding-routed twin of a PromQL-decided cause (route="finding", its own severity).
FINDING = "finding"
TARGET = {"namespace": "llm", "job": "kvwatch", "instance": "10.0.0.1:9400"}
ENGINE = {**TARGET, "model_name": "m", "engine": "0"}
MINUTES = 120  # samples per series, one a minute
OTHER_NAMESPACE = {**ENGINE, "namespace": "batch", "instance": "10.0.0.2:9400"}


def _selector(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def const(value: float, minutes: int = MINUTES) -> str:
    return f"{value:g}x{minutes}"


def rate(per_minute: float, minutes: int = MINUTES) -> str:
    return f"0+{per_minute:g}x{minutes}"


def missing(minutes: int) -> str:
    return f"_x{minutes}"


def lapse(per_minute: float, at: int = 30, flat: int = 5, minutes: int = MINUTES) -> str:
    """A counter rising `per_minute` that stands still for `flat` samples after
    minute `at`: the 5m window (6 samples, both ends included in Prometheus
    2.x) that holds only those sees no increase at one evaluation, at + flat."""
    level = per_minute * at
    return (f"0+{per_minute:g}x{at} {level:g}+0x{flat - 1} "
            f"{level + per_minute:g}+{per_minute:g}x{minutes - at - flat - 1}")


@dataclass
class Engine:
    """One engine's series. Each field is a promtool values string (or None for absent)."""

    labels: dict = field(default_factory=lambda: dict(ENGINE))
    usage: str | None = const(0.4)
    running: str | None = const(4)
    waiting: str | None = const(0)
    waiting_capacity: str | None = None
    waiting_deferred: str | None = None
    preemptions: str | None = rate(0)
    prompt_tokens: str | None = rate(30000)
    prefix_queries: str | None = None
    prefix_hits: str | None = None
    ttft: tuple[str, str] | None = None  # (sum, count)
    queue: tuple[str, str] | None = None
    prefill: tuple[str, str] | None = None
    caching: str = "True"
    info: str | None = const(1)
    up: str | None = const(1)
    kvwatch_up: str | None = const(1)
    stats_disabled: str | None = None
    starting: str | None = None  # kvwatch_starting
    # kvwatch's own findings: (cause, values), each a kvwatch_finding series whose
    # symptom and severity are the cause record's (kvwatch/diagnose/causes.py).
    findings: tuple = ()

    def series(self) -> list[dict]:
        target = {k: self.labels[k] for k in TARGET}
        out = []

        def add(name, values, labels=None):
            if values is not None:
                out.append({"series": _selector(name, labels or self.labels), "values": values})

        add("up", self.up, target)
        add("kvwatch_up", self.kvwatch_up, target)
        add("kvwatch_stats_disabled", self.stats_disabled, target)
        add("kvwatch_starting", self.starting, target)
        for cause, values in self.findings:
            record = CAUSE[cause]
            add("kvwatch_finding", values, {**self.labels, "symptom": record.symptom or "", "cause": cause,
                                            "severity": record.severity})
        add("kvwatch_engine_info", self.info, {**self.labels, "enable_prefix_caching": self.caching,
                                               "block_size": "16"})
        add("kvwatch_engine_kv_cache_usage_ratio", self.usage)
        add("kvwatch_engine_requests_running", self.running)
        add("kvwatch_engine_requests_waiting", self.waiting)
        add("kvwatch_engine_requests_waiting_by_reason", self.waiting_capacity, {**self.labels, "reason": "capacity"})
        add("kvwatch_engine_requests_waiting_by_reason", self.waiting_deferred, {**self.labels, "reason": "deferred"})
        add("kvwatch_engine_preemptions_total", self.preemptions)
        add("kvwatch_engine_prompt_tokens_total", self.prompt_tokens)
        add("kvwatch_engine_prefix_cache_queries_total", self.prefix_queries)
        add("kvwatch_engine_prefix_cache_hits_total", self.prefix_hits)
        for name, pair in (("time_to_first_token_seconds", self.ttft), ("request_queue_time_seconds", self.queue),
                           ("request_prefill_time_seconds", self.prefill)):
            if pair:
                add(f"kvwatch_engine_{name}_sum", pair[0])
                add(f"kvwatch_engine_{name}_count", pair[1])
        return out


def hits(ratio: float, queried_per_minute: float = 20000) -> dict:
    return {"prefix_queries": rate(queried_per_minute), "prefix_hits": rate(queried_per_minute * ratio)}


def latency(ttft: float, queue: float, prefill: float, per_minute: int = 60) -> dict:
    def hist(mean):
        return (rate(mean * per_minute), rate(per_minute))

    return {"ttft": hist(ttft), "queue": hist(queue), "prefill": hist(prefill)}


def latency_lapse(ttft: float, queue: float, prefill: float, per_minute: int = 60, flat: int = 5) -> dict:
    """latency(), with no request observed in one rate window (see lapse): vLLM
    observes TTFT at the first token and queue and prefill at the end of a
    request, so a stalled engine leaves a window without any."""
    def hist(mean):
        return (lapse(mean * per_minute, flat=flat), lapse(per_minute, flat=flat))

    return {"ttft": hist(ttft), "queue": hist(queue), "prefill": hist(prefill)}


def latency_stop(ttft: float, queue: float, prefill: float, per_minute: int = 60, at: int = 30) -> dict:
    """latency() until minute `at`, then no request observed again."""
    def hist(mean):
        return (f"0+{mean * per_minute:g}x{at} {mean * per_minute * at:g}x{MINUTES - at - 1}",
                f"0+{per_minute}x{at} {per_minute * at}x{MINUTES - at - 1}")

    return {"ttft": hist(ttft), "queue": hist(queue), "prefill": hist(prefill)}


def latency_switch(ttft: float, before: tuple[float, float], after: tuple[float, float], at: int = 30,
                   per_minute: int = 60) -> dict:
    """latency() whose (queue, prefill) means change from `before` to `after` at minute `at`."""
    def hist(first, then):
        return (f"0+{first * per_minute:g}x{at} {(first * at + then) * per_minute:g}+{then * per_minute:g}"
                f"x{MINUTES - at - 1}", rate(per_minute))

    return {"ttft": hist(ttft, ttft), "queue": hist(before[0], after[0]), "prefill": hist(before[1], after[1])}


@dataclass
class Case:
    name: str
    engines: list[Engine]
    eval_time: str
    expect: list[tuple]  # (alert, cause, engine or target labels[, severity when not the cause's default])
    extra_series: list[dict] = field(default_factory=list)


def expected_severity(cause: str, severity: str | None = None) -> str:
    """The severity an expectation names: the cause's, its preempting one, or one given."""
    if severity == FINDING:
        return SEVERITY[cause]
    if severity == PREEMPTING:
        return SEVERITY[cause + PREEMPTING_SUFFIX]
    return severity or SEVERITY[cause]


def _labels_of(alert: str, cause: str, labels: dict, severity: str | None = None) -> dict:
    out = dict(labels)
    out.update({"severity": expected_severity(cause, severity), "cause": cause})
    if severity == FINDING or (cause in CAUSE and CAUSE[cause].routed_by_finding):
        out["route"] = "finding"
    if alert in SYMPTOM:
        out["symptom"] = SYMPTOM[alert]
    return out


def render(cases: list[Case], rule_file: str = "rules.yaml") -> str:
    tests = []
    for case in cases:
        series = [s for engine in case.engines for s in engine.series()] + case.extra_series
        checks = []
        for alert in ALERT_NAMES:
            expected = [{"exp_labels": _labels_of(*e)} for e in case.expect if e[0] == alert]
            checks.append({"eval_time": case.eval_time, "alertname": alert, "exp_alerts": expected})
        tests.append({"name": case.name, "interval": "1m", "input_series": series, "alert_rule_test": checks})
    header = ("# Generated by tests/promtool/cases.py; edit that file and run it. Loaded by\n"
              "# tests/test_rules_promtool.py, which writes rules.yaml beside it.\n")
    return header + yaml.safe_dump({"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False, width=1 << 16)


LONG = 240  # minutes, for cases that outlast the hit-ratio baseline span


def long_engine(**kw) -> Engine:
    """An engine whose series run LONG minutes."""
    defaults = dict(usage=const(0.4, LONG), running=const(4, LONG), waiting=const(0, LONG), preemptions=rate(0, LONG),
                    prompt_tokens=rate(30000, LONG), info=const(1, LONG), up=const(1, LONG),
                    kvwatch_up=const(1, LONG))
    return Engine(**{**defaults, **kw})


def default_cases() -> list[Case]:
    """Against the default config: rate window 5m, for 10m (exhaustion,
    TTFT), 15m (hit rate), 5m (health); cold window 30m; baseline 1h. Engines
    exist from minute 0, so they are cold until minute 30."""
    silent = dict(info=None, usage=None, running=None, waiting=None, preemptions=None, prompt_tokens=None)
    busy = dict(usage=const(0.98), preemptions=rate(6), running=const(8), waiting=const(12))
    def old_engine_hit(ratio: float, queried_per_minute: float = 20000, **kw) -> Engine:
        return Engine(**hits(ratio, queried_per_minute), **kw)

    return [
        # --- exhaustion --------------------------------------------------------
        Case("exhaustion: many requests overflow the cache -> concurrency_beyond_capacity",
             [Engine(**busy)], "40m", [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING)]),
        Case("exhaustion: three running requests fill it -> long_requests, not concurrency",
             [Engine(usage=const(0.97), preemptions=rate(2), running=const(3), waiting=const(1))], "40m",
             [("VllmKvCacheExhausted", "long_requests", ENGINE, PREEMPTING)]),
        Case("exhaustion: a large share per request but a long queue (preemption thinned the batch) -> "
             "concurrency_beyond_capacity, not long_requests",
             [Engine(usage=const(0.99), preemptions=rate(3), running=const(4), waiting=const(18))], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING)]),
        Case("exhaustion: waiting for capacity without preemptions still counts",
             [Engine(usage=const(0.95), running=const(10), waiting=const(4), waiting_capacity=const(4),
                     waiting_deferred=const(0))], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE)]),
        Case("exhaustion: preemptions while no scrape caught the usage peak (a preempted request's blocks are "
             "freed at once) -> still exhaustion",
             [Engine(usage=const(0.8), preemptions=rate(2), running=const(6), waiting=const(0))], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING)]),
        Case("exhaustion: three running requests fill it, one waits, none preempted -> long_requests, warning",
             [Engine(usage=const(0.97), running=const(3), waiting=const(1))], "40m",
             [("VllmKvCacheExhausted", "long_requests", ENGINE)]),
        Case("no exhaustion: only deferred requests wait (KV transfer, LoRA), none preempted",
             [Engine(usage=const(0.95), running=const(10), waiting=const(3), waiting_capacity=const(0),
                     waiting_deferred=const(3))], "40m", []),
        Case("no exhaustion: a full cache nobody waits for is a busy cache",
             [Engine(usage=const(0.99), running=const(10))], "40m", []),
        Case("no exhaustion: an overload shorter than for: (10m)",
             [Engine(usage="0.4x30 0.98x6 0.4x84", preemptions="0x30 0+6x6 36x84",
                     running=const(8), waiting="0x30 12x6 0x84")], "40m", []),
        # --- KV cache full soon (ETA under 15m for 5m, nothing preempted yet) --------
        # +1.5 %/min from 10 %: at 52m usage is 0.88 and rising 0.00025/s, so the cache
        # is full in 0.12 / 0.00025 = 480 s; the ETA fell under 900 s at 46m (0.79)
        Case("exhaustion soon: usage climbing to full within minutes, nothing preempted -> usage_rising",
             [Engine(usage="0.1+0.015x60 1x59", running="2+0.2x60 14x59")], "52m",
             [("VllmKvCacheExhaustionSoon", "usage_rising", ENGINE)]),
        Case("exhaustion soon: the ETA has been under 15m only since 46m, under for: (5m) -> not yet",
             [Engine(usage="0.1+0.015x60 1x59")], "49m", []),
        Case("exhaustion soon: high and flat usage has no trend -> nothing",
             [Engine(usage=const(0.88))], "52m", []),
        Case("exhaustion soon: high and falling usage -> nothing",
             [Engine(usage="0.98-0.005x119")], "52m", []),
        Case("exhaustion soon: rising, but full in about two hours -> nothing",
             [Engine(usage="0.1+0.005x119")], "52m", []),
        Case("exhaustion soon: still climbing once requests are preempted -> exhaustion only, the forecast is over",
             [Engine(usage="0.1+0.015x60 1x59", running=const(8), waiting=const(12), preemptions=rate(6))], "52m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING)]),
        # --- low prefix-cache hit rate ---------------------------------------------
        Case("hit rate: prefix caching off -> caching_disabled",
             [Engine(caching="False")], "40m", [("VllmPrefixCacheHitRateLow", "caching_disabled", ENGINE)]),
        Case("hit rate: prefix caching off, and kvwatch misses a poll every 7 minutes -> still caching_disabled",
             [Engine(caching="False", info="1x5 stale " * 17 + "1x0")], "100m",
             [("VllmPrefixCacheHitRateLow", "caching_disabled", ENGINE)]),
        Case("hit rate: a new engine (little history, no restart seen) is not a cold cache -> nothing",
             [old_engine_hit(0.05)], "25m", []),
        Case("hit rate: an engine restart makes the cache cold again",
             [Engine(prompt_tokens="0+30000x60 0+30000x60", prefix_queries="0+20000x60 0+20000x60",
                     prefix_hits="0+1000x60 0+1000x60")], "85m",
             [("VllmPrefixCacheHitRateLow", "cold_cache", ENGINE)]),
        Case("hit rate: the engine came back with another cache configuration -> cold_cache",
             [old_engine_hit(0.05, info="1x60 _x60")], "85m",
             [("VllmPrefixCacheHitRateLow", "cold_cache", ENGINE)],
             [{"series": _selector("kvwatch_engine_info", {**ENGINE, "enable_prefix_caching": "True",
                                                           "block_size": "32"}), "values": "_x60 1x60"}]),
        Case("hit rate: another cache configuration, and kvwatch misses a poll every 7 minutes -> still cold_cache",
             [old_engine_hit(0.05, info="1x5 stale " * 8 + "1x4 _x60")], "85m",
             [("VllmPrefixCacheHitRateLow", "cold_cache", ENGINE)],
             [{"series": _selector("kvwatch_engine_info", {**ENGINE, "enable_prefix_caching": "True",
                                                           "block_size": "32"}),
               "values": "_x60 " + "1x5 stale " * 8 + "1x4"}]),
        Case("hit rate: low and stable on a warm engine with room -> nothing (no_reuse_alert is off)",
             [old_engine_hit(0.05)], "50m", []),
        Case("hit rate: low all along on a crowded cache is not eviction (no healthy baseline) -> nothing",
             [old_engine_hit(0.05, usage=const(0.88), running=const(8))], "50m", []),
        Case("hit rate: healthy for an hour, then dropped on a crowded cache that is not exhausted -> "
             "eviction_before_reuse",
             [Engine(usage=const(0.88), running=const(8), prefix_queries=rate(20000),
                     prefix_hits="0+16000x60 960000+1000x60")], "82m",
             [("VllmPrefixCacheHitRateLow", "eviction_before_reuse", ENGINE)]),
        Case("hit rate: healthy for an hour, then dropped -> prefix_changed",
             [Engine(prefix_queries=rate(20000), prefix_hits="0+16000x60 960000+1000x60")], "82m",
             [("VllmPrefixCacheHitRateLow", "prefix_changed", ENGINE)]),
        Case("hit rate: healthy for an hour, then low for over two hours (past the baseline span) -> still "
             "prefix_changed: the recording rules remember the last healthy ratio",
             [long_engine(prefix_queries=rate(20000, LONG), prefix_hits=f"0+16000x60 960000+1000x{LONG - 60}")],
             "200m", [("VllmPrefixCacheHitRateLow", "prefix_changed", ENGINE)]),
        # --- low hit rate decided by kvwatch's finding (the KV-event stream), not by the ratio's twin ----
        Case("hit rate: the ratio reads healthy, kvwatch's KV-event stream decided eviction before reuse -> "
             "eviction_before_reuse from kvwatch_finding (route finding)",
             [Engine(**hits(0.5), findings=(("eviction_before_reuse", "_x20 1x100"),))],
             "40m", [("VllmPrefixCacheHitRateLow", "eviction_before_reuse", ENGINE, FINDING)]),
        Case("hit rate: the ratio reads healthy to the rules, kvwatch's KV-event stream saw the cache reset -> "
             "cache_reset from kvwatch_finding",
             [Engine(**hits(0.5), findings=(("cache_reset", "_x20 1x100"),))],
             "40m", [("VllmPrefixCacheHitRateLow", "cache_reset", ENGINE, FINDING)]),
        Case("hit rate: a reset finding for less than for: (15m) -> nothing",
             [Engine(**hits(0.5), findings=(("cache_reset", "_x20 1x10 stale"),))], "40m", []),
        Case("hit rate: both routes hold for one engine (the rules decide prefix_changed, kvwatch's finding "
             "names eviction) -> the rules' cause alone, never two causes of one symptom",
             [Engine(prefix_queries=rate(20000), prefix_hits="0+16000x60 960000+1000x60",
                     findings=(("eviction_before_reuse", "_x60 1x60"),))], "82m",
             [("VllmPrefixCacheHitRateLow", "prefix_changed", ENGINE)]),
        Case("hit rate: kvwatch's finding first (the stream decides minutes before the ratio), then the rules "
             "decide prefix_changed -> the finding's route alone while it fires",
             [Engine(prefix_queries=rate(20000), prefix_hits="0+16000x60 960000+1000x60",
                     findings=(("prefix_changed", "_x40 1x80"),))], "82m",
             [("VllmPrefixCacheHitRateLow", "prefix_changed", ENGINE, FINDING)]),
        # --- low prefix-cache hit rate while the cache is exhausted ---------------------
        Case("hit rate: the documented burst (exhausted, prompts share nothing) -> exhaustion only",
             [Engine(**busy, **hits(0.0))], "50m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING)]),
        Case("hit rate: healthy, then dropped as the cache became exhausted -> exhaustion only, no hit-rate cause",
             [Engine(usage="0.4x60 0.99x60", running=const(6), waiting="0x60 18x60", preemptions="0x60 0+6x60",
                     prefix_queries=rate(20000), prefix_hits="0+16000x60 960000+1000x60")], "82m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING)]),
        Case("hit rate: preemptions without a full cache are exhaustion too, not eviction -> exhaustion only",
             [Engine(usage=const(0.85), running=const(8), preemptions="0x60 0+2x60",
                     prefix_queries=rate(20000), prefix_hits="0+16000x60 960000+1000x60")], "82m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING)]),
        Case("hit rate: the prefix changed before the cache became exhausted -> prefix_changed and exhaustion",
             [Engine(usage="0.4x80 0.99x40", running=const(6), waiting="0x80 18x40", preemptions="0x80 0+6x40",
                     prefix_queries=rate(20000), prefix_hits="0+16000x60 960000+1000x60")], "100m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmPrefixCacheHitRateLow", "prefix_changed", ENGINE)]),
        Case("hit rate: an engine restart under exhaustion is still a cold cache",
             [Engine(**busy, prompt_tokens="0+30000x60 0+30000x60", prefix_queries="0+20000x60 0+20000x60",
                     prefix_hits="0+1000x60 0+1000x60")], "85m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmPrefixCacheHitRateLow", "cold_cache", ENGINE)]),
        Case("hit rate: prefix caching off under exhaustion is still caching_disabled",
             [Engine(**busy, caching="False")], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmPrefixCacheHitRateLow", "caching_disabled", ENGINE)]),
        Case("hit rate: healthy -> nothing",
             [old_engine_hit(0.7)], "50m", []),
        Case("hit rate: too few queried tokens to judge -> nothing",
             [old_engine_hit(0.05, queried_per_minute=100)], "50m", []),
        # --- slow first token ----------------------------------------------------
        Case("first token: queue on a full, preempting cache -> queueing_kv_bound (and exhaustion)",
             [Engine(**busy, **latency(3.0, 2.5, 0.3))], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmTimeToFirstTokenSlow", "queueing_kv_bound", ENGINE)]),
        Case("first token: queue with KV room -> queueing_compute_bound, never kv_bound",
             [Engine(usage=const(0.5), running=const(12), waiting=const(10), **latency(3.0, 2.5, 0.3))], "40m",
             [("VllmTimeToFirstTokenSlow", "queueing_compute_bound", ENGINE)]),
        # KV-bound by the cache while the requests waited: a queue for slots that a long request's
        # preemption overlaps waited with room (the demo's slow-prefill: at most 38 % full as 144 waited).
        Case("first token: queue for slots with KV room while a long request is preempted -> queueing_compute_bound",
             [Engine(usage=const(0.4), preemptions=rate(1), running=const(12), waiting=const(10),
                     **latency(3.0, 2.5, 0.3))], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmTimeToFirstTokenSlow", "queueing_compute_bound", ENGINE)]),
        Case("first token: queue while preempting, the cache under pressure below the full line -> queueing_kv_bound",
             [Engine(usage=const(0.85), preemptions=rate(6), running=const(8), waiting=const(12),
                     **latency(3.0, 2.5, 0.3))], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmTimeToFirstTokenSlow", "queueing_kv_bound", ENGINE)]),
        Case("first token: mostly prefill -> prefill",
             [Engine(**latency(3.0, 0.2, 2.5))], "40m", [("VllmTimeToFirstTokenSlow", "prefill", ENGINE)]),
        Case("first token: mostly outside queue and prefill -> front_end",
             [Engine(**latency(3.0, 0.2, 0.3))], "40m", [("VllmTimeToFirstTokenSlow", "front_end", ENGINE)]),
        # One story: a preempted request's re-queueing and recomputation are in neither
        # histogram, so the residual grows exactly when the cache is the cause: preemption, never front_end.
        Case("first token: mostly outside queue and prefill while preempting -> preemption, not front_end",
             [Engine(**busy, **latency(3.0, 0.2, 0.3))], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmTimeToFirstTokenSlow", "preemption", ENGINE)]),
        Case("first token: mostly outside queue and prefill while full and waiting, no preemption -> preemption",
             [Engine(usage=const(0.98), running=const(8), waiting=const(12), **latency(3.0, 0.2, 0.3))], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE),
              ("VllmTimeToFirstTokenSlow", "preemption", ENGINE)]),
        # One story through a change of cause: at minute 30 the largest part moves from the
        # queue to prefill. The queue's alert is kept firing for the hold (1m) while prefill is pending
        # (10m): never both firing.
        Case("first token: the largest part moves from queue to prefill -> the queue fires before",
             [Engine(**latency_switch(3.0, (2.5, 0.2), (0.2, 2.5)))], "31m",
             [("VllmTimeToFirstTokenSlow", "queueing_compute_bound", ENGINE)]),
        Case("first token: the largest part moves from queue to prefill -> neither fires between",
             [Engine(**latency_switch(3.0, (2.5, 0.2), (0.2, 2.5)))], "38m", []),
        Case("first token: the largest part moves from queue to prefill -> prefill fires after its for:",
             [Engine(**latency_switch(3.0, (2.5, 0.2), (0.2, 2.5)))], "45m",
             [("VllmTimeToFirstTokenSlow", "prefill", ENGINE)]),
        Case("first token: queue and prefill tie -> exactly one cause (queue)",
             [Engine(**latency(3.0, 1.2, 1.2))], "40m",
             [("VllmTimeToFirstTokenSlow", "queueing_compute_bound", ENGINE)]),
        Case("first token: fast -> nothing", [Engine(**latency(0.5, 0.3, 0.1))], "40m", []),
        # The finding hold (keep_firing_for, diagnosis: finding_hold_seconds, 1m): the rate window at 35m
        # holds no first token (the engine stalled, exhaustion goes on); one evaluation without the
        # condition neither resolves the firing alert nor sends it back to pending.
        Case("first token: one evaluation without a first token in the window, mid-exhaustion -> still firing at "
             "the lapse (kept firing)",
             [Engine(**busy, **latency_lapse(3.0, 2.5, 0.3))], "35m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmTimeToFirstTokenSlow", "queueing_kv_bound", ENGINE)]),
        Case("first token: one evaluation without a first token in the window, mid-exhaustion -> still firing "
             "after it, not pending again",
             [Engine(**busy, **latency_lapse(3.0, 2.5, 0.3))], "37m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmTimeToFirstTokenSlow", "queueing_kv_bound", ENGINE)]),
        Case("first token: no first token for longer than the hold -> resolved one hold after the first clear "
             "evaluation",
             [Engine(**busy, **latency_stop(3.0, 2.5, 0.3))], "36m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING)]),
        Case("first token: no first token since 30m -> still firing within the hold (35m, first clear evaluation)",
             [Engine(**busy, **latency_stop(3.0, 2.5, 0.3))], "35m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING),
              ("VllmTimeToFirstTokenSlow", "queueing_kv_bound", ENGINE)]),
        # --- health --------------------------------------------------------------
        Case("kvwatch not scraped -> KvwatchDown",
             [Engine(up=const(0), kvwatch_up=None, info=None, usage=None, running=None, waiting=None,
                     preemptions=None, prompt_tokens=None)], "10m",
             [("KvwatchDown", "kvwatch_unreachable", TARGET)]),
        Case("no kvwatch target at all (the monitor selects nothing) -> KvwatchDown kvwatch_absent",
             [Engine(up=None, kvwatch_up=None, info=None, usage=None, running=None, waiting=None,
                     preemptions=None, prompt_tokens=None)], "10m",
             [("KvwatchDown", "kvwatch_absent", {"job": "kvwatch"})]),
        Case("one namespace's kvwatch targets vanished while another's remain -> KvwatchDown kvwatch_absent there",
             [Engine(up="1x30", kvwatch_up="1x30", info="1x30", usage=None, running=None, waiting=None,
                     preemptions=None, prompt_tokens=None),
              Engine(labels=dict(OTHER_NAMESPACE))], "50m",
             [("KvwatchDown", "kvwatch_absent", {"namespace": "llm", "job": "kvwatch"})]),
        Case("engine not polled -> KvwatchEngineUnreachable",
             [Engine(kvwatch_up=const(0), info=None, usage=None, running=None, waiting=None,
                     preemptions=None, prompt_tokens=None)], "10m",
             [("KvwatchEngineUnreachable", "engine_unreachable", TARGET)]),
        Case("engine answers without statistics (--disable-log-stats) -> VllmEngineStatsDisabled, not unreachable",
             [Engine(kvwatch_up=const(0), stats_disabled=const(1), info=None, usage=None, running=None,
                     waiting=None, preemptions=None, prompt_tokens=None)], "10m",
             [("VllmEngineStatsDisabled", "stats_disabled", TARGET)]),
        # --- starting is not down: an engine loading its weights has not answered since kvwatch started --
        *[Case(f"an engine that takes 15 minutes to start pages nothing (at {at})",
               [Engine(kvwatch_up="0x15 1x104", starting="1x15 0x104", **silent)], at, [])
          for at in ("10m", "15m", "22m")],
        Case("an engine that answered once, then stopped -> KvwatchEngineUnreachable",
             [Engine(kvwatch_up="1x20 0x99", starting=const(0), **silent)], "30m",
             [("KvwatchEngineUnreachable", "engine_unreachable", TARGET)]),
        Case("an engine silent past the load grace -> KvwatchEngineUnreachable",
             [Engine(kvwatch_up=const(0), starting="1x30 0x89", **silent)], "40m",
             [("KvwatchEngineUnreachable", "engine_unreachable", TARGET)]),
        Case("a down blip shorter than for: (5m) -> nothing",
             [Engine(up="1x5 0x3 1x112")], "10m", []),
        # --- stuck: routed by kvwatch's own finding (diagnose/stuck.py already waited stuck_seconds) --
        Case("requests held, no token counted -> VllmEngineStuck requests_stalled, critical",
             [Engine(running=const(6), waiting=const(3), prompt_tokens=const(50000),
                     findings=(("requests_stalled", "_x20 1x100"),))], "30m",
             [("VllmEngineStuck", "requests_stalled", ENGINE)]),
        Case("KV held with nothing running -> VllmEngineStuck kv_held_idle, warning",
             [Engine(usage=const(0.3), running=const(0), waiting=const(0), prompt_tokens=const(50000),
                     findings=(("kv_held_idle", "_x20 1x100"),))], "30m",
             [("VllmEngineStuck", "kv_held_idle", ENGINE)]),
        Case("a stuck finding for one evaluation, shorter than for: (2m) -> nothing",
             [Engine(findings=(("requests_stalled", "_x20 1 stale"),))], "22m", []),
        Case("a finding of another symptom -> not VllmEngineStuck",
             [Engine(findings=(("engine_restarted", const(1)),))], "30m", []),
        # --- routing: routed by kvwatch's own finding (kvwatch/routing/ judged the window already) --
        Case("the router predicted what the engines did not deliver -> VllmRouterPrefixRouting routing_miss",
             [Engine(findings=(("routing_miss", "_x20 1x100"),))], "40m",
             [("VllmRouterPrefixRouting", "routing_miss", ENGINE)]),
        Case("the router decides on stale metrics -> VllmRouterPrefixRouting stale_router_metrics",
             [Engine(findings=(("stale_router_metrics", "_x20 1x100"),))], "40m",
             [("VllmRouterPrefixRouting", "stale_router_metrics", ENGINE)]),
        Case("a routing finding for five minutes, shorter than for: (10m) -> nothing",
             [Engine(findings=(("routing_miss", "_x20 1x5 stale"),))], "26m", []),
    ]


UPSTREAM_CONFIG = {
    "upstream_histogram": "app_retrieval_seconds",
    "upstream_selector": 'job="rag-app"',
    "upstream_join_labels": ["namespace"],
}


def _retrieval(mean: float, namespace: str = "llm", per_minute: int = 60) -> list[dict]:
    labels = {"job": "rag-app", "namespace": namespace, "instance": "10.0.1.1:8080"}
    return [{"series": _selector("app_retrieval_seconds_sum", labels), "values": rate(mean * per_minute)},
            {"series": _selector("app_retrieval_seconds_count", labels), "values": rate(per_minute)}]


def upstream_cases() -> list[Case]:
    """Against a config with an upstream histogram joined on namespace."""
    return [
        Case("upstream: retrieval is most of the first token -> upstream",
             [Engine(**latency(0.3, 0.1, 0.1))], "40m",
             [("VllmTimeToFirstTokenSlow", "upstream", ENGINE)], _retrieval(2.0)),
        Case("upstream: fast retrieval, engine queue dominates -> queueing, not upstream",
             [Engine(usage=const(0.5), running=const(12), waiting=const(10), **latency(3.0, 2.5, 0.3))], "40m",
             [("VllmTimeToFirstTokenSlow", "queueing_compute_bound", ENGINE)], _retrieval(0.2)),
        Case("upstream: an engine without an upstream in its namespace is judged on its own",
             [Engine(labels=dict(OTHER_NAMESPACE), **latency(3.0, 0.2, 2.5))], "40m",
             [("VllmTimeToFirstTokenSlow", "prefill", OTHER_NAMESPACE)], _retrieval(2.0)),
        Case("upstream: fast engine and fast retrieval -> nothing",
             [Engine(**latency(0.3, 0.1, 0.1))], "40m", [], _retrieval(0.2)),
    ]


NO_REUSE_CONFIG = {"no_reuse_alert": True}


def no_reuse_cases() -> list[Case]:
    """Against a config that turns the no_reuse alert on."""
    busy = dict(usage=const(0.98), preemptions=rate(6), running=const(8), waiting=const(12))
    return [
        Case("no_reuse: low and stable on a warm engine with room -> no_reuse",
             [Engine(**hits(0.05))], "50m", [("VllmPrefixCacheHitRateLow", "no_reuse", ENGINE)]),
        Case("no_reuse: low all along on a crowded cache that is not exhausted -> no_reuse",
             [Engine(**hits(0.05), usage=const(0.88), running=const(8))], "50m",
             [("VllmPrefixCacheHitRateLow", "no_reuse", ENGINE)]),
        Case("no_reuse: never while the cache is exhausted (the documented burst) -> exhaustion only",
             [Engine(**busy, **hits(0.0))], "50m", [("VllmKvCacheExhausted", "concurrency_beyond_capacity", ENGINE, PREEMPTING)]),
        Case("no_reuse: not after a healthy baseline -> prefix_changed",
             [Engine(prefix_queries=rate(20000), prefix_hits="0+16000x60 960000+1000x60")], "82m",
             [("VllmPrefixCacheHitRateLow", "prefix_changed", ENGINE)]),
        Case("no_reuse: too few queried tokens to judge -> nothing",
             [Engine(**hits(0.05, queried_per_minute=100))], "50m", []),
    ]


def replica(number: int, **fields) -> Engine:
    """Replica `number` of model m (its own kvwatch instance, engine 0)."""
    return Engine(labels={**ENGINE, "instance": f"10.0.0.{number}:9400"}, **fields)


def fleet_cases() -> list[Case]:
    """Four replicas of one model, against the default config (fleet alert
    for: 10m, rate window 5m, cold window 30m)."""
    busy = dict(usage=const(0.98), preemptions=rate(6), running=const(8), waiting=const(12))
    idle = dict(usage=const(0.2), running=const(1), waiting=const(0))
    one, four = replica(1).labels, replica(4).labels
    return [
        Case("fleet: one replica exhausted while three have room -> imbalance (and its exhaustion)",
             [replica(1, **busy)] + [replica(n, **idle) for n in (2, 3, 4)], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", one, PREEMPTING),
              ("VllmFleetReplicaOutlier", "imbalance", one)]),
        Case("fleet: every replica exhausted -> exhaustion on each, no imbalance (a capacity problem)",
             [replica(n, **busy) for n in (1, 2, 3, 4)], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", replica(n).labels, PREEMPTING)
              for n in (1, 2, 3, 4)]),
        Case("fleet: one replica exhausted beside peers that are busy too (over the room ratio) -> no imbalance",
             [replica(1, **busy)] + [replica(n, usage=const(0.7), running=const(6)) for n in (2, 3, 4)], "40m",
             [("VllmKvCacheExhausted", "concurrency_beyond_capacity", one, PREEMPTING)]),
        Case("fleet: one replica's hit ratio far below its peers' -> lost_prefix_affinity",
             [replica(n, **hits(0.6)) for n in (1, 2, 3)] + [replica(4, **hits(0.1))], "40m",
             [("VllmFleetReplicaOutlier", "lost_prefix_affinity", four)]),
        Case("fleet: hit ratios spread but within the fraction -> nothing",
             [replica(n, **hits(0.6)) for n in (1, 2)] + [replica(n, **hits(0.4)) for n in (3, 4)], "40m", []),
        Case("fleet: every replica reuses little (no pool to compare with) -> nothing",
             [replica(n, **hits(0.05)) for n in (1, 2, 3, 4)], "40m", []),
        Case("fleet: one replica restarted while its peers are warm (its ratio a quarter, under half the peers') -> "
             "cold_replica, not lost affinity",
             [replica(n, **hits(0.6)) for n in (1, 2, 3)]
             + [replica(4, prompt_tokens="0+30000x60 0+30000x60", prefix_queries="0+20000x60 0+20000x60",
                        prefix_hits="0+5000x60 0+5000x60")], "75m",
             [("VllmFleetReplicaOutlier", "cold_replica", four)]),
        Case("fleet: the whole model restarted (a rollout) -> no cold replica",
             [replica(n, prompt_tokens="0+30000x60 0+30000x60", **hits(0.6)) for n in (1, 2, 3, 4)], "75m", []),
        Case("fleet: balanced and healthy -> nothing",
             [replica(n, **hits(0.6)) for n in (1, 2, 3, 4)], "40m", []),
    ]


# --- the exhaustion ETA recording rules ---------------------------------------

ETA = "kvwatch_kv_cache_exhaustion_eta_seconds"
ETA_RECORDS = {"engine": f"instance_model_name_engine:{ETA}:deriv5m", "model": f"model_name:{ETA}:deriv5m"}


def stream(connections: str = const(1), messages: str = rate(60), silent: str = const(0),
           missed: str = const(0), dropped: str = const(0), recovered: str = const(0)) -> list[dict]:
    """kvwatch's KV-cache event stream series (one stream per kvwatch target)."""
    values = {"kvwatch_kv_events_connections_total": connections, "kvwatch_kv_events_messages_total": messages,
              "kvwatch_kv_events_silent_blocks": silent, "kvwatch_kv_events_missed_messages_total": missed,
              "kvwatch_kv_events_dropped_messages_total": dropped,
              "kvwatch_kv_events_recovered_messages_total": recovered}
    return [{"series": _selector(name, TARGET), "values": v} for name, v in values.items()]


def stream_cases() -> list[Case]:
    """The stream's health (KvwatchKvEventStreamUnhealthy, for 10m): never
    connected, stopped while the engine stores blocks, messages lost; and
    an idle or quiet engine's stream, a late start, a single gap: nothing."""
    never = dict(connections=const(0), messages=const(0))
    return [
        Case("no publisher ever connected and no message -> events_never_connected",
             [Engine()], "20m", [("KvwatchKvEventStreamUnhealthy", "events_never_connected", TARGET)],
             extra_series=stream(**never)),
        Case("never connected while the engine is still starting -> nothing",
             [Engine(starting=const(1))], "20m", [], extra_series=stream(**never)),
        Case("a publisher connected to an idle engine, no message -> nothing",
             [Engine(prompt_tokens=const(0))], "20m", [], extra_series=stream(messages=const(0))),
        Case("the publisher connects after 5 minutes -> nothing",
             [Engine()], "20m", [], extra_series=stream(connections=f"0x5 1x{MINUTES - 6}", messages=const(0))),
        Case("blocks stored by the page while the stream is quiet -> events_stopped",
             [Engine()], "30m", [("KvwatchKvEventStreamUnhealthy", "events_stopped", TARGET)],
             extra_series=stream(silent=f"0x10 40x{MINUTES - 11}")),
        Case("a quiet stream while the engine stores nothing (silent blocks 0) -> nothing",
             [Engine()], "30m", [], extra_series=stream(messages=const(500))),
        Case("sequence gaps every minute -> events_missed",
             [Engine()], "30m", [("KvwatchKvEventStreamUnhealthy", "events_missed", TARGET)],
             extra_series=stream(missed=rate(3))),
        Case("drops of kvwatch's full intake -> events_missed",
             [Engine()], "30m", [("KvwatchKvEventStreamUnhealthy", "events_missed", TARGET)],
             extra_series=stream(dropped=rate(1))),
        Case("gaps every minute, each answered by the replay socket -> nothing",
             [Engine()], "30m", [], extra_series=stream(missed=rate(3), recovered=rate(3))),
        Case("one gap at minute 10 -> nothing (shorter than for:)",
             [Engine()], "30m", [], extra_series=stream(missed=f"0x10 4x{MINUTES - 11}")),
    ]


@dataclass
class EtaCase:
    """Engines "0", "1", ... of model m, each with its usage (one sample a
    minute), and the ETA each engine's recorded series holds at `minute` (None:
    no series); the model's is the soonest of them."""

    name: str
    usage: list[str]
    minute: int
    expect: list[float | None]

    def model_expect(self) -> float | None:
        values = [value for value in self.expect if value is not None]
        return min(values) if values else None


def eta_cases() -> list[EtaCase]:
    """Hand-computed against the 5m deriv() and 5m mean of the rules (the
    sidecar's signal reads the same samples the same way: test_rules_promtool
    checks every expected value against it too)."""
    return [
        # u = 0.1 + 0.01/min: at 20m u = 0.3, slope 0.01 / 60 s, ETA = 0.7 x 6000 s.
        EtaCase("rising linearly: ETA = (1 - u) / slope", ["0.1+0.01x30"], 20, [4200]),
        # engine 1: u = 0.1 + 0.02/min, at 20m 0.5, slope 0.02 / 60 s: 0.5 x 3000 s.
        EtaCase("two engines rising: each its own ETA, the model the soonest",
                ["0.1+0.01x30", "0.1+0.02x30"], 20, [4200, 1500]),
        EtaCase("full and still rising: 0 (1 - u clamped at 0)", ["0.6+0.1x4 1x10"], 6, [0]),
        EtaCase("falling usage: no series", ["0.9-0.01x30"], 20, [None]),
        EtaCase("flat usage: no series", ["0.88x30"], 20, [None]),
        # 15..20m: 0.1 0.3 0.5 0.7 0.9 0.45: the slope is still positive, but 0.45
        # is under the 5m mean 0.49: a cache that just emptied is not filling.
        EtaCase("rising trend but usage now under its 5m mean: no series", ["0.1x15 0.3 0.5 0.7 0.9 0.45"], 20, [None]),
        EtaCase("one engine rising, one falling: the model is the rising one's",
                ["0.1+0.01x30", "0.9-0.01x30"], 20, [4200, None]),
    ]


def _eta_labels(labels: dict) -> str:
    return "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def render_eta(cases: list[EtaCase], rule_file: str = "rules.yaml") -> str:
    """promql_expr_test cases of both recorded levels. Values are compared
    rounded to 0.001 (promtool compares floats exactly, deriv() is not)."""
    tests = []
    for case in cases:
        engines = [{**ENGINE, "engine": str(i)} for i in range(len(case.usage))]
        series = [{"series": _selector("kvwatch_engine_kv_cache_usage_ratio", labels), "values": values}
                  for labels, values in zip(engines, case.usage)]
        at = f"{case.minute}m"
        model = {k: ENGINE[k] for k in ("namespace", "job", "model_name")}
        model_value = case.model_expect()
        checks = [
            {"expr": f"round({ETA_RECORDS['engine']}, 0.001)", "eval_time": at,
             "exp_samples": [{"labels": _eta_labels(labels), "value": value}
                             for labels, value in zip(engines, case.expect) if value is not None]},
            {"expr": f"round({ETA_RECORDS['model']}, 0.001)", "eval_time": at,
             "exp_samples": [] if model_value is None else [{"labels": _eta_labels(model), "value": model_value}]},
        ]
        tests.append({"name": case.name, "interval": "1m", "input_series": series, "promql_expr_test": checks})
    header = ("# Generated by tests/promtool/cases.py; edit that file and run it. Loaded by\n"
              "# tests/test_rules_promtool.py, which writes rules.yaml beside it (the ETA recording rules).\n")
    return header + yaml.safe_dump({"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests},
                                   sort_keys=False, width=1 << 16)


_TERM = re.compile(r"^(?P<start>[0-9.]+)(?:(?P<sign>[+-])(?P<step>[0-9.]+))?x(?P<times>[0-9]+)$")


def expand(values: str) -> list[float]:
    """A values string of these cases (`a`, `axn`, `a+bxn`, `a-bxn`) as one
    value a step, as promtool reads it (`xn` adds n steps after the first)."""
    out: list[float] = []
    for term in values.split():
        match = _TERM.match(term)
        if match is None:
            out.append(float(term))
            continue
        step = float(match["step"] or 0) * (-1 if match["sign"] == "-" else 1)
        out.extend(float(match["start"]) + step * i for i in range(int(match["times"]) + 1))
    return out


FILES = {"alerts.test.yaml": default_cases, "upstream.test.yaml": upstream_cases,
         "no-reuse.test.yaml": no_reuse_cases, "fleet.test.yaml": fleet_cases, "kv-events.test.yaml": stream_cases}
RENDER_FILES = {"eta.test.yaml": (eta_cases, render_eta)}


def main() -> int:
    for name, build in FILES.items():
        (HERE / name).write_text(render(build()))
        print(HERE / name)
    for name, (build, render_file) in RENDER_FILES.items():
        (HERE / name).write_text(render_file(build()))
        print(HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
