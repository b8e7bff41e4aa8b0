"""`kvwatch diagnose`: poll a target for a while, then print the signals per
model and engine and the active findings with their evidence and next check.

Exit status: 0 when no warning or critical finding is active at the end, 1
when one is, 2 when the configuration is bad or the target never answered
with engine metrics. `--json` prints one object for scripts.

`--replay CAPTURE` reads a capture (`kvwatch capture`) instead of a target:
every recorded page goes through the sidecar's monitor at its recorded time,
without waiting, and the report is the timeline of findings (when each
started and ended, its evidence at the worst point). Exit status 1 when a
warning or critical finding occurred anywhere in the capture.

`--prometheus URL` reads history from a Prometheus-compatible store instead
of polling a target (`--since 6h`, or `--from`/`--to`; `--selector`): every
replica the store scraped, diagnosed step by step with the sidecar's
pipeline, plus the fleet findings across replicas of a model; the report is
a timeline per model and replica (`--json`, `--html FILE`). Exit status 1
when a warning or critical finding occurred anywhere in the range, 2 when the
store could not be read or holds no vLLM series there.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import textwrap
import time
from typing import TYPE_CHECKING, Any, TextIO

from kvwatch.diagnose import is_actionable
from kvwatch.diagnose.arbitration import decided_headline
from kvwatch.sidecar.report import caveat_lines, diagnosis_json, signals_json
from kvwatch.settings import Settings, SettingsError, flag_help, load_settings, parse_duration
from kvwatch.commands import failfast
from kvwatch.signals import SIGNALS
from kvwatch.present import TerminalText, TextOut, format_evidence, format_value, signal_columns, signal_label
from kvwatch.stream_report import KVEventsReport

if TYPE_CHECKING:
    from kvwatch.pipeline.monitor import Monitor, State

EXIT_OK, EXIT_FINDINGS, EXIT_UNUSABLE = 0, 1, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help=flag_help("target"))
    parser.add_argument("--duration", default="30s", help="how long to poll (default 30s); the window covers it")
    parser.add_argument("--interval", default="2s", help="time between polls (default 2s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    failfast.add_arguments(parser, "polling")
    parser.add_argument("--config", help="YAML config file (diagnosis thresholds, TLS, upstream, ...)")
    parser.add_argument("--engine", help=flag_help("engine"))
    parser.add_argument("--gpu-hour-price", help=flag_help("gpu_hour_price"))
    parser.add_argument("--replay", metavar="CAPTURE",
                        help="replay a capture folder or .tar.gz bundle at its recorded times instead of polling")
    history = parser.add_argument_group("history (--prometheus)")
    history.add_argument("--prometheus", metavar="URL",
                         help="read history from this Prometheus-compatible query API instead of polling a target")
    history.add_argument("--since", default="6h", help="range ending now (default 6h)")
    history.add_argument("--from", dest="from_", metavar="TIME", help="range start: Unix seconds or RFC 3339")
    history.add_argument("--to", metavar="TIME", help="range end: Unix seconds or RFC 3339 (default now)")
    history.add_argument("--step", help="time between rebuilt polls (default: from the range, at least 15s)")
    history.add_argument("--selector", default="", help="label selector of the series, e.g. '{namespace=\"llm\"}'")
    history.add_argument("--source", choices=("auto", "vllm", "kvwatch"), default="auto",
                         help="vLLM's own series or the sidecars' kvwatch_engine_* (default: vLLM's if present)")
    history.add_argument("--window", default=None,
                         help="with --replay or --prometheus: span of the windowed signals (default: the config's, 5m)")
    history.add_argument("--replica-labels", default="job,instance,namespace,pod",
                         help="labels that tell replicas apart (default job,instance,namespace,pod)")
    history.add_argument("--html", metavar="FILE", help="also write a self-contained HTML report")
    history.add_argument("--concurrency", type=int, default=4, help="queries at once (default 4)")
    history.add_argument("--workers", type=int, default=None,
                         help="processes that diagnose the replicas (default: one per usable core; 1: none)")
    history.add_argument("--max-samples", type=int, default=5_000_000,
                         help="samples per query at most (default 5,000,000; Prometheus refuses above 50M)")
    history.add_argument("--query-timeout", default="60s", help="timeout of each query (default 60s)")
    history.add_argument("--bearer-token-file", help="token for the store (default: the config's bearer_token_file)")
    history.add_argument("--ca-bundle", help="CA bundle for the store's TLS (default: the config's ca_bundle)")
    history.add_argument("--insecure-skip-verify", action="store_true", help="do not verify the store's certificate")


def run(args: argparse.Namespace) -> int:
    from kvwatch.pipeline.monitor import Monitor

    if args.replay:
        return run_replay(args)
    if getattr(args, "prometheus", None):
        return run_history(args)
    parsed = _poll_arguments(args)
    if isinstance(parsed, list):
        return _fail(parsed)
    duration, interval, max_failures = parsed
    # The window spans the whole run, so every poll counts: planned so, and
    # widened as the polls come if a loaded machine or a slow engine makes them
    # late (the run takes its polls however long they take: see _poll).
    overrides = {"target": args.target, "engine": args.engine, "poll_interval": interval, "window": max(duration, 2 * interval) + interval,
                 "gpu_hour_price": args.gpu_hour_price}
    try:
        settings = load_settings(args.config, overrides)
    except SettingsError as exc:
        return _fail(exc.problems)
    _say_target(args, settings)
    # One account of a failing target, at the end (the sentence), not a log
    # line per transition beside it.
    logging.getLogger("kvwatch").setLevel(logging.ERROR)
    monitor = Monitor(settings, whole_run=True)
    failures = failfast.FailureReport(sys.stderr, "kvwatch diagnose", max_failures)
    progress = sys.stderr if sys.stderr.isatty() and not args.json else None
    last_good, polls = _poll(monitor, duration, interval, failures, progress)
    return _report(args, settings, monitor.state, last_good, polls, failures)


def _poll_arguments(args: argparse.Namespace) -> tuple[float, float, int | None] | list[str]:
    """(duration, interval, max failures) from the flags, or the problems with them."""
    problems = []
    durations: dict[str, float] = {}
    for flag, raw in (("--duration", args.duration), ("--interval", args.interval)):
        try:
            durations[flag] = parse_duration(raw)
        except ValueError as exc:
            problems.append(f"{flag}: {exc}")
    duration, interval = durations.get("--duration"), durations.get("--interval")
    if duration is not None and interval is not None and interval > duration:
        problems.append(f"--interval ({interval:g}s) must not exceed --duration ({duration:g}s)")
    if getattr(args, "window", None):
        # A live run's window is the run itself; a --window taken silently would say a span it did not read.
        problems.append(f"--window ({args.window}) applies to --replay and --prometheus: a live run's window is "
                        f"its --duration")
    max_failures, problem = failfast.limit_of(args)
    if problem:
        problems.append(problem)
    if problems or duration is None or interval is None:
        return problems
    return duration, interval, max_failures


def _say_target(args: argparse.Namespace, settings: Settings) -> None:
    """Say where the target came from: a silent default polled the wrong engine."""
    import os

    from kvwatch.present import public_url

    if args.target:
        source = "--target"
    elif os.environ.get("KVWATCH_TARGET"):
        source = "KVWATCH_TARGET"
    elif args.config and settings.target != Settings.target:
        source = f"`target` in {args.config}"
    else:
        source = "the default; give --target, `target` in --config, or KVWATCH_TARGET"
    print(f"kvwatch diagnose: polling {public_url(settings.target)} ({source})", file=sys.stderr)


def _poll(monitor: Monitor, duration: float, interval: float, failures: failfast.FailureReport,
          progress: TextIO | None) -> tuple[State | None, int]:
    """Polls every `interval` for `duration` (or until the failures give up
    or Ctrl-C): the last good poll's state and the number of polls."""
    if monitor.kv_events is not None:  # `kv_events` in the config: read the engine's stream while polling
        monitor.kv_events.start()
    last_good = None
    polls = 0
    started = time.monotonic()
    deadline = started + duration
    try:
        while True:
            state = monitor.poll_once()
            polls += 1
            if state.up:
                last_good = state
            _said(state, polls, failures, progress)
            if failures.gave_up:
                break
            next_due = started + polls * interval
            if next_due > deadline + 1e-9:
                break
            time.sleep(max(0.0, next_due - time.monotonic()))
    except KeyboardInterrupt:
        if progress:
            print(" interrupted", file=progress)
    finally:
        if monitor.kv_events is not None:
            monitor.kv_events.stop()
    if progress:
        print(file=progress)
    return last_good, polls


