"""Hostile input, by property: hypothesis generates engine pages and
sequences of pages, and kvwatch's whole pipeline (parser, adapter, window,
signals, diagnosis, exporter, JSON, status page) must hold its promises on
every one of them.

- Any page at all: no exception escapes a poll, and every view stays
  well-formed (the exposition parses back, the JSON is strict).
- Any sequence of valid pages, with restarts anywhere: the windowed
  increases are exactly the counters' increases under Prometheus' reset
  rule, computed here by a model; no rate is negative, no ratio above one.
- Any label value (quotes, backslashes, newlines, any unicode): it survives
  engine page -> kvwatch -> /metrics -> prometheus_client, and the JSON API.
- Worst-case shapes at megabyte scale finish (under the test's timeout) and
  hold memory in proportion to the page; one model name per request is
  capped by max_series, counted, and memory stays flat across polls.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
import tracemalloc
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvwatch.pipeline.monitor
from fuzz.pages import TTFT_BOUNDS, Engine, escape, page
from fuzz.pipeline import Pipeline
from kvwatch.engines.vllm import PREFIXES, VllmAdapter, all_families
from kvwatch.exposition import SAMPLE_SUFFIXES
from kvwatch.sidecar.report import diagnosis_json
from kvwatch.signals import evaluate_window
from kvwatch.window import Window

# Enough examples to find what the strategies are built to find, few enough
# for `make test`; KVWATCH_FUZZ_EXAMPLES=5000 for a long run. No deadline: a
# slow example on a busy machine is not a failure (the pytest timeout is).
FUZZ = settings(max_examples=int(os.environ.get("KVWATCH_FUZZ_EXAMPLES", "60")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

# --- pages of any shape ------------------------------------------------------

names = st.builds(lambda prefix, family, suffix: prefix + family + suffix,
                  st.sampled_from(PREFIXES + ("", "vllm", "VLLM:")),
                  st.sampled_from(all_families()),
                  st.sampled_from(SAMPLE_SUFFIXES + ("_bucket_total", "_", "x")))
label_names = st.sampled_from(["model_name", "engine", "le", "pid", "finished_reason", "reason", "source",
                               "block_size", "num_gpu_blocks", "kv_cache_size_tokens", "running_lora_adapters",
                               "max_lora", "quantile"]) | st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)
label_values = st.sampled_from(["0", "1", "m", "+Inf", "-Inf", "Inf", "NaN", "0.5", "1e9", "", "abc", "1,2"]) | st.text(max_size=12)
numbers = (st.sampled_from(["0", "1", "-1", "NaN", "nan", "+Inf", "-Inf", "inf", "1e308", "-1e308", "1e-320", "4.9e-324",
                            "0x1F", "1_000", "", "3.5", "17", "1" * 400, "-0", "1e", ".", "+", "Infinity"])
           | st.floats().map(repr) | st.integers(-2**70, 2**70).map(str))


@st.composite
def label_blocks(draw):
    pairs = draw(st.lists(st.tuples(label_names, label_values), max_size=5))
    rendered = [f'{key}="{escape(value)}"' for key, value in pairs]
    if draw(st.booleans()) and rendered:  # break the syntax somewhere
        index = draw(st.integers(0, len(rendered) - 1))
        rendered[index] = draw(st.sampled_from([
            rendered[index][:-1], rendered[index].replace('"', "", 1), rendered[index] + '"', "=", '"', "\\",
            rendered[index].replace("=", " = "), draw(st.text(max_size=10))]))
    separator = draw(st.sampled_from([",", ", ", " ,", ",,", " "]))
    trailing = draw(st.sampled_from(["", ",", " "]))
    closing = draw(st.sampled_from(["}", "}", "}", "", "}}"]))
    return "{" + separator.join(rendered) + trailing + closing


@st.composite
def sample_lines(draw):
    line = draw(names)
    if draw(st.booleans()):
        line += draw(label_blocks())
    line += draw(st.sampled_from([" ", " ", "  ", "\t", ""])) + draw(numbers)
    if draw(st.integers(0, 4)) == 0:
        line += " " + draw(numbers)  # a timestamp, or garbage where one goes
    if draw(st.integers(0, 6)) == 0:
        line += ' # {trace_id="abc"} 1.0'  # an OpenMetrics exemplar
    return line


comment_lines = st.builds(lambda kind, name, rest: f"# {kind} {name} {rest}",
                          st.sampled_from(["TYPE", "HELP", "UNIT", "type", "EOF"]), names,
                          st.sampled_from(["counter", "gauge", "histogram", "summary", "untyped", "info", "", "x y z"]))
lines = st.one_of(sample_lines(), sample_lines(), sample_lines(), comment_lines,
                  st.text(max_size=60), st.just("# EOF"), st.just(""))
pages = st.lists(lines, max_size=40).map(lambda found: "\n".join(found) + "\n")


@FUZZ
@given(st.lists(st.one_of(pages, st.text(max_size=300)), min_size=1, max_size=3))
def test_no_page_breaks_a_poll_or_any_view(texts):
    pipeline = Pipeline()
    for text in texts:
        state = pipeline.poll(text)
        assert state.up or state.reason == "no_engine_metrics"
        assert len(state.snapshot.engines if state.snapshot else ()) <= 50
        views = pipeline.views()
        assert views["signals"]["up"] == state.up
        up = [s.value for f in views["families"] if f.name == "kvwatch_up" for s in f.samples]
        assert up == [1.0 if state.up else 0.0]


@FUZZ
@given(st.lists(sample_lines(), min_size=1, max_size=30), st.data())
def test_a_malformed_line_costs_only_itself(good_and_bad, data):
    """Lines kvwatch reads, mixed with garbage lines of the same families:
    the result is the same as with the garbage left out, and every
    malformed line is counted with its line number."""
    valid = "".join(f'vllm:num_requests_running{{model_name="m{i}",engine="0"}} {i}\n' for i in range(3))
    garbage = [line for line in good_and_bad if line.strip()]
    mixed_lines = valid.splitlines()
    for line in garbage:
        mixed_lines.insert(data.draw(st.integers(0, len(mixed_lines))), line)
    adapter = VllmAdapter(max_series=100)
    text = "\n".join(mixed_lines) + "\n"
    snapshot = adapter.adapt(text, 0)
    for i in range(3):
        # Garbage may add to an engine (it may be valid), never take the valid lines away.
        assert snapshot.engines[(f"m{i}", "0")].gauges.get("running") is not None
    # The page's own lines: a garbage line drawn with a newline in it is two.
    page_lines = text.split("\n")
    for error in snapshot.parse_errors:
        if hasattr(error, "line_number"):
            assert page_lines[error.line_number - 1] == error.line


# --- valid sequences with restarts: a model of Prometheus' increase ------------


@st.composite
def engine_histories(draw):
    """Per poll: seconds since the last poll, whether the engine restarted
    just before it, and what it did since (or since the restart)."""
    with_created = draw(st.booleans())
    steps = []
    for _ in range(draw(st.integers(2, 8))):
        queries = draw(st.integers(0, 5000))
        hits = draw(st.integers(0, queries))
        steps.append(dict(
            seconds=draw(st.floats(0.5, 60)),
            restart=draw(st.integers(0, 3)) == 0,
            queries=queries, hits=hits, prompt=queries + draw(st.integers(0, 500)),
            preemptions=draw(st.integers(0, 20)),
            ttft=draw(st.lists(st.integers(0, 30), min_size=len(TTFT_BOUNDS) + 1, max_size=len(TTFT_BOUNDS) + 1)),
            ttft_mean=draw(st.floats(0.01, 10)),
        ))
    return with_created, draw(st.integers(0, 10**6)), steps


@FUZZ
@given(engine_histories())
def test_windowed_increases_follow_the_reset_rule_exactly(history):
    """The model: a series that went down restarted from zero (its increase is
    its new value), each series on its own; the engine restarted (every
    series counts its new value) only on evidence: `_created` moved and a
    series went down, or every counter that had counted something went down."""
    with_created, history_before, steps = history
    adapter = VllmAdapter()
    window = Window(10**6)
    counter_keys = ("queries", "hits", "prompt", "preemptions")
    total = dict(queries=history_before, hits=history_before // 2, prompt=history_before * 2, preemptions=7,
                 ttft=[0] * (len(TTFT_BOUNDS) + 1), ttft_sum=0.0)
    created, now = 1000.0, 0.0
    expected = dict(queries=0, hits=0, prompt=0, preemptions=0, seconds=0.0, count=0, ttft_sum=0.0)
    before = None
    for index, step in enumerate(steps):
        restart = step["restart"] and index > 0
        if restart:
            created += 1
            total = dict(queries=0, hits=0, prompt=0, preemptions=0, ttft=[0] * len(step["ttft"]), ttft_sum=0.0)
        for key in counter_keys:
            total[key] += step[key]
        total["ttft"] = [a + b for a, b in zip(total["ttft"], step["ttft"])]
        total["ttft_sum"] += sum(step["ttft"]) * step["ttft_mean"]
        now += step["seconds"]
        cumulative = [sum(total["ttft"][: i + 1]) for i in range(len(total["ttft"]))]
        if before is not None:
            fell = {key: total[key] < before[key] for key in counter_keys}
            histogram_fell = (any(a < b for a, b in zip(cumulative, before["cumulative"]))
                              or total["ttft_sum"] < before["ttft_sum"])
            counted = [fell[key] for key in counter_keys if before[key] > 0]
            engine_restarted = ((with_created and restart and (any(fell.values()) or histogram_fell))
                                or (len(counted) >= 2 and all(counted)))
            for key in counter_keys:
                new_value = engine_restarted or fell[key]
                expected[key] += total[key] if new_value else total[key] - before[key]
            if engine_restarted or histogram_fell:
                expected["count"] += cumulative[-1]
                expected["ttft_sum"] += total["ttft_sum"]
            else:
                expected["count"] += cumulative[-1] - before["cumulative"][-1]
                expected["ttft_sum"] += total["ttft_sum"] - before["ttft_sum"]
            expected["seconds"] += step["seconds"]
        before = dict(total, cumulative=cumulative)
        window.add(adapter.adapt(page(Engine(
            prompt_tokens=total["prompt"], prefix_queries=total["queries"], prefix_hits=total["hits"],
            preemptions=total["preemptions"], ttft_cumulative=tuple(cumulative), ttft_sum=total["ttft_sum"],
            created=created if with_created else None)), at=now))

    per_engine, per_model = evaluate_window(window)
    values = per_engine[0].values
    assert values["kvwatch_prompt_tokens_per_second"] == pytest.approx(expected["prompt"] / expected["seconds"])
    assert values["kvwatch_preemptions_per_second"] == pytest.approx(expected["preemptions"] / expected["seconds"])
    if expected["queries"] and expected["hits"] <= expected["queries"]:
        assert values["kvwatch_prefix_cache_hit_ratio"] == pytest.approx(expected["hits"] / expected["queries"])
    else:  # no queries, or a restart without evidence left more hits than queries
        assert values["kvwatch_prefix_cache_hit_ratio"] is None
    if expected["count"]:
        assert values["kvwatch_time_to_first_token_mean_seconds"] == pytest.approx(
            expected["ttft_sum"] / expected["count"], rel=1e-6)
        p99 = values["kvwatch_time_to_first_token_seconds"]["0.99"]
        assert 0 <= p99 <= TTFT_BOUNDS[-1]
    for row in per_engine + per_model:
        for name, found in row.values.items():
            for number in (found.values() if isinstance(found, dict) else [found]):
                if number is not None:
                    assert math.isfinite(number) and number >= 0, (name, number)
                    if name.endswith("_ratio"):
                        assert number <= 1 + 1e-9, (name, number)


# --- label values round trip --------------------------------------------------

any_text = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=30)


@pytest.mark.parametrize("model", [
    'with "quotes"', "back\\slash", "trailing backslash\\", "new\nline", "\\n (a literal backslash-n)",
    "模型-🚀-ünïcödé", "tab\there", "carriage\rreturn", "nul\x00byte", "\u2028line separator", '{"json": [1, 2]}',
    "comma, equals=, hash # brace }", "  spaces  ",
])
def test_awkward_label_values_round_trip(model):
    assert_round_trip(model, "0")


@FUZZ
@given(any_text, any_text)
def test_any_label_value_round_trips_through_the_export(model, engine):
    assert_round_trip(model, engine)


def assert_round_trip(model: str, engine: str) -> None:
    pipeline = Pipeline()
    for prompt in (100, 250):
        state = pipeline.poll(page(Engine(model=model, engine=engine, prompt_tokens=prompt, running=3)))
        assert state.up
    views = pipeline.views()
    exported = {(s.labels.get("model_name"), s.labels.get("engine")) for f in views["families"]
                for s in f.samples if s.name == "kvwatch_engine_requests_running"}
    assert exported == {(model, engine)}
    rates = [s for f in views["families"] for s in f.samples if s.name == "kvwatch_prompt_tokens_per_second"]
    assert [(s.labels["model_name"], s.labels["engine"]) for s in rates] == [(model, engine)]
    assert [(e["model_name"], e["engine"]) for e in views["signals"]["engines"]] == [(model, engine)]
    assert [m["model_name"] for m in views["signals"]["models"]] == [model]


def test_long_label_values_of_a_page_are_exported_as_a_start_and_a_digest():
    """A 200 KB model name and engine id, the same on both polls: exported as
    their start and a digest (kvwatch.labels, the rule every source follows),
    the same pair on both polls, so the window's rates still read; a short
    name beside them is exported whole."""
    from kvwatch.labels import LABEL_VALUE_MAX_BYTES, bounded_label

    model, engine = "m" * 200_000 + "-a", "e" * 200_000 + "-b"
    pipeline = Pipeline()
    for prompt in (100, 250):
        text = page(Engine(model=model, engine=engine, prompt_tokens=prompt, running=3),
                    Engine(model="short", engine="0", prompt_tokens=prompt, running=1))
        assert pipeline.poll(text).up
    views = pipeline.views()
    exported = {(s.labels.get("model_name"), s.labels.get("engine")) for f in views["families"]
                for s in f.samples if s.name == "kvwatch_engine_requests_running"}
    assert exported == {(bounded_label(model), bounded_label(engine)), ("short", "0")}
    assert all(len(v.encode()) <= LABEL_VALUE_MAX_BYTES for pair in exported for v in pair)
    rates = {s.labels["model_name"]: s.value for f in views["families"] for s in f.samples
             if s.name == "kvwatch_prompt_tokens_per_second"}
    assert rates[bounded_label(model)] > 0 and rates["short"] > 0
    assert max(len(json.dumps(e)) for e in views["signals"]["engines"]) < 20_000


def test_a_long_finished_reason_is_exported_as_a_start_and_a_digest():
    """The values of a labelled family inside one engine (finished_reason)
    follow the same rule as the engine's own labels."""
    from kvwatch.labels import LABEL_VALUE_MAX_BYTES

    reason = "r" * 100_000
    pipeline = Pipeline()
    for count in (10, 25):
        text = page(Engine(prompt_tokens=100 * count, running=1)) + (
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{model_name="m",engine="0",finished_reason="{reason}"}} {count}\n')
        assert pipeline.poll(text).up
    values = [v for f in pipeline.views()["families"] for s in f.samples for v in s.labels.values()]
    assert values and max(len(v.encode()) for v in values) <= LABEL_VALUE_MAX_BYTES


