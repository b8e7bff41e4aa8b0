"""`kvwatch serve`: poll the target in the background and serve kvwatch's
endpoints. Every option is also a `KVWATCH_*` environment variable and a key
of the YAML config file.

`--replay CAPTURE [--speed N]` serves a recording instead of polling an
engine (demos, tests, looking at an incident the way it looked live): the
sidecar's monitor reads the recorded pages one by one, each at its recorded
time (the window, the rates and the status page run on recorded time), with
the recorded gaps divided by N in wall time. When the capture ends kvwatch
keeps serving its last state.

`--prometheus URL [--selector '{namespace="llm"}']` is central mode, for
clusters without sidecars: kvwatch reads every replica the store scrapes
through its query API (as `kvwatch diagnose --prometheus` does, a refresh per
poll interval, 30 s unless set), and serves the same endpoints for all of them
(kvwatch.central.app). `target` is not polled; bearer_token_file,
ca_bundle, tls_verify and timeout apply to the store."""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys

from kvwatch.settings import DECLARED, FLAGS, SettingsError, env_name, flag_help, flag_name, load_settings

# settings key -> its help, for every setting that is a flag (declared once,
# beside its field in kvwatch/settings.py); option_help adds the default (from
# Settings, written back as the flag takes it) and the environment variable.
OPTIONS = {key: DECLARED[key]["help"] for key in FLAGS}


def option_help(key: str) -> str:
    return flag_help(key)


# Seconds a shutdown waits for open connections to kvwatch before closing them.
SHUTDOWN_GRACE_SECONDS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help=f"YAML config file (default: none; env {env_name('config')})")
    for key in OPTIONS:
        parser.add_argument(flag_name(key), dest=key, default=None, help=option_help(key))
    parser.add_argument("--replay", metavar="CAPTURE",
                        help="serve a capture (folder or .tar.gz of kvwatch capture) instead of polling a target "
                             "(default: none)")
    parser.add_argument("--speed", default="1",
                        help="with --replay: recorded seconds per wall second, 0 for no waiting (default: 1)")
    central = parser.add_argument_group("central mode (--prometheus)")
    central.add_argument("--prometheus", metavar="URL",
                         help="serve every replica a Prometheus-compatible store scrapes, read through its query "
                              "API, instead of polling a target; refreshed every 30s unless --poll-interval is "
                              "set (default: none)")
    central.add_argument("--selector", default="",
                         help="with --prometheus: label selector of the replicas' series, e.g. "
                              "'{namespace=\"llm\"}' (default: all)")
    central.add_argument("--source", choices=("auto", "vllm", "kvwatch"), default="auto",
                         help="with --prometheus: vLLM's own series or sidecars' kvwatch_engine_* (default: auto)")
    central.add_argument("--replica-labels", default="job,instance,namespace,pod",
                         help="with --prometheus: labels that tell replicas apart (default: job,instance,namespace,pod)")
    central.add_argument("--max-replicas", type=int, default=256,
                         help="with --prometheus: most replicas kept; the rest are counted as dropped (default: 256)")
    central.add_argument("--shard", default=None,
                         help="with --prometheus: serve shard k of N (k/N, 0 <= k < N), the replicas a stable hash "
                              "of their replica labels gives it; ordinal/N takes k from the pod's name in a "
                              "StatefulSet (POD_NAME or HOSTNAME, NAME-k); fleet findings then come from the "
                              "store's fleet rules over every shard's series (default: none; env KVWATCH_SHARD)")


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    # urllib3's debug lines quote every request line, the target's query
    # string included (where an API key may be); kvwatch logs its polls itself.
    logging.getLogger("urllib3").setLevel(max(logging.INFO, logging.getLogger().level))


