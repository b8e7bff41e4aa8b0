"""The Prometheus text-format parser (0.0.4 and OpenMetrics text).

It parses only the families it is asked for. A caller names the families by
their base name (no `vllm:` prefix, no `_total`/`_bucket`/... suffix); every
spelling an engine may use on the wire (`vllm:`, `vllm_`, `ray_vllm:`, the
suffixes a counter or histogram adds) is precomputed once into one dict and
into one regular expression (a trie of the spellings) that finds the lines of
wanted families in C. A line of an unwanted family never reaches Python code,
and a wanted line in the canonical form (`name{labels} value [timestamp]`) is
split by the same expression. Any wanted line in another form (tabs, stray
spaces, exemplars, quoted names, a number outside the grammar, garbage) sends
the page to the line-by-line parser, which defines the behaviour; the fast
path only ever returns what it would.

What it handles: escaped label values (`\\\\`, `\\"`, `\\n`), NaN and +/-Inf,
optional timestamps, blanks and tabs between tokens, OpenMetrics exemplars and
`# EOF`, quoted (UTF-8) metric and label names, HELP/TYPE lines with no
samples, `_created` series, OpenMetrics `_info`/`_gcount`/`_gsum` series,
histograms whose base name ends in `_total` (`vllm:iteration_tokens_total`).

Every line of a wanted family is either a sample or a ParseError with its
line number: a malformed line is recorded and skipped (the rest of the page
still counts), and so is a line after `# EOF`. Where kvwatch is more lenient
than the format, docs/reliability.md says so and why.
"""

from __future__ import annotations

import operator
import re
from sys import getsizeof as _getsizeof
from dataclasses import dataclass, field
from typing import Iterable, Sequence

# Suffixes a sample name may carry on top of its family's base name: those of
# 0.0.4 and OpenMetrics (`_info` of an info metric, `_gcount` and `_gsum` of a
# gauge histogram). The empty suffix comes first so that an exact family name
# always wins (a histogram named `..._total` is found as itself, not as a
# counter of a shorter name).
SAMPLE_SUFFIXES = ("", "_total", "_bucket", "_sum", "_count", "_created", "_info", "_gcount", "_gsum")

# Possessive quantifiers (`*+`, `++`): the alternatives never overlap, so no
# match needs backtracking, and without them the regex engine keeps state for
# every repetition: a 1 MB label block or value cost about 120 MB to match.
# A label name is plain or, since Prometheus 3, quoted (any UTF-8).
_LABEL_PAIR = re.compile(
    r'\s*(?:([a-zA-Z_][a-zA-Z0-9_]*)|"((?:[^"\\]++|\\.)*+)")\s*=\s*"((?:[^"\\]++|\\.)*+)"\s*(,|$)')
_LABEL_BLOCK = re.compile(r'\{((?:[^"}]++|"(?:[^"\\]++|\\.)*+")*+)\}')
_ESCAPES = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}
_ESCAPE_RE = re.compile(r'\\[\\"n]')
# Whitespace up to the end of a label block. Matched in place: slicing the rest
# of the block at every label would make a hostile line with many labels cost
# quadratic time.
_ONLY_SPACE_LEFT = re.compile(r"\s*\Z")
# What _LABEL_BLOCK takes between the braces, for validating a block the fast
# path cut out by its closing `} `.
_LABEL_BLOCK_INNER = re.compile(r'(?:[^"}]++|"(?:[^"\\]++|\\.)*+")*+')

# Label blocks repeat verbatim from one poll to the next; caching their parsed
# form removes most of the per-poll work. Bounded so that an engine emitting
# unbounded label values (one per request) cannot grow it without limit: in
# entries, and in bytes (the block and its parsed dict, as sys.getsizeof
# counts them). Bounded in entries only, new 80 KB label values on pages under
# the 8 MiB cap grew it by ~15 MiB a poll, past the pod's limit in 45 polls.
# A real page of 64 engines holds about 4 MiB of distinct label blocks.
_LABEL_CACHE_MAX = 20_000
_LABEL_CACHE_MAX_BYTES = 16 * 1024 * 1024

# Characters a sample name may hold for the scanner to be built (names outside
# this alphabet would need escaping beyond what the line parser assumes).
_NAME_CHARS = re.compile(r"[A-Za-z0-9_:]+\Z")

