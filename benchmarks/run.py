"""kvwatch's cost, measured against its baselines in one run (`make bench`).

Prints a table of every figure beside its baseline and target, and the
machine it ran on, and writes the same to benchmarks/RESULTS.md. Each figure
is a ratio or a median taken in this run; nothing here is a pass/fail test
(see docs/performance.md for the method).

    .venv/bin/python benchmarks/run.py [--fixtures DIR] [--quick] [--only parse,poll,...] [--merge]

`--only history --merge` runs one section and updates only its figures and
details in RESULTS.md. `--history-scale 256x6` runs the history section over
256 replicas x 6 h (the same replica-steps as 64 x 24 h, four times the
series) as a section and figures of their own.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import bench_curve  # noqa: E402
import bench_history  # noqa: E402
import bench_kv_events  # noqa: E402
import bench_timeline  # noqa: E402
import bench_memory  # noqa: E402
import bench_page  # noqa: E402
import bench_parse  # noqa: E402
import bench_poll  # noqa: E402
import bench_process  # noqa: E402
import bench_replay  # noqa: E402
import bench_scrape  # noqa: E402
from bench_support import Report, machine, plain_table, table  # noqa: E402
from kvwatch.pipeline.monitor import tune_garbage_collector  # noqa: E402
from pages import capture_text  # noqa: E402

from sections import SECTIONS, not_rerun_of, with_not_rerun  # noqa: E402


@dataclass
class Run:
    """What a section is handed besides the report: this run's options and
    the real vLLM page it scales."""
    capture: str
    fixtures: Path
    quick: bool
    history_scale: str | None = None


def bench_central(report: Report, quick: bool) -> None:
    """Central mode's cost per replica at 64, 256 and 1,000 replicas, and 4
    shards (benchmarks/central_cost.py)."""
    import central_cost

    central_cost.bench_central(report, quick)


# The sections, each with what runs it: one module per section
# (benchmarks/bench_<name>.py; central's is central_cost.py), each function
# adding its figures and its detail block to the report. They run in the
# order of sections.SECTIONS; a new section is a module, a line here, and
# its entry in benchmarks/sections.py (SECTIONS, SECTION_CODE,
# SECTION_HEADINGS).
SECTION_RUNS: dict[str, Callable[[Report, Run], None]] = {
    "parse": lambda report, run: bench_parse.bench_parse(report, run.capture, run.quick),
    "poll": lambda report, run: bench_poll.bench_poll(report, run.capture, run.fixtures, run.quick),
    "scrape": lambda report, run: bench_scrape.bench_scrape(report, run.fixtures, run.quick),
    "memory": lambda report, run: bench_memory.bench_memory(report, run.fixtures, run.quick),
    "curve": lambda report, run: bench_curve.bench_curve(report, run.capture, run.quick),
    "replay": lambda report, run: bench_replay.bench_replay(report, run.capture, run.quick),
    "page": lambda report, run: bench_page.bench_page(report, run.fixtures, run.quick),
    "history": lambda report, run: bench_history.bench_history(report, run.quick, run.history_scale),
    "central": lambda report, run: bench_central(report, run.quick),
    "kv_events": lambda report, run: bench_kv_events.bench_kv_events(report, run.quick),
    "timeline": lambda report, run: bench_timeline.bench_timeline(report, run.quick),
    "process": lambda report, run: bench_process.bench_process(report, run.fixtures, run.quick),
}
assert tuple(SECTION_RUNS) == SECTIONS, "benchmarks/sections.py SECTIONS and SECTION_RUNS name different sections"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixtures", type=Path, default=REPO / "tests" / "fixtures")
    parser.add_argument("--quick", action="store_true", help="fewer rounds, shorter simulated hour (20 min)")
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--merge", action="store_true",
                        help="update only the figures and sections run (with --only) in an existing --output")
    parser.add_argument("--history-scale", metavar="REPLICASxHOURS",
                        help="the history section over this fleet and range (e.g. 256x6), as a section and figures "
                             "of their own beside the default's (64x24, 16x1 with --quick)")
    args = parser.parse_args()
    if not (args.fixtures / "vllm-0.32-cpu").is_dir():
        print(f"real vLLM captures not found under {args.fixtures}", file=sys.stderr)
        return 2
    wanted = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        print(f"unknown sections: {', '.join(unknown)} (known: {', '.join(SECTIONS)})", file=sys.stderr)
        return 2

    started = time.monotonic()
    # kvwatch serve's setting (kvwatch/pipeline/monitor.py): every figure measured in
    # this process, prometheus_client's included, runs under it; the curve
    # also shows the poll under CPython's default.
    tune_garbage_collector()
    info = machine()
    print("kvwatch benchmark\n" + "\n".join(f"  {k}: {v}" for k, v in info.items()), flush=True)
    capture = capture_text(args.fixtures)
    report = Report()
    run = Run(capture, args.fixtures, args.quick, args.history_scale)
    for name in SECTIONS:
        if name in wanted:
            print(f"\n== {name} ==", flush=True)
            gc.collect()
            before = len(report.sections)
            stamp = section_stamp(info, merge=args.merge, quick=args.quick)
            SECTION_RUNS[name](report, run)
            for index in range(before, len(report.sections)):
                report.sections[index] = report.sections[index].rstrip("\n") + "\n\n" + stamp
    elapsed = time.monotonic() - started

    header = ["figure", "kvwatch", "baseline", "target", "met"]
    rows = [[f.name, f.value, f.baseline, f.target, "-" if f.met is None else ("yes" if f.met else "NO")]
            for f in report.figures]
    print("\n== summary ==\n" + plain_table(header, rows))
    print(f"\n{len([f for f in report.figures if f.met])} of {len([f for f in report.figures if f.met is not None])} "
          f"targets met in {elapsed:.0f} s; written to {args.output}")

    document = [
        "# kvwatch benchmark results",
        "",
        "Written by `make bench` (`benchmarks/run.py`); the method is in docs/performance.md. "
        "Every figure comes from this one run on this machine: compare ratios across machines, not milliseconds.",
        "",
        table(["machine", ""], [[k, v] for k, v in info.items()]),
        "",
        f"Input: `{args.fixtures.name}/vllm-0.32-cpu/metrics-load.txt` (a real vLLM 0.32 page), scaled to N engines. "
        f"Run{' (--quick)' if args.quick else ''} took {elapsed:.0f} s.",
        "",
        "## Summary",
        "",
        table(header, rows),
        "",
        "## Details",
        "",
        "\n\n".join(report.sections),
        "",
    ]
    if args.merge and args.output.exists():
        text = merged(args.output.read_text(), rows, report.sections, info)
        skipped = {name: why for name, why in not_rerun_of(text).items() if name not in wanted}
    else:
        text = "\n".join(document)
        skipped = {}
    skipped.update(report.not_run)
    args.output.write_text(with_not_rerun(text, skipped))
    return 0


def section_stamp(info: dict[str, str], merge: bool, quick: bool = False) -> str:
    """The line every section ends with: the commit it measured, when, and
    the load average as it started (tests/test_bench_results.py reads the
    commit)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    how = ("run on its own (`benchmarks/run.py --only ... --merge`; the machine table above is the full run's)"
           if merge else "run in the full run described above") + (", with --quick (fewer rounds)" if quick else "")
    return (f"Measured at commit {info['kvwatch commit']} on {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, load "
            f"average at the start of the section {' '.join(f'{x:.2f}' for x in load)}; {how}.")