def _said(state: State, polls: int, failures: failfast.FailureReport, progress: TextIO | None) -> None:
    # A failure is said at once, on a line of its own, before the progress line.
    if state.up:
        failures.succeeded(polls)
    else:
        if progress and polls > 1:
            print(file=progress)  # end the progress line the terminal shows
        failures.failed(polls, state.reason or "error", state.detail)
    if progress:
        print(f"\rpoll {polls}: {'up' if state.up else 'down: ' + (state.reason or '')}"
              f" ({len(state.findings)} findings)   ", end="", file=progress, flush=True)


def _report(args: argparse.Namespace, settings: Settings, final: State, last_good: State | None, polls: int,
            failures: failfast.FailureReport) -> int:
    """The report of the last good poll (JSON or tables) and the exit status."""
    stopped = failures.gave_up_text() if failures.gave_up else None
    if last_good is None:
        if args.json:
            print(json.dumps({"up": False, "target": signals_json(final, settings)["target"], "reason": final.reason,
                              "detail": final.detail, "polls": polls, "stopped": stopped}, indent=2))
        else:
            # The failure's sentence was said as it happened; this line says how it ended.
            print(f"kvwatch diagnose: no engine metrics from {signals_json(final, settings)['target']} in {polls} "
                  f"polls" + (f"; {stopped}" if stopped else ""), file=sys.stderr)
        return EXIT_UNUSABLE
    if stopped and not args.json:
        print(f"kvwatch diagnose: {stopped}; the report below is of the last good poll", file=sys.stderr)

    signals = signals_json(last_good, settings)
    diagnosis = diagnosis_json(last_good, settings)
    actionable = [f for f in last_good.findings if is_actionable(f)]
    exit_code = EXIT_FINDINGS if actionable else EXIT_OK
    if args.json:
        print(json.dumps(_json_report(signals, diagnosis, polls, final, stopped, last_good, exit_code), indent=2))
    else:
        print_report(TerminalText(sys.stdout), signals, diagnosis, polls, final)
        print_worth(TerminalText(sys.stdout), signals["worth"])
    return exit_code