# The numbers of the text format: Go's strconv.ParseFloat as Prometheus calls
# it, which rejects hex floats and digit underscores ("pP_"). So: decimals,
# and Inf, Infinity (signed or not) and NaN in any case. Python's float()
# alone would also take `1_2`, `+nan`, non-ASCII digits and whitespace around
# the number. [0-9], not \d: \d matches every Unicode digit.
_DECIMAL = r"[+-]?+(?:[0-9]++(?:\.[0-9]*+)?+|\.[0-9]++)(?:[eE][+-]?+[0-9]++)?+"
_NUMBER_SOURCE = rf"{_DECIMAL}|[+-]?+(?i:inf(?:inity)?+)|(?i:nan)"
_NUMBER = re.compile(_NUMBER_SOURCE)
# Timestamps are integers (0.0.4) or decimals (OpenMetrics); never NaN or Inf.
_TIMESTAMP = re.compile(_DECIMAL)
# The fast path's cheaper form of _NUMBER, for the scanner: on this alphabet
# (ASCII letters, digits, sign, dot: no `_`, no whitespace, nothing
# non-ASCII) float() accepts exactly the strings _NUMBER accepts, once a
# signed NaN (which float() takes and Go does not) is kept out; what else the
# class lets through (`1.2.3`, `abc`) float() rejects, and the page goes to
# the line parser. A character class is one step of the regex engine; the
# grammar itself, inside the scanner, cost a fifth more time per page.
_NUMBER_CHARS = r"(?![+-][nN])[-+.0-9A-Za-z]++"
# Tokens are separated by blanks and tabs; other whitespace is not a separator.
_BLANKS = re.compile(r"[ \t]+")
# A line's name: after leading whitespace, up to `{` or whitespace; or the
# quoted name that opens the label block (`{"a.b", x="y"} 1`).
_LINE_NAME = re.compile(r'\s*+(?:([^\s{]++)|\{\s*+"((?:[^"\\]++|\\.)*+)")')
# The quoted name at the start of a label block, and the comma after it.
_QUOTED_NAME_FIRST = re.compile(r'\s*+"(?:[^"\\]++|\\.)*+"\s*+(?:,|\Z)')
_QUOTED = re.compile(r'"((?:[^"\\]++|\\.)*+)"')
_EOF = "# EOF"


@dataclass(slots=True)
class Family:
    """The samples of one family: (suffix, labels, value) in page order."""

    name: str
    type: str = "untyped"
    spelling: str = ""
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)
    # Set when the samples' suffixes and label sets are those of a page layout
    # the parser keeps: two families with the same `layout` object have the
    # same suffixes and the same label dicts, in the same order (only values
    # differ), so a reader may reuse what it derived from the first.
    layout: object = field(default=None, compare=False, repr=False)


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


_SCANNERS: dict[tuple, "re.Pattern | None"] = {}


