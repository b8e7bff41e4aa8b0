"""`kvwatch sim`: serve a simulated vLLM 0.32 engine on loopback, list the shipped
scenarios, or run a scenario offline (no wall time) and print how its signals
move (`--report SECONDS`)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from kvwatch.sim.dialects import DIALECTS, SGLANG_SPELLINGS
from kvwatch.sim.lmcache import DEFAULT_SIZE_FACTOR
from kvwatch.sim.router import POLICIES
from kvwatch.sim.scenario import ScenarioError, clock_text, list_scenarios, load_scenario, phase_line
from kvwatch.sim.simulation import DEFAULT_MODEL_NAME, Simulation
from kvwatch.units import parse_duration, parse_number, parse_port, parse_whole_number


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--scenario", default="demo",
                        help="shipped scenario name, or a YAML file of your own by a path with a slash or a "
                             ".yaml ending (./demo, my.yaml); default: demo")
    parser.add_argument("--list-scenarios", action="store_true", help="list the shipped scenarios and exit")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    parser.add_argument("--port", default="8000", help="port to serve on; 0 picks a free one (default: 8000)")
    parser.add_argument("--speed", default="1",
                        help="simulated seconds per wall second (default: 1.0)")
    parser.add_argument("--seed", default="0", help="seed of the workload's random draws (default: 0)")
    parser.add_argument("--engines", default=None,
                        help="number of engines (data-parallel ranks, label engine=\"0\"..); default from the scenario")
    parser.add_argument("--model-name", default=DEFAULT_MODEL_NAME,
                        help=f"served model name (default: {DEFAULT_MODEL_NAME})")
    parser.add_argument("--duration", default=None,
                        help="stop after this much wall time, e.g. 90s or 10m (default: run until Ctrl-C)")
    parser.add_argument("--report", default=None, metavar="SECONDS",
                        help="do not serve: simulate SECONDS offline and print the signals every --interval")
    parser.add_argument("--dialect", default="vllm", choices=DIALECTS,
                        help="whose /metrics page to serve: vllm (default), sglang, llamacpp or trtllm; the same "
                             "simulated engines, spelled as that engine spells them")
    parser.add_argument("--spelling", default="sglang:", choices=SGLANG_SPELLINGS,
                        help="with --dialect sglang, the names' spelling: sglang: (SGLang's own, default) or sglang_ "
                             "(sample lines as OpenMetrics' escaping=underscores rewrites them)")
    parser.add_argument("--lmcache", action="store_true",
                        help="give the engines a simulated LMCache tier that keeps the prefixes their GPU cache "
                             "evicts and serves them back; its page (LMCache's names) at /lmcache/metrics")
    parser.add_argument("--lmcache-tokens", default=None, metavar="TOKENS",
                        help="size of the simulated LMCache tier in tokens (default: 4x one engine's GPU cache); "
                             "implies --lmcache")
    parser.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                        help="publish the engines' KV-cache events as vLLM does (ZMQ, msgpack) to this endpoint: "
                             "connect to it, or bind a wildcard tcp://*:N; engine i on port N+i (default: none)")
    parser.add_argument("--kv-events-full", default=0.0, type=float, metavar="SHARE",
                        help="the share of requests in vLLM's full report mode (kv_cache_report_mode full: their "
                             "reused blocks announced as stored too), 0 to 1 (default: 0, incremental)")
    parser.add_argument("--kv-events-origin", action="store_true",
                        help="events name their origin, NEW or REUSED (a proposed vLLM field; the map layout)")
    parser.add_argument("--kv-events-layout", default="vllm", choices=("vllm", "sglang", "trtllm"),
                        help="whose publisher the events' batches look like (default: vllm)")
    parser.add_argument("--router", default=None, choices=POLICIES,
                        help="put a simulated router with this policy in front of the engines (round_robin, prefix, "
                             "prefix_stale: prefix-aware over an index never told of evictions); its page (llm-d's "
                             "endpoint picker names) at /router/metrics; default: none, the least-loaded engine")
    parser.add_argument("--interval", default="15s", help="report interval, simulated time (default: 15s)")


def _kv_events_problem(args) -> str | None:
    """The KV-event options' one sentence of what is wrong (the endpoint normalised in place), or None."""
    if args.kv_events:
        from kvwatch.settings import zmq_endpoint

        try:
            args.kv_events = zmq_endpoint(args.kv_events)
        except ValueError as exc:
            return f"--kv-events: {exc}"
    if not 0.0 <= args.kv_events_full <= 1.0:
        return "--kv-events-full must be between 0 and 1"
    return None