def run(args: argparse.Namespace) -> int:
    capture = None
    overrides = {key: getattr(args, key) for key in OPTIONS}
    if getattr(args, "replay", None):
        from kvwatch.capture.bundle import Capture, CaptureError
        from kvwatch.commands.diagnose import REPLAYED_EVENTS

        from kvwatch.units import parse_number

        try:
            args.speed = parse_number(args.speed, minimum=0)
        except ValueError as exc:
            print(f"kvwatch: --speed: {exc}", file=sys.stderr)
            return 2
        try:
            capture = Capture(args.replay)
        except CaptureError as exc:
            print(f"kvwatch: {exc}", file=sys.stderr)
            return 2
        # The recorded target and interval; nothing is fetched.
        overrides.update(target=capture.manifest.get("target") or None,
                         poll_interval=capture.manifest.get("interval_seconds") or None,
                         upstream_target="", upstream_histogram="", lmcache_target="", demo_target="",
                         kv_events=REPLAYED_EVENTS if capture.events else "")
    if getattr(args, "prometheus", None):
        return run_central(args, overrides)
    try:
        settings = load_settings(args.config, overrides)
    except SettingsError as exc:
        print(f"kvwatch: {exc}", file=sys.stderr)
        return 2
    if not _can_listen(settings):
        return 1

    from kvwatch.sidecar import server
    from kvwatch.sidecar.app import create_app
    from kvwatch.pipeline.monitor import Monitor, tune_garbage_collector
    from kvwatch.present import public_url

    if capture is not None:
        monitor, start = replaying(capture, settings, args.speed)
    else:
        monitor = Monitor(settings)
        start = monitor.start
    app = create_app(monitor, settings)
    tune_garbage_collector()
    start()
    scheme = "https" if settings.tls_cert_file else "http"
    doing = (f"replaying the capture of {public_url(settings.target)}" if capture is not None
             else f"polling {public_url(settings.target)} every {settings.poll_interval:g}s")
    logging.getLogger("kvwatch").info("kvwatch %s; serving %s://%s:%d/", doing, scheme, settings.host, settings.port)
    raise_file_limit()
    try:
        server.run(app, **server_options(settings))
    finally:
        monitor.stop()
    return 0


def listen_problem(host: str, port: int) -> str | None:
    """One sentence when kvwatch cannot listen there, before it says it
    serves (uvicorn logged `[Errno 98] error while attempting to bind...`
    after kvwatch had announced the address, and exited 3)."""
    where = f"{host}:{port}"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError):
        return f"cannot listen on {where}: the host does not resolve to an address of this machine (check --host)"
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind(address)
        except OSError as exc:
            reason = {
                errno.EADDRINUSE: "another process already listens on that port (choose another --port)",
                errno.EADDRNOTAVAIL: "no interface of this machine has that address (check --host)",
                errno.EACCES: "permission denied (a port below 1024 needs privileges; choose another --port)",
            }.get(exc.errno or 0, exc.strerror or "the address cannot be bound")
            return f"cannot listen on {where}: {reason}"
    return None


def run_central(args: argparse.Namespace, overrides: dict) -> int:
    import os

    from kvwatch.central.refresh import DEFAULT_INTERVAL, Central
    from kvwatch.history.query import CENTRAL_MAX_BYTES, PrometheusClient, check_selector
    from kvwatch.history.shard import ShardError, parse_shard
    from kvwatch.present import normalize_target
    from kvwatch.settings import Settings

    problems = []
    try:
        normalize_target(args.prometheus)
    except ValueError as exc:
        problems.append(f"--prometheus: {exc}")
    if args.replay:
        problems.append("--prometheus and --replay exclude each other")
    selector_problem = check_selector(args.selector)
    if selector_problem:
        problems.append(f"--selector: {selector_problem}")
    if args.max_replicas < 1:
        problems.append("--max-replicas must be at least 1")
    shard = None
    try:
        shard = parse_shard(args.shard if args.shard is not None else os.environ.get("KVWATCH_SHARD"))
    except ShardError as exc:
        problems.append(f"--shard: {exc}")
    try:
        settings = load_settings(args.config, overrides)
    except SettingsError as exc:
        problems.extend(exc.problems)
        settings = None
    if settings is not None:
        # Central mode reads a store scraped every 15-60 s: 30 s unless the
        # interval was chosen (flag, environment or config file).
        if (args.poll_interval is None and not os.environ.get(env_name("poll_interval"))
                and settings.poll_interval == Settings.poll_interval):
            settings.poll_interval = DEFAULT_INTERVAL
        if settings.window < 2 * settings.poll_interval:
            problems.append(f"window ({settings.window:g}s) must hold at least two refreshes "
                            f"({settings.poll_interval:g}s apart)")
    if problems or settings is None:
        for problem in problems:
            print(f"kvwatch: {problem}", file=sys.stderr)
        return 2
    if not _can_listen(settings):
        return 1

    from kvwatch.sidecar import server
    from kvwatch.central.app import create_central_app
    from kvwatch.pipeline.monitor import tune_garbage_collector
    from kvwatch.present import public_url

    # The store's URL is the target the page and the JSON name.
    settings.target = args.prometheus
    client = PrometheusClient(args.prometheus, timeout=settings.fetch_timeout,
                              bearer_token_file=settings.bearer_token_file, ca_bundle=settings.ca_bundle,
                              tls_verify=settings.tls_verify, max_bytes=CENTRAL_MAX_BYTES)
    central = Central(client, settings, args.selector, args.source,
                      tuple(label.strip() for label in args.replica_labels.split(",") if label.strip()),
                      max_replicas=args.max_replicas, shard=shard)
    app = create_central_app(central, settings)
    tune_garbage_collector()
    central.start()
    scheme = "https" if settings.tls_cert_file else "http"
    logging.getLogger("kvwatch").info(
        "kvwatch central mode: reading %s%s%s every %gs; serving %s://%s:%d/",
        public_url(settings.target), f" for {args.selector}" if args.selector else "",
        f" (shard {shard})" if shard else "", settings.poll_interval,
        scheme, settings.host, settings.port)
    raise_file_limit()
    try:
        server.run(app, **server_options(settings))
    finally:
        central.stop()
    return 0


