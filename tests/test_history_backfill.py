"""A capture and the store that scraped the same pages tell the same story:
a bundle recorded from the simulator is backfilled into a real Prometheus
TSDB (`promtool tsdb create-blocks-from openmetrics`), and `kvwatch diagnose
--prometheus` over it gives the findings timeline of `kvwatch diagnose
--replay` over the bundle: the same causes, each start and end within one
step."""

from __future__ import annotations

import json
import time

import pytest

from kvwatch.capture.bundle import Capture, CaptureWriter
from kvwatch.capture.record import manifest_for, record
from kvwatch.cli import main
from kvwatch.scrape import Fetcher
from kvwatch.sim.server import start_background
from promstack import backfilled_prometheus
from sim_support import pages_openmetrics

# 9 minutes: the exhaustion ends inside the capture, one window plus the
# finding hold (1m) after the overload.
INTERVAL, DURATION, WINDOW = 5.0, 540.0, "2m"
INSTANCE = "10.0.9.1:8000"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """The exhaustion scenario (light, 3 min overload, recovery) recorded
    every 5 s on the simulator's clock, from whole hours in the past (the
    blocks are complete and the range fixed)."""
    base = float((int(time.time()) // 3600 - 3) * 3600)
    path = tmp_path_factory.mktemp("capture") / "sim.tar.gz"
    with start_background("exhaustion", speed=0) as sim:
        now = [base]

        def sleep(seconds):
            sim.advance(seconds)
            now[0] += seconds

        writer = CaptureWriter(path, manifest_for(sim.metrics_url, INTERVAL, DURATION))
        fetches = record(Fetcher(sim.metrics_url, 5.0, 16 << 20), writer, INTERVAL, DURATION,
                         clock=lambda: now[0], monotonic=lambda: now[0] - base, sleep=sleep)
        writer.close(ended_at=now[0], interrupted=False)
    assert fetches == DURATION / INTERVAL + 1
    return Capture(path), base


def _episodes(findings: list[dict]) -> dict[tuple, list[dict]]:
    keyed: dict[tuple, list[dict]] = {}
    for finding in findings:
        keyed.setdefault((finding["symptom"], finding["cause"], finding["model_name"], finding["engine"]),
                         []).append(finding)
    return {key: sorted(found, key=lambda f: f["start"]) for key, found in keyed.items()}


# The replay runs the sidecar's Monitor and the history its own pipeline per replica; both judge
# whether a finding is active on the last now_seconds and hold it by the catalogue's hysteresis
# through the same judgment (diagnose/now.py NowJudgment), so the two timelines agree.
def test_the_store_gives_the_timeline_the_capture_gives(bundle, capsys):
    capture, base = bundle
    pages = [(entry.time, text) for entry, text in capture.pages()]
    main(["diagnose", "--replay", str(capture.path), "--window", WINDOW, "--json"])
    replayed = json.loads(capsys.readouterr().out)
    with backfilled_prometheus(pages_openmetrics(pages, INSTANCE)) as prom:
        main(["diagnose", "--prometheus", prom.url, "--from", str(base), "--to", str(base + DURATION),
              "--step", f"{INTERVAL:g}s", "--window", WINDOW, "--json"])
    stored = json.loads(capsys.readouterr().out)

    assert stored["source"] == "vllm" and [r["replica"] for r in stored["replicas"]] == [f"vllm/{INSTANCE}"]
    assert stored["findings_dropped"] == replayed["findings_dropped"] == 0
    expected, found = _episodes(replayed["findings"]), _episodes(stored["findings"])
    # The story is worth comparing: the overload's exhaustion starts and ends inside the capture.
    exhaustion = [e for (symptom, *_), episodes in expected.items() if symptom == "exhaustion" for e in episodes]
    assert exhaustion and any(not e["active_at_end"] for e in exhaustion)
    assert sorted(found) == sorted(expected)
    for key, episodes in expected.items():
        assert len(found[key]) == len(episodes), key
        for want, got in zip(episodes, found[key]):
            assert abs(got["start"] - want["start"]) <= INTERVAL, (key, want, got)
            assert abs(got["end"] - want["end"]) <= INTERVAL, (key, want, got)
            assert got["active_at_end"] == want["active_at_end"], key
            assert got["replica"] == f"vllm/{INSTANCE}" and want["replica"] == ""
    assert stored["exit_code"] == replayed["exit_code"] == 1