# --- worst cases at scale -------------------------------------------------------


def many_labels_in_one_line(size: int) -> str:
    count = size // 12
    return "vllm:num_requests_running{" + ",".join(f'l{i}="v"' for i in range(count)) + "} 1\n"


def unterminated_quotes(size: int) -> str:
    return 'vllm:num_requests_running{model_name="' + '\\"' * (size // 2) + "\n"


def escapes_everywhere(size: int) -> str:
    value = "\\\\\\n\\\"" * 8
    line = f'vllm:num_requests_running{{model_name="{value}",engine="0"}} 1\n'
    return line * (size // len(line))


def one_model_per_line(size: int) -> str:
    lines = (f'vllm:prompt_tokens_total{{model_name="request-{i:09d}",engine="0"}} {i}\n' for i in range(size // 60))
    return "".join(lines)


def malformed_lines(size: int) -> str:
    return 'vllm:num_requests_running{model_name="m" 1\n' * (size // 42)


def long_garbage_line(size: int) -> str:
    return "vllm:num_requests_running " + "9" * size + "\n"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", [many_labels_in_one_line, unterminated_quotes, escapes_everywhere,
                                   one_model_per_line, malformed_lines, long_garbage_line])
def test_worst_case_pages_finish_and_hold_memory_in_proportion(shape):
    """1 MB of each worst shape found: the poll finishes (the timeout is the
    bound, not a speed claim: a quadratic parse of the first shape took
    seconds per megabyte squared before it was fixed) and holds at most a
    small multiple of the page at its peak (matching a 1 MB label block
    took about 120 MB of regex state before it was fixed)."""
    text = shape(1024 * 1024)
    pipeline = Pipeline(max_series=100)
    gc.collect()
    tracemalloc.start()
    try:
        pipeline.poll(text)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 20 * len(text) + 16 * 1024 * 1024, f"{peak / 1e6:.0f} MB for a {len(text) / 1e6:.0f} MB page"
    pipeline.views()


def test_one_model_name_per_request_is_capped_counted_and_memory_stays_flat(monkeypatch):
    """Each poll brings 5,000 model names never seen before (one per request,
    as a misconfigured gateway does). kvwatch keeps max_series of them, counts
    the rest once per poll, exports only what it keeps, and its memory stops
    growing once the window and the parser's bounded caches are full (they
    are cleared when full, so memory saws up and down: compare peaks)."""
    clock = [1_000_000.0]
    monkeypatch.setattr(kvwatch.pipeline.monitor, "time", types.SimpleNamespace(
        time=lambda: clock[0], monotonic=lambda: clock[0], thread_time=time.thread_time))
    pipeline = Pipeline(max_series=100, window="30s")
    per_poll, polls = 5000, 30

    def poll(number: int):
        names = range(number * per_poll, (number + 1) * per_poll)
        text = "".join(f'vllm:prompt_tokens_total{{model_name="request-{n}",engine="0"}} {n}\n' for n in names)
        clock[0] += 5
        return pipeline.poll(text)

    # Live allocated blocks: tracemalloc's numbers without its slowdown.
    blocks = []
    for number in range(polls):
        state = poll(number)
        assert state.up and len(state.snapshot.engines) == 100
        assert state.dropped_series == (number + 1) * (per_poll - 100)
        gc.collect()
        blocks.append(sys.getallocatedblocks())
    views = pipeline.views()
    kept = {s.labels["model_name"] for f in views["families"] for s in f.samples
            if s.name == "kvwatch_engine_prompt_tokens_total"}
    assert len(kept) == 100
    dropped = [s.value for f in views["families"] for s in f.samples if s.name == "kvwatch_dropped_series_total"]
    assert dropped == [polls * (per_poll - 100)]
    assert len(pipeline.monitor.window.entries) <= 8  # 30 s of 5 s polls, plus the one at the horizon
    # Polls 0-14 and 15-29 each span a whole fill-and-clear cycle of the
    # parser's and the adapter's caches (20,000 and 50,000 entries, 5,000
    # new label sets a poll; the cycle is about 11 polls): the same peak,
    # give or take 20,000 blocks (about 1 MB; one poll adds 45,000).
    first, second = max(blocks[:15]), max(blocks[15:])
    assert second - first < 20_000, f"peak grew by {second - first} blocks in 15 polls: {blocks}"


def test_new_80_kb_label_values_every_poll_keep_the_parser_cache_bounded_in_bytes(monkeypatch):
    """Each poll brings 40 new label values of 80 KB (a 3.2 MB page, under
    the body cap): the parser's label cache is bounded in bytes, not only in
    entries, and the adapter lets go of the label sets with it, so traced
    memory after 30 polls is where it was after 10 (bounded in entries only,
    the cache kept every one: 6.4 MB more each poll, 190 MB here)."""
    import tracemalloc

    from kvwatch import exposition

    clock = [1_000_000.0]
    monkeypatch.setattr(kvwatch.pipeline.monitor, "time", types.SimpleNamespace(
        time=lambda: clock[0], monotonic=lambda: clock[0], thread_time=time.thread_time))
    pipeline = Pipeline(max_series=100, window="30s")

    def page(number: int) -> str:
        return "".join(
            f'vllm:num_requests_running{{model_name="m",engine="0",request="{number:04d}-{n:02d}-{"x" * 80_000}"}} 1\n'
            for n in range(40))

    tracemalloc.start()
    try:
        current = []
        for number in range(30):
            clock[0] += 5
            assert pipeline.poll(page(number)).up
            gc.collect()
            current.append(tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    # One fill of the cache (16 MiB) plus a page's worth in flight, wherever
    # in its saw the last poll falls; never a climb with the polls.
    assert max(current[10:]) - max(current[:10]) < 8 * 1024 * 1024, [c >> 20 for c in current]
    assert max(current) < current[0] + exposition._LABEL_CACHE_MAX_BYTES + 24 * 1024 * 1024, [c >> 20 for c in current]


def test_model_names_changing_every_poll_keep_findings_events_and_details_bounded(monkeypatch):
    """200 new served names each poll (a gateway that sets one name per
    request), under max_series: each poll is a models change. Each change
    and its findings keep at most MAX_NAMES names and say how many there
    were, so the diagnosis stays the same size poll after poll (whole name
    lists in every change and finding grew memory with the square of the
    names: 1.38 GB, and a 323 MB /api/v1/diagnosis)."""
    from kvwatch.diagnose.changes import MAX_NAMES
    from kvwatch.diagnose.thresholds import DEFAULT_THRESHOLDS

    # The window (60 s of 5 s polls) plus the finding hold (a finding whose
    # names left is held that long, marked clearing): from then on the
    # diagnosis no longer grows.
    full = int((60 + DEFAULT_THRESHOLDS.finding_hold_seconds) / 5) + 1
    polls = full + 16
    clock = [1_000_000.0]
    monkeypatch.setattr(kvwatch.pipeline.monitor, "time", types.SimpleNamespace(
        time=lambda: clock[0], monotonic=lambda: clock[0], thread_time=time.thread_time))
    pipeline = Pipeline(max_series=1000, window="60s")
    sizes = []
    for number in range(polls):
        clock[0] += 5
        text = "".join(f'vllm:prompt_tokens_total{{model_name="gw-{number}-{n}",engine="0"}} {n}\n' for n in range(200))
        state = pipeline.poll(text)
        assert state.up
        diagnosis = json.dumps(diagnosis_json(state, pipeline.settings))
        sizes.append(len(diagnosis))
    state = pipeline.monitor.state
    models = [c for c in state.events if c.kind == "models"]
    assert models and all(len(c.before) <= MAX_NAMES and len(c.after) <= MAX_NAMES for c in models)
    assert all(len(c.detail) < 1000 and "(200 in all)" in c.detail for c in models)
    assert all(len(str(f.evidence)) < 2000 for f in state.findings)
    changed = [f for f in state.findings if f.cause == "model_changed"]
    assert 0 < len(changed) <= MAX_NAMES * (len(pipeline.monitor.window.entries) + len(models))
    assert max(sizes[full + 1:]) <= 1.1 * sizes[full], sizes


def test_a_new_lora_adapter_set_each_poll_is_forgotten_after_the_window(monkeypatch):
    """running_lora_adapters names 50 new adapters each poll: kvwatch keeps
    the adapters seen within the window only (the set used to grow for ever:
    1.5 M names after 300 polls, still held after good pages returned), and
    each event's detail names at most MAX_NAMES of them."""
    from kvwatch.diagnose.changes import MAX_NAMES

    clock = [1_000_000.0]
    monkeypatch.setattr(kvwatch.pipeline.monitor, "time", types.SimpleNamespace(
        time=lambda: clock[0], monotonic=lambda: clock[0], thread_time=time.thread_time))
    pipeline = Pipeline(window="30s")

    def lora_page(names: list[str], prompt: int) -> str:
        return page(Engine(prompt_tokens=prompt)) + (
            f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{",".join(names)}",'
            f'waiting_lora_adapters=""}} {clock[0]}\n')

    for number in range(100):
        clock[0] += 5
        assert pipeline.poll(lora_page([f"adapter-{number}-{n}" for n in range(50)], 100 * number)).up
    seen = pipeline.monitor._lora_seen
    assert len(seen) <= 50 * 8  # 30 s of 5 s polls, and the one at the horizon
    lora = [c for c in pipeline.monitor.state.events if c.kind == "lora"]
    assert lora and all("(50 in all)" in c.detail and len(c.detail) < 500 for c in lora)
    assert MAX_NAMES < 50
    for number in range(100, 110):  # good pages again: one adapter
        clock[0] += 5
        assert pipeline.poll(lora_page(["steady"], 100 * number)).up
    assert set(seen) == {"steady"}


def test_long_lora_adapter_names_are_remembered_within_a_byte_bound(monkeypatch):
    """running_lora_adapters names new adapters every poll: ten of 200 KB
    each, then 500 of 250 characters. The names kvwatch remembers stay within
    MAX_LORA_BYTES (a count alone held 61 polls of one 8 MiB name each,
    490 MB, or 10,000 names of any length), a long name is remembered by a
    digest of it (seen again, it is no new adapter), and an event's detail
    shows at most NAME_MAX_CHARS of each name."""
    from kvwatch.diagnose.changes import MAX_NAMES, NAME_MAX_CHARS
    from kvwatch.pipeline.monitor import LORA_NAME_MAX_CHARS, MAX_LORA_BYTES, lora_name_bytes

    clock = [1_000_000.0]
    monkeypatch.setattr(kvwatch.pipeline.monitor, "time", types.SimpleNamespace(
        time=lambda: clock[0], monotonic=lambda: clock[0], thread_time=time.thread_time))
    pipeline = Pipeline(window="5m")

    def lora_page(names: list[str], prompt: int) -> str:
        return page(Engine(prompt_tokens=prompt)) + (
            f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{",".join(names)}",'
            f'waiting_lora_adapters=""}} {clock[0]}\n')

    def held() -> int:
        seen = pipeline.monitor._lora_seen
        assert sum(lora_name_bytes(name) for name in seen) == pipeline.monitor._lora_bytes <= MAX_LORA_BYTES
        return sum(len(name) for name in seen)

    for number in range(15):
        clock[0] += 5
        long_names = [f"adapter-{number}-{n}-" + "x" * 200_000 for n in range(10)]
        assert pipeline.poll(lora_page(long_names, 100 * number)).up
        assert held() <= MAX_LORA_BYTES
    assert len(pipeline.monitor._lora_seen) == 140  # by their digests, each poll's but the first (nothing before it)
    events = [c for c in pipeline.monitor.state.events if c.kind == "lora"]
    assert events and all(len(c.detail) < MAX_NAMES * (NAME_MAX_CHARS + 40) + 100 for c in events)
    before = len(events)
    clock[0] += 5
    assert pipeline.poll(lora_page(long_names, 100 * 15)).up  # the same long names again: nothing new
    assert len([c for c in pipeline.monitor.state.events if c.kind == "lora"]) == before
    for number in range(16, 26):  # names just under the digest's length, 500 a poll: the bytes bind
        clock[0] += 5
        names = [f"a-{number}-{n}-".ljust(LORA_NAME_MAX_CHARS, "y") for n in range(500)]
        assert pipeline.poll(lora_page(names, 100 * number)).up
        assert held() <= MAX_LORA_BYTES
    assert set(names) <= set(pipeline.monitor._lora_seen)  # the latest poll's are kept
    assert len(pipeline.monitor._lora_seen) < 5000