def _report(sim: Simulation, seconds: float, interval: float) -> None:
    """A table of windowed signals straight from the engine counters."""
    print(f"{'t':>7} {'phase':<18} {'usage':>6} {'peak':>5} {'run':>4} {'wait':>5} {'hit%':>6} {'preempt':>7} "
          f"{'ttft':>7} {'queue':>7} {'prefill':>7} {'retrieval':>9} {'done':>5}")
    previous = sim.summary()
    step = min(interval, 1.0)
    while sim.now < seconds - 1e-9:
        window_end = min(seconds, sim.now + interval)
        phase = sim.phase.name  # the phase the window starts in
        peak_usage = 0.0
        usage_samples = []
        while sim.now < window_end - 1e-9:
            sim.advance_to(min(window_end, sim.now + step))
            usage_samples.append(sim.summary()["kv_usage"])
            peak_usage = max(peak_usage, usage_samples[-1])
        mean_usage = sum(usage_samples) / len(usage_samples)
        now = sim.summary()

        def delta(key: str) -> float:
            return now[key] - previous[key]

        queries = delta("prefix_queries")
        hit = f"{100 * delta('prefix_hits') / queries:5.1f}" if queries else "    -"
        ttft = f"{delta('ttft_sum') / delta('ttft_count'):7.2f}" if delta("ttft_count") else "      -"
        finished = delta("phase_count")
        queue = f"{delta('queue_sum') / finished:7.2f}" if finished else "      -"
        prefill = f"{delta('prefill_sum') / finished:7.2f}" if finished else "      -"
        retrievals = delta("app_retrieval_count")
        retrieval = f"{delta('app_retrieval_sum') / retrievals:9.2f}" if retrievals else "        -"
        print(f"{now['time']:7.0f} {phase:<18} {mean_usage:6.2f} {peak_usage:5.2f} {now['running']:4d} {now['waiting']:5d} "
              f"{hit:>6} {int(delta('preemptions')):7d} {ttft} {queue} {prefill} {retrieval} {int(finished):5d}")
        previous = now
    print("(usage: mean of 1 s samples in the window, peak: their max; ttft/queue/prefill/retrieval: mean seconds of the window)")


def _print_sources(sim: Simulation, server, kv_events: str | None) -> None:
    """The banner's lines for the simulated sources beside the engines' page."""
    if sim.lmcache is not None:
        print(f"kvwatch sim: simulated LMCache tier of {sim.lmcache.capacity_chunks * sim.lmcache.chunk_tokens} "
              f"tokens, its page at {server.lmcache_metrics_url}", flush=True)
    if sim.router is not None:
        print(f"kvwatch sim: simulated router ({sim.router.policy}), its page at {server.router_metrics_url}",
              flush=True)
    if kv_events:
        print(f"kvwatch sim: KV-cache events published to {kv_events} (kvwatch serve --kv-events)", flush=True)


def _zmq_error() -> type[Exception]:
    try:
        import zmq
    except ImportError:  # pragma: no cover - pyzmq is a dependency
        return OSError
    return zmq.ZMQError


