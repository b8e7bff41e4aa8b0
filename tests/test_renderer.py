"""kvwatch's /metrics renderer writes exactly what prometheus_client's
generate_latest writes, render after render, while series come and go and
label values carry what the text format must escape."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
)
from prometheus_client.registry import Collector, CollectorRegistry

from kvwatch.sidecar.collector import Renderer, make_registry

ODD_VALUES = ['plain', 'with "quotes"', "back\\slash", "new\nline", "ünïcödé ✓", "", "trailing\\"]


class Scripted(Collector):
    """Families built from `self.round`, so each render sees new values and,
    from round to round, other series."""

    def __init__(self):
        self.round = 0

    def collect(self):
        r = self.round
        gauge = GaugeMetricFamily("kv_usage", "A gauge.\nWith a newline and a \\ backslash.",
                                  labels=["model_name", "engine"])
        for index, value in enumerate(ODD_VALUES[: 3 + r % 5]):
            gauge.add_metric([value, str(index + r)], 0.1 * index + r)
        gauge.add_metric(["inf", "0"], math.inf)
        gauge.add_metric(["-inf", "0"], -math.inf)
        gauge.add_metric(["nan", "0"], math.nan)
        gauge.add_metric(["big", "0"], 12345678.0 * (r + 1))
        gauge.add_metric(["tiny", "0"], 1.5e-9)
        yield gauge
        counter = CounterMetricFamily("polls", "A counter.", labels=["reason"], created=1_700_000_000.0 + r)
        counter.add_metric(["ok"], 10 + r, created=1_700_000_000.0 + r)
        counter.add_metric(["timeout"], r, timestamp=1_700_000_100.5 + r)
        yield counter
        histogram = HistogramMetricFamily("ttft_seconds", "A histogram.", labels=["engine"])
        bounds = ("0.005", "0.1", "1.0", "+Inf") if r % 2 else ("0.1", "2.5", "+Inf")
        histogram.add_metric([str(r % 3)], [(b, float(i + r)) for i, b in enumerate(bounds)], 3.5 + r)
        yield histogram
        yield InfoMetricFamily("build", "An info family.", value={"version": f"0.{r}", "quote": '"'})
        yield GaugeMetricFamily("empty", "A family with no samples.", labels=["x"])


def test_the_renderer_writes_what_generate_latest_writes_render_after_render():
    scripted = Scripted()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(scripted)
    renderer = Renderer(registry)
    for round_ in range(12):
        scripted.round = round_
        assert renderer.render() == generate_latest(registry), f"round {round_}"


def test_the_renderer_keeps_only_the_series_of_its_latest_render():
    scripted = Scripted()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(scripted)
    renderer = Renderer(registry)
    for round_ in range(30):  # the engine label moves every round: new series each time
        scripted.round = round_
        renderer.render()
    samples = sum(len(metric.samples) for metric in registry.collect())
    assert len(renderer._prefixes) == samples


CAPTURES = ["vllm-0.32-cpu/metrics-idle.txt", "vllm-0.32-cpu/metrics-load.txt",
            "vllm-0.32-cpu/metrics-prefix-load.txt", "public/vllm-0.11.0.txt",
            "public/vllm-0.25-deepseek-specdecode.txt", "public/vllm-v0-0.5.txt"]


@pytest.mark.parametrize("capture", CAPTURES)
def test_the_renderer_matches_generate_latest_on_kvwatch_s_own_registry(fixtures_dir, capture):
    from pageserver import Answer, PageServer

    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings

    page = (fixtures_dir / capture).read_text()
    with PageServer([Answer(page if page.endswith("\n") else page + "\n")]) as server:
        monitor = Monitor(load_settings(overrides={"target": server.url}, environ={}))
        for _ in range(3):
            assert monitor.poll_once().up
        registry = make_registry(monitor)
        renderer = Renderer(registry)
        renderer.render()  # the second render reads the kept series text

        def own(text: bytes) -> list[bytes]:
            # kvwatch's own process CPU and memory move between two renders.
            return [line for line in text.splitlines() if b"process_" not in line]

        ours, reference = renderer.render(), generate_latest(registry)
    assert own(ours) == own(reference)
    assert any(line.startswith(b"kvwatch_engine_") for line in own(ours))
