"""A busy vLLM answers /metrics late (1.5-12 s on the tier's CPU under load,
1 s polls). A late page is still a page: kvwatch keeps it, stamps it at the
time it was answered and says how late it was, instead of dropping exactly
the polls of the load."""

from __future__ import annotations

import pytest

from kvwatch.sidecar.collector import make_registry
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from pageserver import Answer, PageServer


def page(fixtures_dir, name):
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def test_a_page_answered_later_than_the_interval_is_kept_and_stamped_when_answered(fixtures_dir):
    late = 0.9
    with PageServer([Answer(page(fixtures_dir, "idle")), Answer(page(fixtures_dir, "load"), delay=late)]) as engine:
        settings = load_settings(overrides={"target": engine.url, "poll_interval": "0.5s", "window": "30s"},
                                 environ={})
        monitor = Monitor(settings)
        assert monitor.poll_once().up
        asked = monitor.clock()
        state = monitor.poll_once()
    assert state.up, state.detail  # the deadline was 0.4 s (80 % of the interval): the burst's page was lost
    assert state.page_late_seconds >= late
    assert state.snapshot.time >= asked + late  # the engine's state when it answered, not when asked
    exported = {s.name: s.value for family in make_registry(monitor).collect() for s in family.samples}
    assert exported["kvwatch_page_late_seconds"] == pytest.approx(state.page_late_seconds)
    assert exported["kvwatch_up"] == 1


def test_the_default_deadline_outlasts_a_late_vllm_page_at_any_interval():
    for interval in ("1s", "5s", "30s"):
        settings = load_settings(overrides={"poll_interval": interval}, environ={})
        assert settings.fetch_timeout >= 12.0  # the latest page vLLM 0.32 answered under load
