"""Resident memory of `kvwatch serve`'s poll for the worst pages the default
body cap admits, from every source it polls, over a full window of polls, in
a fresh process (JSON on stdout).

The engine's page: one served model name per line of a counter, new names on
every poll (a gateway that sets one name per request), filled up to just
under the default cap (8 MiB). Such a page keeps max_series (1000) of its
names and drops the rest, but the fetch holds the body and its text, and the
parser and adapter go through every line: that transient is what the pod's
memory limit must allow, and the window holds a window's worth of the kept
pairs. With `--sources engine,upstream,lmcache` (the default) the same poll
also reads an upstream page (the named histogram with the most bucket bounds
kvwatch sums, as many label sets as their cap admits) and an LMCache page (one
served model name per line, new every poll), each up to the second sources'
cap (SECOND_SOURCE_MAX_BYTES, 2 MiB). The process is
built as `kvwatch serve` builds itself (settings, Monitor, the app) with the
default settings, and polls a loopback server a full window of polls
(window / poll interval + 1, 61 at the defaults) unless `--polls N`; a
/metrics and a /api/v1/diagnosis request follow each poll. Peak RSS is VmHWM
from /proc/self/status.

With `kvevents` among the sources (the default), a publisher on loopback
sends the KV-cache event stream at its caps while the polls run: every poll,
eight messages just under the message cap (4 MiB) of block hashes never
seen (the ledger fills its table to kv_events_table_bytes and samples past
it; the intake's queue fills and drops), and one message of the same size
that the typed decoders refuse (an unknown event type holding 4 M empty
arrays). `--shape rich` fills the engine's page with real vLLM 0.32
engines (every family, its histograms' buckets) instead of one counter per
name: the same engines every poll, so the window's byte bound
(kvwatch.window.WINDOW_MAX_BYTES) drops the oldest polls instead of
forgetting pairs.

`--events strings` makes the stream's messages the strings' shape
instead: every poll, four messages just under the cap, each a stored block
naming a new medium and a new LoRA adapter of about 2 MB each (label values
of /metrics and the API). `--events capture` replays them from a capture
bundle instead: events.bin at its cap (MAX_EVENTS_BYTES, 64 MiB) of such
messages, written as a .tar.gz, read back as `kvwatch serve --replay` reads
it and fed to the stream a few per poll. `--serve` serves the app on
loopback (uvicorn, as `kvwatch serve` does), reads /metrics and the API over
HTTP, and asks /healthz every 0.1 s throughout (its latencies in the output).

`--central` measures central mode instead: a stand-in store on loopback
answers every series listing and every range query just under central
mode's cap on one answer (CENTRAL_MAX_BYTES, 32 MiB) with the most objects
that many bytes can hold, and central mode (built as `kvwatch serve
--prometheus` builds it, with the manifests' --max-replicas) refreshes
`--polls` times (default 10); `--layout reordered` writes each series'
keys in the other order, which kvwatch does not scan but decodes whole
(matrix.decode's fallback); `--listing empty` makes the series list
empty label sets (`{}`) up to the cap, the most objects a list can hold.

    python benchmarks/worst_page_probe.py [--polls N|full] [--sources engine,upstream,lmcache,kvevents]
                                          [--events blocks|strings|capture] [--serve]
                                          [--shape rotating|rich] [--central [--layout compact|reordered]
                                                                          [--listing replicas|empty]]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
import tracemalloc
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worst_page(poll: int, cap: int) -> bytes:
    lines, size, n = [], 0, 0
    while True:
        line = f'vllm:prompt_tokens_total{{model_name="gateway-request-{poll:04d}-{n:08d}",engine="0"}} {n}.0\n'
        if size + len(line) > cap - 1024:
            break
        lines.append(line)
        size += len(line)
        n += 1
    return "".join(lines).encode()


def upstream_page(poll: int, cap: int, bounds: int) -> bytes:
    """The upstream histogram with `bounds` bucket bounds (the most kvwatch
    sums) per label set, as many label sets as fit under the cap."""
    les = [f"{(n + 1) / 1000:g}" for n in range(bounds - 1)] + ["+Inf"]
    lines, size, route = ["# TYPE app_retrieval_seconds histogram\n"], 0, 0
    while True:
        block = [f'app_retrieval_seconds_bucket{{route="r{route:06d}",le="{le}"}} {poll * 10 + n}\n'
                 for n, le in enumerate(les)]
        block += [f'app_retrieval_seconds_sum{{route="r{route:06d}"}} {poll}.5\n',
                  f'app_retrieval_seconds_count{{route="r{route:06d}"}} {poll * 10 + bounds}\n']
        length = sum(map(len, block))
        if size + length > cap - 1024:
            break
        lines += block
        size += length
        route += 1
    return "".join(lines).encode()


def rich_page(cap: int) -> bytes:
    """Real vLLM 0.32 engines (the capture's engine 0 under new engine
    ids), as many as fit under the cap; their counters move every poll."""
    capture = Path(__file__).resolve().parent.parent / "tests/fixtures/vllm-0.32-cpu/metrics-prefix-load.txt"
    head, per_engine = [], []
    for line in capture.read_text().splitlines(keepends=True):
        (per_engine if 'engine="0"' in line else head).append(line)
    size, engines = sum(map(len, head)), 0
    block = "".join(per_engine)
    while size + len(block) + 64 * len(per_engine) < cap - 1024:
        size += len(block) + 8 * len(per_engine)
        engines += 1
    return "".join(head + [line.replace('engine="0"', f'engine="{n}"') for n in range(engines)
                           for line in per_engine]).encode()


def moving(page: bytes, poll: int) -> bytes:
    """The page with every `_total`/`_count`/`_sum` counter advanced by `poll`."""
    out = []
    for line in page.split(b"\n"):
        if line and not line.startswith(b"#") and (b"_total{" in line or b"_count{" in line or b"_sum{" in line
                                                   or b"_bucket{" in line):
            name, _, value = line.rpartition(b" ")
            line = name + b" " + repr(float(value) + poll).encode()
        out.append(line)
    return b"\n".join(out)


def kv_event_messages(poll: int, max_bytes: int) -> list[bytes]:
    """Eight typed messages of new block hashes just under the cap, and one
    the typed decoders refuse (an unknown event type of 4 M empty arrays)."""
    import msgspec

    from kvwatch.kvevents import wire

    per_message = (max_bytes - 4096) // 9  # a 64-bit hash is 9 msgpack bytes
    out = []
    for n in range(8):
        base = ((poll * 8 + n) * per_message) << 1
        hashes = [(base + i) * 0x9E3779B97F4A7C15 % (1 << 63) + (1 << 62) for i in range(per_message)]
        out.append(wire.encode_batch(float(poll), [wire.stored(hashes, 16)]))
    count = max_bytes - 4096
    out.append(b"\x92" + msgspec.msgpack.encode(float(poll)) + b"\x91\x92" + msgspec.msgpack.encode("BlockPinnedSoon")
               + b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count)
    return out


def kv_string_messages(poll: int, max_bytes: int, count: int = 4) -> list[bytes]:
    """Messages just under the cap, each one stored block naming a new medium
    and a new LoRA adapter of about half the cap each."""
    from kvwatch.kvevents import wire

    size = (max_bytes - 4096) // 2 - 64
    out = []
    for n in range(count):
        tag = f"{poll:05d}-{n:02d}-"
        out.append(wire.encode_batch(float(poll), [wire.stored([poll * 64 + n + 1], 16, medium=tag + "m" * size,
                                                               lora_name=tag + "l" * size)]))
    return out


def capture_events(folder: Path) -> tuple[list, int]:
    """A capture bundle whose events.bin is at its cap with the strings'
    messages, read back as a replay reads it: (its records, bundle bytes)."""
    from kvwatch.capture.bundle import MAX_EVENTS_BYTES, Capture, CaptureWriter
    from kvwatch.capture.record import manifest_for
    from kvwatch.kvevents.source import DEFAULT_MAX_MESSAGE_BYTES

    out = folder / "strings.tar.gz"
    writer = CaptureWriter(out, {**manifest_for("http://127.0.0.1:8000/metrics", 5.0, 300.0), "kv_events": "tcp://x:1"})
    seq = 0
    while True:
        payload = kv_string_messages(seq, DEFAULT_MAX_MESSAGE_BYTES, count=1)[0]
        if not writer.add_event(1_700_000_000.0 + seq, seq, payload) or seq * len(payload) > MAX_EVENTS_BYTES:
            break
        seq += 1
    writer.add(1_700_000_100.0, 0.01, worst_page(0, 1 << 16).decode())
    writer.close(ended_at=1_700_000_200.0, interrupted=False)
    return Capture(out).events, out.stat().st_size


class HealthProbe:
    """Asks /healthz every 0.1 s on its own connection, as a kubelet does,
    and keeps each answer's latency (a failure or a timeout counts 10 s)."""

    def __init__(self, url: str):
        self.url = url
        self.latencies: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import time

        import requests

        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                ok = requests.get(self.url, timeout=10).status_code == 200
            except requests.RequestException:
                ok = False
            self.latencies.append(time.perf_counter() - started if ok else 10.0)
            self.failures += not ok
            self._stop.wait(0.1)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join(15)
        found = sorted(self.latencies)
        return {"answers": len(found), "failures": self.failures,
                "max_s": round(found[-1], 3) if found else None,
                "p99_s": round(found[int(0.99 * (len(found) - 1))], 3) if found else None,
                "over_1s": sum(1 for x in found if x > 1.0)}


