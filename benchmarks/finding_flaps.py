"""Flaps of the findings on the simulated demo (`make run`'s settings: 2 s
polls, a 1m window), with and without the finding hold
(diagnosis: finding_hold_seconds; docs/diagnosis.md, "Clearing: the hold").

The simulator and the sidecar's monitor run on simulated time (no waits):
one loop of the demo's phases (1710 s) per seed, polled on the simulator's
seconds and between them.

    .venv/bin/python benchmarks/finding_flaps.py            # no hold, and the default hold
    .venv/bin/python benchmarks/finding_flaps.py 0 30 120   # holds in seconds

Prints, per hold and per simulated hour: findings gone for exactly one poll;
kvwatch_finding series (its severity label included) gone for one poll;
episodes; episodes that start again within 60 s of the last one's end.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from kvwatch.diagnose.timeline import Timeline  # noqa: E402
from sim_support import sim_monitor  # noqa: E402

LOOP = 1710.0  # seconds: one loop of kvwatch/scenarios/demo.yaml
SEEDS = range(4)
OFFSETS = (0.0, 1.0)  # polls on the simulator's seconds, and between them


def run(seed: int, hold: float | None, offset: float) -> tuple[int, int, int, int]:
    thresholds = {"max_num_seqs": 12}
    if hold is not None:
        thresholds["finding_hold_seconds"] = hold
    polls = []
    timeline = Timeline()

    def on_state(state):
        timeline.add_state(state)
        polls.append(({(f.symptom, f.cause, f.model, f.engine) for f in state.findings},
                      {(f.symptom, f.cause, f.severity, f.model, f.engine) for f in state.findings}))

    sim_monitor([("demo", offset)], until=LOOP, seed=seed, every=2.0, window="1m", thresholds=thresholds,
                on_state=on_state)
    timeline.finish()
    blinks = [0, 0]
    for i in range(1, len(polls) - 1):
        for j in (0, 1):
            blinks[j] += len((polls[i - 1][j] - polls[i][j]) & polls[i + 1][j])
    episodes: dict[tuple, list] = {}
    for episode in timeline.episodes:
        episodes.setdefault((episode.symptom, episode.cause, episode.model, episode.engine), []).append(episode)
    restarts = 0
    for group in episodes.values():
        group.sort(key=lambda e: e.start)
        restarts += sum(1 for a, b in zip(group, group[1:]) if b.start - a.end <= 60.0)
    return blinks[0], blinks[1], restarts, len(timeline.episodes)


def main(argv: list[str]) -> None:
    holds = [float(a) for a in argv] or [0.0, None]
    for hold in holds:
        totals = [0, 0, 0, 0]
        hours = 0.0
        for seed in SEEDS:
            for offset in OFFSETS:
                totals = [a + b for a, b in zip(totals, run(seed, hold, offset))]
                hours += LOOP / 3600
        name = "default hold" if hold is None else f"hold {hold:g} s"
        print(f"{name} over {hours:.2f} simulated h, per hour: findings gone for one poll {totals[0] / hours:.1f}, "
              f"kvwatch_finding series gone for one poll {totals[1] / hours:.1f}, episodes {totals[3] / hours:.1f}, "
              f"episodes starting again within 60 s {totals[2] / hours:.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
