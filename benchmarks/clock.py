"""A simulated clock for the monitor, so an hour of polls at 1 s (or a full
5-minute window) takes seconds. The monitor stamps each snapshot with its
steady clock (wall time at start-up plus `time.monotonic()` since), so both
`time.time()` and `time.monotonic()` as kvwatch.pipeline.monitor reads them
move on by one interval at each `advance`: `monotonic()` is the real one
plus every interval advanced, so a poll's own duration stays real. Every
other clock (thread CPU time, the fetch's deadlines in kvwatch.scrape) stays
real."""

from __future__ import annotations

import time as real_time

import kvwatch.pipeline.monitor


class SimulatedClock:
    def __init__(self, start: float = 1.8e9):
        self.now = start
        self.advanced = 0.0

    def time(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return real_time.monotonic() + self.advanced

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.advanced += seconds

    def __getattr__(self, name):
        return getattr(real_time, name)


def install(clock: SimulatedClock) -> None:
    """Make kvwatch.pipeline.monitor read its wall and steady clocks from `clock`."""
    kvwatch.pipeline.monitor.time = clock


def uninstall() -> None:
    kvwatch.pipeline.monitor.time = real_time