def sample_names(base_names: Iterable[str], prefixes: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Every wire spelling of the families' samples -> (family, suffix)."""
    names: dict[str, tuple[str, str]] = {}
    base_names, prefixes = tuple(base_names), tuple(prefixes)
    # Suffix by suffix, so that every exact name is in before any name with a
    # suffix, whatever the order of the base names; setdefault keeps the
    # first (most exact) interpretation.
    for suffix in SAMPLE_SUFFIXES:
        for base in base_names:
            for prefix in prefixes:
                names.setdefault(prefix + base + suffix, (base, suffix))
    return names


class FamilySelector:
    """Maps every wire spelling of the wanted families to (family, suffix)."""

    def __init__(self, base_names: Iterable[str], prefixes: Iterable[str]):
        self.base_names = tuple(base_names)
        self.prefixes = tuple(prefixes)
        self.sample_names = sample_names(self.base_names, self.prefixes)
        self._label_cache: dict[str, dict[str, str]] = {}
        self._label_cache_bytes = 0
        # How many times the label cache was emptied: a reader that keeps
        # its own tables keyed by these dicts empties them with it.
        self.cache_clears = 0
        # Built once per set of names and shared (a compiled pattern is
        # immutable): building it takes about half a second, and a history
        # diagnosis makes one adapter per replica.
        key = (self.base_names, self.prefixes)
        if key not in _SCANNERS:
            _SCANNERS[key] = _scanner(self.sample_names)
        self._scanner = _SCANNERS[key]
        self._layout: _Layout | None = None
        # The text plan of the last layout read twice in a row (_TextPlan),
        # or the layout whose plan could not be made or did not read its page.
        self._text_plan: _TextPlan | None = None
        self._unplanned: _Layout | None = None
        # Whether the last page was read by the text plan: its lines then
        # start as the previous page's did (only the values after each
        # line's last blank differ), so what a reader learnt from those
        # line starts (the spelling) still holds.
        self.planned = False

    def parse(self, text: str) -> Page:
        if self._scanner is not None:
            page = self._parse_scanned(text)
            if page is not None:
                return page
        return self._parse_lines(text)

    def _parse_scanned(self, text: str) -> Page | None:
        """The page in one regex pass that yields only the lines of wanted
        families; None when any of them is not in canonical form (the line
        parser then handles the page and records errors with line numbers).

        A page whose wanted lines carry the same names and label blocks, in
        the same order, as the previous page (every poll of an engine whose
        series did not change) only has its values read: the families are
        rebuilt from the previous page's layout."""
        plan = self._text_plan
        self.planned = False
        if plan is not None:
            page = plan.read(text)
            if page is not None:
                self.planned = True
                return page
            self._text_plan, self._unplanned = None, plan.layout
        # The leading newline lets the first line match like any other; the
        # trailing one ends a last line that has no newline of its own.
        scanner = self._scanner
        if scanner is None:
            return None
        found = scanner.findall("\n" + text + "\n")
        line_count = text.count("\n") + 1
        if not found:
            return Page({}, [], line_count)
        series, values, type_lines, others = zip(*found)
        if any(others):
            return None
        if _EOF in type_lines and type_lines.index(_EOF) != len(type_lines) - 1:
            return None  # lines after `# EOF`: the line parser counts them
        layout = self._layout
        if layout is not None and layout.series == series and layout.type_lines == type_lines:
            try:
                page = layout.page(list(map(float, layout.sample_values(values))), line_count)
            except ValueError:
                pass  # not a number (see _NUMBER_CHARS): line by line
            else:
                if layout is not self._unplanned and self._text_plan is None:
                    # The layout's second page: plan the next ones from its text.
                    self._text_plan = _TextPlan.of(text, scanner, layout)
                    if self._text_plan is None:
                        self._unplanned = layout
                return page
        families: dict[str, Family] = {}
        owners: list[str] = []
        clears = self.cache_clears
        if not self._parse_found(found, families, owners):
            return None
        # A page whose label sets did not fit the label cache (it emptied
        # while reading them) brought new ones: a layout of it would hold
        # every one of them until the next page (the parser's and the
        # adapter's, through family.layout: 89 MiB of an 8 MiB page of new
        # names each poll, beside that next page), and no page repeats it.
        self._layout = _Layout(series, type_lines, families, owners) if self.cache_clears == clears else None
        self._text_plan = self._unplanned = None
        return Page(families, [], line_count)

    def _parse_found(self, found: list[tuple[str, str, str, str]], families: dict[str, Family],
                     owners: list[str]) -> bool:
        """The scanner's matches, line by line, into `families` (and each
        sample's family into `owners`); False at the first wanted line that
        is not in canonical form."""
        sample_names = self.sample_names
        label_cache = self._label_cache
        family = None
        family_base = None
        for series, value, type_line, _other in found:
            if not series:
                self._parse_comment(type_line, families)
                continue
            brace = series.find("{")
            if brace == -1:
                name = series
                labels: dict[str, str] | None = {}
            else:
                name = series[:brace]
                block = series[brace + 1:-1]
                labels = label_cache.get(block)
                if labels is None:
                    # Only blocks _LABEL_BLOCK would have cut out of this line
                    # enter the cache, so a cached block is a valid one.
                    if _LABEL_BLOCK_INNER.fullmatch(block) is None:
                        return False
                    try:
                        labels = _parse_labels(block)
                    except ValueError:
                        return False
                    self._cache_labels(block, labels)
            try:
                number = float(value)
            except ValueError:
                return False  # not a number (see _NUMBER_CHARS): line by line
            base, suffix = sample_names[name]
            if base != family_base:
                family = families.get(base)
                if family is None:
                    family = families[base] = Family(base, spelling=_prefix_of(name, base))
                family_base = base
            family.samples.append((suffix, labels, number))  # type: ignore[union-attr,arg-type]  # set above: base is new at first
            owners.append(base)
        return True

    def _parse_lines(self, text: str) -> Page:
        families: dict[str, Family] = {}
        errors: list[ParseError] = []
        sample_names = self.sample_names
        after_eof = False
        lines = text.split("\n")
        for index, line in enumerate(lines):
            if not line:
                continue
            # CRLF pages: the CR is not read (docs/reliability.md).
            bare = line[:-1] if line[-1] == "\r" else line
            if line[0] == "#":
                if bare == _EOF:
                    after_eof = True
                elif not after_eof:
                    self._parse_comment(bare, families)
                continue
            found = _LINE_NAME.match(bare)
            if found is None:
                continue
            quoted = found.group(2)
            if quoted is None:
                name = found.group(1)
                if name is None:
                    continue
            else:
                name = _unescape(quoted)
            hit = sample_names.get(name)
            if hit is None:
                continue
            base, suffix = hit
            try:
                if after_eof:
                    raise ValueError("after # EOF")
                if bare[:found.start(1) if quoted is None else bare.index("{")].strip(" \t"):
                    raise ValueError("whitespace other than blanks and tabs before the name")
                if quoted is None:
                    rest = bare[found.end():]
                    brace = len(rest) - len(rest.lstrip(" \t"))
                    if rest[brace:brace + 1] == "{":
                        labels, rest = self._labels_at(rest, brace, False)
                    else:
                        labels = {}
                else:
                    labels, rest = self._labels_at(bare, bare.index("{"), True)
                value = _parse_value(rest)
            except ValueError as exc:
                errors.append(ParseError(index + 1, str(exc), line))
                continue
            family = families.get(base)
            if family is None:
                family = families[base] = Family(base, spelling=_prefix_of(name, base))
            family.samples.append((suffix, labels, value))
        return Page(families, errors, len(lines))

    def _labels_at(self, line: str, brace: int, quoted_name: bool) -> tuple[dict[str, str], str]:
        """The labels of the block that opens at `brace`, and the rest of
        the line after it; past the quoted metric name that opens the block
        when `quoted_name`."""
        match = _LABEL_BLOCK.match(line, brace)
        if match is None:
            raise ValueError("unterminated label set")
        block = match.group(1)
        if quoted_name:
            first = _QUOTED_NAME_FIRST.match(block)
            if first is None:
                raise ValueError("no comma after the quoted metric name")
            block = block[first.end():]
        label_cache = self._label_cache
        labels = label_cache.get(block)
        if labels is None:
            labels = _parse_labels(block)
            self._cache_labels(block, labels)
        return labels, line[match.end():]

    def _cache_labels(self, block: str, labels: dict[str, str]) -> None:
        """Keep a parsed block, within the cache's bounds: emptied first when
        it would go past either (memory saws, never climbs)."""
        size = _getsizeof(block) + _getsizeof(labels)
        for name, value in labels.items():
            size += _getsizeof(name) + _getsizeof(value)
        label_cache = self._label_cache
        if len(label_cache) >= _LABEL_CACHE_MAX or self._label_cache_bytes + size > _LABEL_CACHE_MAX_BYTES:
            label_cache.clear()
            self._label_cache_bytes = 0
            self.cache_clears += 1
        if size <= _LABEL_CACHE_MAX_BYTES:
            label_cache[block] = labels
            self._label_cache_bytes += size

    def _parse_comment(self, line: str, families: dict[str, Family]) -> None:
        # "# TYPE name type"; HELP lines and other comments carry nothing we use.
        if not line.startswith("# TYPE "):
            return
        rest = line[7:].lstrip()
        quoted = _QUOTED.match(rest)
        if quoted is not None:  # a quoted (UTF-8) name
            name = _unescape(quoted.group(1))
            words = rest[quoted.end():].split()
        else:
            words = rest.split()
            name = words.pop(0) if words else ""
        if not words:
            return
        hit = self.sample_names.get(name)
        if hit is None:
            return
        base, suffix = hit
        if suffix == "_created":
            return  # the `_created` gauge's TYPE line must not retype its counter
        family = families.get(base)
        if family is None:
            family = families[base] = Family(base, spelling=_prefix_of(name, base))
        family.type = words[0]


def _scanner(sample_names: dict[str, tuple[str, str]]) -> re.Pattern | None:
    """One pattern over the whole page (each line preceded by its newline)
    whose matches are, by group:
    1, 2: a wanted sample line in canonical form, split after its series
       (name and label block, braces included) at the first `} ` (or after
       the name and its space): the series, and the value (_NUMBER_CHARS;
       an optional timestamp after it is checked, not kept; a CR before the
       newline is allowed, as the line parser allows it);
    3: a `# TYPE` line (of any family; the comment parser picks), or `# EOF`;
    4: any other line the line parser would take as a wanted sample, by its
       rule: whitespace, the name, then `{` or whitespace; or whitespace and
       a label block that opens with the quoted name.
    Lines of other families match nothing; the regex engine skips them
    without entering Python."""
    if not sample_names or not all(_NAME_CHARS.match(name) for name in sample_names):
        return None
    names = _trie_pattern(sample_names)
    return re.compile(
        rf"\n(?:((?:{names})(?:\{{[^}}\n]*+\}})?)\x20({_NUMBER_CHARS})(?:\x20{_DECIMAL})?+(?=\r?\n)"
        r"|(\#\x20(?:TYPE\x20[^\n]*+|EOF(?=\r?\n)))"
        rf"|([^\S\n]*+(?:(?:{names})(?=[\s{{])|\{{[^\S\n]*+\"(?:{names})\")[^\n]*+))"
    )


class _Layout:
    """Where each sample of a parsed page came from, so that a page with the
    same series in the same order is rebuilt from its values alone."""

    __slots__ = ("series", "type_lines", "rows", "families")

    def __init__(self, series: tuple[str, ...], type_lines: tuple[str, ...], families: dict[str, Family],
                 owners: list[str]):
        self.series = series
        self.type_lines = type_lines
        # The matches that are samples (the others are TYPE lines), in order.
        self.rows = tuple(index for index, name in enumerate(series) if name)
        # owners[k]: the family of the k-th sample in page order. A family's
        # samples are its numbers in order, consecutive (a slice) unless its
        # lines were interleaved with another family's.
        numbers: dict[str, list[int]] = {name: [] for name in families}
        for number, owner in enumerate(owners):
            numbers[owner].append(number)
        self.families = []
        for name, family in families.items():
            at = tuple(numbers[name])
            where: slice | tuple[int, ...] = at
            if at and at[-1] - at[0] == len(at) - 1:
                where = slice(at[0], at[-1] + 1)
            entry = (name, family.type, family.spelling, tuple(s[0] for s in family.samples),
                     tuple(s[1] for s in family.samples), where)
            self.families.append(entry)
            family.layout = entry

    def sample_values(self, values: tuple[str, ...]):
        rows = self.rows
        if len(rows) == len(values):
            return values
        if not rows:
            return ()
        if len(rows) == 1:
            return (values[rows[0]],)
        return operator.itemgetter(*rows)(values)

    def page(self, numbers: list[float], line_count: int) -> Page:
        families: dict[str, Family] = {}
        for entry in self.families:
            name, type_, spelling, suffixes, labels, where = entry
            values: Sequence[float]
            if isinstance(where, slice):
                values = numbers[where]
            elif len(where) == 1:
                values = (numbers[where[0]],)
            elif where:
                values = operator.itemgetter(*where)(numbers)
            else:
                values = ()
            families[name] = Family(name, type_, spelling, list(zip(suffixes, labels, values)), entry)
        return Page(families, [], line_count)


# The values a text plan reads: _NUMBER_CHARS tokens, one blank apart.
_PLANNED_VALUES = re.compile(rf"{_NUMBER_CHARS}(?:\x20{_NUMBER_CHARS})*+")


def _picker(indices: list[int]):
    """A function of a sequence giving the tuple of its items at `indices`."""
    if len(indices) == 1:
        return lambda items: (items[indices[0]],)
    if not indices:
        return lambda items: ()
    return operator.itemgetter(*indices)


class _TextPlan:
    """A page's text as the scanner read it, so that a page that differs
    only in the values of the samples it reads is read without the scanner.
    Split after the last blank of each line that a newline ends, a page is a
    skeleton (each such line up to and with that blank, every other line
    whole) and the tokens after those blanks. A page with the same skeleton,
    the same tokens on its TYPE and EOF lines, and each value read a
    _NUMBER_CHARS token gives the scanner the same matches but for those
    values (each match is one line, decided by its text up to the blank
    after its name or label block), so the Page the layout rebuilds from its
    values; any other page is read by the scanner. Made from the layout's
    second page; a page the plan does not read drops it
    (tests/test_bench_equivalence.py).

    The skeleton is checked line by line in C (the page's lines against
    their kept starts), not by splitting the page on a regex: a regex tries
    a match at every blank, and the HELP lines hold most of a page's blanks."""

    __slots__ = ("starts", "whole_at", "whole", "token_at", "token_slices", "exact", "pick_exact", "pick_values",
                 "layout", "line_count")

    def __init__(self, starts, whole_at, whole, token_at, token_slices, exact, pick_exact, pick_values, layout,
                 line_count):
        # Each line's start in the skeleton: up to and with its last blank,
        # or the whole line (those lines' positions and texts: whole_at, whole).
        self.starts = starts
        self.whole_at = whole_at
        self.whole = whole
        # The lines with a token, and where in each the token begins.
        self.token_at = token_at
        self.token_slices = token_slices
        self.exact = exact
        self.pick_exact = pick_exact
        self.pick_values = pick_values
        self.layout = layout
        self.line_count = line_count

    @staticmethod
    def of(text: str, scanner: re.Pattern, layout: _Layout) -> "_TextPlan | None":
        lines = text.split("\n")
        last = len(lines) - 1
        starts: list[str] = []
        whole_at: list[int] = []
        token_at: list[int] = []
        token_slices: list[slice] = []
        tokens: list[str] = []
        exact_at: list[int] = []
        values_at: list[int] = []
        for index, line in enumerate(lines):
            head, blank, token = line.rpartition(" ")
            has_token = index < last and blank == " "
            if has_token:
                starts.append(head + blank)
                token_at.append(index)
                token_slices.append(slice(len(head) + 1, None))
                tokens.append(token)
            else:
                starts.append(line)
                whole_at.append(index)
            match = scanner.match("\n" + line + "\n")
            if match is not None:
                series, value, type_line, other = match.groups()
                if other:
                    return None
                if type_line:
                    if has_token:
                        exact_at.append(len(tokens) - 1)
                elif has_token and line == series + " " + value and token == value:
                    values_at.append(len(tokens) - 1)
                else:
                    return None  # a timestamp, a CR, the last line: not planned
        if len(values_at) != len(layout.rows):
            return None
        pick_exact = _picker(exact_at)
        pick_whole = _picker(whole_at)
        return _TextPlan(tuple(starts), pick_whole, pick_whole(lines), _picker(token_at), tuple(token_slices),
                         pick_exact(tokens), pick_exact, _picker(values_at), layout, len(lines))

    def read(self, text: str) -> Page | None:
        lines = text.split("\n")
        # Every line starts as its skeleton's does, the lines kept whole are
        # those lines exactly, and no token holds a blank: the same skeleton.
        if (len(lines) != self.line_count or not all(map(str.startswith, lines, self.starts))
                or self.whole_at(lines) != self.whole):
            return None
        tokens: list[str] = list(map(operator.getitem, self.token_at(lines), self.token_slices))
        if "\x20" in "\n".join(tokens) or self.pick_exact(tokens) != self.exact:
            return None
        values = self.pick_values(tokens)
        if values and _PLANNED_VALUES.fullmatch(" ".join(values)) is None:
            return None
        try:
            return self.layout.page(list(map(float, values)), self.line_count)
        except ValueError:
            return None


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex alternation of `words` shaped as a trie, so the regex engine
    tests each character once instead of each word in turn."""
    trie: dict = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}

    def render(node: dict) -> str:
        ends_here = "" in node
        branches = [re.escape(char) + render(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        if ends_here:
            return ("(?:" + body + ")?") if len(branches) == 1 else body + "?"
        return body

    return render(trie)


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
        name = match.group(1)
        if name is None:
            name = _unescape(match.group(2))
        labels[name] = _unescape(match.group(3))
        position = match.end()
        if match.group(4) == "" and position < length and not _ONLY_SPACE_LEFT.match(block, position):
            raise ValueError("missing comma between labels")
    return labels


def _unescape(text: str) -> str:
    if "\\" not in text:
        return text
    return _ESCAPE_RE.sub(lambda m: _ESCAPES[m.group(0)], text)


def _parse_value(rest: str) -> float:
    # OpenMetrics exemplars follow " # " and are not read; timestamps follow
    # the value and are checked, not kept.
    hash_at = rest.find(" # ")
    if hash_at != -1:
        rest = rest[:hash_at]
    rest = rest.strip(" \t")
    if not rest:
        raise ValueError("missing value")
    parts = _BLANKS.split(rest)
    if len(parts) > 2:
        raise ValueError("trailing garbage after value")
    if _NUMBER.fullmatch(parts[0]) is None:
        raise ValueError(f"value {parts[0][:40]!r} is not a number")
    if len(parts) == 2 and _TIMESTAMP.fullmatch(parts[1]) is None:
        raise ValueError(f"timestamp {parts[1][:40]!r} is not a number")
    return float(parts[0])