def merged(existing: str, rows: list[list[str]], sections: list[str], info: dict[str, str]) -> str:
    """`existing` results with this run's summary rows and detail sections
    put in place of those of the same name (or added), the rest kept; each
    section says when and at which commit it was run (section_stamp)."""
    lines = existing.rstrip("\n").split("\n")
    names = {row[0] for row in rows}
    start = lines.index("## Summary")
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    table_rows = [line for line in lines[start:end] if line.startswith("| ") and not line.startswith("| figure ")]
    kept = [line for line in table_rows if line.split(" | ")[0][2:] not in names]
    new_rows = ["| " + " | ".join(row) + " |" for row in rows]
    header = [line for line in lines[start:end] if line.startswith("| figure ") or line.startswith("|---")]
    lines[start:end] = ["## Summary", "", *header, *kept, *new_rows, ""]
    text = "\n".join(lines) + "\n"
    for section in sections:
        heading = section.split("\n", 1)[0]
        body = section
        at = text.find("\n" + heading + "\n")
        if at < 0:
            text = text.rstrip("\n") + "\n\n" + body + "\n"
            continue
        after = text.find("\n### ", at + 1)
        text = text[:at + 1] + body + ("\n" + text[after:] if after >= 0 else "\n")
    return text


if __name__ == "__main__":
    sys.exit(main())
