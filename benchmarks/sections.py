"""The sections of `make bench` (benchmarks/run.py), the code each one
measures, and the "## Not rerun" list of benchmarks/RESULTS.md: read by the
benchmark and by tests/test_bench_results.py (this module imports nothing
of the benchmark's)."""

from __future__ import annotations

SECTIONS = ("parse", "poll", "scrape", "memory", "curve", "replay", "page", "history", "central", "kv_events",
            "timeline", "process")

# The code each section measures: a section of RESULTS.md is current while
# no commit after the one it was measured at touched these paths
# (tests/test_bench_results.py asks git). Folders and files; a path that no
# longer exists still names its history.
_READING = ("kvwatch/exposition.py", "kvwatch/engines", "kvwatch/snapshot.py")
_POLL = _READING + ("kvwatch/scrape.py", "kvwatch/window.py", "kvwatch/window", "kvwatch/signals.py",
                    "kvwatch/signals", "kvwatch/diagnose", "kvwatch/pipeline/monitor.py", "kvwatch/pipeline",
                    "benchmarks/pageserver.py")
_SERVE = _POLL + ("kvwatch/sidecar", "kvwatch/commands/serve.py", "kvwatch/units.py")
# The benchmark's own code counts too: each section's module
# (benchmarks/bench_<section>.py) and the helpers all of them measure with;
# not benchmarks/run.py, the driver (options, stamps, writing RESULTS.md).
_BENCH = ("benchmarks/bench_support.py",)
SECTION_CODE: dict[str, tuple[str, ...]] = {
    "parse": _READING + _BENCH + ("benchmarks/bench_parse.py",),
    "poll": _POLL + _BENCH + ("benchmarks/bench_poll.py",),
    "scrape": _SERVE + _BENCH + ("benchmarks/burst.py", "benchmarks/bench_scrape.py"),
    "memory": _SERVE + _BENCH + ("benchmarks/memory_probe.py", "benchmarks/worst_page_probe.py",
                                 "kvwatch/mixin/config.py", "benchmarks/bench_memory.py"),
    "curve": _POLL + _BENCH + ("benchmarks/bench_curve.py",),
    "replay": _POLL + _BENCH + ("kvwatch/capture", "benchmarks/bench_replay.py"),
    "page": _POLL + _BENCH + ("kvwatch/sidecar/statuspage.py", "kvwatch/sidecar/series.py",
                              "kvwatch/sidecar/report.py", "kvwatch/sidecar/static", "kvwatch/present.py",
                              "benchmarks/bench_page.py"),
    "history": _READING + _BENCH + ("kvwatch/history", "kvwatch/window.py", "kvwatch/window", "kvwatch/signals.py",
                                    "kvwatch/signals", "kvwatch/diagnose", "benchmarks/bench_history.py"),
    "central": _READING + _BENCH + ("kvwatch/history", "kvwatch/central", "kvwatch/window.py", "kvwatch/window",
                                    "kvwatch/signals.py", "kvwatch/signals", "kvwatch/diagnose", "benchmarks/central_cost.py",
                                    "benchmarks/bench_history.py"),
    "kv_events": _BENCH + ("kvwatch/kvevents", "benchmarks/kv_events.py", "benchmarks/bench_kv_events.py"),
    "timeline": _POLL + _BENCH + ("kvwatch/sim", "kvwatch/scenarios", "scripts/demo-kvwatch.yaml",
                                  "kvwatch/settings.py", "benchmarks/bench_timeline.py"),
    "process": _SERVE + _BENCH + ("kvwatch/cli.py", "kvwatch/settings.py", "benchmarks/process_probe.py",
                                  "benchmarks/bench_process.py"),
}
# Commits that only moved code a section measures, unchanged, from one file
# to another (each with what moved): tests/test_bench_results.py does not
# count them against a section, since what the section measures is the same
# before and after. A commit that also changed what runs does not belong
# here: rerun the section or list it under "## Not rerun".
MOVED_WITHOUT_CHANGE: dict[str, str] = {
    "6429feb": "benchmarks/run.py's sections moved verbatim to benchmarks/bench_<section>.py and bench_support.py "
               "(central_cost.py imports them from there)",
}
# Each section's heading in RESULTS.md starts with one of these.
SECTION_HEADINGS: dict[str, tuple[str, ...]] = {
    "parse": ("### Parse + adapt",),
    "poll": ("### Whole poll cycle",),
    "scrape": ("### /metrics under",),
    "memory": ("### Memory over", "### The worst page"),
    "curve": ("### Cost from 1 to 64",),
    "replay": ("### Replay of",),
    "page": ("### Status page",),
    "history": ("### history:",),
    "central": ("### central mode: cost",),
    "kv_events": ("### KV-cache events",),
    "timeline": ("### Timeline:",),
    "process": ("### What the pod pays",),
}


def not_rerun_of(text: str) -> dict[str, str]:
    """The sections RESULTS.md lists under "## Not rerun" (`- name: why`)."""
    lines = text.split("\n")
    if "## Not rerun" not in lines:
        return {}
    found = {}
    for line in lines[lines.index("## Not rerun") + 1:]:
        if line.startswith("## "):
            break
        if line.startswith("- ") and ": " in line:
            name, why = line[2:].split(": ", 1)
            found[name] = why
    return found


def with_not_rerun(text: str, skipped: dict[str, str]) -> str:
    """`text` with its "## Not rerun" block (before the details) listing
    `skipped`, or without one when nothing was skipped."""
    lines = text.rstrip("\n").split("\n")
    if "## Not rerun" in lines:
        start = lines.index("## Not rerun")
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        del lines[start:end]
    if skipped:
        at = lines.index("## Details") if "## Details" in lines else len(lines)
        block = ["## Not rerun", "", "Sections of `make bench` whose figures below are not from a run on the code "
                 "they describe, and why:", ""] + [f"- {name}: {why}" for name, why in sorted(skipped.items())] + [""]
        lines[at:at] = block
    return "\n".join(lines) + "\n"