def _fail(problems: list[str], heading: str = "invalid configuration") -> int:
    print(f"kvwatch diagnose: {heading}:", file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    return EXIT_UNUSABLE


def _table(rows: list[list[str]], out: TextOut, indent: str = "") -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip(), file=out)


def _json_report(signals: dict[str, Any], diagnosis: dict[str, Any], polls: int, final: Any, stopped: str | None,
                 last_good: Any, exit_code: int) -> dict[str, Any]:
    """The one JSON object `--json` prints."""
    return {
        "target": signals["target"],
        "engine": signals["engine"],
        "dark_signals": signals["dark_signals"],
        "polls": polls,
        "failed_polls": sum(final.errors_by_reason.values()),
        "last_poll_up": final.up,
        "stopped": stopped,
        "window_covered_seconds": last_good.window_seconds,
        "engines": signals["engines"],
        "models": signals["models"],
        "findings": diagnosis["findings"],
        "events": diagnosis["events"],
        "upstream": diagnosis["upstream"],
        "lmcache": diagnosis["lmcache"],
        "worth": signals["worth"],
        "exit_code": exit_code,
    }


def print_worth(out: TextOut, worth: list[dict[str, Any]]) -> None:
    """What the cache is worth per engine, in the sentences the status page shows."""
    for item in worth:
        where = item["model_name"] + ("" if item.get("engine") is None else f"/{item['engine']}")
        print(f"\nWHAT THE CACHE IS WORTH [{where}]", file=out)
        for line in item.get("lines") or []:
            print(textwrap.fill(line, width=110, initial_indent="  ", subsequent_indent="    "), file=out)


