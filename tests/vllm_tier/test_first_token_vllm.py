"""Slow first token on the tier's real vLLM, cause by cause: a queue bound by
compute (more requests than --max-num-seqs, the cache far from full), a queue
bound by KV (the burst beyond the cache), prefill (long prompts one at a
time), the front end (vLLM's API server process alone stopped and continued
in a duty cycle, the engine core untouched), and time spent upstream of the
engine (a small retrieval service of the tier's own in front of vLLM,
exporting its histogram as an application would). kvwatch names that cause
and no other cause of slow first token.

The tiny model answers in milliseconds, so only upstream reaches the default
objectives (2 s p95, 1 s mean). For the engine's own parts each test sets the
objectives as a user of a slower model would meet them (the `diagnosis:`
config): the decomposition, not the objective, is what is checked.
"""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pageserver import Answer, LoopbackServer, Request
from promstack import prometheus, query, wait_until

from .harness import LoadRun, burst_load, prompt_text, prompt_words, wait_until_idle
from .kvwatch_support import generate_rules, read_kvwatch_diagnosis, running_kvwatch, tier_reporter
from .scenarios import stalled_front_end_load

pytestmark = pytest.mark.vllm

# Objectives a tiny CPU model misses only through the cause under test.
FAST_OBJECTIVES = {"ttft_p95_seconds": 0.5, "ttft_mean_seconds": 0.25}
# A front end stopped 0.3 s of every 0.4 s delayed first tokens by 0.04-0.12 s
# on average (p95 0.38-0.59 s in five runs); the engine core answers these
# short prompts within 10 ms.
FRONT_END_OBJECTIVES = {"ttft_p95_seconds": 0.1, "ttft_mean_seconds": 0.02}
TTFT_ALERT = "VllmTimeToFirstTokenSlow"
FRONT_END_WINDOW_SECONDS = 15.0
# The generated rules with the same objectives, over kvwatch's window.
FRONT_END_MIXIN = {"selector": 'job="kvwatch"', "rate_window": f"{FRONT_END_WINDOW_SECONDS:.0f}s",
                   **FRONT_END_OBJECTIVES, "for_durations": {TTFT_ALERT: "5s"}}


@pytest.fixture(scope="module")
def report(request):
    return tier_reporter(request.config)


def distinct(base_url: str, concurrency: int, prompt_tokens: int, output_tokens: int, duration: float) -> LoadRun:
    words = prompt_words()
    seed = time.monotonic_ns()

    def make_prompt(index: int) -> str:
        import random
        return prompt_text(prompt_tokens, random.Random(f"{seed}-{index}"), words)

    return LoadRun("first-token", base_url, make_prompt, output_tokens, concurrency, duration, 5000, 120.0)


def observe(kvwatch, run: LoadRun, after_s: float = 3.0, alerts: tuple[str, list] | None = None,
            enough=None) -> list[list[dict]]:
    """kvwatch's findings every 0.5 s while the load runs and `after_s` after
    it (or until `enough()` once it ended); with `alerts` (Prometheus' URL, a
    list), Prometheus' ALERTS too, as (alertname, cause, state) sets."""
    samples = []
    end = None
    while end is None or time.monotonic() < end:
        try:
            samples.append(read_kvwatch_diagnosis(kvwatch.url).get("findings", []))
        except OSError:
            pass
        if alerts is not None:
            try:
                alerts[1].append({(a["metric"]["alertname"], a["metric"].get("cause", ""), a["metric"]["alertstate"])
                                  for a in query(alerts[0], "ALERTS")})
            except Exception:
                pass  # a query that timed out under load is a gap
        if end is None and not run.running:
            end = time.monotonic() + after_s
        if end is not None and enough is not None and enough():
            break
        time.sleep(0.5)
    stats = run.wait()
    assert stats.failed == 0, stats.errors
    return samples


def fired(alerts: list[set], alertname: str) -> set[str]:
    return {cause for sample in alerts for name, cause, state in sample if name == alertname and state == "firing"}


def causes(samples, symptom="slow_first_token") -> set[str]:
    return {f["cause"] for found in samples for f in found if f["symptom"] == symptom}