def run(args: argparse.Namespace) -> int:
    if args.list_scenarios:
        for name, description in list_scenarios():
            print(f"{name:<18} {description}")
        return 0
    try:
        scenario = load_scenario(args.scenario)
    except ScenarioError as exc:
        print(f"kvwatch sim: {exc}", file=sys.stderr)
        return 2
    problem = _parse_flags(args)
    if problem:
        print(f"kvwatch sim: {problem}", file=sys.stderr)
        return 2
    lmcache_tokens = args.lmcache_tokens
    if lmcache_tokens is None and args.lmcache:
        lmcache_tokens = DEFAULT_SIZE_FACTOR * scenario.phases[0].engine.kv_cache_size_tokens
    problem = _kv_events_problem(args)
    if problem:
        print(f"kvwatch sim: {problem}", file=sys.stderr)
        return 2
    if args.engines is not None and args.engines < 1:
        print("kvwatch sim: --engines must be >= 1", file=sys.stderr)
        return 2
    sim = Simulation(scenario, seed=args.seed, engines=args.engines, model_name=args.model_name,
                     lmcache_tokens=lmcache_tokens, router=args.router)
    if args.report is not None:
        _report(sim, args.report, args.interval)
        return 0

    from kvwatch.sim.server import SimServer

    try:
        server = SimServer(sim, speed=args.speed, host=args.host, port=args.port, dialect=args.dialect,
                           kv_events=args.kv_events, kv_report=(args.kv_events_full, args.kv_events_origin,
                                                                args.kv_events_layout),
                           spelling=args.spelling)
    except _zmq_error() as exc:
        print(f"kvwatch sim: cannot publish KV-cache events to {args.kv_events}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvwatch sim: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    previous_handler = None
    if threading.current_thread() is threading.main_thread():
        previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server.start()
    _say_serving(args, scenario, sim, server)
    try:
        _follow_phases(args, server, stop)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        print("kvwatch sim: stopped", flush=True)
    return 0


def _parse_flags(args: argparse.Namespace) -> str | None:
    """Each flag parsed in place, by the shared parsers (kvwatch/units.py);
    the first problem as one sentence, not argparse's usage."""
    parsers = {"duration": parse_duration, "report": parse_duration, "interval": parse_duration,
               "port": parse_port, "seed": parse_whole_number, "speed": lambda v: parse_number(v, minimum=0),
               "engines": parse_whole_number, "lmcache_tokens": parse_whole_number}
    for flag, parse in parsers.items():
        raw = getattr(args, flag)
        if raw is None:
            continue
        try:
            setattr(args, flag, parse(raw))
        except ValueError as exc:
            return f"--{flag.replace('_', '-')}: {exc}"
    if args.lmcache_tokens is not None and args.lmcache_tokens < 1:
        return "--lmcache-tokens must be >= 1"
    if args.kv_events:
        from kvwatch.settings import zmq_endpoint

        try:
            args.kv_events = zmq_endpoint(args.kv_events)
        except ValueError as exc:
            return f"--kv-events: {exc}"
    if args.engines is not None and args.engines < 1:
        return "--engines must be >= 1"
    return None


def _say_serving(args: argparse.Namespace, scenario, sim: Simulation, server) -> None:
    print(f"kvwatch sim: scenario {scenario.name!r}, {len(sim.engines)} engine(s), model {sim.model_name!r}, "
          f"speed {args.speed:g}, dialect {args.dialect}", flush=True)
    print(f"kvwatch sim: serving {server.url}  (metrics {server.metrics_url}, app metrics {server.app_metrics_url})",
          flush=True)
    _print_sources(sim, server, args.kv_events)
    status = server.phase_status()
    if status["phases"] > 1:
        loop = "then loops" if scenario.loop else "then stays in the last phase"
        length = (f"{clock_text(status['cycle_seconds'])} at speed {args.speed:g}" if args.speed > 0
                  else f"{clock_text(status['cycle_seconds'])} of simulated time (speed 0: the clock moves by hand)")
        print(f"kvwatch sim: {status['phases']} phases, {length}, {loop}; the phase now and the next at "
              f"{server.url}/sim/phase", flush=True)


def _follow_phases(args: argparse.Namespace, server, stop: threading.Event) -> None:
    """Says each phase as it starts, until --duration, SIGTERM or Ctrl-C."""
    status = server.phase_status()
    shown = None
    deadline = None if args.duration is None else time.monotonic() + args.duration
    while True:
        if status["phases"] > 1 and (status["phase"], status["index"], status["cycle"]) != shown:
            shown = (status["phase"], status["index"], status["cycle"])
            note = f" ({status['note']})" if status["note"] else ""
            print(f"kvwatch sim: {phase_line(status)}{note}", flush=True)
        if stop.wait(0.2):
            break
        if deadline is not None and time.monotonic() >= deadline:
            break
        status = server.phase_status()
