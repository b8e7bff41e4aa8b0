"""When the first-token objective pages on the simulated demo (`make run`'s
scenario, kvwatch/scenarios/demo.yaml), with the default objective (99 % of
first tokens within 2.5 s) and burn-rate pairs.

The simulator and the sidecar's monitor run on simulated time (no waits);
kvwatch polls every 15 s (a scrape interval), and each pair's error ratios are
computed from the TTFT bucket counters kvwatch exports at each poll, with the
arithmetic of the recording rules (kvwatch-objectives.rules: 1 - the
increase of the 2.5 s bucket over the increase of the count, over the pair's
windows; a window longer than the history reads the whole history, as
Prometheus' rate() does). A pair fires once both ratios have exceeded
factor x budget for `for: 2m`, and keeps firing until they have been clear for
its short window (keep_firing_for).

    .venv/bin/python benchmarks/demo_time_to_page.py [SECONDS]   # default: two loops

Prints the minutes into the demo at which each pair fires, and the share of
late first tokens over 5 minutes every 3 minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from prometheus_client import generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvwatch.mixin import objectives  # noqa: E402
from kvwatch.mixin.config import MixinConfig  # noqa: E402
from kvwatch.sidecar.collector import make_registry  # noqa: E402
from kvwatch.units import parse_prometheus_duration as seconds  # noqa: E402
from sim_support import sim_monitor  # noqa: E402

EVERY = 15
FOR_POLLS = 120 // EVERY


def polls(until: float) -> list[tuple[float | None, float | None]]:
    """(first tokens within 2.5 s, all first tokens) as exported after each poll."""
    rows = []

    def on_state(state):
        text = generate_latest(make_registry(SimpleNamespace(state=state))).decode()
        good = count = None
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvwatch_engine_time_to_first_token_seconds_bucket" and sample.labels["le"] == "2.5":
                    good = sample.value
                elif sample.name == "kvwatch_engine_time_to_first_token_seconds_count":
                    count = sample.value
        rows.append((good, count))

    sim_monitor("demo", until=until, every=EVERY, window="5m", on_state=on_state)
    return rows


def late_share(rows, i: int, span_s: float) -> float | None:
    j = max(0, i - int(span_s // EVERY))
    (g0, c0), (g1, c1) = rows[j], rows[i]
    if None in (g0, c0, g1, c1) or c1 - c0 <= 0:
        return None
    return 1 - (g1 - g0) / (c1 - c0)


def main() -> None:
    until = float(sys.argv[1]) if len(sys.argv) > 1 else 2 * 1710.0
    config = MixinConfig()
    rows = polls(until)
    budget = objectives.budget(config, "first_token")
    for pair in objectives.burn_windows(config):
        threshold = pair.factor * budget
        held, clear, firing, fired, resolved = 0, 0, False, [], []
        hold_polls = int(seconds(pair.short) // EVERY)
        for i in range(len(rows)):
            long, short = late_share(rows, i, seconds(pair.long)), late_share(rows, i, seconds(pair.short))
            burning = long is not None and short is not None and long > threshold < short
            held = held + 1 if burning else 0
            clear = 0 if burning else clear + 1
            if not firing and held > FOR_POLLS:
                firing = True
                fired.append(round(i * EVERY / 60, 1))
            elif firing and clear > hold_polls:
                firing = False
                resolved.append(round(i * EVERY / 60, 1))
        print(f"{pair.long}/{pair.short} ({pair.severity}) fires at minutes {fired}, resolves at {resolved}")
    for i in range(0, len(rows), 180 // EVERY):
        share = late_share(rows, i, 300)
        print(f"{i * EVERY / 60:5.1f} min  late over 5m: {'-' if share is None else f'{share:.0%}'}")


if __name__ == "__main__":
    main()
