"""The parser against the text format's grammar: every valid line of a wanted
family is read, every other one is counted as a parse error with its line
number, and nothing vanishes silently.

The inputs are written here from the formats' specifications: Prometheus'
text format 0.0.4 (tokens separated by any number of blanks and tabs, values
as Go's strconv.ParseFloat reads them, minus the hex floats and digit
underscores Prometheus rejects), the quoted UTF-8 names of Prometheus 3
(`{"name", "label"="value"} 1`, `# TYPE "name" counter`), and OpenMetrics
(`_info`, `_gcount`/`_gsum`, `# EOF`, exemplars).

Every input goes through all three of the parser's routes, which must agree:
the line parser (`_parse_lines`, which defines the behaviour), the fast path
(`parse` on a fresh selector: one regex pass, or the line parser when a
wanted line is not canonical), and the cached layout (`parse` on a selector
that has read a page with the same series and other values).
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.exposition import FamilySelector, Page

BASES = ("a", "h")
PREFIXES = ("vllm:", "vllm_", "")


def selector(*bases: str) -> FamilySelector:
    return FamilySelector(bases or BASES, PREFIXES)


def comparable(page: Page):
    """A Page as plain data; NaN compared by its text."""
    return (
        [(name, f.type, f.spelling, [(s, sorted(lbl.items()), repr(v)) for s, lbl, v in f.samples])
         for name, f in page.families.items()],
        [(e.line_number, e.reason, e.line) for e in page.errors],
        page.line_count,
    )


def other_values(text: str) -> str:
    """`text` with the value of every canonical sample line (`series value`,
    no space in the series) replaced: the same series, other numbers."""
    return re.sub(r"(?m)^([^#\s][^ \n]* )[^ \n]+$", r"\g<1>7", text)


def every_route(text: str, *bases: str) -> Page:
    """The page as the line parser reads it, after checking that the fast
    path and the cached layout read it the same."""
    by_lines = selector(*bases)._parse_lines(text)
    fast = selector(*bases).parse(text)
    warm = selector(*bases)
    warm.parse(other_values(text))
    cached = warm.parse(text)
    assert comparable(fast) == comparable(by_lines), "fast path"
    assert comparable(cached) == comparable(by_lines), "cached layout"
    return by_lines


def samples(page: Page, base: str = "a") -> list[tuple[str, dict, float]]:
    family = page.families.get(base)
    return [] if family is None else family.samples


def error_lines(page: Page) -> list[int]:
    return [e.line_number for e in page.errors]


# --- blanks and tabs ------------------------------------------------------------


def test_a_tab_or_any_run_of_blanks_and_tabs_separates_tokens():
    text = (
        "vllm:a\t1\n"
        "vllm:a \t 2\n"
        'vllm:a{x="y"}\t3\n'
        "vllm:a\t4\t1700000000000\n"
        " \tvllm:a 5 \t\n"  # leading and trailing blanks are ignored
    )
    page = every_route(text)
    assert page.errors == []
    assert [v for _, _, v in samples(page)] == [1, 2, 3, 4, 5]


def test_whitespace_between_the_name_and_the_label_block():
    text = 'vllm:a   {foo="buz"}    3\nvllm:a\t{foo="tab"}\t4\n'
    page = every_route(text)
    assert page.errors == []
    assert samples(page) == [("", {"foo": "buz"}, 3.0), ("", {"foo": "tab"}, 4.0)]


def test_whitespace_other_than_blanks_and_tabs_is_no_separator_and_is_counted():
    # Vertical tab, form feed, no-break space: whitespace to Python's
    # str.split() and float(), not to the format.
    text = "vllm:a\x0b1\n\x0cvllm:a 2\nvllm:a 3\xa0\nvllm:a 4\n"
    page = every_route(text)
    assert error_lines(page) == [1, 2, 3]
    assert [v for _, _, v in samples(page)] == [4.0]


# --- quoted names (Prometheus 3, OpenMetrics 2.0) -------------------------------


def test_quoted_metric_names_are_read():
    text = (
        '# TYPE "vllm:a" counter\n'
        '{"vllm:a_total"} 1\n'
        '{"vllm:a_total", foo="x"} 2\n'
        '{ "vllm:a_total" ,foo="y",} 3\n'
        '\t{"vllm:a_created"}\t4\n'
        '{"vllm:a.b_total"} 5\n'  # another family (a UTF-8 name kvwatch does not ask for)
        '{"other", foo="x"} 6\n'
    )
    page = every_route(text)
    assert page.errors == []
    assert page.families["a"].type == "counter"
    assert samples(page) == [("_total", {}, 1.0), ("_total", {"foo": "x"}, 2.0), ("_total", {"foo": "y"}, 3.0),
                             ("_created", {}, 4.0)]


def test_quoted_label_names_are_read():
    text = 'vllm:a{"model.name"="m",engine="0"} 1\n{"vllm:a", "é \\"q\\""="v"} 2\n'
    page = every_route(text)
    assert page.errors == []
    assert samples(page) == [("", {"model.name": "m", "engine": "0"}, 1.0), ("", {'é "q"': "v"}, 2.0)]


def test_malformed_lines_with_a_quoted_wanted_name_are_counted():
    text = (
        '{"vllm:a" foo="x"} 1\n'  # no comma after the name
        '{"vllm:a", foo="x" 2\n'  # unterminated label set
        '{"vllm:a"}\n'  # no value
        '{"vllm:a", "foo"} 3\n'  # a quoted label name without a value
        '{"vllm:a"} 1_0\n'
        '{"vllm:a"} 4\n'
    )
    page = every_route(text)
    assert error_lines(page) == [1, 2, 3, 4, 5]
    assert samples(page) == [("", {}, 4.0)]


# --- numbers ---------------------------------------------------------------------

VALID_NUMBERS = [
    ("0", 0.0), ("-0", -0.0), ("+1", 1.0), ("17", 17.0), ("1.", 1.0), (".5", 0.5), ("-1.5e3", -1500.0),
    ("1E-3", 0.001), ("2e+2", 200.0), ("00012", 12.0), ("1.7976931348623157e308", 1.7976931348623157e308),
    ("+Inf", math.inf), ("-Inf", -math.inf), ("inf", math.inf), ("INF", math.inf), ("Infinity", math.inf),
    ("-infinity", -math.inf), ("NaN", math.nan), ("nan", math.nan), ("nAn", math.nan),
]
INVALID_NUMBERS = [
    "1_2",  # digit separators: Python's float() takes them, Prometheus does not
    "1_000.5", "1e1_0",
    "+nan", "-NaN",  # a signed NaN: float() takes it, Go's ParseFloat does not
    "0x1F", "0x1p3", "0X1.8P1",  # hex: Prometheus rejects the `p` every Go hex float needs
    "\u0661\u0662",  # Arabic-Indic digits: float() reads 12
    "\uff11",  # a fullwidth digit
    "1.2.3", "1e", "e1", ".", "+", "-", "", "infin", "infinityy", "Inf1", "1,5", "1e5x", "twelve",
]


def test_numbers_follow_the_format_grammar():
    valid = "".join(f'vllm:a{{n="{i}"}} {text}\n' for i, (text, _) in enumerate(VALID_NUMBERS))
    page = every_route(valid)
    assert selector()._parse_scanned(valid) is not None  # the fast path reads them all
    assert page.errors == []
    for (suffix, labels, value), (text, expected) in zip(samples(page), VALID_NUMBERS, strict=True):
        assert repr(value) == repr(expected), text
    # Each invalid number alone on its page, so that its page has the same
    # series as a valid one and may be read through the cached layout.
    for text in INVALID_NUMBERS:
        page = every_route(f'vllm:a{{n="0"}} {text}\nvllm:a{{n="1"}} 1\n')
        assert error_lines(page) == [1] and samples(page) == [("", {"n": "1"}, 1.0)], repr(text)
        # In a timestamp's place too.
        page = every_route(f'vllm:a{{n="0"}} 1 {text}\n')
        assert error_lines(page) == ([1] if text else []), repr(text)


def test_timestamps_are_integers_or_decimals_and_exemplars_are_skipped():
    text = (
        "vllm:a 1 1700000000000\n"
        "vllm:a 2 -17\n"
        "vllm:a 3 1.7e9\n"  # OpenMetrics: seconds, as a decimal
        "vllm:a 4 NaN\n"
        "vllm:a 5 +Inf\n"
        "vllm:a 6 1_7\n"
        'vllm:a_total{x="1"} 7 # {trace_id="abc"} 0.5 1700000000.1\n'
        "vllm:a_total 8 17 # {} 1\n"
    )
    page = every_route(text)
    assert error_lines(page) == [4, 5, 6]
    assert [v for _, _, v in samples(page)] == [1.0, 2.0, 3.0, 7.0, 8.0]


# --- OpenMetrics -------------------------------------------------------------------


def test_openmetrics_info_and_gauge_histogram_series_belong_to_their_family():
    text = (
        "# TYPE vllm:a info\n"
        'vllm:a_info{version="1.2"} 1\n'
        "# TYPE vllm:h gaugehistogram\n"
        'vllm:h_bucket{le="1"} 2\n'
        'vllm:h_bucket{le="+Inf"} 3\n'
        "vllm:h_gcount 3\n"
        "vllm:h_gsum 4.5\n"
        "# EOF\n"
    )
    page = every_route(text)
    assert selector()._parse_scanned(text) is not None
    assert page.errors == []
    assert page.families["a"].type == "info"
    assert samples(page) == [("_info", {"version": "1.2"}, 1.0)]
    assert page.families["h"].type == "gaugehistogram"
    assert [(s, v) for s, _, v in samples(page, "h")] == [("_bucket", 2.0), ("_bucket", 3.0), ("_gcount", 3.0),
                                                          ("_gsum", 4.5)]


def test_an_exact_family_name_wins_whatever_order_the_families_are_asked_in():
    text = "vllm:c_total 1\nvllm:c_info 2\nvllm:c 3\n"
    for bases in (("c", "c_total", "c_info"), ("c_total", "c_info", "c")):
        page = every_route(text, *bases)
        assert [(name, [(s, v) for s, _, v in f.samples]) for name, f in sorted(page.families.items())] == [
            ("c", [("", 3.0)]), ("c_info", [("", 2.0)]), ("c_total", [("", 1.0)])], bases


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_lines_after_eof_are_not_read_and_are_counted(newline):
    ending = ["# TYPE vllm:a gauge", 'vllm:a{x="1"} 1', "vllm:a 2 17", "# EOF"]
    text = newline.join(ending) + newline
    page = every_route(text)
    assert selector()._parse_scanned(text) is not None  # `# EOF` last: the fast path reads the page
    assert page.errors == [] and page.families["a"].type == "gauge"
    assert [v for _, _, v in samples(page)] == [1.0, 2.0]

    text = newline.join(ending + [
        "# TYPE vllm:a counter",  # not read: the family stays a gauge
        "vllm:a 3",
        "other_family 4",  # not asked for: skipped as anywhere else
        "vllm:a{x=",
    ]) + newline
    page = every_route(text)
    assert page.families["a"].type == "gauge"
    assert [v for _, _, v in samples(page)] == [1.0, 2.0]
    assert [(e.line_number, e.reason) for e in page.errors] == [(6, "after # EOF"), (8, "after # EOF")]


# --- where kvwatch is lenient (docs/reliability.md, "The text format") ---------------


def test_the_documented_leniencies_read_the_line():
    text = (
        'vllm:a{x="1"} 1\n'
        "# TYPE vllm:h gauge\n"  # a family's lines interleaved with another's
        "vllm:h 2\n"
        'vllm:a{x="2"} 3\n'
        "# TYPE vllm:a whatever\n"  # the TYPE after the samples, and not a type
        'vllm:a{x="3"}4\n'  # no blank between `}` and the value (0.0.4 allows it)
        'vllm:a{ x = "4" , } 5\n'  # blanks inside the label block
        'vllm:a{x="5",x="6"} 6\n'  # a repeated label name: the last value
        'vllm:a{x="7"} 7\n'
        'vllm:a{x="7"} 8\n'  # a duplicate series: both read
        "vllm:a 1e400\n"  # out of a double's range: Inf
        "vllm:a_info 9\n"  # an OpenMetrics suffix on a 0.0.4 page: family a's `_info` series
    )  # and no `# EOF`
    page = every_route(text)
    assert page.errors == []
    assert page.families["a"].type == "whatever"
    assert [(s, lbl.get("x"), v) for s, lbl, v in samples(page)] == [
        ("", "1", 1.0), ("", "2", 3.0), ("", "3", 4.0), ("", "4", 5.0), ("", "6", 6.0), ("", "7", 7.0),
        ("", "7", 8.0), ("", None, math.inf), ("_info", None, 9.0)]
    assert samples(page, "h") == [("", {}, 2.0)]


# --- any page of wanted families: read or counted, line by line --------------------

VALID_VALUES = st.sampled_from(VALID_NUMBERS).map(lambda pair: pair[0]) | st.floats().map(repr) | \
    st.integers(-2**70, 2**70).map(str)
BLANKS = st.text(" \t", min_size=1, max_size=3)
LABEL_NAMES = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,5}", fullmatch=True) | st.sampled_from(
    ["model.name", "é", "with space", 'q"uote', "back\\slash"])
LABEL_VALUES = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)
BREAKAGES = ("value", "timestamp", "extra token", "no value", "unterminated labels", "label without value",
             "no comma after the name")


def quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def label_name(name: str) -> str:
    return name if re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", name) else quote(name)


@st.composite
def sample_lines(draw):
    """A line of a wanted family, valid in one of the spellings the format
    allows or broken in one known way: (line, (base, suffix, labels, value)
    when it must be read, or None when it must be counted)."""
    base = draw(st.sampled_from(BASES))
    suffix = draw(st.sampled_from(["", "_total", "_bucket", "_sum", "_count", "_created", "_info", "_gcount",
                                   "_gsum"]))
    name = draw(st.sampled_from(PREFIXES)) + base + suffix
    labels = draw(st.dictionaries(LABEL_NAMES, LABEL_VALUES, max_size=3))
    pairs = [f"{label_name(k)}={quote(v)}" for k, v in labels.items()]
    quoted_name = draw(st.booleans())
    breakage = draw(st.sampled_from((None,) * 4 + BREAKAGES))
    if breakage == "no comma after the name" and not (quoted_name and pairs):
        breakage = "value"
    if breakage == "label without value":
        pairs.append(quote("orphan"))
    if quoted_name:
        comma = "" if breakage == "no comma after the name" else ","
        inside = quote(name) + (comma + ",".join(pairs) if pairs else "")
        series = "{" + inside + "}"
    elif pairs or draw(st.booleans()):
        trailing_comma = draw(st.sampled_from(["", ","])) if pairs else ""  # `{,}` is not in the grammar
        series = name + draw(st.sampled_from(["", " ", "\t "])) + "{" + ",".join(pairs) + trailing_comma + "}"
    else:
        series = name
    if breakage == "unterminated labels":
        if not series.endswith("}"):
            series = name + "{"
        else:
            series = series[:-1]
    value = draw(VALID_VALUES)
    if breakage == "value":
        value = draw(st.sampled_from([text for text in INVALID_NUMBERS if text]))  # "" is "no value"
    tail = ""
    if draw(st.booleans()):
        tail = draw(BLANKS) + str(draw(st.integers(0, 2**53)))
    if breakage == "timestamp":
        tail = draw(BLANKS) + draw(st.sampled_from(["NaN", "+Inf", "1_0", "17x", "0x10"]))
    if breakage == "extra token":
        tail += draw(BLANKS) + "1" + draw(BLANKS) + "2"
    if draw(st.integers(0, 4)) == 0:
        tail += ' # {trace_id="abc"} 0.5'  # an exemplar
    if breakage == "no value":
        value, tail = "", ""
    line = draw(st.sampled_from(["", " ", "\t"])) + series + draw(BLANKS) + value + tail + \
        draw(st.sampled_from(["", "", " ", "\t", "\r"]))
    if breakage is not None:
        return line, None
    read_labels = dict(labels)
    return line, (base, suffix, read_labels, float(value))


OTHER_LINES = st.sampled_from([
    "", "# HELP vllm:a Some help.", "# TYPE vllm:a gauge", "# TYPE vllm:h histogram", "# a comment",
    "vllm:ab 1", "other_family{a=\"b\"} 2", '{"other.family"} 3', "vllm:a_bucket_total 4", "#vllm:a 5",
])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(sample_lines(), sample_lines(), OTHER_LINES.map(lambda line: (line, "other"))),
                max_size=30),
       st.booleans())
def test_every_line_of_a_wanted_family_is_read_or_counted_with_its_line_number(drawn, with_eof):
    lines = [line for line, _ in drawn] + (["# EOF"] if with_eof else [])
    text = "\n".join(lines) + "\n"
    page = every_route(text)
    expected: dict[str, list] = {}
    counted = []
    for number, (line, outcome) in enumerate(drawn, start=1):
        if outcome == "other":
            continue
        if outcome is None:
            counted.append(number)
        else:
            base, suffix, labels, value = outcome
            expected.setdefault(base, []).append((suffix, sorted(labels.items()), repr(value)))
    assert error_lines(page) == counted
    page_lines = text.split("\n")
    for error in page.errors:
        assert page_lines[error.line_number - 1] == error.line
    assert {name: [(s, sorted(lbl.items()), repr(v)) for s, lbl, v in f.samples]
            for name, f in page.families.items() if f.samples} == expected
