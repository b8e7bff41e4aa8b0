"""The benchmark's inputs: a real vLLM capture scaled to N engines, and a
version of it whose counters advance from one poll to the next.

Scaling: each run of sample lines between two comment lines is one family's
samples; the lines carrying `engine="0"` are repeated for engines 0..N-1 in
turn (all of engine 0's lines, then engine 1's, ...), the others are kept
once. So every family keeps its HELP/TYPE lines and its samples stay
together, as with a real multi-engine vLLM, and `cache_config_info` (which
carries `engine`) is there once per engine.
"""

from __future__ import annotations

import re
from pathlib import Path

ENGINE_ZERO = 'engine="0"'
# The capture of the parse's baseline figures (53.6 KB, 440 samples): a burst
# of requests, so every family kvwatch reads is present and non-zero.
CAPTURE = "vllm-0.32-cpu/metrics-load.txt"


def capture_text(fixtures_dir: Path) -> str:
    return (fixtures_dir / CAPTURE).read_text()


def scale(text: str, engines: int) -> str:
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        for engine in range(engines):
            label = f'engine="{engine}"'
            for line in block:
                if ENGINE_ZERO in line:
                    out.append(line.replace(ENGINE_ZERO, label))
                elif engine == 0:
                    out.append(line)
        block.clear()

    for line in text.split("\n"):
        if not line or line.startswith("#"):
            flush()
            out.append(line)
        else:
            block.append(line)
    flush()
    return "\n".join(out)


def sample_count(text: str) -> int:
    return sum(1 for line in text.split("\n") if line and not line.startswith("#"))


_SAMPLE = re.compile(r"^(?P<name>[^{\s]+)(?P<labels>\{[^}]*\})? (?P<value>\S+)$")
_LE = re.compile(r',?le="[^"]*"')


class AdvancingPage:
    """The page at poll k: every vLLM counter and histogram advanced by k
    increments (gauges and `_created` unchanged), so consecutive polls have
    real increases and no reset. Histogram buckets advance by 0, 1 or 2 per
    poll (by their third of the layout), so buckets stay cumulative and each
    poll adds two observations spread over the upper buckets."""

    def __init__(self, text: str):
        self.pieces: list[str] = []  # literal text, then one slot per advancing value
        self.slots: list[tuple[float, float]] = []  # (value at poll 0, increment per poll)
        literal: list[str] = []
        lines = text.split("\n")
        increments = self._increments(lines)
        for index, line in enumerate(lines):
            increment = increments.get(index)
            if increment is None:
                literal.append(line + "\n")
                continue
            head, _, value = line.rpartition(" ")
            literal.append(head + " ")
            self.pieces.append("".join(literal))
            literal = ["\n"]
            self.slots.append((float(value), increment))
        self.tail = "".join(literal)

    @staticmethod
    def _increments(lines: list[str]) -> dict[int, float]:
        increments: dict[int, float] = {}
        series_buckets: dict[str, list[int]] = {}
        for index, line in enumerate(lines):
            match = _SAMPLE.match(line)
            if match is None or not match["name"].startswith("vllm:"):
                continue
            name = match["name"]
            if name.endswith("_bucket"):
                series = name + _LE.sub("", match["labels"] or "")
                series_buckets.setdefault(series, []).append(index)
            elif name.endswith("_count"):
                increments[index] = 2.0
            elif name.endswith("_sum"):
                increments[index] = 1.25
            elif name.endswith("_total"):
                increments[index] = 10.0
        for indices in series_buckets.values():
            for position, index in enumerate(indices):
                increments[index] = float(position * 3 // len(indices))
        return increments

    def render(self, poll: int) -> str:
        parts = []
        for piece, (start, increment) in zip(self.pieces, self.slots):
            parts.append(piece)
            parts.append(repr(start + poll * increment))
        parts.append(self.tail)
        text = "".join(parts)
        return text[:-1] if text.endswith("\n\n") else text
