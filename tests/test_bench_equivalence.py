"""The fast parser reads exactly what prometheus_client reads, and its
one-regex path exactly what its own line-by-line path reads.

The benchmark (benchmarks/run.py) times the parser against prometheus_client;
these tests hold the values it compares, with no timing: on every real
capture, every sample of every family kvwatch asks for has the same labels
and value in both parsers, and the regex path (taken for canonical pages)
gives the same Page as the line parser (which defines the behaviour,
malformed lines and their line numbers included)."""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.engines.vllm import VllmAdapter
from kvwatch.exposition import FamilySelector, Page


def captures(fixtures_dir):
    paths = sorted(fixtures_dir.glob("*/*.txt"))
    assert paths, f"no captures under {fixtures_dir}"
    return paths


def same_value(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def kvwatch_samples(selector: FamilySelector, text: str) -> list[tuple[str, dict, float]]:
    page = selector.parse(text)
    assert page.errors == []
    return [
        (family.spelling + family.name + suffix, labels, value)
        for family in page.families.values()
        for suffix, labels, value in family.samples
    ]


def reference_samples(selector: FamilySelector, text: str) -> list[tuple[str, dict, float]]:
    return [
        (sample.name, sample.labels, sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in selector.sample_names
    ]


def as_comparable(page: Page):
    """A Page as plain data; NaN compared by its text."""
    return (
        [(name, f.type, f.spelling, [(s, sorted(lbl.items()), repr(v)) for s, lbl, v in f.samples])
         for name, f in page.families.items()],
        [(e.line_number, e.reason, e.line) for e in page.errors],
        page.line_count,
    )


def test_every_sample_kvwatch_uses_matches_prometheus_client(fixtures_dir):
    selector = VllmAdapter().selector
    compared = 0
    for path in captures(fixtures_dir):
        text = path.read_text()
        ours = kvwatch_samples(selector, text)
        theirs = reference_samples(selector, text)
        # Same samples, in page order, with the same labels and values.
        assert [(n, lbl) for n, lbl, _ in ours] == [(n, lbl) for n, lbl, _ in theirs], path.name
        for (name, labels, a), (_, _, b) in zip(ours, theirs):
            assert same_value(a, b), f"{path.name}: {name}{labels}: {a} != {b}"
        compared += len(ours)
    assert compared > 1000  # the captures really hold the families kvwatch reads


def test_fast_path_is_taken_on_real_captures_and_agrees_with_the_line_parser(fixtures_dir):
    selector = VllmAdapter().selector
    for path in captures(fixtures_dir):
        text = path.read_text()
        fast = selector._parse_scanned(text)
        assert fast is not None, f"{path.name} fell back to the line parser"
        assert as_comparable(fast) == as_comparable(selector._parse_lines(text)), path.name


def test_adapter_reads_the_same_snapshot_twice_from_its_caches(fixtures_dir):
    """The label-set and bucket-bound caches give the second poll exactly
    what a fresh adapter computes."""
    for path in captures(fixtures_dir):
        text = path.read_text()
        warm = VllmAdapter()
        warm.adapt(text, at=1.0)
        assert warm.adapt(text, at=1.0) == VllmAdapter().adapt(text, at=1.0), path.name


ODD_PAGES = [
    # Each differs from the canonical form in one way the line parser accepts
    # or rejects in its own manner; parse() must answer what it answers.
    'vllm:g\t{engine="0"} 1\n',
    '\tvllm:g{engine="0"} 1\n',
    'vllm:g{engine="0"}  1\n',
    'vllm:g{engine="0"} 1 \n',
    'vllm:g{engine="0"}1\n',
    'vllm:g{engine="0"} 1 1700000000\n',
    'vllm:g{engine="0"} 1 17x\n',
    'vllm:g{engine="0"} 1 2 3\n',
    'vllm:g{engine="0"} 1 # {trace_id="a"} 0.5 1\n',
    'vllm:g{engine="0"} \n',
    'vllm:g{engine="0"}\n',
    'vllm:g\n',
    'vllm:g 1\n',
    'vllm:g  1\n',
    'vllm:g{a="x} y",engine="0"} 1\n',
    'vllm:g{a="x\\"} 2"} 1\n',
    'vllm:g{a="x"}} 1\n',
    'vllm:g{a="x" b="y"} 1\n',
    'vllm:g{a="x",} 1\n',
    'vllm:g{a="unterminated} 1\n',
    'vllm:g{} 1\n',
    'vllm:g{ a = "x" } 1\n',
    'vllm:g{engine="0"} 1\r\n',
    'vllm:g{engine="0"} NaN\nvllm:g{engine="1"} -Inf\n',
    'vllm:g{engine="0"} 1_0\n',
    'vllm:gg{engine="0"} 1\nvllm:g_total_x 1\n',
    ' vllm:g 1\n',
    '# TYPE vllm:g gauge\n# TYPE  vllm:g_created   counter\n#TYPE vllm:g counter\n',
    '# TYPE vllm:g\n',
    'vllm:g{engine="0"} 1',
    'vllm:g{engine="0"} 1\n\n\nvllm:g{engine="1"} 2\n',
]


@pytest.mark.parametrize("text", ODD_PAGES)
def test_odd_lines_parse_as_the_line_parser_parses_them(text):
    selector = FamilySelector(["g", "h"], ("vllm:", "vllm_"))
    page = selector.parse(text)
    assert as_comparable(page) == as_comparable(FamilySelector(["g", "h"], ("vllm:", "vllm_"))._parse_lines(text))


FRAGMENTS = st.sampled_from([
    "vllm:g", "vllm_g", "vllm:g_total", "vllm:g_bucket", "vllm:h_created", "vllm:gx", "other", "#", "# TYPE ",
    "# HELP ", "{", "}", '"', "\\", ",", "=", "a", 'le="+Inf"', 'engine="0"', " ", "  ", "\t", "\r", "\x0b",
    "1", "1.5", "NaN", "+Inf", "x", "1e3", "_", "\n", "\n",
])


@settings(max_examples=400, deadline=None)
@given(st.lists(FRAGMENTS, max_size=40), st.sampled_from(["1", "2.5", "x", "1 2", "NaN"]))
def test_any_page_parses_as_the_line_parser_parses_it(fragments, other_value):
    """Twice with one selector: the second page, the first with its `1`s
    changed, may be read through the first one's layout."""
    selector = FamilySelector(["g", "h"], ("vllm:", "vllm_"))
    for text in ("".join(fragments), "".join(other_value if f == "1" else f for f in fragments)):
        slow = FamilySelector(["g", "h"], ("vllm:", "vllm_"))._parse_lines(text)
        assert as_comparable(selector.parse(text)) == as_comparable(slow)


def test_next_poll_with_the_same_series_reads_its_values_through_the_layout(fixtures_dir):
    selector = VllmAdapter().selector
    for path in captures(fixtures_dir):
        text = path.read_text()
        selector.parse(text)
        layout = selector._layout
        # Every value doubled: same series, same order, new numbers.
        doubled = re.sub(r"^([^#\n][^\n]* )(\S+)$", lambda m: m[1] + repr(2 * float(m[2])), text, flags=re.M)
        page = selector.parse(doubled)
        assert selector._layout is layout, f"{path.name}: layout not reused"
        assert as_comparable(page) == as_comparable(selector._parse_lines(doubled)), path.name
        # A page with one series more is read line by line, and its layout kept.
        extra = text.rstrip("\n") + '\nvllm:num_requests_running{engine="9",model_name="x"} 3.0\n'
        assert as_comparable(selector.parse(extra)) == as_comparable(selector._parse_lines(extra))
        assert selector._layout is not layout


def test_a_changed_type_line_is_read_even_when_the_series_are_the_same():
    selector = FamilySelector(["g"], ("vllm:",))
    assert selector.parse("# TYPE vllm:g gauge\nvllm:g 1\n").families["g"].type == "gauge"
    assert selector.parse("# TYPE vllm:g counter\nvllm:g 2\n").families["g"].type == "counter"
    assert selector.parse("vllm:g 3\n").families["g"].type == "untyped"


def histogram_page(shape: str, scale: float) -> str:
    """A TTFT histogram in one of several shapes, values times `scale`."""
    def series(labels: str, counts=(1, 3, 4)) -> list[str]:
        bounds = ("0.5", "1.0", "+Inf")
        lines = [f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{b}"}} {c * scale}' for b, c in zip(bounds, counts)]
        return lines + [f"vllm:time_to_first_token_seconds_count{{{labels}}} {4 * scale}",
                        f"vllm:time_to_first_token_seconds_sum{{{labels}}} {2.5 * scale}"]
    engine0, engine1 = 'engine="0",model_name="m"', 'engine="1",model_name="m"'
    lines = {
        "plain": series(engine0) + series(engine1),
        "sum first": series(engine0)[3:] + series(engine0)[:3],
        "pid folded": series(engine0 + ',pid="1"') + series(engine0 + ',pid="2"'),
        "interleaved": [x for pair in zip(series(engine0), series(engine1)) for x in pair],
        "unsorted": [series(engine0)[1], series(engine0)[0]] + series(engine0)[2:],
        "duplicate le": series(engine0)[:1] + series(engine0),
        "no +Inf": series(engine0)[:2] + series(engine0)[3:],
        "bad le": series(engine0) + ['vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m",le="x"} 1'],
        "no le": series(engine0) + ['vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m"} 1'],
        "bare": series(engine0) + ['vllm:time_to_first_token_seconds{engine="0",model_name="m"} 1'],
        "created": series(engine0) + ['vllm:time_to_first_token_seconds_created{engine="0",model_name="m"} 1e9'],
        "negative zero": [line.replace(" 0.0", " -0.0") for line in series(engine0, counts=(0, 0, 0))],
    }[shape]
    return "# TYPE vllm:time_to_first_token_seconds histogram\n" + "\n".join(lines) + "\n"


@pytest.mark.parametrize("shape", ["plain", "sum first", "pid folded", "interleaved", "unsorted", "duplicate le",
                                   "no +Inf", "bad le", "no le", "bare", "created", "negative zero"])
def test_histograms_of_a_known_layout_read_as_a_fresh_adapter_reads_them(shape):
    adapter = VllmAdapter()
    for scale in (1.0, 2.0, 3.0):
        text = histogram_page(shape, scale)
        warm = adapter.adapt(text, at=1.0)
        fresh = VllmAdapter().adapt(text, at=1.0)
        assert warm == fresh
        assert [repr(h) for e in warm.engines.values() for h in e.histograms.values()] == \
               [repr(h) for e in fresh.engines.values() for h in e.histograms.values()]


def _mutations(text: str):
    """(what, page) pairs: the capture with its values changed in every
    way the text plan reads or must refuse, and with one line changed in
    every way that decides how the scanner takes it."""
    import random

    from test_vllm_page_plan import with_values

    lines = text.split("\n")
    wanted = [i for i, line in enumerate(lines) if line.startswith("vllm:") and " " in line]
    other = [i for i, line in enumerate(lines) if line and not line.startswith(("vllm:", "#")) and " " in line]
    types = [i for i, line in enumerate(lines) if line.startswith("# TYPE vllm:")]
    helps = [i for i, line in enumerate(lines) if line.startswith("# HELP ")]
    draw = random.Random(len(text))

    def one(index: int, line: str) -> str:
        changed = list(lines)
        changed[index] = line
        return "\n".join(changed)

    yield "values grow", with_values(text, lambda n, v: repr(v * 2 + n % 5))
    yield "values fall, NaN", with_values(text, lambda n, v: "NaN" if n % 7 == 3 else repr(v / 3))
    for token in ("Inf", "+Inf", "-Inf", "nan", "1e3", "1E-3", ".5", "5.", "-0.0", "0x10", "1_0", "--1", "+nan",
                  "infinity", "1e", ""):
        yield f"a value {token!r}", with_values(text, lambda n, v, t=token: t if n % 11 == 2 else repr(v + 1))
    if wanted:
        at = draw.choice(wanted)
        yield "a timestamp", one(at, lines[at] + " 1700000000000")
        yield "a CR", one(at, lines[at] + "\r")
        yield "a tab before the value", one(at, lines[at].replace(" ", "\t", 1))
        yield "a label changed", one(at, lines[at].replace('="', '="x', 1))
        yield "a line gone", "\n".join(lines[:at] + lines[at + 1:])
        yield "a line twice", "\n".join(lines[:at + 1] + lines[at:])
        yield "no value", one(at, lines[at].rpartition(" ")[0])
    if other:
        yield "another family's value", one(other[0], other[0] and lines[other[0]].rpartition(" ")[0] + " 987654")
        yield "another family's line becomes ours", one(other[0], "vllm:num_requests_running" + lines[other[0]][
            lines[other[0]].find("{"):] if "{" in lines[other[0]] else "vllm:num_requests_running 3")
    empty = [i for i, line in enumerate(lines) if not line]
    if empty:
        # A line without a blank is taken by its whole text: here a wanted
        # name with no value (a malformed line the line parser reports).
        yield "a name alone on an empty line", one(empty[0], "vllm:num_requests_running")
    if types:
        yield "a TYPE changed", one(types[0], lines[types[0]].rsplit(" ", 1)[0] + " untyped")
    if helps:
        yield "a HELP changed", one(helps[0], lines[helps[0]] + " more")


def test_the_text_plan_reads_what_the_scanner_reads(fixtures_dir):
    """A page whose text differs from the one before only in its values is
    read by the selector's text plan (exposition._TextPlan) without the
    scanner; every page, planned or not, gives what a fresh selector (no
    layout, no plan) gives: on every capture, with values changed in every
    way and lines changed in every way the plan must refuse."""
    from kvwatch.exposition import _TextPlan

    planned_reads = 0
    original = _TextPlan.read

    def counted(plan, text):
        nonlocal planned_reads
        page = original(plan, text)
        planned_reads += page is not None
        return page

    _TextPlan.read = counted
    try:
        for path in captures(fixtures_dir):
            text = path.read_text()
            for what, page in _mutations(text):
                selector = VllmAdapter().selector
                selector.parse(text)
                selector.parse(text)  # its second sight: the plan is made
                expected = as_comparable(VllmAdapter().selector.parse(page))
                assert as_comparable(selector.parse(page)) == expected, f"{path.name}: {what}"
                # And the page after it, back to the capture's layout.
                assert as_comparable(selector.parse(text)) == as_comparable(VllmAdapter().selector.parse(text))
    finally:
        _TextPlan.read = original
    assert planned_reads > 100


def test_a_warm_adapter_says_the_spelling_a_fresh_one_reads_from_the_text(fixtures_dir):
    """The adapter keeps the last page's spelling while the text plan reads
    the pages (their lines start as the last one's did) and reads it again
    from the text otherwise: on every capture and every mutation, planned
    or not, and on the capture respelled (vllm: -> vllm_ on its sample lines,
    as OpenMetrics' escaping writes them), a warm adapter's spelling is what
    the page's text says."""
    planned = 0
    for path in captures(fixtures_dir):
        text = path.read_text()
        respelled = "\n".join(line.replace("vllm:", "vllm_", 1) if line.startswith("vllm:") else line
                              for line in text.split("\n"))
        pages = [page for _, page in _mutations(text)] + [respelled, text]
        for page in pages:
            warm = VllmAdapter()
            warm.adapt(text, at=1.0)
            warm.adapt(text, at=2.0)  # the plan is made
            snapshot = warm.adapt(page, at=3.0)
            planned += warm.selector.planned
            assert snapshot.spelling == VllmAdapter.spelling_of(page), path.name
        if "\nvllm:" in text:
            warm = VllmAdapter()
            spellings = [warm.adapt(page, at=float(i)).spelling for i, page in enumerate((text, text, respelled))]
            assert spellings[1] == "vllm:" and spellings[2] == "vllm_", (path.name, spellings)
    assert planned > 20  # the kept spelling was exercised


@settings(max_examples=600, deadline=None)
@given(st.lists(FRAGMENTS, max_size=40), st.lists(st.tuples(st.integers(0, 39), FRAGMENTS), max_size=3),
       st.sampled_from(["1", "2.5", "x", "1 2", "NaN", "", " "]))
def test_a_page_after_a_planned_one_parses_as_the_line_parser_parses_it(fragments, changes, other_value):
    """The text plan is made at a layout's second sight and reads the
    third page: whatever that page changed (its values, or any fragment),
    it reads what the line parser reads, or leaves the page to the scanner."""
    selector = FamilySelector(["g", "h"], ("vllm:", "vllm_"))
    base = "".join(fragments)
    changed = ["".join(other_value if f == "1" else f for f in fragments), base]
    edited = list(fragments)
    for at, fragment in changes:
        if at < len(edited):
            edited[at] = fragment
    changed.append("".join(edited))
    for text in (base, base, *changed):
        slow = FamilySelector(["g", "h"], ("vllm:", "vllm_"))._parse_lines(text)
        assert as_comparable(selector.parse(text)) == as_comparable(slow)


@pytest.mark.parametrize("before, after", [
    # A line that was a blank and a token becomes a line without a blank.
    ('vllm:g 1\n 5\nvllm:h 2\n', 'vllm:g 2\nvllm:g\nvllm:h 3\n'),
    # A line without a blank changes (into a wanted name without a value).
    ('vllm:g 1\nabc\nvllm:h 2\n', 'vllm:g 2\nvllm:h\nvllm:h 3\n'),
    # The last line (no newline after it) becomes a wanted one.
    ('vllm:g 1\nother 2', 'vllm:g 2\nvllm:h 3'),
    # A TYPE line's last token changes.
    ('# TYPE vllm:g gauge\nvllm:g 1\n', '# TYPE vllm:g counter\nvllm:g 1\n'),
    # A line keeps its start but gains a blank after it: a timestamp after
    # a value, a word after a TYPE, a longer line kept whole.
    ('vllm:g 1\nvllm:h 2\n', 'vllm:g 1 5\nvllm:h 3\n'),
    ('# TYPE vllm:g gauge\nvllm:g 1\n', '# TYPE vllm:g gauge x\nvllm:g 1\n'),
    ('vllm:g 1\nabc\nvllm:h 2\n', 'vllm:g 2\nabcd\nvllm:h 3\n'),
])
def test_the_text_plan_refuses_a_page_whose_lines_changed(before, after):
    selector = FamilySelector(["g", "h"], ("vllm:", "vllm_"))
    selector.parse(before)
    selector.parse(before)  # the plan is made
    assert selector._text_plan is not None
    expected = as_comparable(FamilySelector(["g", "h"], ("vllm:", "vllm_"))._parse_lines(after))
    assert as_comparable(selector.parse(after)) == expected
    assert not selector.planned
