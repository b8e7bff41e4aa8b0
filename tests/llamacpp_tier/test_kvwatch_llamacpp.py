"""kvwatch against a real llama.cpp `llama-server --metrics`: the engine chosen
from the page, the prompt-cache hit ratio from the counter deltas, a full slot
pool, and a diagnosis that names a cause.

As in the vLLM tier, kvwatch runs as `kvwatch serve` does and every claim is
read from its HTTP surface; the reference values come from llama-server's own
pages (parsed by prometheus_client, not by kvwatch), the very pages kvwatch
polled, kept by a recording proxy. Loads are bounded by their duration and each
wait by a deadline; the figures measured are printed with a [llamacpp-tier]
prefix.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest

from kvwatch.engines import recognize
from promstack import wait_until
from vllm_tier.harness import burst_load, prompt_text, prompt_words, read_metrics, shared_prefix_load
from vllm_tier.kvwatch_support import (
    PageRecorder,
    read_kvwatch_diagnosis,
    read_kvwatch_metrics,
    running_kvwatch,
)

from .conftest import SLOTS, reporter
from .harness import _open, count_prompt_tokens, server_props, wait_until_idle

pytestmark = pytest.mark.llamacpp

PROCESSED = "llamacpp:prompt_tokens_total"
CACHED = "llamacpp:prompt_tokens_cached_total"
POLL_INTERVAL = "1s"
PREFIX_WINDOW = "8s"
PREFIX_LOAD_SECONDS = 15.0
PREFIX_TOKENS, SUFFIX_TOKENS = 256, 32
# Twice as many requests in flight as slots, each long enough (200 prompt +
# 256 generated tokens) that the pool stays full between kvwatch's polls.
BURST_CONCURRENCY = 2 * SLOTS
BURST_SECONDS = 20.0
BURST_WINDOW = "12s"


@pytest.fixture(scope="module")
def report(request):
    return reporter(request.config)


def test_the_page_is_llamacpp_and_each_prompt_word_one_token(real_llamacpp, report):
    with _open(real_llamacpp.metrics_url, timeout=10) as response:
        page = response.read().decode()
    assert recognize(page) == "llamacpp"
    metrics = read_metrics(real_llamacpp.metrics_url)
    # This build counts cached prompt tokens apart (the adapter's "recent build").
    assert CACHED in metrics and PROCESSED in metrics
    props = server_props(real_llamacpp.base_url)
    assert props["total_slots"] == SLOTS
    text = prompt_text(40, random.Random(1), prompt_words())
    assert count_prompt_tokens(real_llamacpp.base_url, text) == 40
    report(f"llama-server {props.get('build_info', '?')}: {props['total_slots']} slots, "
           f"n_ctx per slot {props.get('default_generation_settings', {}).get('n_ctx')}")


# --------------------------------------------------------------- hit ratio


@dataclass
class WindowComparison:
    kvwatch_ratio: float
    raw_ratio: float
    window_seconds: float
    cached_delta: float
    processed_delta: float
    last_poll: float


def compare_with_raw_pages(kvwatch_url: str, recorder: PageRecorder) -> WindowComparison | None:
    """kvwatch's exported hit ratio next to cached / (processed + cached) of
    the counter deltas between the two pages its window spans."""
    exported = read_kvwatch_metrics(kvwatch_url)
    if exported.value("kvwatch_up") != 1 or "kvwatch_prefix_cache_hit_ratio" not in exported:
        return None
    ratio = exported.value("kvwatch_prefix_cache_hit_ratio")
    last_poll = exported.value("kvwatch_last_success_timestamp_seconds")
    span = exported.value("kvwatch_window_seconds")
    first = recorder.page_of_poll(last_poll - span).metrics()
    last = recorder.page_of_poll(last_poll).metrics()
    # The right pages: kvwatch re-exports the last one's counters (queries = processed + cached).
    assert exported.value("kvwatch_engine_prefix_cache_hits_total") == last.value(CACHED)
    assert exported.value("kvwatch_engine_prefix_cache_queries_total") == (
        last.value(CACHED) + last.value(PROCESSED))
    cached = last.value(CACHED) - first.value(CACHED)
    processed = last.value(PROCESSED) - first.value(PROCESSED)
    return WindowComparison(ratio, cached / (cached + processed), span, cached, processed, last_poll)


def test_prompt_cache_hit_ratio_equals_the_counter_deltas_of_the_polled_pages(real_llamacpp, report):
    wait_until_idle(real_llamacpp.metrics_url)
    with PageRecorder(real_llamacpp.base_url) as recorder, \
            running_kvwatch(recorder.url, poll_interval=POLL_INTERVAL, window=PREFIX_WINDOW) as kvwatch:
        wait_until(lambda: kvwatch.monitor.state.up, 10, "kvwatch's first poll")
        assert kvwatch.monitor.state.engine == "llamacpp"
        comparisons: list[WindowComparison] = []

        def compare() -> None:
            found = compare_with_raw_pages(kvwatch.url, recorder)
            if found is not None and (not comparisons or found.last_poll != comparisons[-1].last_poll):
                comparisons.append(found)

        with shared_prefix_load(real_llamacpp.base_url, duration=PREFIX_LOAD_SECONDS,
                                concurrency=SLOTS, prefix_tokens=PREFIX_TOKENS,
                                suffix_tokens=SUFFIX_TOKENS, output_tokens=16) as run:
            while run.running:
                time.sleep(0.5)
                compare()
            stats = run.wait()
        # Settled: every counter has its final value on the next poll.
        wait_until_idle(real_llamacpp.metrics_url)
        polls = kvwatch.monitor.state.polls
        wait_until(lambda: kvwatch.monitor.state.polls >= polls + 2, 10, "two polls after the load")
        compare()

    assert stats.failed == 0, stats.errors
    assert stats.completed >= 8
    report(f"shared prefix: {stats.completed} requests in {stats.seconds:.1f} s; kvwatch's hit ratio "
           f"equal to the counter deltas in {len(comparisons)} windows: "
           + ", ".join(f"{c.kvwatch_ratio:.4f} ({c.cached_delta:.0f} cached, {c.processed_delta:.0f} "
                       f"processed over {c.window_seconds:.1f} s)" for c in comparisons))
    assert len(comparisons) >= 3
    for comparison in comparisons:
        assert comparison.kvwatch_ratio == pytest.approx(comparison.raw_ratio, rel=1e-12, abs=0)
    # The prefix is reused: most prompt tokens of a window under load come from the cache.
    assert max(c.kvwatch_ratio for c in comparisons) > 0.5


# --------------------------------------------------------------- full slot pool


@dataclass
class Sample:
    at: float
    running: float | None
    waiting: float | None
    findings: set[tuple[str, str, str]]


def _sample(kvwatch_url: str, started: float) -> Sample:
    exported = read_kvwatch_metrics(kvwatch_url)

    def gauge(name: str) -> float | None:
        return exported.value(name) if name in exported else None

    findings = {(labels["symptom"], labels["cause"], labels["severity"])
                for labels, value in exported.samples.get("kvwatch_finding", ()) if value == 1}
    return Sample(time.monotonic() - started, gauge("kvwatch_requests_running"),
                  gauge("kvwatch_requests_waiting"), findings)


def test_a_full_slot_pool_is_seen_and_the_diagnosis_names_a_cause(real_llamacpp, report):
    wait_until_idle(real_llamacpp.metrics_url)
    with PageRecorder(real_llamacpp.base_url) as recorder, \
            running_kvwatch(recorder.url, poll_interval=POLL_INTERVAL, window=BURST_WINDOW) as kvwatch:
        wait_until(lambda: kvwatch.monitor.state.up, 10, "kvwatch's first poll")
        samples: list[Sample] = []
        started = time.monotonic()
        with burst_load(real_llamacpp.base_url, concurrency=BURST_CONCURRENCY, prompt_tokens=200,
                        output_tokens=256, duration=BURST_SECONDS) as run:
            while run.running:
                time.sleep(0.5)
                samples.append(_sample(kvwatch.url, started))
            stats = run.wait()
        diagnosis = read_kvwatch_diagnosis(kvwatch.url)
        pages = [page.metrics() for page in recorder.pages if page.status == 200]

    assert stats.failed == 0, stats.errors
    full = [s for s in samples if s.running == SLOTS and (s.waiting or 0) > 0]
    raw_full = [p for p in pages if p.value("llamacpp:requests_processing") == SLOTS
                and p.value("llamacpp:requests_deferred") > 0]
    causes = sorted({f[:2] for s in samples for f in s.findings})
    report(f"burst: {stats.completed} requests of 200+256 tokens, {BURST_CONCURRENCY} in flight on "
           f"{SLOTS} slots, {stats.seconds:.1f} s; kvwatch saw the pool full (running {SLOTS}, waiting "
           f"> 0) in {len(full)} of {len(samples)} samples, the polled pages in {len(raw_full)} of "
           f"{len(pages)}; findings {causes}")
    # The pool is full on the pages kvwatch polled, and kvwatch says so.
    assert raw_full, [(p.value("llamacpp:requests_processing"), p.value("llamacpp:requests_deferred"))
                      for p in pages]
    assert full, [(s.running, s.waiting) for s in samples]
    assert max(s.waiting for s in full) <= BURST_CONCURRENCY - SLOTS
    # Distinct prompts share nothing but <s>: the diagnosis names why the hit ratio is low.
    assert ("low_hit_rate", "no_reuse") in causes, causes
    named = [f for f in diagnosis["findings"] if f["symptom"] == "low_hit_rate"]
    assert named and named[0]["cause"] == "no_reuse", diagnosis["findings"]
    assert diagnosis.get("engine", "llamacpp") == "llamacpp"
