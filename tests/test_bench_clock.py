"""The benchmark's simulated clock (benchmarks/clock.py) moves the monitor's
own clock, so a simulated hour of polls fills and empties the window as an
hour would: when the monitor's clock became steady (monotonic) and the
simulated one moved only time.time(), the window kept every poll and the
memory benchmark read the growth of a window that never let go."""

from __future__ import annotations

import importlib.util

from conftest import REPO

from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings

# Loaded from its file: benchmarks/ on sys.path would shadow tests/pageserver.py.
_spec = importlib.util.spec_from_file_location("bench_clock", REPO / "benchmarks" / "clock.py")
simulated = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(simulated)


def test_the_simulated_clock_moves_the_monitors_clock():
    monitor = Monitor(load_settings(overrides={"target": "http://127.0.0.1:1/metrics", "engine": "vllm"},
                                    environ={}))
    clock = simulated.SimulatedClock()
    simulated.install(clock)
    try:
        before = monitor.clock()
        clock.advance(3600.0)
        moved = monitor.clock() - before
    finally:
        simulated.uninstall()
    # An hour, and the few real milliseconds between the two reads.
    assert 3600.0 <= moved < 3601.0