def shares(samples, cause: str | None = None) -> str:
    found = [f for s in samples for f in s if f["symptom"] == "slow_first_token" and cause in (None, f["cause"])]
    if not found:
        return "no slow-first-token finding"
    e = found[-1]["evidence"]
    return (f"ttft mean {e.get('ttft_mean_seconds')} s p95 {e.get('ttft_p95_seconds')} s, queue "
            f"{e.get('queue_share')}, prefill {e.get('prefill_share')}, other {e.get('other_share')}")


def test_a_queue_for_scheduler_slots_is_compute_bound(real_vllm, report):
    # 32 short requests in flight, 8 slots: 24 wait while 8 run holding about
    # a quarter of the cache. A bigger cache would not shorten this queue.
    wait_until_idle(real_vllm.metrics_url)
    with running_kvwatch(real_vllm.metrics_url, poll_interval="1s", window="15s",
                         diagnosis={**FAST_OBJECTIVES, "max_num_seqs": 8}) as kvwatch:
        samples = observe(kvwatch, distinct(real_vllm.base_url, 32, 64, 48, 15.0))
    report(f"compute-bound queue: kvwatch said {sorted(causes(samples))}; {shares(samples)}; "
           f"exhaustion {sorted(causes(samples, 'exhaustion'))}")
    assert causes(samples) == {"queueing_compute_bound"}, shares(samples)
    assert not causes(samples, "exhaustion")


def test_a_queue_behind_a_full_cache_is_kv_bound(real_vllm, report):
    wait_until_idle(real_vllm.metrics_url)
    with running_kvwatch(real_vllm.metrics_url, poll_interval="1s", window="15s",
                         diagnosis=FAST_OBJECTIVES) as kvwatch:
        samples = observe(kvwatch, burst_load(real_vllm.base_url, duration=12.0))
    report(f"KV-bound queue: kvwatch said {sorted(causes(samples))}; {shares(samples)}")
    others = [(i, f["cause"], f["evidence"]) for i, s in enumerate(samples) for f in s
              if f["symptom"] == "slow_first_token" and f["cause"] != "queueing_kv_bound"]
    assert "queueing_kv_bound" in causes(samples), shares(samples)
    # The queue's other reading, and prefill, never. `front_end` never either
    # (one story): under the burst a request lives longer than the window, its
    # queue and prefill times are observed only when it finishes, and a
    # preempted request's re-queueing and recomputation are in neither
    # histogram, so the residual can pass its share for a poll or two (it did
    # in 1 of 4 runs); while the cache is exhausted that residual is
    # `preemption`, as a contributing factor or, for a poll, the primary.
    assert not causes(samples) & {"queueing_compute_bound", "prefill", "upstream", "front_end"}, others[:3]
    assert not [f for s in samples for f in s for c in f.get("contributing") or () if c["cause"] == "front_end"]
    # One story: at most one primary cause per symptom per engine at every poll.
    for found in samples:
        stories = [(f["model_name"], f.get("engine"), f["symptom"]) for f in found if f["symptom"] != "change"]
        assert len(stories) == len(set(stories)), found
    if "preemption" in causes(samples):
        report(f"KV-bound queue: preemption at {len(others)} samples: {others[:1]}")


def test_long_prompts_one_at_a_time_are_prefill(real_vllm, report):
    # One 1,000-token prompt at a time, one token generated: no queue; the
    # tiny model prefills in tens of milliseconds, so the objectives are
    # set below that.
    wait_until_idle(real_vllm.metrics_url)
    with running_kvwatch(real_vllm.metrics_url, poll_interval="1s", window="15s",
                         diagnosis={"ttft_p95_seconds": 0.005, "ttft_mean_seconds": 0.005}) as kvwatch:
        samples = observe(kvwatch, distinct(real_vllm.base_url, 1, 1000, 1, 12.0))
    report(f"prefill: kvwatch said {sorted(causes(samples))}; {shares(samples)}")
    assert causes(samples) == {"prefill"}, shares(samples)


