"""The parse section: kvwatch's parse + adapt against prometheus_client's
parser, on the real vLLM page scaled to 1, 8 and 32 engines."""

from __future__ import annotations

import math
import time

from prometheus_client.parser import text_string_to_metric_families

from bench_support import Report, calls_for, cpu_seconds, median, ms, plain_table, table
from kvwatch.engines.vllm import VllmAdapter
from pages import sample_count, scale


def wanted_samples_ours(adapter: VllmAdapter, text: str) -> list[tuple[str, dict, float]]:
    page = adapter.selector.parse(text)
    return [(f.spelling + f.name + suffix, labels, value)
            for f in page.families.values() for suffix, labels, value in f.samples]


def wanted_samples_reference(adapter: VllmAdapter, text: str) -> list[tuple[str, dict, float]]:
    names = adapter.selector.sample_names
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(text)
            for s in f.samples if s.name in names]


def identical(ours, theirs) -> bool:
    if [(n, labels) for n, labels, _ in ours] != [(n, labels) for n, labels, _ in theirs]:
        return False
    return all(a == b or (math.isnan(a) and math.isnan(b)) for (_, _, a), (_, _, b) in zip(ours, theirs))


def split_floor(text: str) -> None:
    """Issue 9's floor: split into lines and read each sample's name and
    value in plain Python, with no label parsing."""
    for line in text.split("\n"):
        if line and line[0] != "#":
            brace = line.find("{")
            space = line.find(" ")
            line[:brace if brace != -1 and brace < space else space]
            float(line[line.rfind(" ") + 1:])


def bench_parse(report: Report, capture: str, quick: bool) -> None:
    rows = []
    for engines in (1, 8, 32):
        text = scale(capture, engines)
        adapter = VllmAdapter()
        started = time.thread_time()
        adapter.adapt(text, at=0.0)
        cold = time.thread_time() - started
        ours = wanted_samples_ours(adapter, text)
        same = identical(ours, wanted_samples_reference(adapter, text))

        def reference(t):
            return list(text_string_to_metric_families(t))

        def parse_and_adapt(t):
            return adapter.adapt(t, at=0.0)

        def parse_only(t):
            return adapter.selector.parse(t)

        # Interleaved rounds: both parsers see the same machine conditions.
        rounds = 5 if quick else 9
        n_ref = calls_for(cpu_seconds(reference, text, 1), 0.08)
        n_ours = calls_for(cpu_seconds(parse_and_adapt, text, 1), 0.05)
        times = {"ref": [], "ours": [], "parse": [], "floor": []}
        for _ in range(rounds):
            times["ref"].append(cpu_seconds(reference, text, n_ref))
            times["ours"].append(cpu_seconds(parse_and_adapt, text, n_ours))
            times["parse"].append(cpu_seconds(parse_only, text, n_ours))
            times["floor"].append(cpu_seconds(split_floor, text, n_ours))
        ref, ours_t = median(times["ref"]), median(times["ours"])
        ratio = ref / ours_t
        rows.append([str(engines), f"{len(text) / 1024:.0f} KB", str(sample_count(text)), str(len(ours)),
                     ms(ref), ms(ours_t, 3), ms(median(times["parse"]), 3), ms(cold, 3), ms(median(times["floor"]), 3),
                     f"{ratio:.1f}x", "yes" if same else "NO"])
        report.figure(f"parse+adapt vs prometheus_client, {engines} engine{'s' if engines > 1 else ''}",
                      f"{ms(ours_t, 3)} ({ratio:.1f}x faster)", f"prometheus_client {ms(ref)}", ">= 10x", ratio >= 10)
        report.figure(f"values identical to prometheus_client, {engines} engine{'s' if engines > 1 else ''}",
                      f"{'yes' if same else 'NO'} ({len(ours)} samples)", "prometheus_client", "identical", same)
    header = ["engines", "page", "samples", "samples read", "prometheus_client", "kvwatch parse+adapt",
              "of which parse", "first poll (cold caches)", "split floor", "ratio", "identical values"]
    report.sections.append(
        "### Parse + adapt against prometheus_client\n\n"
        "Thread CPU time per page, median of interleaved rounds; kvwatch with the caches a running sidecar has "
        "(the first poll's cold figure beside it). 'split floor' is the floor any parser pays: splitting the page into "
        "lines and reading each sample's name and value, no labels.\n\n" + table(header, rows))
    print(plain_table(header, rows), flush=True)
