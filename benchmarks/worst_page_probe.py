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

    python benchmarks/worst_page_probe.py [--polls N|full] [--sources engine,upstream,lmcache]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import threading
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
    parser.add_argument("--sources", default="engine,upstream,lmcache",
                        help="sources polled each poll, of engine, upstream, lmcache (default: all three)")
    args = parser.parse_args()
    sources = set(args.sources.split(","))

    from fastapi.testclient import TestClient

    from kvwatch.sidecar.app import create_app
    from kvwatch.sidecar.monitor import Monitor, tune_garbage_collector
    from kvwatch.sidecar.settings import load_settings
    from kvwatch.scrape import SECOND_SOURCE_MAX_BYTES
    from kvwatch.sidecar.upstream import MAX_BUCKETS

    overrides = {"max_body_bytes": args.cap} if args.cap else {}
    defaults = load_settings(overrides=overrides, environ={})
    cap = defaults.max_body_bytes
    total = (int(defaults.window // defaults.poll_interval) + 1 if args.polls == "full" else int(args.polls))
    counters = {"/metrics": iter(range(total)), "/upstream": iter(range(total)), "/lmcache": iter(range(total))}
    # The second sources' pages up to their own cap (SECOND_SOURCE_MAX_BYTES).
    second = min(cap, SECOND_SOURCE_MAX_BYTES)
    makers = {"/metrics": lambda n: worst_page(n, cap), "/upstream": lambda n: upstream_page(n, second, MAX_BUCKETS),
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
    settings = load_settings(overrides={"target": f"{base}/metrics", "timeout": "4s", "log_level": "warning",
                                        **overrides, **more}, environ={})
    # The monitor's clock advances one poll interval a poll, whatever the
    # polls take here: the window then holds a full window of polls on any
    # machine (on a loaded one, real time held only half of them).
    import time

    now = [time.time()]
    monitor = Monitor(settings, clock=lambda: now[0])
    client = TestClient(create_app(monitor, settings))
    tune_garbage_collector()
    gc.collect()
    before = status_kib("VmRSS")
    rss = []
    for _ in range(total):
        state = monitor.poll_once()
        if not state.up:
            raise RuntimeError(f"poll failed: {state.reason} {state.detail}")
        client.get("/metrics")
        client.get("/api/v1/diagnosis")
        rss.append(status_kib("VmRSS"))
        now[0] += settings.poll_interval
    state = monitor.state
    print(json.dumps({"cap_bytes": cap, "page_bytes": sizes["/metrics"][0], "polls": total,
                      "sources": sorted(sources),
                      "source_page_bytes": {path: max(found) for path, found in sizes.items() if found},
                      "upstream": None if state.upstream is None else state.upstream.get("reason") or "up",
                      "lmcache": None if state.lmcache is None else state.lmcache.get("reason") or "up",
                      "window_entries": len(monitor.window.entries), "rss_before_kib": before, "rss_kib": rss,
                      "peak_rss_kib": status_kib("VmHWM"), "engines": len(state.snapshot.engines)}))
    httpd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
