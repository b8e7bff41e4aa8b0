"""Recorded pages handed to a Monitor one per poll, and one value changed on
a page: shared by the tests that judge what a page says (source faults,
stuck and busy engines, cache tiers)."""

from __future__ import annotations

import re

from kvwatch.pipeline.monitor import Monitor
from kvwatch.scrape import RenderedPage
from kvwatch.settings import load_settings


class Pages(RenderedPage):
    """Hands the monitor the given pages, one per poll."""

    def __init__(self, pages):
        self.pages = list(pages)
        super().__init__(lambda: self.pages.pop(0))


def polled(pages, engine="auto", every=60.0) -> Monitor:
    """A monitor that polled each page once, `every` seconds apart on its clock."""
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "engine": engine,
                                        "poll_interval": "1s", "window": "5m"}, environ={})
    times = iter(1000.0 + every * i for i in range(100))
    monitor = Monitor(settings, fetcher=Pages(pages), clock=lambda: next(times))
    for _ in pages:
        monitor.poll_once()
    return monitor


def with_value(page: str, series: str, value: str) -> str:
    """The page with one series' value replaced (the series' name at the start of a line, once)."""
    changed, count = re.subn(rf"^({re.escape(series)}(?:\{{[^}}]*\}})?) \S+$", rf"\g<1> {value}", page, flags=re.M)
    assert count == 1, f"{series} is on the page once"
    return changed
