"""The history section: `kvwatch diagnose --prometheus` over a fleet
backfilled into a real Prometheus with promtool; and the fleet's
OpenMetrics, which the central section (benchmarks/central_cost.py) reads too."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench_support import REPO, Report


# The bench fleet's shape: 14 families (9 plain, 5 histograms), 116 series a replica.
# The real vLLM 0.32 page each simulated replica of the history benchmark
# copies: its series, labels, bucket shares and sizes per request.
HISTORY_TEMPLATE = REPO / "tests" / "fixtures" / "vllm-0.32-cpu" / "metrics-load.txt"


def history_template() -> list[tuple[str, str, str, dict[str, str], float]]:
    """(kind, family, sample name, labels, value) of every series of the
    template page that kvwatch's adapter reads (and the `_created` of the
    counter that marks a restart, which history reads too)."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvwatch.history.pages import vllm_sample_name

    rows = []
    for family in text_string_to_metric_families(HISTORY_TEMPLATE.read_text()):
        for sample in family.samples:
            if vllm_sample_name(sample.name) is not None:
                rows.append((family.type, family.name, sample.name, dict(sample.labels), sample.value))
    return rows


def history_series(diagnosed_only: bool) -> tuple[int, int]:
    """(series, families) per replica that history reads from the template."""
    from kvwatch.history.pages import family_of, wanted

    names = [name for _kind, _family, name, _labels, _value in history_template()
             if wanted(name, "vllm", diagnosed_only)]
    return len(names), len({family_of(name, "vllm") for name in names})


def write_history_openmetrics(out, replicas: int, start: float, points: int, step: float) -> None:
    """A fleet's history as OpenMetrics for promtool, written to `out` one
    replica at a time: per replica, every series of a real vLLM 0.32 page
    that kvwatch reads (HISTORY_TEMPLATE: 256 series in 28 families, its 38
    cache_config_info labels, vLLM's buckets) advancing every step; replica 0
    runs full from the middle of the range, so the diagnosis has findings to
    fold. Replicas other than 0 differ only in their `instance`: their text
    is written once and copied with it replaced."""
    template_rows = history_template()
    template = None
    for r in range(replicas):
        instance = f"10.1.{r // 250}.{r % 250}:8000"
        if r == 0:
            out.write(_replica_openmetrics(template_rows, instance, start, points, step, hot=True))
            continue
        if template is None:
            template = _replica_openmetrics(template_rows, "@INSTANCE@", start, points, step, hot=False)
        out.write(template.replace("@INSTANCE@", instance))
    out.write("# EOF\n")


