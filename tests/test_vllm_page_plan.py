"""The vLLM adapter's page plan (a page whose layout it has seen is read by
where each value goes) gives the Snapshots of the reading it stands for, on
pages that keep their layout while their values do what the plan must not
get wrong: NaN (skipped by the reading), counters that fall (folded resets),
-0.0 and +Inf, series folded over `pid`, several engines, duplicates and an
engine limit (read apart), and history's families with gaps."""

import math
import re

import pytest

from kvwatch.engines.vllm import VllmAdapter
from kvwatch.history.pages import Pages
from test_history_pages import _as_query_results
from test_vllm_newer_families import HEALTHY, OFFLOAD_DEPRECATED

_SAMPLE = re.compile(r"^([^#\s][^ ]*(?:\{.*\})?) (\S+)$")


def with_values(text: str, value_of) -> str:
    """The page with each sample's value replaced by value_of(line number,
    value), the process start time aside (a new one clears the folds)."""
    lines = []
    for number, line in enumerate(text.splitlines()):
        found = _SAMPLE.match(line)
        keep = not found or line.startswith("process_start_time_seconds ")
        lines.append(line if keep else f"{found[1]} {value_of(number, float(found[2]))}")
    return "\n".join(lines) + "\n"


def folded_over_pids(text: str, histograms: bool = False) -> str:
    """Each labelled sample twice, as two processes (pid 1 and 2) write it;
    histograms too where asked (the plan leaves those pages to the reading)."""
    lines = []
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found and "{" in line and (histograms or not re.search(r"_(bucket|sum|count)\{", line)):
            lines += [line.replace("{", '{pid="1",', 1), line.replace("{", '{pid="2",', 1)]
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


def two_engines(text: str) -> str:
    """The samples again for engine 1 of the same model, and engine 0 of another."""
    samples = [line for line in text.splitlines() if _SAMPLE.match(line) and "{" in line]
    engine_1 = [line.replace('engine="0"', 'engine="1"') if 'engine="0"' in line else line.replace("{", '{engine="1",', 1)
                for line in samples]
    return (text + "\n".join(engine_1) + "\n"
            + "\n".join(line.replace('model_name="', 'model_name="other-') for line in samples) + "\n")


# Values by step: growing, then each way a value can surprise the plan.
STEPS = [
    lambda n, v: repr(v),
    lambda n, v: repr(v * 2 + n % 3),
    lambda n, v: "NaN" if n % 7 == 3 else repr(v * 3),  # a NaN in some families
    lambda n, v: repr(v * 3 + n),
    lambda n, v: repr(v / 2),  # counters fall: a reset, or one pid's restart in a folded sum
    lambda n, v: "-0.0" if v == 0 else repr(v * 4 - n % 2),
    lambda n, v: "+Inf" if n % 11 == 5 else repr(v * 5),
    lambda n, v: "-Inf" if n % 13 == 6 else repr(v * 5),
    lambda n, v: "-0.0" if n % 2 else "0.0",
    lambda n, v: repr(v * 6),
    lambda n, v: repr(v * 6),
]


def deep(snapshot):
    """Everything a Snapshot holds, dict order included, NaN comparable."""
    return repr(snapshot).replace("nan", "NaN"), [
        (key, list(e.gauges), list(e.counters), list(e.histograms), e.created) for key, e in snapshot.engines.items()
    ], list(snapshot.sources), list(map(str, snapshot.parse_errors))


def assert_same_reading(pages, max_series=10_000):
    planned, read = VllmAdapter(max_series), VllmAdapter(max_series)
    read.page_plans = False
    for index, page in enumerate(pages):
        got, expected = planned.adapt(page, at=float(index)), read.adapt(page, at=float(index))
        assert deep(got) == deep(expected), index
        assert planned.dropped_series == read.dropped_series
    return planned


def captures(fixtures_dir):
    return {
        "0.32": (fixtures_dir / "vllm-0.32-cpu" / "metrics-after.txt").read_text() + OFFLOAD_DEPRECATED + HEALTHY,
        "0.25": (fixtures_dir / "public" / "vllm-0.25-deepseek-specdecode.txt").read_text(),
        "0.11": (fixtures_dir / "public" / "vllm-0.11.0.txt").read_text(),
        "V0": (fixtures_dir / "public" / "vllm-v0-0.5.txt").read_text(),
    }


@pytest.mark.parametrize("capture", ["0.32", "0.25", "0.11", "V0"])
@pytest.mark.parametrize("shape", ["as captured", "pid folded", "two engines", "histograms pid folded"])
def test_page_plan_reads_as_the_adapter_reads(fixtures_dir, capture, shape):
    text = captures(fixtures_dir)[capture]
    text = {"as captured": text, "pid folded": folded_over_pids(text), "two engines": two_engines(text),
            "histograms pid folded": folded_over_pids(text, histograms=True)}[shape]
    pages = [with_values(text, step) for step in STEPS]
    planned = assert_same_reading(pages)
    # The plan was made (on the second page) and read the pages after it;
    # never where a histogram is folded.
    assert (planned._series.page[2] is None) == (shape == "histograms pid folded")
    # One pid's counters fall while the other's grow: the fold carries the fallen one.
    if "pid folded" in shape:
        one_falls = [with_values(text, lambda n, v, k=k: repr(v * (k if 'pid="2"' in text.splitlines()[n] else 10 - k)))
                     for k in (1, 2, 3, 4)]
        # Then pid 2 goes away: its count stays in the sums (the fold's carry).
        pid_1 = "\n".join(line for line in text.splitlines() if 'pid="2"' not in line) + "\n"
        assert_same_reading(pages + one_falls + [with_values(pid_1, step) for step in STEPS])