def server_options(settings) -> dict:
    """uvicorn's options for kvwatch (the tests serve with these too)."""
    from kvwatch.sidecar.app import BoundedHttpProtocol

    return dict(
        host=settings.host,
        port=settings.port,
        log_level="warning" if settings.log_level == "info" else settings.log_level,
        access_log=False,
        # uvloop when installed, and httptools (kvwatch depends on both:
        # /metrics' latency under concurrent scrapers, docs/performance.md),
        # behind kvwatch's bounds on header size, header time and connections.
        loop="auto",
        http=BoundedHttpProtocol,
        ssl_certfile=settings.tls_cert_file,
        ssl_keyfile=settings.tls_key_file,
        # A scraper's idle keep-alive connection (Prometheus keeps one)
        # would otherwise hold a TLS shutdown for asyncio's 30 s close
        # timeout: as long as Kubernetes' whole grace period.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS,
    )


def raise_file_limit() -> None:
    """Open files up to the hard limit: the connection cap (MAX_CONNECTIONS)
    and the polls then never compete for descriptors under the usual soft
    limit of 1024."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = hard if hard != resource.RLIM_INFINITY else 65536
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    except (ImportError, ValueError, OSError):
        pass


def replaying(capture, settings, speed: float):
    """A Monitor over the capture's pages and its start: a thread polling one
    recorded page per recorded gap / speed. monitor.stop() ends it."""
    import threading

    from kvwatch.capture.bundle import CaptureError
    from kvwatch.capture.replay import ReplaySource, paced, with_events
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.pipeline.reports import ReplayProgress

    import dataclasses
    from pathlib import Path

    source = ReplaySource(capture.pages(), capture.events)
    monitor = with_events(source, Monitor(settings, fetcher=source, clock=source.now))
    # What the page, the JSON and /readyz say of the replay (report.replay_text):
    # updated in place, so the last state says when it finished.
    progress = ReplayProgress(capture=Path(str(capture.path)).name, speed=speed, recorded_polls=len(capture.entries),
                              finished=False, stopped=None)
    monitor.replay = progress
    monitor.state = dataclasses.replace(monitor.state, replay=progress)
    log = logging.getLogger("kvwatch")

    def poll() -> None:
        state = monitor.poll_once()
        for listener in monitor.after_poll:  # as the live poll loop does
            try:
                listener(state)
            except Exception:
                log.exception("after-poll work failed; the replay goes on")

    def run_replay() -> None:
        try:
            polls = paced(source, poll, speed, wait=monitor._stop.wait)
        except CaptureError as exc:
            progress["finished"], progress["stopped"] = True, str(exc)
            log.error("replay stopped: %s; serving the last state read", exc)
            return
        progress["finished"] = not monitor._stop.is_set()
        log.info("replay of %s finished after %d polls; serving its last state", capture.path, polls)

    def start() -> None:
        log.info("replaying %s (%d recorded fetches) at %gx", capture.path, len(capture.entries), speed)
        monitor._thread = threading.Thread(target=run_replay, name="kvwatch-replay", daemon=True)
        monitor._thread.start()

    return monitor, start


def _can_listen(settings) -> bool:
    """Logging set up, and the address free to listen on (said in one
    sentence before anything starts when it is not): both serve modes."""
    configure_logging(settings.log_level)
    problem = listen_problem(settings.host, settings.port)
    if problem:
        print(f"kvwatch: {problem}", file=sys.stderr)
    return not problem
