"""The text-format parser on hand-written edge cases."""

import math

from kvwatch.exposition import FamilySelector


def select(*names, prefixes=("vllm:", "vllm_", "")):
    return FamilySelector(names, prefixes)


def test_escaped_label_values_are_unescaped():
    page = select("info").parse('vllm:info{a="q\\"uote",b="back\\\\slash",c="new\\nline",d="ünï{},="} 1\n')
    (suffix, labels, value), = page.families["info"].samples
    assert labels == {"a": 'q"uote', "b": "back\\slash", "c": "new\nline", "d": "ünï{},="}
    assert page.errors == []


def test_nan_inf_and_timestamps():
    page = select("g").parse("vllm:g{x=\"1\"} NaN\nvllm:g{x=\"2\"} +Inf 1700000000000\nvllm:g{x=\"3\"} -Inf\nvllm:g{x=\"4\"} 1e+06 17\n")
    values = [v for _, _, v in page.families["g"].samples]
    assert math.isnan(values[0]) and values[1] == math.inf and values[2] == -math.inf and values[3] == 1e6


def test_help_and_type_without_samples():
    page = select("h").parse("# HELP vllm:h Something. \n# TYPE vllm:h histogram\n")
    assert page.families["h"].type == "histogram" and page.families["h"].samples == []


def test_counter_type_line_with_total_and_created_gauge_does_not_retype_it():
    text = (
        "# TYPE vllm:c_total counter\nvllm:c_total 5.0\n"
        "# TYPE vllm:c_created gauge\nvllm:c_created 1.7e9\n"
    )
    family = select("c").parse(text).families["c"]
    assert family.type == "counter"
    assert [(s, v) for s, _, v in family.samples] == [("_total", 5.0), ("_created", 1.7e9)]


def test_histogram_whose_name_ends_in_total_is_found_as_itself():
    text = (
        "# TYPE vllm:iteration_tokens_total histogram\n"
        'vllm:iteration_tokens_total_bucket{le="1.0"} 2.0\n'
        'vllm:iteration_tokens_total_bucket{le="+Inf"} 3.0\n'
        "vllm:iteration_tokens_total_count 3.0\nvllm:iteration_tokens_total_sum 9.0\n"
    )
    page = select("iteration_tokens_total", "iteration_tokens").parse(text)
    assert "iteration_tokens" not in page.families
    family = page.families["iteration_tokens_total"]
    assert family.type == "histogram"
    assert [s for s, _, _ in family.samples] == ["_bucket", "_bucket", "_count", "_sum"]


def test_underscore_spelling_from_openmetrics_escaping_is_the_same_family():
    text = "# TYPE vllm:q counter\nvllm_q_total{engine=\"0\"} 4.0\nvllm:q_total{engine=\"1\"} 5.0\n"
    family = select("q").parse(text).families["q"]
    assert [v for _, _, v in family.samples] == [4.0, 5.0]


def test_openmetrics_exemplars_and_eof():
    text = (
        "# TYPE vllm:t histogram\n"
        'vllm:t_bucket{le="0.5"} 1 # {trace_id="abc"} 0.4 1700000000.1\n'
        'vllm:t_bucket{le="+Inf"} 2\nvllm:t_count 2\nvllm:t_sum 1.2\nvllm:t_created 1700000000.0\n# EOF\n'
    )
    page = select("t").parse(text)
    assert page.errors == []
    assert [v for _, _, v in page.families["t"].samples] == [1.0, 2.0, 2.0, 1.2, 1700000000.0]


def test_unwanted_families_are_skipped_and_malformed_wanted_lines_counted_with_line_numbers():
    text = (
        "vllm:other{garbage 12\n"  # not asked for: skipped without tokenizing
        "vllm:g{engine=\"0\"} 1.0\n"
        "vllm:g{engine=\"0\" 2.0\n"  # unterminated label set
        "vllm:g{engine=\"1\"} notanumber\n"
        "vllm:g{engine=\"2\"}\n"  # no value
        "vllm:g{engine=\"3\"} 4.0\n"
    )
    page = select("g").parse(text)
    assert [e.line_number for e in page.errors] == [3, 4, 5]
    assert [labels["engine"] for _, labels, _ in page.families["g"].samples] == ["0", "3"]
    assert "line 4" in str(page.errors[1])


def test_a_page_of_label_sets_past_the_label_cache_is_not_kept_as_a_layout(monkeypatch):
    """A page whose label sets do not fit the label cache (new served names
    on every line, every poll) is read, and its layout is not kept: kept, it
    held every label set of the page until the next one (89 MiB of an 8 MiB
    page, beside the next page as it is read) for a page that never comes
    back. A page that fits keeps its layout (once its sets are in the cache),
    and reads the next poll's values through it."""
    from kvwatch import exposition

    monkeypatch.setattr(exposition, "_LABEL_CACHE_MAX", 50)
    parser = select("prompt_tokens")

    def page(poll: int, names: int, value: float = 0.0) -> str:
        return "".join(f'vllm:prompt_tokens_total{{model_name="m-{poll}-{n}",engine="0"}} {n + value}\n'
                       for n in range(names))

    for poll in range(3):
        parsed = parser.parse(page(poll, 200))
        assert len(parsed.families["prompt_tokens"].samples) == 200
        assert parser._layout is None
        assert all(family.layout is None for family in parsed.families.values())
    parser.parse(page(9, 20))  # new sets: the cache may empty once more for them
    parser.parse(page(9, 20))
    layout = parser._layout
    assert layout is not None
    again = parser.parse(page(9, 20, 0.5))
    assert parser._layout is layout
    assert [sample[2] for sample in again.families["prompt_tokens"].samples] == [n + 0.5 for n in range(20)]
