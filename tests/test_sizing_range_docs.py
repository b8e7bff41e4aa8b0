"""The range of the stream's sizing curve as the docs state it: its steps
are EXTRA cache, multiples of the engine's added to it
(kvwatch/kvevents/source.py CURVE_FACTORS), so a step of 8 is a cache of 9x."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from kvwatch.kvevents.source import CURVE_FACTORS

REPO = Path(__file__).resolve().parent.parent


def one_line(path: str) -> str:
    return " ".join((REPO / path).read_text().split())


def test_the_readme_and_the_stream_s_doc_state_the_curve_s_range():
    # The README said "1.25x to 8x the cache": neither end of the curve.
    low, high = Fraction(min(CURVE_FACTORS)), Fraction(max(CURVE_FACTORS))
    readme = one_line("README.md")
    assert f"larger by {low} to {high} times its size ({float(1 + low):g}x to {float(1 + high):g}x in all)" in readme
    assert f"extra cache of {low} to {high} times the engine's" in one_line("docs/kv-events.md")
