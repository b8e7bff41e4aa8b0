"""One simulated hour of `kvwatch serve` at a 1 s poll interval, in a fresh
process, reporting its resident memory as it goes (JSON on stdout).

The process is built as `kvwatch serve` builds itself: settings, Monitor,
the FastAPI app, served by uvicorn on a loopback port (in a thread). The
main thread then drives Monitor.poll_once over loopback against the
benchmark's page server 3,600 times with a simulated wall clock that
advances 1 s per poll, so the window, the event ring and every cache go
through an hour's worth of polls in about a minute; every 15 simulated
seconds it scrapes its own /metrics over HTTP, as Prometheus would. RSS is
read from /proc/self/status after each simulated minute.

    python benchmarks/memory_probe.py --target URL [--minutes 60]
"""

from __future__ import annotations

import argparse
import gc
import json
import socket
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", required=True)
    parser.add_argument("--minutes", type=int, default=60)
    parser.add_argument("--scrape-every", type=int, default=15, help="simulated seconds between scrapes")
    args = parser.parse_args()

    import uvicorn

    from clock import SimulatedClock, install
    from kvwatch.sidecar.app import create_app
    from kvwatch.pipeline.monitor import Monitor, tune_garbage_collector
    from kvwatch.settings import load_settings

    port = free_port()
    settings = load_settings(overrides={"target": args.target, "engine": "vllm", "poll_interval": "1s", "port": port,
                                        "log_level": "warning"}, environ={})
    monitor = Monitor(settings)
    app = create_app(monitor, settings)
    tune_garbage_collector()  # as kvwatch serve does before it starts polling
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise SystemExit("uvicorn did not start within 30 s")
        time.sleep(0.05)

    clock = SimulatedClock()
    install(clock)
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    samples = [{"minute": 0, "rss_kib": status_kib("VmRSS"), "objects": len(gc.get_objects())}]
    failed_polls = 0
    scrape_bytes = 0
    started = time.monotonic()
    for second in range(1, args.minutes * 60 + 1):
        clock.advance(1.0)
        if not monitor.poll_once().up:
            failed_polls += 1
        if second % args.scrape_every == 0:
            with urllib.request.urlopen(metrics_url, timeout=10) as response:
                scrape_bytes = len(response.read())
        if second % 60 == 0:
            samples.append({"minute": second // 60, "rss_kib": status_kib("VmRSS"),
                            "objects": len(gc.get_objects())})
    server.should_exit = True
    thread.join(10)
    print(json.dumps({
        "samples": samples,
        "peak_rss_kib": status_kib("VmHWM"),
        "polls": args.minutes * 60,
        "failed_polls": failed_polls,
        "window_entries": len(monitor.window.entries),
        "label_cache": len(monitor.adapter.selector._label_cache),
        "events": len(monitor._events),
        "scrape_bytes": scrape_bytes,
        "wall_seconds": time.monotonic() - started,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
