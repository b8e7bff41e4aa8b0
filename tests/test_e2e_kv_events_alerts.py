"""KvwatchKvEventStreamUnhealthy in a real Prometheus (Debian `prometheus`)
with the generated rules, its `for:` shortened: three kvwatch beside
simulated engines on loopback, one stream per cause.

    never connected  kvwatch listens, no engine publishes there
    stopped          the engine published, then its events stopped while it
                     kept storing blocks (kv_events_silence_seconds: 3 s)
    missed           a publisher skips sequence numbers

Each kvwatch's alert names its own cause and no other."""

from __future__ import annotations

import contextlib
import shutil
import time

import pytest
import zmq

from kvwatch.commands.generate import RULES_FILE, render_all
from kvwatch.kvevents import wire
from kvwatch.mixin.config import config_from_mapping
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.sidecar.app import create_app
from kvwatch.sim.server import start_background
from pageserver import serving
from promstack import free_port, prometheus, query, wait_until

pytestmark = pytest.mark.skipif(not shutil.which("prometheus"), reason="prometheus not installed (make system-deps)")

ALERT = "KvwatchKvEventStreamUnhealthy"
CONFIG = {"rate_window": "20s", "rule_interval": "1s", "for_durations": {ALERT: "2s"}}


def _kvwatch(running: contextlib.ExitStack, sim, endpoint: str) -> tuple[str, Monitor]:
    settings = load_settings(overrides={"target": sim.metrics_url, "port": 0, "poll_interval": "0.5s",
                                        "window": "5m", "kv_events": endpoint}, environ={})
    settings.diagnosis["kv_events_silence_seconds"] = 3.0
    monitor = Monitor(settings)
    served = running.enter_context(serving(create_app(monitor, settings), start_timeout_s=10))
    monitor.start()
    running.callback(monitor.stop)
    return f"127.0.0.1:{served.port}", monitor


def _firing(prom: str) -> set[tuple[str, str]]:
    return {(s["metric"]["instance"], s["metric"]["cause"])
            for s in query(prom, f'ALERTS{{alertname="{ALERT}",alertstate="firing"}}')}


def test_each_unhealthy_stream_fires_its_own_cause_in_prometheus(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(render_all(config_from_mapping(CONFIG))[RULES_FILE])
    ctx = zmq.Context()
    with contextlib.ExitStack() as running:
        running.callback(ctx.term)
        idle = start_background("eviction-pressure", speed=0)
        running.callback(idle.stop)
        stopped_endpoint = f"tcp://127.0.0.1:{free_port()}"
        busy = start_background("eviction-pressure", speed=0, kv_events=stopped_endpoint)
        running.callback(busy.stop)
        never, _ = _kvwatch(running, idle, f"tcp://127.0.0.1:{free_port()}")
        stopped, stopped_monitor = _kvwatch(running, busy, stopped_endpoint)
        missed_endpoint = f"tcp://127.0.0.1:{free_port()}"
        missed, missed_monitor = _kvwatch(running, idle, missed_endpoint)
        prom = running.enter_context(prometheus([never, stopped, missed], rule_files=[rules], interval="1s")).url

        # The busy engine's events reach kvwatch, then stop while it keeps storing blocks.
        deadline = time.monotonic() + 30
        while stopped_monitor.kv_events.messages == 0:
            assert time.monotonic() < deadline, "no KV-cache event reached kvwatch"
            busy.advance(2.0)
            time.sleep(0.1)
        busy.kv_publisher.stop()
        # A publisher that skips sequence numbers: 0, then 10 (9 never sent).
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.connect(missed_endpoint)
        running.callback(pub.close, 0)
        payload = wire.encode_batch(1.0, [wire.stored([1], 16)])
        wait_until(lambda: pub.send_multipart([b"kv", wire.sequence_bytes(0), payload])
                   or missed_monitor.kv_events.messages, 20, "the first message to reach kvwatch", interval=0.1)
        # Prometheus reads the counter at 0 first, or the gap is its first sample and no increase.
        wait_until(lambda: query(prom, f'kvwatch_kv_events_missed_messages_total{{instance="{missed}"}} == 0'), 30,
                   "Prometheus to scrape the stream before the gap")
        pub.send_multipart([b"kv", wire.sequence_bytes(10), payload])

        expected = {(never, "events_never_connected"), (stopped, "events_stopped"), (missed, "events_missed")}

        seen: set[tuple[str, str]] = set()

        def all_firing():
            # Each fires in its own time (the gap's increase leaves the rate window after 20 s).
            busy.advance(1.0)
            seen.update(_firing(prom))
            return seen >= expected
        try:
            wait_until(all_firing, 90, "each stream's cause to fire", interval=0.5)
        except AssertionError:
            state = {name: [(x["metric"], x["value"][1]) for x in query(prom, name)]
                     for name in ("ALERTS", "kvwatch_kv_events_silent_blocks", "kvwatch_kv_events_connections_total",
                                  "kvwatch_kv_events_missed_messages_total", "kvwatch_starting")}
            raise AssertionError(f"expected {sorted(expected)}, fired {sorted(seen)}; Prometheus has {state}") from None
        assert seen == expected  # each kvwatch named its own cause and no other
        blocks = query(prom, f'kvwatch_kv_events_silent_blocks{{instance="{stopped}"}}')
        assert float(blocks[0]["value"][1]) >= 1
