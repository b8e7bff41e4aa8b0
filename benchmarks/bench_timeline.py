"""The timeline section: the demo loop told over time,
scored poll by poll against the story each phase states
(kvwatch/sim/score.py), at the demo's settings (scripts/demo-kvwatch.yaml)
and at the defaults, over three seeds on simulated time."""

from __future__ import annotations

from bench_support import REPO, Report, plain_table, table

from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.score import BARS, run_scenario, score, settings_for

SEEDS = (0, 1, 2)
# The defaults, with what an operator states for the demo's engine (vLLM does not export max_num_seqs).
SETTINGS = (("the demo's (2 s polls, 1m window)", str(REPO / "scripts" / "demo-kvwatch.yaml"), None),
            ("the defaults (5 s polls, 5m window)", None, {"max_num_seqs": 12}))


def _worst(value: float | None) -> str:
    return "never" if value is None else f"{value:.0f} s"


def _row(label: str, seed: int, result) -> list[str]:
    f = result.figures()
    worst = _worst
    return [label, str(seed), f"{f['banner_right']:.1%}", f"{f['false_min']:.2f}", f"{f['false_high_min']:.2f}",
            str(f["cause_changes_max"]), str(f["toggles"]), str(f["born_clearing"]), worst(f["start_worst_s"]),
            worst(f["clear_worst_s"]), "yes" if not result.failures() else "NO"]


def bench_timeline(report: Report, quick: bool) -> None:
    demo = load_scenario("demo")
    rows, missed = [], []
    for label, config, diagnosis in SETTINGS:
        settings = settings_for(config, diagnosis=diagnosis)
        results = [(seed, score(demo, run_scenario(demo, settings, demo.cycle_seconds, seed)))
                   for seed in (SEEDS[:1] if quick else SEEDS)]
        for seed, result in results:
            rows.append(_row(label, seed, result))
            missed += [f"{label}, seed {seed}: {line}" for line in result.failures()]
        worst_banner = min(r.banner_right_share for _, r in results)
        false = max(r.false_seconds for _, r in results) / 60
        report.figure(f"timeline, demo loop at {label}: banner right (worst seed)", f"{worst_banner:.1%}",
                      f"{len(results)} seeds, from {75:.0f} s into each phase", f">= {BARS['banner_right_share']:.0%}",
                      worst_banner >= BARS["banner_right_share"])
        report.figure(f"timeline, demo loop at {label}: every bar of the story over time", f"{sum(not r.failures() for _, r in results)} "
                      f"of {len(results)} seeds", f"false findings up to {false:.2f} min a loop", "all",
                      all(not r.failures() for _, r in results))
    header = ["settings", "seed", "banner right", "false min", "false high-confidence min", "cause changes (most in a phase)",
              "toggles", "born clearing", "start (worst)", "clear (worst)", "every bar"]
    report.sections.append(
        "### Timeline: the demo loop told over time\n\n"
        "One loop of kvwatch/scenarios/demo.yaml (27 min) per seed through the sidecar's Monitor on simulated time "
        "(the engine's page, its RAG service's page, its KV-cache events), every poll scored against the story its "
        "phase states (kvwatch/sim/score.py; docs/diagnosis.md, \"The story over time, scored\"). Bars: "
        "banner right on 97 % of polls from 75 s into each phase, at most 0.5 min of false findings a loop and none "
        "at high confidence, at most one cause change a phase, no toggles, none born clearing, a finding within 45 s "
        "of its condition and gone within 75 s of its end.\n\n" + table(header, rows)
        + ("\n\nMissed:\n\n" + "\n".join(f"- {line}" for line in missed) if missed else ""))
    print(plain_table(header, rows), flush=True)
    for line in missed:
        print("  missed:", line)