def print_report(out: TextOut, signals: dict[str, Any], diagnosis: dict[str, Any], polls: int, final) -> None:
    _print_signals(out, signals, polls, final)
    _print_findings(out, diagnosis["findings"])
    _print_sources(out, diagnosis)
    _print_stream(out, diagnosis.get("kv_events"))


def _print_signals(out: TextOut, signals: dict[str, Any], polls: int, final) -> None:
    failed = sum(final.errors_by_reason.values())
    print(f"kvwatch diagnose: {signals['target']} ({signals['engine']}), {polls} polls ({failed} failed), window "
          f"{signals['window_covered_seconds']:.0f}s", file=out)
    if signals["dark_signals"]:
        dark = ", ".join(item["signal"][len("kvwatch_"):] for item in signals["dark_signals"])
        print(textwrap.fill(f"{signals['engine']} does not provide: {dark}", width=110, initial_indent="  ",
                            subsequent_indent="    "), file=out)
    if not final.up:
        print(f"  last poll failed: {final.detail}; showing the last good poll", file=out)

    columns = signal_columns(signals)
    print("\nSIGNALS", file=out)
    rows = [["signal"] + [heading for heading, _, _ in columns]]
    for signal in SIGNALS:
        cells = [format_value(values.get(signal.name), signal.unit, pinned.get(signal.name))
                 for _, values, pinned in columns]
        if all(cell == "–" for cell in cells):
            continue
        rows.append([signal_label(signal.name)] + cells)
    _table(rows, out, "  ")
    # Signals this engine's version counts differently (re-lookups, a late counter).
    for heading, name, text in caveat_lines(signals):
        print(textwrap.fill(f"* {signal_label(name)} [{heading}]: {text}", width=110, initial_indent="  ",
                            subsequent_indent="    "), file=out)


def _print_findings(out: TextOut, findings: list[dict[str, Any]]) -> None:
    print(f"\nFINDINGS ({len(findings)} active)", file=out)
    if not findings:
        print("  none", file=out)
    for finding in findings:
        where = finding["model_name"] + (f"/{finding['engine']}" if finding["engine"] is not None else "")
        print(f"\n  {finding['severity'].upper():8}  {finding['symptom']} / {finding['cause']}"
              f"{decided_headline(finding['evidence'])}  [{where}]  confidence {finding['confidence']}", file=out)
        lines = [("", finding["summary"]), ("evidence: ", format_evidence(finding["evidence"], finding.get("pinned")))]
        lines += [(f"{key.replace('_', ' ')}: ", note) for key, note in finding.get("notes", {}).items()]
        # One story: the other causes found for the symptom, and what the data cannot tell apart.
        lines += [(f"contributing: {c['cause']} ({c['confidence']} confidence): ", c["summary"])
                  for c in finding.get("contributing") or ()]
        lines += [(f"cannot tell apart from: {a['cause']}, decided by {', '.join(a['decided_by'])}: ", a["how"])
                  for a in finding.get("alternatives") or ()]
        lines += [("next: ", finding["next_check"])]
        if finding.get("runbook"):
            anchor = finding["runbook"].split("#")[-1]
            lines.append(("runbook: ", f"kvwatch runbook {anchor} (or /runbooks#{anchor} on kvwatch serve)"))
        for label, text in lines:
            print(textwrap.fill(label + text, width=110, initial_indent="    ", subsequent_indent="      "), file=out)


