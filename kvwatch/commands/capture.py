"""`kvwatch capture`: record a target's /metrics pages, byte-exact, with the
time each was fetched, into a folder or one `.tar.gz` bundle that someone
else can replay (`kvwatch diagnose --replay`). The format is in docs/capture.md.

Exit status: 0 when at least one page was recorded, 1 when every fetch
failed (the capture still holds the failures and their reasons), 2 when the
configuration is bad or the output cannot be written. Ctrl-C (or SIGTERM)
stops the recording and keeps what was recorded: the bundle is finished.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from kvwatch.capture.bundle import CaptureError, CaptureWriter, Entry, is_bundle
from kvwatch.capture.record import manifest_for, record
from kvwatch.commands import failfast
from kvwatch.present import TerminalText, TextOut, public_host
from kvwatch.scrape import Fetcher, failure_sentence
from kvwatch.settings import Settings, SettingsError, flag_help, flag_name, load_settings
from kvwatch.units import parse_duration

if TYPE_CHECKING:  # imported where a capture records the stream
    from kvwatch.kvevents.source import KVEventSource

EXIT_OK, EXIT_NO_PAGES, EXIT_UNUSABLE = 0, 1, 2
# Without a terminal (a log, CI), one progress line per this many fetches.
PROGRESS_EVERY = 60
# Names of files kvwatch does not write: `--out x.zip` made a folder named x.zip.
FILE_SUFFIXES = (".zip", ".tar", ".gz", ".bz2", ".xz", ".zst", ".7z", ".rar", ".tbz", ".tbz2", ".txz", ".json",
                 ".txt", ".yaml", ".yml", ".log", ".csv", ".html", ".prom")


def out_problem(out: str) -> str | None:
    """Why `--out` names something kvwatch cannot write, or None."""
    path = Path(out)
    if is_bundle(path) or path.suffix.lower() not in FILE_SUFFIXES:
        return None
    return (f"--out {out}: kvwatch writes a folder or a .tar.gz bundle, not a {path.suffix} file; "
            f"name a folder (e.g. {path.with_suffix('')}) or a bundle ({path.with_suffix('')}.tar.gz)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The settings this command takes as flags, help and default as `kvwatch serve` gives them (kvwatch/settings.py).
    parser.add_argument("--target", help=flag_help("target"))
    parser.add_argument("--interval", default="5s", help="time between fetches (default 5s)")
    parser.add_argument("--duration", default="10m", help="how long to record (default 10m); Ctrl-C stops early")
    parser.add_argument("--count", type=int, default=None, help="stop after this many fetches (default: none)")
    parser.add_argument("--out", required=True,
                        help="a new folder, or a file ending in .tar.gz for one bundle; never overwritten")
    parser.add_argument("--config", help="YAML config file of kvwatch serve (target, TLS, bearer token, size cap)")
    notes = {"bearer_token_file": "never recorded"}
    for key in ("bearer_token_file", "ca_bundle", "tls_verify", "timeout", "max_body_bytes"):
        parser.add_argument(flag_name(key), dest=key, help=flag_help(key, notes.get(key, "")))
    parser.add_argument("--kv-events", metavar="ENDPOINT",
                        help="also record the engine's KV-cache events from this ZMQ endpoint (kvwatch binds it "
                             "for vLLM's --kv-events-config publisher to connect), e.g. tcp://127.0.0.1:5557")
    parser.add_argument("--kv-events-connect", action="store_true",
                        help="connect to --kv-events instead of binding it (a publisher that binds tcp://*:N)")
    failfast.add_arguments(parser, "recording")


def run(args: argparse.Namespace) -> int:
    parsed = _arguments(args)
    if isinstance(parsed, list):
        return _fail(parsed)
    interval, duration, max_failures, settings = parsed
    fetcher = Fetcher(settings.target, settings.fetch_timeout, settings.max_body_bytes,
                      settings.bearer_token_file, settings.ca_bundle, settings.tls_verify)
    try:
        writer = CaptureWriter(args.out, manifest_for(settings.target, interval, duration))
    except CaptureError as exc:
        return _fail([str(exc)])
    stream = _start_stream(args, settings, writer)
    if isinstance(stream, str):
        return _fail([stream])

    out = TerminalText(sys.stderr)  # the engine's target and failure sentences: escapes written out
    tty = sys.stderr.isatty()
    limit = f"for {duration:g}s" + (f" or {args.count} fetches, whichever comes first" if args.count else "")
    print(f"kvwatch capture: {writer.manifest['target']} every {interval:g}s {limit} into {args.out}"
          + ("; Ctrl-C stops and keeps what was recorded" if tty else ""), file=out, flush=True)
    started = time.monotonic()
    failures = failfast.FailureReport(out, "kvwatch capture", max_failures)

    def progress(entry: Entry, writer: CaptureWriter) -> None:
        # A failure is said before the progress line, on a line of its own.
        if entry.ok:
            failures.succeeded(entry.seq)
        else:
            if tty and entry.seq > 1:
                print(file=out)  # end the progress line the terminal shows
            reason = entry.reason or "error"
            sentence = failure_sentence(reason, public_host(settings.target), settings.fetch_timeout)
            failures.failed(entry.seq, reason, sentence)
        _progress(out, tty, entry, writer, started)

    interrupted, path = _record(fetcher, writer, stream, interval, duration, args.count, progress, failures)
    if tty:
        print(file=out)
    return _summary(out, writer.manifest, stream is not None, failures, interrupted, started, path)


def _arguments(args: argparse.Namespace) -> tuple[float, float, int | None, Settings] | list[str]:
    """(interval, duration, failures to stop at, settings) from the flags, or the problems with them."""
    problems = []
    values = {}
    for flag, raw in (("--interval", args.interval), ("--duration", args.duration)):
        try:
            values[flag] = parse_duration(raw)
        except ValueError as exc:
            problems.append(f"{flag}: {exc}")
    if problems:
        return problems
    interval, duration = values["--interval"], values["--duration"]
    if interval <= 0:
        return ["--interval must be above 0"]
    if args.count is not None and args.count < 1:
        return ["--count must be at least 1"]
    max_failures, problem = failfast.limit_of(args)
    problem = problem or out_problem(args.out)
    if problem:
        return [problem]
    overrides = {"target": args.target, "poll_interval": interval, "window": max(300.0, 2 * interval),
                 "bearer_token_file": args.bearer_token_file, "ca_bundle": args.ca_bundle,
                 "tls_verify": args.tls_verify, "timeout": args.timeout, "max_body_bytes": args.max_body_bytes,
                 "kv_events": getattr(args, "kv_events", None)}
    try:
        settings = load_settings(args.config, overrides)
    except SettingsError as exc:
        return exc.problems
    return interval, duration, max_failures, settings


def _start_stream(args: argparse.Namespace, settings: Settings, writer: CaptureWriter) -> KVEventSource | str | None:
    """The engine's KV-event stream recorded beside the pages (`kv_events` set), or why it cannot listen."""
    if not settings.kv_events:
        return None
    from kvwatch.kvevents.source import KVEventSource

    # The same receiver as the sidecar's (byte cap, bounded queues), each
    # well-formed message recorded as it arrives.
    stream = KVEventSource(settings.kv_events, connect=bool(getattr(args, "kv_events_connect", False)),
                           topic=settings.kv_events_topic, tap=writer.add_event)
    stream.start()
    if stream.listen_error:
        writer.close(ended_at=time.time(), interrupted=False)
        return stream.listen_error
    writer.update(kv_events=settings.kv_events)
    return stream


