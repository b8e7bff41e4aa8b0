"""A simulated wall clock for the monitor, so an hour of polls at 1 s (or a
full 5-minute window) takes seconds: the monitor stamps each snapshot with
`time.time()`, which this clock advances by one interval per poll; every
other clock (thread CPU time, monotonic deadlines of the fetch) stays real."""

from __future__ import annotations

import time as real_time

import kvwatch.pipeline.monitor


class SimulatedClock:
    def __init__(self, start: float = 1.8e9):
        self.now = start

    def time(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __getattr__(self, name):
        return getattr(real_time, name)


def install(clock: SimulatedClock) -> None:
    """Make kvwatch.pipeline.monitor read its wall clock from `clock`."""
    kvwatch.pipeline.monitor.time = clock


def uninstall() -> None:
    kvwatch.pipeline.monitor.time = real_time
