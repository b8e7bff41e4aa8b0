"""The Prometheus text-format parser (0.0.4 and OpenMetrics text).

It parses only the families it is asked for. A caller names the families by
their base name (no `vllm:` prefix, no `_total`/`_bucket`/... suffix); every
spelling an engine may use on the wire (`vllm:`, `vllm_`, `ray_vllm:`, the
suffixes a counter or histogram adds) is precomputed once into one dict, so a
line of an unwanted family costs one `str.find` and one dict miss, and is never
tokenized further.

What it handles: escaped label values (`\\\\`, `\\"`, `\\n`), NaN and +/-Inf,
optional timestamps, OpenMetrics exemplars and `# EOF`, HELP/TYPE lines with no
samples, `_created` series, histograms whose base name ends in `_total`
(`vllm:iteration_tokens_total`). A malformed line of a wanted family is
recorded with its line number and skipped; the rest of the page still counts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable

# Suffixes a sample name may carry on top of its family's base name. The empty
# suffix comes first so that an exact family name always wins (a histogram named
# `..._total` is found as itself, not as a counter of a shorter name).
SAMPLE_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created")

_LABEL_PAIR = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*(,|$)')
_LABEL_BLOCK = re.compile(r'\{((?:[^"}]|"(?:[^"\\]|\\.)*")*)\}')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE_RE = re.compile(r'\\[\\"n]')
# Whitespace up to the end of a label block. Matched in place: slicing the rest
# of the block at every label would make a hostile line with many labels cost
# quadratic time.
_ONLY_SPACE_LEFT = re.compile(r"\s*\Z")

# Label blocks repeat verbatim from one poll to the next; caching their parsed
# form removes most of the per-poll work. Bounded so that an engine emitting
# unbounded label values (one per request) cannot grow it without limit.
_LABEL_CACHE_MAX = 20_000


@dataclass(slots=True)
class Family:
    """The samples of one family: (suffix, labels, value) in page order."""

    name: str
    type: str = "untyped"
    spelling: str = ""
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


@dataclass(slots=True)
class ParseError:
    line_number: int
    reason: str
    line: str

    def __str__(self) -> str:
        return f"line {self.line_number}: {self.reason}: {self.line[:120]!r}"


@dataclass(slots=True)
class Page:
    families: dict[str, Family]
    errors: list[ParseError]
    line_count: int


class FamilySelector:
    """Maps every wire spelling of the wanted families to (family, suffix)."""

    def __init__(self, base_names: Iterable[str], prefixes: Iterable[str]):
        self.base_names = tuple(base_names)
        self.prefixes = tuple(prefixes)
        self.sample_names: dict[str, tuple[str, str]] = {}
        for base in self.base_names:
            for prefix in self.prefixes:
                for suffix in SAMPLE_SUFFIXES:
                    # setdefault keeps the first (most exact) interpretation.
                    self.sample_names.setdefault(prefix + base + suffix, (base, suffix))
        self._label_cache: dict[str, dict[str, str]] = {}

    def parse(self, text: str) -> Page:
        families: dict[str, Family] = {}
        errors: list[ParseError] = []
        sample_names = self.sample_names
        label_cache = self._label_cache
        lines = text.split("\n")
        for index, line in enumerate(lines):
            if not line:
                continue
            if line[0] == "#":
                self._parse_comment(line, families)
                continue
            brace = line.find("{")
            space = line.find(" ")
            if brace != -1 and (space == -1 or brace < space):
                name = line[:brace]
            elif space != -1:
                name = line[:space]
            else:
                name = line
            hit = sample_names.get(name)
            if hit is None:
                name = name.strip()
                hit = sample_names.get(name)
                if hit is None:
                    continue
            base, suffix = hit
            try:
                if brace != -1 and (space == -1 or brace < space):
                    match = _LABEL_BLOCK.match(line, brace)
                    if match is None:
                        raise ValueError("unterminated label set")
                    block = match.group(1)
                    labels = label_cache.get(block)
                    if labels is None:
                        labels = _parse_labels(block)
                        if len(label_cache) >= _LABEL_CACHE_MAX:
                            label_cache.clear()
                        label_cache[block] = labels
                    rest = line[match.end():]
                else:
                    labels = {}
                    rest = line[len(name):]
                value = _parse_value(rest)
            except ValueError as exc:
                errors.append(ParseError(index + 1, str(exc), line))
                continue
            family = families.get(base)
            if family is None:
                family = families[base] = Family(base, spelling=_prefix_of(name, base))
            family.samples.append((suffix, labels, value))
        return Page(families, errors, len(lines))

    def _parse_comment(self, line: str, families: dict[str, Family]) -> None:
        # "# TYPE name type"; HELP lines and other comments carry nothing we use.
        if not line.startswith("# TYPE "):
            return
        parts = line.split()
        if len(parts) < 4:
            return
        hit = self.sample_names.get(parts[2])
        if hit is None:
            return
        base, suffix = hit
        if suffix == "_created":
            return  # the `_created` gauge's TYPE line must not retype its counter
        family = families.get(base)
        if family is None:
            family = families[base] = Family(base, spelling=_prefix_of(parts[2], base))
        family.type = parts[3]


def _prefix_of(sample_name: str, base: str) -> str:
    return sample_name[: sample_name.find(base)] if base in sample_name else ""


def _parse_labels(block: str) -> dict[str, str]:
    labels: dict[str, str] = {}
    position = 0
    length = len(block)
    while position < length:
        if _ONLY_SPACE_LEFT.match(block, position):
            break
        match = _LABEL_PAIR.match(block, position)
        if match is None:
            raise ValueError(f"bad label syntax at {block[position:position + 40]!r}")
        value = match.group(2)
        if "\\" in value:
            value = _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], value)
        labels[match.group(1)] = value
        position = match.end()
        if match.group(3) == "" and position < length and not _ONLY_SPACE_LEFT.match(block, position):
            raise ValueError("missing comma between labels")
    return labels


def _parse_value(rest: str) -> float:
    # OpenMetrics exemplars follow " # "; timestamps follow the value.
    hash_at = rest.find(" # ")
    if hash_at != -1:
        rest = rest[:hash_at]
    parts = rest.split()
    if not parts:
        raise ValueError("missing value")
    if len(parts) > 2:
        raise ValueError("trailing garbage after value")
    try:
        value = float(parts[0])
    except ValueError:
        raise ValueError(f"value {parts[0][:40]!r} is not a number") from None
    if len(parts) == 2:
        try:
            float(parts[1])
        except ValueError:
            raise ValueError(f"timestamp {parts[1][:40]!r} is not a number") from None
    return value