def _record(fetcher: Fetcher, writer: CaptureWriter, stream: KVEventSource | None, interval: float,
            duration: float, count: int | None, progress: Callable[[Entry, CaptureWriter], None],
            failures: failfast.FailureReport) -> tuple[bool, Path]:
    """Records until the duration, the count, the failures or a signal ends it;
    (interrupted, where the capture was written)."""
    interrupted = False
    previous_term = _set_signal(signal.SIGTERM, _interrupt)
    try:
        record(fetcher, writer, interval, duration, progress=progress, count=count,
               give_up=lambda: failures.gave_up)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if stream is not None:
            stream.stop()
        previous_int = _set_signal(signal.SIGINT, signal.SIG_IGN)  # packing the bundle must finish
        try:
            path = writer.close(ended_at=time.time(), interrupted=interrupted)
        finally:
            _set_signal(signal.SIGINT, previous_int)
            _set_signal(signal.SIGTERM, previous_term)
    return interrupted, path


def _summary(out: TextOut, manifest: dict, streamed: bool, failures: failfast.FailureReport, interrupted: bool,
             started: float, path: Path) -> int:
    """The closing line (pages, failures by reason, event messages, where) and the exit status."""
    failed = ", ".join(f"{reason} {count}" for reason, count in sorted(manifest["failed_by_reason"].items()))
    failed_text = f", {manifest['failed']} failed ({failed})" if failed else ""
    if streamed:
        failed_text += (f", {manifest.get('kv_events_messages', 0)} KV-cache event messages"
                        + (" (cut short at the capture's cap)" if manifest.get("kv_events_truncated") else ""))
    stopped = f"{failures.gave_up_text()}; " if failures.gave_up else ""
    print(f"kvwatch capture: {'interrupted; ' if interrupted else ''}{stopped}{manifest['pages']} pages{failed_text}"
          f" in {time.monotonic() - started:.0f}s; engine {manifest.get('engine') or 'not recognised'}; "
          f"written to {path}", file=out)
    if not manifest["pages"] and failures.last_sentence:
        # Why nothing was recorded, as the sidecar says it (also said when it first happened).
        print(f"kvwatch capture: no page recorded: {failures.last_sentence}", file=out)
    return EXIT_OK if manifest["pages"] else EXIT_NO_PAGES


def _progress(out: TextOut, tty: bool, entry: Entry, writer: CaptureWriter, started: float) -> None:
    manifest = writer.manifest
    line = (f"{entry.seq} fetches: {manifest['pages']} pages, {manifest['failed']} failed, "
            f"{time.monotonic() - started:.0f}s"
            + ("" if entry.ok else f"; last: {entry.reason}"))
    if tty:
        print(f"\r{line}   ", end="", file=out, flush=True)
    elif entry.seq == 1 or entry.seq % PROGRESS_EVERY == 0:
        print(line, file=out, flush=True)


def _interrupt(signum, frame):
    # SIGTERM (a container stopping, `kill`) ends the recording like Ctrl-C.
    raise KeyboardInterrupt


def _set_signal(signum, handler):
    """The previous handler; None (and nothing set) outside the main thread."""
    if handler is None:
        return None
    try:
        return signal.signal(signum, handler)
    except ValueError:  # not the main thread (a test calling run())
        return None


def _fail(problems: list[str]) -> int:
    print("kvwatch capture: cannot record:", file=sys.stderr)
    for problem in problems:
        print(f"  - {problem}", file=sys.stderr)
    return EXIT_UNUSABLE
