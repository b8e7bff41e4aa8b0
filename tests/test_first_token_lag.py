"""Lag-aware first-token evidence: vLLM observes a request's
queue time and first token only once it is admitted, so while a burst's
requests wait the histograms have not seen them. The first-token finding
starts from what waits now, and never only after the incident ended."""

from __future__ import annotations

import time
import types

import pytest

import kvwatch.pipeline.monitor
from fuzz.pages import Engine, page
from fuzz.pipeline import Pipeline


@pytest.fixture
def clock(monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr(kvwatch.pipeline.monitor, "time", types.SimpleNamespace(
        time=lambda: now[0], monotonic=lambda: now[0], thread_time=time.thread_time))
    return now


def _slow_first_token(state) -> list:
    return [f for f in state.findings if f.symptom == "slow_first_token" and f.clearing_since is None]


def test_a_queue_that_admits_nobody_is_slow_first_tokens_before_any_histogram_says_so(clock):
    pipeline = Pipeline(window="5m")
    ttft = [0.0, 0.0, 0.0, 0.0, 0.0]
    done, total, decoded = 0.0, 0.0, 0.0
    for _ in range(24):  # two healthy minutes: fast first tokens
        clock[0] += 5
        done += 4
        total += 4 * 0.05
        decoded += 400
        ttft = [done] * 5
        assert not _slow_first_token(pipeline.poll(page(Engine(usage=0.3, running=4, ttft_cumulative=tuple(ttft),
                                                                ttft_sum=total, generation_tokens=decoded))))
    started = None
    for poll in range(12):  # a burst: the cache full, 20 requests waiting, no first token for a minute
        clock[0] += 5
        decoded += 400  # the running requests decode: the engine moves (one that does not is stuck.py's)
        state = pipeline.poll(page(Engine(usage=1.0, running=4, waiting=20, ttft_cumulative=tuple(ttft),
                                          ttft_sum=total, generation_tokens=decoded)))
        if started is None and _slow_first_token(state):
            started = poll * 5
    assert started is not None and started <= 45, started
    found = _slow_first_token(state)[0]
    assert found.cause == "queueing_kv_bound", found
    assert "waiting" in found.summary


def test_requests_waiting_again_after_preemption_are_no_first_token_queue(clock):
    """vLLM puts a preempted request back in the queue, its first token long
    since out (the demo's long requests): waiting that the window's
    preemptions account for is no first-token finding."""
    pipeline = Pipeline(window="5m")
    done, total, preempted = 0.0, 0.0, 0.0
    for _ in range(24):
        clock[0] += 5
        done += 4
        total += 4 * 0.05
        pipeline.poll(page(Engine(usage=0.3, running=4, ttft_cumulative=(done,) * 5, ttft_sum=total)))
    for _ in range(12):
        clock[0] += 5
        preempted += 2
        state = pipeline.poll(page(Engine(usage=1.0, running=2, waiting=min(preempted, 20), preemptions=preempted,
                                          ttft_cumulative=(done,) * 5, ttft_sum=total)))
        assert not _slow_first_token(state), state.findings