def test_pages_the_plan_does_not_read_take_the_general_reading(fixtures_dir):
    text = captures(fixtures_dir)["0.32"]
    line = next(line for line in text.splitlines() if line.startswith("vllm:num_requests_running{"))
    duplicated = text + line + "\n"
    assert_same_reading([with_values(duplicated, step) for step in STEPS])
    # More engines than the adapter keeps.
    assert_same_reading([with_values(two_engines(text), step) for step in STEPS], max_series=2)
    planned = VllmAdapter()
    for _ in range(3):
        planned.adapt(duplicated)
    assert planned._series.page[2] is None


def test_history_families_with_gaps_read_as_the_adapter_reads(fixtures_dir):
    """Replica.families hands the same layout object while a family's present
    series stay the same: the plan follows the layouts as series come and go."""
    text = captures(fixtures_dir)["0.32"]
    pages_in = [(1000.0 + 15.0 * i, with_values(text, step)) for i, step in enumerate(STEPS[:2] + STEPS[3:])]
    results = _as_query_results(pages_in, {"job": "vllm", "instance": "10.0.0.2:8000"})
    for series in results:
        name = series["metric"]["__name__"]
        if name == "vllm:num_requests_waiting" or name.startswith("vllm:request_prefill_time_seconds"):
            series["values"] = [v for v in series["values"] if v[0] not in (1030.0, 1045.0)]
    pages = Pages(1000.0, 15.0, len(pages_in), "vllm")
    pages.add(results)
    (replica,) = pages.replicas.values()
    planned, read = VllmAdapter(), VllmAdapter()
    read.page_plans = False
    for index, (at, _text) in enumerate(pages_in):
        families, start = replica.families(index)
        got = planned.adapt_families(families, [], start, at=at)
        expected = read.adapt_families(families, [], start, at=at)
        assert deep(got) == deep(expected), index
        assert not math.isnan(got.engines[("tiny-llama", "0")].counters["prompt_tokens"])


def _new_label_sets_page(poll: int, width: int) -> str:
    """Every label set new this poll and `width` characters long: served
    names (the engines' identity), gauges and a histogram per name."""
    lines = ["# TYPE vllm:num_requests_running gauge",
             "# TYPE vllm:prompt_tokens_total counter",
             "# TYPE vllm:time_to_first_token_seconds histogram"]
    for n in range(6):
        name = f"m-{poll:03d}-{n}-" + "x" * width
        labels = f'model_name="{name}",engine="0"'
        lines.append(f"vllm:num_requests_running{{{labels}}} {n}")
        lines.append(f"vllm:prompt_tokens_total{{{labels}}} {100 * poll + n}")
        for bound in ("0.1", "1.0", "+Inf"):
            lines.append(f'vllm:time_to_first_token_seconds_bucket{{{labels},le="{bound}"}} {poll + n}')
        lines.append(f"vllm:time_to_first_token_seconds_sum{{{labels}}} {0.5 * poll}")
        lines.append(f"vllm:time_to_first_token_seconds_count{{{labels}}} {poll + n}")
    return "\n".join(lines) + "\n"


def test_new_large_label_sets_every_poll_keep_the_series_cache_within_its_byte_bound():
    """A reader that hands the adapter new label sets on every poll, each
    with 40 KB values (a store's answers read into new dicts, as history and
    central mode do, where the parser's cache the series cache empties with
    is not in the way): the series cache's estimate stays within its bound
    after every poll, what is traced stays flat as the polls go on, and
    every poll reads what a fresh adapter reads. Bounded in entries only
    (50,000), the cache kept every label set it saw: 1 MB more a poll
    here, 11 MiB over the last 12 polls."""
    import gc
    import tracemalloc

    adapter = VllmAdapter()
    cache = adapter._series
    cache.max_bytes = 4 * 2 ** 20
    traced, largest = [], 0
    tracemalloc.start()
    try:
        for poll in range(24):
            text = _new_label_sets_page(poll, 40_000)
            # A new parser each poll: new dicts, as a store's answer gives.
            snapshot = adapter.adapt_families(VllmAdapter().selector.parse(text).families, [], None, at=float(poll))
            largest = max(largest, cache.bytes)
            assert cache.bytes <= cache.max_bytes, (poll, cache.bytes)
            fresh = VllmAdapter().adapt_families(VllmAdapter().selector.parse(text).families, [], None,
                                                 at=float(poll))
            assert snapshot.engines == fresh.engines, poll
            assert len(snapshot.engines) == 6 and all(
                engine.histograms["ttft"].count == poll + n
                for n, engine in enumerate(sorted(snapshot.engines.values(), key=lambda e: e.model)))
            del text, snapshot, fresh
            gc.collect()
            traced.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    assert largest > cache.max_bytes // 2  # the bound was neared, so it was what held the cache
    assert max(traced[12:]) - max(traced[:12]) < 2 * 2 ** 20, [t >> 20 for t in traced]