def _print_sources(out: TextOut, diagnosis: dict[str, Any]) -> None:
    """The changes seen, the upstream histogram and the LMCache tier."""
    events = diagnosis["events"]
    if events:
        print("\nCHANGES", file=out)
        for event in events:
            print(f"  {event['kind']} {event['model'] or '*'}/{event['engine'] or '*'}: {event['detail']}", file=out)
    upstream = diagnosis.get("upstream")
    if upstream:
        print(f"\nUPSTREAM {upstream['histogram']}: {'up' if upstream['up'] else 'down ' + str(upstream['reason'])}, "
              f"mean {format_value(upstream['mean_seconds'], 'seconds')}, p95 "
              f"{format_value(upstream['p95_seconds'], 'seconds', upstream.get('p95_pinned'))}", file=out)
    tier = diagnosis.get("lmcache")
    if tier:
        if not tier["up"]:
            print(f"\nLMCACHE {tier['target']}: down {tier['reason']}: {tier['detail']}", file=out)
        for row in tier.get("models") or []:
            values = row.get("signals") or {}
            print(f"\nLMCACHE {row['model_name']}: hit ratio "
                  f"{format_value(values.get('kvwatch_lmcache_hit_ratio'), 'ratio')}, tokens retrieved "
                  f"{format_value(values.get('kvwatch_lmcache_retrieved_tokens_per_second'), 'per_second')}, "
                  f"tokens stored {format_value(values.get('kvwatch_lmcache_stored_tokens_per_second'), 'per_second')}",
                  file=out)


def _print_stream(out: TextOut, stream: KVEventsReport | None) -> None:
    if stream:
        if not stream.get("up"):
            print(f"\nKV-CACHE EVENTS {stream.get('endpoint')}: down {stream.get('reason')}: {stream.get('detail')}",
                  file=out)
        else:
            window = stream.get("window") or {}
            intake = stream.get("intake") or {}
            print(f"\nKV-CACHE EVENTS {stream.get('endpoint')}: blocks stored "
                  f"{format_value(window.get('stored_per_second'), 'per_second')}, evicted "
                  f"{format_value(window.get('evicted_per_second'), 'per_second')}, stored again after their "
                  f"eviction {format_value(window.get('stored_again_ratio'), 'ratio')} of those stored (median "
                  f"{format_value(window.get('return_seconds_median'), 'seconds')} after it); "
                  f"{intake.get('missed', 0)} messages missed, {intake.get('dropped', 0)} dropped", file=out)
            if stream.get("labels_note"):
                print(f"  {stream['labels_note']}", file=out)
            for point in (stream.get("sizing") or {}).get("points") or []:
                said = (f"hit ratio {format_value(point['hit_ratio'], 'ratio')}" if point.get("hit_ratio") is not None
                        else f"{format_value(point.get('recomputation_avoided_ratio'), 'ratio')} of the recomputation "
                             "avoided")
                print(f"  x{point['extra_cache']:g} more cache ({point['extra_blocks']} blocks): {said} (estimate)",
                      file=out)


def run_replay(args: argparse.Namespace) -> int:
    from kvwatch.capture.bundle import Capture, CaptureError
    from kvwatch.capture.replay import replay
    from kvwatch.pipeline.monitor import Monitor

    try:
        capture = Capture(args.replay)
    except CaptureError as exc:
        return _fail([str(exc)], "cannot replay")
    try:
        settings = replay_settings(capture, args.config, args.window)
    except SettingsError as exc:
        return _fail(exc.problems)
    try:
        timeline = replay(capture, lambda source: Monitor(settings, fetcher=source, clock=source.now))
    except CaptureError as exc:
        return _fail([str(exc)], "cannot replay")
    report = timeline.to_json()
    actionable = timeline.actionable
    manifest = capture.manifest
    if args.json:
        print(json.dumps(_clean_json({
            "capture": str(args.replay),
            "target": manifest.get("target"),
            "kvwatch_version_recorded": manifest.get("kvwatch_version"),
            "engine": manifest.get("engine"),
            "interrupted": manifest.get("interrupted", False),
            "window_seconds": settings.window,
            **report,
            "exit_code": EXIT_FINDINGS if actionable else EXIT_OK,
        }), indent=2))
    else:
        print_timeline(TerminalText(sys.stdout), capture, settings, timeline)
    if timeline.polls == timeline.failed:
        return EXIT_UNUSABLE
    return EXIT_FINDINGS if actionable else EXIT_OK


