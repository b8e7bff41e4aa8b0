"""A LoRA change as a real vLLM shows it: `vllm:lora_requests_info` keeps
one series per (running, waiting) adapter set, each valued with the time it
was last set, and vLLM sets the idle series ("", "") between a LoRA
request's steps too (recorded on vLLM 0.32: the idle series was the newest
on most pages while lora-a ran). An adapter used between two polls is on the
page as a series set since the previous one, newest or not.

The Monitor is fed the pages at simulated times (1 s polls, a 40 s window,
as the tier's restart test polls a real vLLM): a server without LoRA, a
restart into another served model with prefix caching off, an fp8 KV cache and two adapters,
used one after the other."""

from __future__ import annotations

import time
import types

import pytest

import kvwatch.pipeline.monitor
from fuzz.pages import Engine, page
from kvwatch.pipeline.monitor import Monitor
from kvwatch.scrape import FetchResult, RenderedPage
from kvwatch.sim.score import settings_for

START = 1_000_000.0


class Engine3:
    """The restarted engine's page: its counters, its cache config and its
    lora_requests_info series (adapter set -> time last set)."""

    def __init__(self) -> None:
        self.requests = 0
        self.series: dict[str, float] = {}

    def page(self, now: float) -> str:
        self.requests += 1
        text = page(Engine(model="m-b", prompt_tokens=100 * self.requests, finished_stop=self.requests),
                    process_start=START + 100, num_gpu_blocks=512)
        text = text.replace('enable_prefix_caching="True"', 'enable_prefix_caching="False"').replace(
            'cache_dtype="auto"', 'cache_dtype="fp8"')
        rows = "".join(f'vllm:lora_requests_info{{max_lora="1",running_lora_adapters="{names}",'
                       f'waiting_lora_adapters="{names}"}} {at!r}\n' for names, at in self.series.items())
        return text + "# HELP vllm:lora_requests_info Running stats on lora requests.\n" \
                      "# TYPE vllm:lora_requests_info gauge\n" + rows


@pytest.fixture
def clock(monkeypatch):
    now = [START]
    monkeypatch.setattr(kvwatch.pipeline.monitor, "time", types.SimpleNamespace(
        time=lambda: now[0], monotonic=lambda: now[0], thread_time=time.thread_time))
    return now


class Down:
    """The engine stopped: nothing listens."""

    def fetch(self) -> FetchResult:
        return FetchResult(None, reason="refused", detail="nothing listens there")


def poller(clock):
    settings = settings_for(overrides={"poll_interval": "1s", "window": "40s"},
                            sources={"target": "http://127.0.0.1:9/metrics"})
    monitor = Monitor(settings, clock=lambda: clock[0])

    def poll(text: str | None):
        clock[0] += 1.0
        monitor.fetcher = RenderedPage(lambda: text) if text is not None else Down()
        return monitor.poll_once()
    return monitor, poll


def changes(state) -> dict[str, list]:
    found: dict[str, list] = {}
    for finding in state.findings:
        if finding.symptom == "change" and not finding.clearing_since:
            found.setdefault(finding.cause, []).append(finding)
    return found


def test_an_adapter_never_newest_on_a_page_still_counts_and_the_next_one_is_a_lora_change(clock):
    monitor, poll = poller(clock)
    for n in range(1, 21):  # the first server: no LoRA
        assert poll(page(Engine(prompt_tokens=100 * n, prefix_queries=100 * n, prefix_hits=80 * n, finished_stop=n),
                         process_start=START)).up
    for _ in range(20):  # stopped and started again
        assert not poll(None).up
    engine = Engine3()
    for _ in range(10):  # the other model's own requests, no adapter
        engine.series[""] = clock[0] + 0.5
        assert poll(engine.page(clock[0])).up
    seen: list = []
    for adapter in ("lora-a", "lora-b"):
        for _ in range(4):
            # A step of the adapter's request, then an idle step after it: the idle series is the newest.
            engine.series[adapter] = clock[0] + 0.3
            engine.series[""] = clock[0] + 0.6
            state = poll(engine.page(clock[0]))
            assert state.up and state.snapshot.lora["running_lora_adapters"] == ""
            seen.append(changes(state))
    lora = [f for found in seen for f in found.get("lora_changed", ())]
    assert lora, seen[-1]
    assert all("lora-b" in f.summary and "lora-a" not in f.summary for f in lora), lora[-1].summary
    assert lora[0].model == "m-b"
    # The same restart's other changes are read from the window's pages: model, configuration, dtype.
    last = seen[-1]
    assert {"lora_changed", "model_changed", "cache_config_changed", "cache_dtype_changed"} <= set(last), set(last)
    assert "enable_prefix_caching" in last["cache_config_changed"][0].evidence["changed_keys"]
    assert last["cache_dtype_changed"][0].evidence["changed_keys"] == "cache_dtype"
    assert [e.detail for e in monitor.state.events if e.kind == "lora"] == ["new LoRA adapters: ['lora-b']"]


def test_adapters_used_before_kvwatch_started_are_no_change(clock):
    # The engine served lora-a, then lora-b, before kvwatch's first poll; then lora-a again.
    monitor, poll = poller(clock)
    engine = Engine3()
    engine.series.update({"lora-a": START - 60, "lora-b": START - 30, "": START - 10})
    for _ in range(3):
        assert poll(engine.page(clock[0])).up
    engine.series["lora-a"] = clock[0] + 0.5
    for _ in range(3):
        state = poll(engine.page(clock[0]))
        assert state.up
    assert "lora_changed" not in changes(state)
    assert [e for e in monitor.state.events if e.kind == "lora"] == []
