"""Resident memory of `kvwatch serve`'s poll for the worst page the default
body cap admits, in a fresh process (JSON on stdout).

The page: one served model name per line of a counter, new names on every
poll (a gateway that sets one name per request), filled up to just under
the default cap (16 MiB). Such a page keeps max_series (1000) of its names
and drops the rest, but the fetch holds the body and its text, and the
parser and adapter go through every line: that transient is what the pod's
memory limit must allow. The process is built as `kvwatch serve` builds
itself (settings, Monitor, the app) with the default settings, and polls a
loopback server six times; a /metrics and a /api/v1/diagnosis request follow
each poll. Peak RSS is VmHWM from /proc/self/status.

    python benchmarks/worst_page_probe.py [--polls 6]
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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--polls", type=int, default=6)
    parser.add_argument("--cap", default=None, help="max_body_bytes (default: kvwatch's default)")
    args = parser.parse_args()

    from fastapi.testclient import TestClient

    from kvwatch.sidecar.app import create_app
    from kvwatch.sidecar.monitor import Monitor, tune_garbage_collector
    from kvwatch.sidecar.settings import load_settings

    overrides = {"max_body_bytes": args.cap} if args.cap else {}
    cap = load_settings(overrides=overrides, environ={}).max_body_bytes
    polls = iter(range(args.polls))
    sizes = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            # Made per request and dropped after it (the stand-in engine's
            # memory is then one page at most, not all of them).
            body = worst_page(next(polls), cap)
            sizes.append(len(body))
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    settings = load_settings(overrides={"target": url, "timeout": "4s", "log_level": "warning", **overrides},
                             environ={})
    monitor = Monitor(settings)
    client = TestClient(create_app(monitor, settings))
    tune_garbage_collector()
    gc.collect()
    before = status_kib("VmRSS")
    rss = []
    for _ in range(args.polls):
        state = monitor.poll_once()
        if not state.up:
            raise RuntimeError(f"poll failed: {state.reason} {state.detail}")
        client.get("/metrics")
        client.get("/api/v1/diagnosis")
        rss.append(status_kib("VmRSS"))
    print(json.dumps({"cap_bytes": cap, "page_bytes": sizes[0], "rss_before_kib": before, "rss_kib": rss,
                      "peak_rss_kib": status_kib("VmHWM"), "engines": len(monitor.state.snapshot.engines)}))
    httpd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