# A replay's KV-cache events come from the capture: an endpoint that is never bound.
REPLAYED_EVENTS = "ipc://kvwatch-replayed-events"


def replay_settings(capture, config: str | None, window: str | None):
    """The sidecar's settings for a replay: the config's thresholds and
    window, the recorded target and interval."""
    interval = float(capture.manifest.get("interval_seconds") or 5.0)
    overrides = {"target": capture.manifest.get("target") or None, "poll_interval": interval, "window": window,
                 "upstream_target": "", "upstream_histogram": "", "lmcache_target": "", "demo_target": "",
                 "kv_events": REPLAYED_EVENTS if capture.events else ""}
    settings = load_settings(config, overrides, environ={})
    if settings.window < 2 * interval:
        raise SettingsError([f"window ({settings.window:g}s) must hold at least two recorded pages "
                             f"({interval:g}s apart)"])
    return settings


def _clean_json(value: Any) -> Any:
    if isinstance(value, float):
        return value if value == value and value not in (float("inf"), float("-inf")) else None
    if isinstance(value, dict):
        return {k: _clean_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean_json(v) for v in value]
    return value


def _clock(at: float | None, origin: float | None) -> str:
    if at is None:
        return "-"
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at))
    if origin is None:
        return stamp + "Z"
    offset = int(round(at - origin))
    return f"{stamp}Z (+{offset // 3600}:{offset // 60 % 60:02d}:{offset % 60:02d})"


def print_timeline(out: TextOut, capture, settings, timeline) -> None:
    manifest = capture.manifest
    print(f"kvwatch diagnose --replay {capture.path}: {manifest.get('target')}, engine "
          f"{manifest.get('engine') or 'not recognised'}, recorded by kvwatch {manifest.get('kvwatch_version')}"
          + (" (interrupted)" if manifest.get("interrupted") else ""), file=out)
    print(f"  {timeline.polls} polls ({timeline.failed} failed) every {settings.poll_interval:g}s from "
          f"{_clock(timeline.first, None)} to {_clock(timeline.last, timeline.first)}, window "
          f"{settings.window:g}s", file=out)
    origin = timeline.first
    print(f"\nFINDINGS ({len(timeline.episodes)} episodes)", file=out)
    if not timeline.episodes:
        print("  none", file=out)
    for episode in timeline.episodes:
        worst = episode.worst
        where = episode.model + (f"/{episode.engine}" if episode.engine is not None else "")
        until = "end of capture (still active)" if episode.active_at_end else _clock(episode.end, origin)
        print(f"\n  {worst['severity'].upper():8}  {episode.symptom} / {episode.cause}  [{where}]  "
              f"confidence {worst['confidence']}", file=out)
        print(f"    from {_clock(episode.start, origin)} to {until}, {episode.polls} polls", file=out)
        lines = [("worst at " + _clock(worst["time"], origin) + ": ", worst["summary"]),
                 ("evidence: ", format_evidence(worst["evidence"]))]
        lines += [(f"contributing: {c['cause']} ({c['confidence']} confidence): ", c["summary"])
                  for c in worst.get("contributing") or ()]
        lines += [(f"cannot tell apart from: {a['cause']}, decided by {', '.join(a['decided_by'])}: ", a["how"])
                  for a in worst.get("alternatives") or ()]
        for label, text in lines + [("next: ", worst["next_check"])]:
            print(textwrap.fill(label + text, width=110, initial_indent="    ", subsequent_indent="      "),
                  file=out)
    if timeline.outages:
        print("\nFAILED FETCHES", file=out)
        for outage in timeline.outages:
            print(f"  {_clock(outage['start'], origin)} to {_clock(outage['end'], origin)}: {outage['reason']} "
                  f"x{outage['polls']} {outage['detail']}".rstrip(), file=out)