def serve_app(app):
    """The app served on loopback as `kvwatch serve` serves it; (server, base URL)."""
    import time

    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def lmcache_page(poll: int, cap: int) -> bytes:
    lines, size, n = [], 0, 0
    while True:
        labels = f'model_name="m",worker_id="0",served_model_name="gateway-{poll:04d}-{n:08d}"'
        line = (f"lmcache:num_hit_tokens_total{{{labels}}} {n}.0\n"
                f"lmcache:num_requested_tokens_total{{{labels}}} {n}.0\n")
        if size + len(line) > cap - 1024:
            break
        lines.append(line)
        size += len(line)
        n += 1
    return "".join(lines).encode()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--polls", default="full", help="polls to make, or `full` for a full window (default)")
    parser.add_argument("--cap", default=None, help="max_body_bytes (default: kvwatch's default)")
    parser.add_argument("--sources", default="engine,upstream,lmcache,kvevents",
                        help="sources polled each poll, of engine, upstream, lmcache, kvevents (default: all four)")
    parser.add_argument("--shape", default="rotating", choices=("rotating", "rich"),
                        help="the engine's page: one counter per new name (rotating), or real engines (rich)")
    parser.add_argument("--central", action="store_true", help="central mode against a store at its caps instead")
    parser.add_argument("--layout", default="compact", choices=("compact", "reordered"),
                        help="with --central: the store's answers as Prometheus writes them, or each series' keys "
                             "in the other order (not the layout kvwatch scans: it decodes the answer whole)")
    parser.add_argument("--listing", default="replicas", choices=("replicas", "empty"),
                        help="with --central: the series list names a replica per series (default), or is "
                             "empty label sets ({}) up to the cap, the most objects a list can hold")
    parser.add_argument("--breakdown", action="store_true",
                        help="trace Python's allocations (tracemalloc) and add what the last poll holds by file, "
                             "and the traced peak (slower, and the RSS figures then include the tracing)")
    parser.add_argument("--events", default="blocks", choices=("blocks", "strings", "capture"),
                        help="the stream's shape: new blocks at the caps (default), new 2 MB media and LoRA names "
                             "(strings), or those replayed from a capture bundle at its cap (capture)")
    parser.add_argument("--serve", action="store_true",
                        help="serve the app on loopback, read it over HTTP and ask /healthz every 0.1 s throughout")
    parser.add_argument("--publish", metavar="ENDPOINT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.publish:
        return publish_forever(args.publish, args.events)
    if args.central:
        return central_probe(args)
    sources = set(args.sources.split(","))

    from fastapi.testclient import TestClient

    from kvwatch.pipeline.monitor import Monitor, tune_garbage_collector
    from kvwatch.settings import load_settings
    from kvwatch.sidecar.app import create_app
    from kvwatch.scrape import SECOND_SOURCE_MAX_BYTES
    from kvwatch.pipeline.upstream import MAX_BUCKETS

    overrides = {"max_body_bytes": args.cap} if args.cap else {}
    defaults = load_settings(overrides=overrides, environ={})
    cap = defaults.max_body_bytes
    total = (int(defaults.window // defaults.poll_interval) + 1 if args.polls == "full" else int(args.polls))
    counters = {"/metrics": iter(range(total)), "/upstream": iter(range(total)), "/lmcache": iter(range(total))}
    # The second sources' pages up to their own cap (SECOND_SOURCE_MAX_BYTES).
    second = min(cap, SECOND_SOURCE_MAX_BYTES)
    rich = rich_page(cap) if args.shape == "rich" else None
    makers = {"/metrics": (lambda n: moving(rich, n)) if rich is not None else (lambda n: worst_page(n, cap)),
              "/upstream": lambda n: upstream_page(n, second, MAX_BUCKETS),
              "/lmcache": lambda n: lmcache_page(n, second)}
    sizes: dict[str, list[int]] = {path: [] for path in makers}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            # Made per request and dropped after it (the stand-in servers'
            # memory is then one page at most, not all of them).
            body = makers[self.path](next(counters[self.path]))
            sizes[self.path].append(len(body))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    more = {}
    if "upstream" in sources:
        more.update(upstream_target=f"{base}/upstream", upstream_histogram="app_retrieval_seconds")
    if "lmcache" in sources:
        more.update(lmcache_target=f"{base}/lmcache")
    if "kvevents" in sources:
        import socket

        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            more.update(kv_events=f"tcp://127.0.0.1:{free.getsockname()[1]}")
    # Traced, the loopback server (a thread here) makes its pages slower.
    settings = load_settings(overrides={"target": f"{base}/metrics", "timeout": "60s" if args.breakdown else "4s",
                                        "log_level": "warning",
                                        **overrides, **more}, environ={})
    # The monitor's clock advances one poll interval a poll, whatever the
    # polls take here: the window then holds a full window of polls on any
    # machine (on a loaded one, real time held only half of them).
    import time

    now = [time.time()]
    monitor = Monitor(settings, clock=lambda: now[0])
    app = create_app(monitor, settings)
    client = TestClient(app)
    server = health = None
    render_bytes: list[int] = []
    if args.serve:
        import requests

        server, served = serve_app(app)
        health = HealthProbe(f"{served}/healthz")

        def get(path: str) -> None:
            render_bytes.append(len(requests.get(served + path, timeout=120).content))
    else:
        def get(path: str) -> None:
            render_bytes.append(len(client.get(path).content))
    publisher = None
    replayed: list = []
    per_poll = bundle_bytes = 0
    if args.events == "capture" and monitor.kv_events is not None:
        import tempfile

        with tempfile.TemporaryDirectory() as folder:
            replayed, bundle_bytes = capture_events(Path(folder))
        per_poll = -(-len(replayed) // total)
    elif monitor.kv_events is not None:
        import subprocess
        import time as clock_time

        # The publisher is a process of its own: its send queue is the
        # engine's memory, not kvwatch's.
        monitor.kv_events.start()
        publisher = subprocess.Popen([sys.executable, __file__, "--publish", settings.kv_events, "--events", args.events],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

        def publish(poll: int) -> None:
            publisher.stdin.write(f"{poll}\n")
            publisher.stdin.flush()
            publisher.stdout.readline()  # sent

        waited = clock_time.monotonic()
        while monitor.kv_events.messages == 0 and clock_time.monotonic() - waited < 20:
            publish(-1)  # a one-block batch, until the subscription is through
            clock_time.sleep(0.1)
    tune_garbage_collector()
    gc.collect()
    if args.breakdown:
        tracemalloc.start()
    before = status_kib("VmRSS")
    rss = []
    for poll in range(total):
        if publisher is not None:
            publish(poll)
        for seq in range(poll * per_poll, min(len(replayed), (poll + 1) * per_poll)):
            at, number, payload = replayed[seq]
            monitor.kv_events.feed(number, payload, now=now[0])
        state = monitor.poll_once()
        if not state.up:
            raise RuntimeError(f"poll failed: {state.reason} {state.detail}")
        get("/metrics")
        get("/api/v1/diagnosis")
        rss.append(status_kib("VmRSS"))
        now[0] += settings.poll_interval
    state = monitor.state
    breakdown = traced_breakdown() if args.breakdown else None
    stream = None if monitor.kv_events is None else monitor.kv_events.report(monitor.clock(), checkpoint=False)
    print(json.dumps({"cap_bytes": cap, "page_bytes": sizes["/metrics"][0], "polls": total,
                      "sources": sorted(sources),
                      "source_page_bytes": {path: max(found) for path, found in sizes.items() if found},
                      "upstream": None if state.upstream is None else state.upstream.get("reason") or "up",
                      "lmcache": None if state.lmcache is None else state.lmcache.get("reason") or "up",
                      "kv_events": None if monitor.kv_events is None else {
                          **{key: stream["intake"].get(key) for key in ("messages", "dropped", "malformed")},
                          "table_bytes": stream["table"]["bytes"]},
                      "shape": args.shape, "events": args.events,
                      "largest_render_bytes": max(render_bytes) if render_bytes else None,
                      **({"capture_bundle_bytes": bundle_bytes, "capture_messages": len(replayed)} if replayed else {}),
                      **({"healthz": health.stop()} if health is not None else {}),
                      "window_entries": len(monitor.window.entries),
                      "window_bytes": monitor.window.bytes, "window_trimmed": monitor.window.trimmed,
                      "rss_before_kib": before, "rss_kib": rss,
                      "peak_rss_kib": status_kib("VmHWM"), "engines": len(state.snapshot.engines),
                      **({"traced": breakdown} if breakdown is not None else {})}))
    if publisher is not None:
        publisher.stdin.close()
        publisher.wait(30)
    if monitor.kv_events is not None:
        monitor.kv_events.stop()
    if server is not None:
        server.should_exit = True
    httpd.shutdown()
    return 0


def traced_breakdown(top: int = 12) -> dict:
    """What Python holds after the last poll, by the file and line that
    allocated it (MiB), and the traced peak over the polls."""
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    lines = snapshot.statistics("lineno")[:top]
    files = snapshot.statistics("filename")[:top]
    mib = 2 ** 20

    def where(stat) -> str:
        frame = stat.traceback[0]
        return f"{Path(frame.filename).name}:{frame.lineno}" if hasattr(frame, "lineno") else frame.filename
    tracemalloc.stop()
    return {"current_mib": round(current / mib, 1), "peak_mib": round(peak / mib, 1),
            "by_file_mib": {Path(stat.traceback[0].filename).as_posix().split("site-packages/")[-1].split(
                "/kvwatch/")[-1]: round(stat.size / mib, 1) for stat in files},
            "by_line_mib": {where(stat): round(stat.size / mib, 1) for stat in lines}}


def publish_forever(endpoint: str, shape: str = "blocks") -> int:
    """The KV-event publisher (`--publish ENDPOINT`): for each poll number
    read from stdin, that poll's messages (a one-block batch for -1); a
    line back once sent."""
    import zmq

    from kvwatch.kvevents import wire
    from kvwatch.kvevents.source import DEFAULT_MAX_MESSAGE_BYTES

    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.setsockopt(zmq.SNDHWM, 16)
    publisher.connect(endpoint)
    sequence = 0
    for line in sys.stdin:
        poll = int(line)
        messages = ([wire.encode_batch(0.0, [wire.stored([1], 16)])] if poll < 0
                    else kv_string_messages(poll, DEFAULT_MAX_MESSAGE_BYTES) if shape == "strings"
                    else kv_event_messages(poll, DEFAULT_MAX_MESSAGE_BYTES))
        for payload in messages:
            publisher.send_multipart([b"kv", wire.sequence_bytes(sequence), payload])
            sequence += 1
        print("sent", flush=True)
    publisher.close(linger=2000)
    return 0


def central_probe(args) -> int:
    """Central mode against a store whose every answer is just under its cap."""
    from kvwatch.central.refresh import Central
    from kvwatch.history.query import CENTRAL_MAX_BYTES, PrometheusClient
    from kvwatch.mixin.config import CENTRAL_MAX_REPLICAS
    from kvwatch.pipeline.monitor import tune_garbage_collector
    from kvwatch.settings import load_settings

    cap = CENTRAL_MAX_BYTES - 4096
    # The most objects an answer holds: one series per small object, each a
    # replica of its own (a pod label), of a family central mode reads.
    parts, size, n = [], 0, 0
    while size < cap - 200:
        part = f'{{"__name__":"vllm:num_requests_running","pod":"p{n:07d}","model_name":"m","engine":"0"}},'
        parts.append(part)
        size += len(part)
        n += 1
    if args.listing == "empty":  # the real family's one series kept, so that the refresh reads on
        parts = ["{}," * ((cap - 300) // 3) + parts[0]]
    series = ('{"status":"success","data":[' + "".join(parts)[:-1] + "]}").encode()
    parts, size, n = [], 0, 0
    while size < cap - 200:
        part = (f'{{"metric":{{"pod":"p{n:07d}"}},"values":[[1,"1"]]}},' if args.layout == "compact"
                else f'{{"values":[[1,"1"]],"metric":{{"pod":"p{n:07d}"}}}},')
        parts.append(part)
        size += len(part)
        n += 1
    matrix = ('{"status":"success","data":{"resultType":"matrix","result":[' + "".join(parts)[:-1] + "]}}").encode()
    del parts
    asked = {"series": 0, "query_range": 0}

    class Store(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):  # the client asks by POST, its parameters in the body
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.do_GET()

        def do_GET(self):
            body = series if self.path.startswith("/api/v1/series") else matrix
            asked["series" if body is series else "query_range"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Store)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    settings = load_settings(overrides={"target": url, "timeout": "60s", "log_level": "warning",
                                        "poll_interval": "30s"}, environ={})
    client = PrometheusClient(url, timeout=60, max_bytes=CENTRAL_MAX_BYTES)
    # As the manifests run it (--max-replicas), since their limit is what it is measured against.
    central = Central(client, settings, max_replicas=CENTRAL_MAX_REPLICAS)
    tune_garbage_collector()
    gc.collect()
    if args.breakdown:
        tracemalloc.start()
    before = status_kib("VmRSS")
    refreshes = 10 if args.polls == "full" else int(args.polls)
    rss, states = [], []
    for _ in range(refreshes):
        state = central.refresh_once()
        states.append(f"up, {len(state.replicas)} replicas kept, {state.dropped_replicas} dropped" if state.up
                      else state.reason)
        rss.append(status_kib("VmRSS"))
    print(json.dumps({"mode": "central", "layout": args.layout, "listing": args.listing, "answer_bytes": {"series": len(series), "query_range": len(matrix)},
                      "cap_bytes": CENTRAL_MAX_BYTES, "refreshes": refreshes, "asked": asked, "states": states,
                      "rss_before_kib": before, "rss_kib": rss, "peak_rss_kib": status_kib("VmHWM"),
                      **({"traced": traced_breakdown()} if args.breakdown else {})}))
    httpd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