def test_a_stalled_front_end_is_front_end(real_vllm, tmp_path, report):
    # vLLM V1 stamps arrival and first token in the API server process, queue
    # and prefill in the engine core's (scenarios.stalled_front_end_load).
    # Stopping the API server alone 0.3 s of every 0.4 s holds each output
    # the engine core made until the front end runs again: TTFT grows while
    # queue and prefill stay near 0.02 ms and 10 ms. The objectives are set
    # below that (FRONT_END_OBJECTIVES), as for the other engine parts: the
    # tiny model is fast. A real Prometheus scrapes kvwatch every 5 s (5 s
    # timeout) with the generated rules at the same objectives.
    rules = generate_rules(tmp_path / "rules", FRONT_END_MIXIN)
    wait_until_idle(real_vllm.metrics_url)
    alerts: list[set] = []
    with running_kvwatch(real_vllm.metrics_url, poll_interval="1s", window=f"{FRONT_END_WINDOW_SECONDS:g}s",
                         diagnosis=FRONT_END_OBJECTIVES) as kvwatch, \
            prometheus([f"127.0.0.1:{kvwatch.port}"], rule_files=[rules], interval="5s",
                       scrape_timeout="5s") as prom:
        wait_until(lambda: query(prom.url, 'kvwatch_engine_kv_cache_usage_ratio{job="kvwatch"}'), 30,
                   "Prometheus to scrape kvwatch")
        run = stalled_front_end_load(real_vllm.base_url, real_vllm.pid, duration=20.0)
        samples = observe(kvwatch, run, alerts=(prom.url, alerts),
                          after_s=FRONT_END_WINDOW_SECONDS, enough=lambda: fired(alerts, TTFT_ALERT))
    report(f"front end: {run.stats.completed} requests, {run.pauses} stops; kvwatch said "
           f"{sorted(causes(samples))}; {shares(samples)}; {TTFT_ALERT} fired with causes "
           f"{sorted(fired(alerts, TTFT_ALERT))}")
    assert causes(samples) == {"front_end"}, shares(samples)
    assert fired(alerts, TTFT_ALERT) == {"front_end"}, alerts[-3:]
    found = [f for s in samples for f in s if f["cause"] == "front_end"]
    # Queue and prefill stay small: the residual is the part, not a lag.
    assert found[-1]["evidence"]["other_share"] >= 0.4, found[-1]["evidence"]
    assert not causes(samples, "exhaustion")


# --------------------------------------------------------------- upstream


class RetrievalService(LoopbackServer):
    """A retrieval step in front of the engine, as a RAG application runs one:
    each completion request first spends `seconds` "retrieving", observed in
    its histogram `app_retrieval_seconds` (served on /metrics), then goes on
    to vLLM."""

    def __init__(self, engine_url: str, seconds: float):
        self.engine_url, self.seconds = engine_url, seconds
        self.registry = CollectorRegistry()
        self.histogram = Histogram("app_retrieval_seconds", "Time spent retrieving context.",
                                   registry=self.registry,
                                   buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0))
        super().__init__(name="retrieval")
        self.url = self.base_url

    def respond(self, request: Request) -> Answer:
        if request.method == "GET":
            return Answer(generate_latest(self.registry), headers={"Content-Type": "text/plain; version=0.0.4"})
        started = time.monotonic()
        time.sleep(self.seconds)
        self.histogram.observe(time.monotonic() - started)
        forward = urllib.request.Request(self.engine_url + request.path, data=request.body,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(forward, timeout=120) as answer:
                status, body = answer.status, answer.read()
        except Exception as error:  # reported to the load as a failed request
            status, body = 502, json.dumps({"error": repr(error)}).encode()
        return Answer(body, status, headers={"Content-Type": "application/json"})


def test_time_spent_in_retrieval_before_the_engine_is_upstream(real_vllm, report):
    # Default objectives: 1.5 s of retrieval makes the mean time to first
    # token as the caller sees it about 1.5 s, nearly all of it upstream.
    wait_until_idle(real_vllm.metrics_url)
    with RetrievalService(real_vllm.base_url, 1.5) as retrieval:
        with running_kvwatch(real_vllm.metrics_url, poll_interval="1s", window="15s",
                             upstream=(retrieval.url + "/metrics", "app_retrieval_seconds")) as kvwatch:
            samples = observe(kvwatch, distinct(retrieval.url, 6, 64, 16, 15.0))
    upstream = [f for s in samples for f in s if f["cause"] == "upstream"]
    report(f"upstream: kvwatch said {sorted(causes(samples))}; "
           f"{upstream[-1]['summary'] if upstream else 'no upstream finding'}")
    assert causes(samples) == {"upstream"}
    assert upstream[-1]["evidence"]["upstream_share"] >= 0.5