def _time(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    from datetime import datetime, timezone

    parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()


def _history_arguments(args: argparse.Namespace) -> tuple[float, float, float | None, float, Settings] | list[str]:
    """(start, end, step or None, query timeout, settings) from the flags, or the problems with them."""
    from kvwatch.history.query import check_selector

    problems = []
    start = end = step = timeout = None
    try:
        end = _time(args.to) if args.to else time.time()
        start = _time(args.from_) if args.from_ else end - parse_duration(args.since)
    except ValueError as exc:
        problems.append(f"--from/--to/--since: {exc}")
    if start is not None and end is not None and start >= end:
        problems.append("the range is empty: --from must be before --to")
    try:
        timeout = parse_duration(args.query_timeout)
        if args.step:
            step = parse_duration(args.step)
    except ValueError as exc:
        problems.append(str(exc))
    selector_problem = check_selector(args.selector)
    if selector_problem:
        problems.append(f"--selector: {selector_problem}")
    if args.workers is not None and args.workers < 1:
        problems.append(f"--workers must be at least 1 (1: diagnose in this process), not {args.workers}")
    overrides = {"window": args.window} if args.window else {}
    settings = None
    try:
        settings = load_settings(args.config, overrides, environ={})
    except SettingsError as exc:
        problems.extend(exc.problems)
    if problems or start is None or end is None or timeout is None or settings is None:
        return problems
    return start, end, step, timeout, settings


def run_history(args: argparse.Namespace) -> int:
    from kvwatch.history.query import PrometheusClient, QueryError, choose_step
    from kvwatch.history.report import print_text, to_json, write_html
    from kvwatch.history.run import diagnose_history, usable_cores
    from kvwatch.present import public_url

    parsed = _history_arguments(args)
    if isinstance(parsed, list):
        return _fail(parsed)
    start, end, step, timeout, settings = parsed
    step = step or choose_step(start, end)
    if settings.window < 2 * step:
        return _fail([f"window ({settings.window:g}s) must hold at least two steps ({step:g}s each): "
                      f"raise --window or lower --step"])
    client = PrometheusClient(
        args.prometheus, timeout=timeout,
        bearer_token_file=args.bearer_token_file or settings.bearer_token_file,
        ca_bundle=args.ca_bundle or settings.ca_bundle,
        tls_verify=settings.tls_verify and not args.insecure_skip_verify,
        concurrency=args.concurrency, max_samples=args.max_samples)
    progress = sys.stderr if sys.stderr.isatty() and not args.json else None
    try:
        history = diagnose_history(
            client, start, end, step, args.selector, args.source, settings.window, settings.diagnosis,
            tuple(label.strip() for label in args.replica_labels.split(",") if label.strip()),
            (lambda line: print("\r" + line, end="", file=progress, flush=True)) if progress else None,
            workers=args.workers if args.workers is not None else usable_cores())
    except QueryError as exc:
        if exc.reason in ("limit", "throttled", "partial"):
            from kvwatch.central.refresh import store_sentence

            print(f"kvwatch diagnose: {store_sentence(public_url(args.prometheus), exc)}", file=sys.stderr)
        else:
            print(f"kvwatch diagnose: reading {public_url(args.prometheus)} failed: {exc}", file=sys.stderr)
        return EXIT_UNUSABLE
    if progress:
        print(file=progress)
    url = public_url(args.prometheus)
    report = to_json(history, url)
    if args.html:
        write_html(args.html, history, url)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_text(TerminalText(sys.stdout), history, url)
    if not history.replicas:
        return EXIT_UNUSABLE
    return report["exit_code"]
