"""`kvwatch diagnose`: poll a target for a while, then print the signals per
model and engine and the active findings with their evidence and next check.

Exit status: 0 when no warning or critical finding is active at the end, 1
when one is, 2 when the configuration is bad or the target never answered
with engine metrics. `--json` prints one object for scripts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
import time
from typing import Any, TextIO

from kvwatch.diagnose import is_actionable
from kvwatch.sidecar.report import diagnosis_json, signals_json
from kvwatch.sidecar.settings import SettingsError, load_settings, parse_duration
from kvwatch.signals import SIGNALS
from kvwatch.sidecar.statuspage import format_evidence, format_value, signal_columns

EXIT_OK, EXIT_FINDINGS, EXIT_UNUSABLE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="the engine's /metrics URL (default: `target` in --config, else "
                                         "KVWATCH_TARGET, else http://127.0.0.1:8000/metrics)")
    parser.add_argument("--duration", default="30s", help="how long to poll (default 30s); the window covers it")
    parser.add_argument("--interval", default="2s", help="time between polls (default 2s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--config", help="YAML config file (diagnosis thresholds, TLS, upstream, ...)")


def run(args: argparse.Namespace) -> int:
    from kvwatch.sidecar.monitor import Monitor

    problems = []
    duration = interval = None
    for flag, raw in (("--duration", args.duration), ("--interval", args.interval)):
        try:
            value = parse_duration(raw)
        except ValueError as exc:
            problems.append(f"{flag}: {exc}")
            continue
        if flag == "--duration":
            duration = value
        else:
            interval = value
    if duration is not None and interval is not None and interval > duration:
        problems.append(f"--interval ({interval:g}s) must not exceed --duration ({duration:g}s)")
    if problems:
        return _fail(problems)
    # The window spans the whole run, so every poll counts.
    overrides = {"target": args.target, "poll_interval": interval, "window": max(duration, 2 * interval) + interval}
    try:
        settings = load_settings(args.config, overrides)
    except SettingsError as exc:
        return _fail(exc.problems)

    # Say where the target came from: a silent default polled the wrong engine.
    import os

    from kvwatch.sidecar.report import public_url
    from kvwatch.sidecar.settings import Settings

    if args.target:
        source = "--target"
    elif os.environ.get("KVWATCH_TARGET"):
        source = "KVWATCH_TARGET"
    elif args.config and settings.target != Settings.target:
        source = f"`target` in {args.config}"
    else:
        source = "the default; give --target, `target` in --config, or KVWATCH_TARGET"
    print(f"kvwatch diagnose: polling {public_url(settings.target)} ({source})", file=sys.stderr)
    # One account of a failing target, at the end (the sentence), not a log
    # line per transition beside it.
    logging.getLogger("kvwatch").setLevel(logging.ERROR)
    monitor = Monitor(settings)
    last_good = None
    polls = 0
    started = time.monotonic()
    deadline = started + duration
    progress = sys.stderr if sys.stderr.isatty() and not args.json else None
    try:
        while True:
            state = monitor.poll_once()
            polls += 1
            if state.up:
                last_good = state
            if progress:
                print(f"\rpoll {polls}: {'up' if state.up else 'down: ' + (state.reason or '')}"
                      f" ({len(state.findings)} findings)   ", end="", file=progress, flush=True)
            next_due = started + polls * interval
            if next_due > deadline + 1e-9:
                break
            time.sleep(max(0.0, next_due - time.monotonic()))
    except KeyboardInterrupt:
        if progress:
            print(" interrupted", file=progress)
    if progress:
        print(file=progress)

    final = monitor.state
    if last_good is None:
        if args.json:
            print(json.dumps({"up": False, "target": signals_json(final, settings)["target"], "reason": final.reason,
                              "detail": final.detail, "polls": polls}, indent=2))
        else:
            print(f"kvwatch diagnose: no engine metrics from {signals_json(final, settings)['target']} in {polls} "
                  f"polls: {final.detail}", file=sys.stderr)
        return EXIT_UNUSABLE

    signals = signals_json(last_good, settings)
    diagnosis = diagnosis_json(last_good, settings)
    actionable = [f for f in last_good.findings if is_actionable(f)]
    if args.json:
        print(json.dumps({
            "target": signals["target"],
            "polls": polls,
            "failed_polls": sum(final.errors_by_reason.values()),
            "last_poll_up": final.up,
            "window_covered_seconds": last_good.window_seconds,
            "engines": signals["engines"],
            "models": signals["models"],
            "findings": diagnosis["findings"],
            "events": diagnosis["events"],
            "upstream": diagnosis["upstream"],
            "exit_code": EXIT_FINDINGS if actionable else EXIT_OK,
        }, indent=2))
    else:
        print_report(sys.stdout, signals, diagnosis, polls, final)
    return EXIT_FINDINGS if actionable else EXIT_OK


def _fail(problems: list[str]) -> int:
    print("kvwatch diagnose: invalid configuration:", file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    return EXIT_UNUSABLE


def _table(rows: list[list[str]], out: TextIO, indent: str = "") -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip(), file=out)


def print_report(out: TextIO, signals: dict[str, Any], diagnosis: dict[str, Any], polls: int, final) -> None:
    failed = sum(final.errors_by_reason.values())
    print(f"kvwatch diagnose: {signals['target']}, {polls} polls ({failed} failed), window "
          f"{signals['window_covered_seconds']:.0f}s", file=out)
    if not final.up:
        print(f"  last poll failed: {final.detail}; showing the last good poll", file=out)

    columns = signal_columns(signals)
    print("\nSIGNALS", file=out)
    rows = [["signal"] + [heading for heading, _ in columns]]
    for signal in SIGNALS:
        cells = [format_value(values.get(signal.name), signal.unit) for _, values in columns]
        if all(cell == "–" for cell in cells):
            continue
        rows.append([signal.name[len("kvwatch_"):]] + cells)
    _table(rows, out, "  ")

    findings = diagnosis["findings"]
    print(f"\nFINDINGS ({len(findings)} active)", file=out)
    if not findings:
        print("  none", file=out)
    for finding in findings:
        where = finding["model_name"] + (f"/{finding['engine']}" if finding["engine"] is not None else "")
        print(f"\n  {finding['severity'].upper():8}  {finding['symptom']} / {finding['cause']}  [{where}]  "
              f"confidence {finding['confidence']}", file=out)
        lines = [("", finding["summary"]), ("evidence: ", format_evidence(finding["evidence"]))]
        lines += [(f"{key.replace('_', ' ')}: ", note) for key, note in finding.get("notes", {}).items()]
        lines += [("next: ", finding["next_check"])]
        if finding.get("runbook"):
            lines.append(("runbook: ", finding["runbook"]))
        for label, text in lines:
            print(textwrap.fill(label + text, width=110, initial_indent="    ", subsequent_indent="      "), file=out)
    events = diagnosis["events"]
    if events:
        print("\nCHANGES", file=out)
        for event in events:
            print(f"  {event['kind']} {event['model'] or '*'}/{event['engine'] or '*'}: {event['detail']}", file=out)
    upstream = diagnosis.get("upstream")
    if upstream:
        print(f"\nUPSTREAM {upstream['histogram']}: {'up' if upstream['up'] else 'down ' + str(upstream['reason'])}, "
              f"mean {format_value(upstream['mean_seconds'], 'seconds')}, p95 "
              f"{format_value(upstream['p95_seconds'], 'seconds')}", file=out)
