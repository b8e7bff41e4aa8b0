"""What the window counts of each (model, engine) pair it holds, in bytes:
its bound (WINDOW_MAX_BYTES) is a sum of `pair_bytes` over its entries, and
what a pair costs includes what the window's readers derive from it and
keep beside it (DERIVED_PAIR_BYTES per poll, NEW_PAIR_BYTES where the pair
is new), so the bound covers what the window keeps alive, not only its own
snapshots and steps."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from kvwatch.snapshot import EngineSnapshot, Histogram

if TYPE_CHECKING:
    from kvwatch.window.steps import EngineKey, Step

# The most one window holds, in bytes as `pair_bytes` counts them. A real
# vLLM 0.32 engine costs 22.9 KB a poll (its histograms' buckets, in
# the snapshot and in the step), so 64 engines polled every 5 s over 5
# minutes (61 polls, 85 MiB) fit with a quarter to spare; the memory limit
# (kvwatch/mixin/config.py) is derived from the worst page's peak with the
# window at this bound (benchmarks/worst_page_probe.py).
WINDOW_MAX_BYTES = 112 * 1024 * 1024

# What readers derive per (model, engine) and poll and keep beside its
# snapshot and step (diagnose.context's Poll, the page's trend points, the
# window's gauge series), the larger of two figures measured with
# tracemalloc over a full window: 0.9 KB for a pair of five families, 2.7 KB
# for a real vLLM 0.32 engine. pair_bytes then counts 5.2 KB and 22.9 KB
# where tracemalloc saw 3.3 KB and 22.7 KB.
DERIVED_PAIR_BYTES = 2816
# What a reader keeps per (model, engine) while the pair is in the window
# (the diagnosis' EnginePolls: its deques of polls, times and gauges, at
# least 760 bytes each), counted where a pair has no step (its first poll,
# or its first after a gap): a gateway that sets one model name per request
# makes one per name, 8.4 KB each, and the window held 34,000 of them at its
# bound (peak RSS 596 MiB against 384Mi, benchmarks/worst_page_probe.py).
# One reader keeps one: the window's diagnosis (the now span's rules,
# diagnose/now.py, read the tail of the same polls).
NEW_PAIR_BYTES = 4608
_FLOAT = sys.getsizeof(0.0)
_getsizeof = sys.getsizeof


def _histograms_bytes(histograms: dict[str, Histogram]) -> int:
    # Bounds are interned by the adapter (one tuple per layout, shared by
    # every poll), so only the counts are the entry's own.
    total = _getsizeof(histograms)
    for histogram in histograms.values():
        cumulative = histogram.cumulative
        if type(histogram) is Histogram and type(cumulative) is tuple:
            # A Histogram and a tuple of n counts are the same size whatever
            # their values: looked up by n (two histograms per engine and
            # poll), not measured again.
            size = _HISTOGRAM_BYTES.get(len(cumulative))
            if size is None:
                size = _getsizeof(histogram) + _getsizeof(cumulative) + _FLOAT * (len(cumulative) + 2)
                if len(_HISTOGRAM_BYTES) < 256:
                    _HISTOGRAM_BYTES[len(cumulative)] = size
            total += size
        else:
            total += _getsizeof(histogram) + _getsizeof(cumulative) + _FLOAT * (len(cumulative) + 2)
    return total


# Bucket count -> what one Histogram of that many counts holds, as
# _histograms_bytes measures it.
_HISTOGRAM_BYTES: dict[int, int] = {}


def pair_bytes(key: EngineKey, engine: EngineSnapshot, step: "Step | None") -> int:
    """What one (model, engine) of one window entry holds: its snapshot, its
    step, their dicts, tuples and numbers as sys.getsizeof counts them, the
    key and its names, and what readers derive from it (DERIVED_PAIR_BYTES)."""
    total = (DERIVED_PAIR_BYTES + _getsizeof(key) + _getsizeof(key[0]) + _getsizeof(key[1]) + _getsizeof(engine)
             + _getsizeof(engine.gauges) + _getsizeof(engine.counters)
             + _FLOAT * (len(engine.gauges) + len(engine.counters)) + _histograms_bytes(engine.histograms))
    if step is not None:
        total += (_getsizeof(step) + _getsizeof(step.counters) + _FLOAT * len(step.counters)
                  + _histograms_bytes(step.histograms))
    else:
        total += NEW_PAIR_BYTES
    return total