def _replica_openmetrics(rows, instance: str, start: float, points: int, step: float, hot: bool) -> str:
    """One replica's series. Traffic varies from step to step (requests per
    step drawn at random, fixed seed), as a real engine's does: with the same
    increase at every step, a window's inputs would repeat and the signals'
    evaluation cache would answer for nearly every step, which no real fleet
    gives. Every counter and histogram grows with the requests at the
    template's size per request and its bucket shares."""
    import random

    draw = random.Random(1 if hot else 2)
    reference = next(value for kind, family, name, _labels, value in rows
                     if name == "vllm:time_to_first_token_seconds_count") or 1.0
    # Per histogram (family, labels without le): the template's count, sum and bucket counts.
    counts: dict[tuple, float] = {}
    sums: dict[tuple, float] = {}
    for kind, family, name, labels, value in rows:
        identity = (family, tuple(sorted((k, v) for k, v in labels.items() if k != "le")))
        if kind == "histogram" and name.endswith("_count"):
            counts[identity] = value
        elif kind == "histogram" and name.endswith("_sum"):
            sums[identity] = value
    lines: dict[int, list[str]] = {index: [] for index in range(len(rows))}
    blocks = [(index, kind, family, name, labels, value,
               (family, tuple(sorted((k, v) for k, v in labels.items() if k != "le"))),
               ",".join([f'instance="{instance}"', 'job="vllm"']
                        + [f'{k}="{v}"' for k, v in sorted(labels.items())]))
              for index, (kind, family, name, labels, value) in enumerate(rows)]
    requests = hits = queried = 0
    for i in range(points):
        at = f"{start + i * step:.0f}"
        full = hot and i >= points // 2
        arrived = draw.randint(5, 15)
        requests += arrived
        queried += arrived * 400
        hits += arrived * draw.randint(200, 280)
        waiting = 10 if full else 0
        gauges = {"vllm:kv_cache_usage_perc": 0.99 if full else round(0.2 + draw.random() * 0.2, 3),
                  "vllm:num_requests_running": 32 if full else draw.randint(2, 6),
                  "vllm:num_requests_waiting": waiting,
                  "vllm:num_preemptions_total": (i + 1 - points // 2) * 3 if full else 0,
                  "vllm:prefix_cache_queries_total": queried, "vllm:prefix_cache_hits_total": hits}
        for index, kind, family, name, labels, value, identity, block in blocks:
            if name in gauges:
                current = gauges[name]
            elif name == "vllm:num_requests_waiting_by_reason":
                current = waiting if labels.get("reason") == "capacity" else 0
            elif name.endswith("_created"):
                current = start - 3600.0
            elif kind == "histogram":
                total = round(counts[identity] / reference * requests)
                if name.endswith("_count"):
                    current = total
                elif name.endswith("_sum"):
                    current = round(sums[identity] / counts[identity] * total, 6) if counts[identity] else 0.0
                else:
                    current = round(value / counts[identity] * total) if counts[identity] else 0
            elif kind == "counter":
                current = round(value / reference * requests, 3 if value != int(value) else None)
            else:
                current = value
            lines[index].append(f"{name}{{{block}}} {current!r} {at}")
    return "\n".join(line for index in range(len(rows)) for line in lines[index]) + "\n"


def cpu_with_children() -> float:
    """CPU seconds of this process and of its children that have ended
    (the diagnosis' worker processes, joined when it returns)."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def bench_history(report: Report, quick: bool, scale_text: str | None = None) -> None:
    """kvwatch diagnose --prometheus over a fleet backfilled into a real
    Prometheus with promtool: read, rebuild and diagnose every replica at
    every step, the fleet rules included. The whole range is diagnosed as
    the command does (worker processes, one per usable core); a slice of it
    also in one process, and with each page written as text and parsed
    (the baseline), for the ratios and to check that workers give the same
    timeline."""
    import math
    import shutil
    import tempfile

    sys.path.insert(0, str(REPO / "tests"))
    from promstack import backfilled_prometheus
    from kvwatch.history.query import DEFAULT_MAX_SAMPLES, MAX_POINTS, PrometheusClient
    from kvwatch.history.run import diagnose_history, usable_cores

    if shutil.which("promtool") is None or shutil.which("prometheus") is None:
        print("  skipped: promtool and prometheus are not installed")
        report.not_run["history"] = "promtool and prometheus were not installed on the machine of the run"
        return
    replicas, hours, slice_hours, step = (16, 1, 1, 30.0) if quick else (64, 24, 2, 30.0)
    if scale_text:  # REPLICASxHOURS: its own section and figures, the whole range measured
        replicas, hours = (int(part) for part in scale_text.lower().split("x"))
        slice_hours = 1
    points = int(hours * 3600 / step)
    slice_points = int(slice_hours * 3600 / step)
    start = float((int(time.time()) // 3600 - hours - 2) * 3600)
    workers = usable_cores()
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-bench-history-"))
    began = time.monotonic()
    source = workdir / "fleet.om"
    with open(source, "w") as out:
        write_history_openmetrics(out, replicas, start, points, step)
    size = source.stat().st_size
    written = time.monotonic() - began
    runs = {}
    try:
        # Blocks as long as the range: promtool reads its input once per block.
        with backfilled_prometheus(source, timeout=3600, block_hours=hours) as prom:
            source.unlink()
            setup = time.monotonic() - began

            def measure(label: str, count: int, **options) -> None:
                cpu = cpu_with_children()
                found = diagnose_history(PrometheusClient(prom.url), start, start + (count - 1) * step, step,
                                         window=300.0, **options)
                runs[label] = (cpu_with_children() - cpu, found, replicas * count)
                print(f"  {label}: {found.cost['total_seconds']:.1f}s wall, {runs[label][0]:.1f}s CPU, "
                      f"{found.cost['queries']} queries, {found.cost['samples']:,} samples", flush=True)

            # CPU counts this process and its workers, not the store's own.
            measure("whole range, workers", points, workers=workers)
            measure("slice, pages as text", slice_points, pages_as_text=True)
            measure("slice, one process", slice_points)
            measure("slice, workers", slice_points, workers=workers)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    cpu, history, replica_steps = runs["whole range, workers"]
    cost = history.cost
    total = cost["total_seconds"]
    per_step = {label: run[0] / run[2] for label, run in runs.items()}
    one, many = runs["slice, one process"][1], runs["slice, workers"][1]
    same = (one.timeline.episodes == many.timeline.episodes
            and {n: r.trend for n, r in one.replicas.items()} == {n: r.trend for n, r in many.replicas.items()})
    # The read's bounds: each family read once per chunk of steps (two more
    # queries list the series), each sample once, and each series listed
    # once (the listing counts one per series, all of vLLM's included).
    per_replica, families = history_series(diagnosed_only=True)
    series = replicas * per_replica
    rounds = math.ceil(points / max(1, min(MAX_POINTS, DEFAULT_MAX_SAMPLES // series)))
    max_queries = families * rounds + 2
    max_samples = series * points + replicas * history_series(diagnosed_only=False)[0]
    within = cost["queries"] <= max_queries and cost["samples"] <= max_samples
    full = 64 * 2880
    scale = f"{replicas} replicas x {hours} h at {step:g} s"
    # A chosen scale's rows and section are its own (the default's are kept).
    suffix = f", {scale}" if scale_text else ""
    print(f"  {scale} ({replica_steps:,} replica-steps; OpenMetrics {size / 1e6:.0f} MB written in {written:.0f}s, "
          f"backfilled in {setup - written:.0f}s): {cost['queries']} queries, {cost['samples']:,} samples, "
          f"read {cost['seconds']:.1f}s, total {total:.1f}s wall, {cpu:.1f}s CPU with {workers} workers; "
          f"{len(history.timeline.episodes)} findings; CPU per replica-step: "
          + ", ".join(f"{label} {value * 1e3:.3f} ms" for label, value in per_step.items()))
    if scale_text:
        report.figure(f"history: {scale}, measured",
                      f"{total:.0f} s wall, {cpu:.0f} s CPU ({workers} workers)",
                      f"one process: {per_step['slice, one process'] * replica_steps:.0f} s CPU "
                      f"(from a {slice_hours} h slice)", "< 60 s", total < 60)
    elif replica_steps == full:
        report.figure("history: 64 replicas x 24 h at 30 s, measured",
                      f"{total:.0f} s wall, {cpu:.0f} s CPU ({workers} workers)",
                      f"one process: {per_step['slice, one process'] * full:.0f} s CPU (from a {slice_hours} h slice)",
                      "< 60 s", total < 60)
    else:
        extrapolated = total / replica_steps * full
        report.figure("history: 64 replicas x 24 h at 30 s, extrapolated",
                      f"{extrapolated:.0f} s wall ({scale}: {total:.1f} s, {workers} workers)",
                      f"one process: {per_step['slice, one process'] * full:.0f} s CPU", "< 60 s", extrapolated < 60)
    report.figure(f"history: queries and samples, {scale}", f"{cost['queries']} queries, {cost['samples']:,} samples",
                  "-", f"<= {max_queries} queries, <= {max_samples:,} samples", within)
    report.figure("history: CPU per replica-step" + suffix,
                  f"{per_step['slice, workers'] * 1e3:.3f} ms ({workers} workers), "
                  f"{per_step['slice, one process'] * 1e3:.3f} ms (one process)",
                  f"pages as text {per_step['slice, pages as text'] * 1e3:.3f} ms", "-", None)
    report.figure("history: workers give the one-process timeline" + suffix, "yes" if same else "NO", "one process",
                  "identical", same)
    report.sections.append("\n".join([
        "### history: `kvwatch diagnose --prometheus`" + suffix,
        "",
        f"{scale} ({replica_steps:,} replica-steps), backfilled into a real Prometheus with "
        f"`promtool tsdb create-blocks-from openmetrics` ({size / 1e6:.0f} MB of OpenMetrics, {setup:.0f} s to "
        f"write and backfill), diagnosed as `kvwatch diagnose --prometheus` does, with {workers} worker processes "
        f"(one per usable core): {cost['queries']} queries (bound: {max_queries}, each of the "
        f"{families} families once per chunk of steps, and two listing the series; {per_replica} of the "
        f"{history_series(diagnosed_only=False)[0]} series of a real vLLM 0.32 replica that kvwatch reads, "
        "the rest being latency histograms no rule reads), "
        f"{cost['samples']:,} samples (bound: {max_samples:,}, each sample once and each series listed once), {cost['bytes'] / 1e6:.0f} MB "
        f"read in {cost['seconds']:.1f} s; rebuilding and diagnosing {cost['diagnose_seconds']:.1f} s; total "
        f"{total:.1f} s wall, {cpu:.1f} s CPU of this process and its workers (the store's own not counted): "
        f"on {workers} cores the wall time cannot fall below {cpu / workers:.0f} s, before the store's own work "
        "and whatever else the machine runs.",
        "",
        f"The first {slice_hours} h of the same store, three ways (CPU per replica-step): "
        f"{per_step['slice, workers'] * 1e3:.3f} ms with workers, {per_step['slice, one process'] * 1e3:.3f} ms "
        f"in one process, {per_step['slice, pages as text'] * 1e3:.3f} ms writing and parsing each page (the "
        f"baseline). Workers and one process give the same timeline and trends: {'yes' if same else 'NO'}. "
        "Wall time depends on what else the machine runs: see the load average at start.",
    ]))
