"""The replay section: `kvwatch diagnose --replay` of a day of 5 s pages
written as `kvwatch capture` writes a bundle."""

from __future__ import annotations

import time
from pathlib import Path

from bench_support import Report, plain_table, table
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from pages import AdvancingPage


def bench_replay(report: Report, capture: str, quick: bool) -> None:
    """`kvwatch diagnose --replay` of 24 hours of 5 s pages: the capture's
    page with advancing counters, written as `kvwatch capture` writes a bundle,
    then replayed through the Monitor (5 min window) at recorded time."""
    import shutil
    import tempfile

    from kvwatch.capture.bundle import Capture, CaptureWriter
    from kvwatch.capture.record import manifest_for
    from kvwatch.capture.replay import replay

    interval = 5.0
    hours = 2 if quick else 24
    pages = int(hours * 3600 / interval)
    folder = Path(tempfile.mkdtemp(prefix="kvwatch-bench-replay-"))
    try:
        advancing = AdvancingPage(capture)
        started = time.monotonic()
        bundle = folder / "day.tar.gz"
        writer = CaptureWriter(bundle, manifest_for("http://127.0.0.1:8000/metrics", interval, hours * 3600))
        for poll in range(pages):
            writer.add(1.8e9 + poll * interval, 0.004, advancing.render(poll))
        writer.close(ended_at=1.8e9 + pages * interval, interrupted=False)
        written = time.monotonic() - started
        size = bundle.stat().st_size
        settings = load_settings(overrides={"target": "http://127.0.0.1:8000/metrics", "poll_interval": "5s"},
                                 environ={})
        started = time.monotonic()
        timeline = replay(Capture(bundle), lambda source: Monitor(settings, fetcher=source, clock=source.now))
        seconds = time.monotonic() - started
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert timeline.polls == pages and timeline.failed == 0, (timeline.polls, timeline.failed)
    recorded = hours * 3600
    target_pages = 17_280
    report.figure(f"replay of {hours} h of 5 s pages ({pages} pages of {len(capture) / 1000:.0f} KB), bundle",
                  f"{seconds:.1f} s = {recorded / seconds:,.0f}x recorded time",
                  f"recorded time: {recorded / 3600:g} h", "< 60 s for 17,280 pages",
                  seconds * target_pages / pages < 60)
    detail = [[str(pages), f"{size / 1e6:.1f} MB", f"{written:.1f} s", f"{seconds:.1f} s",
               f"{seconds / pages * 1e3:.2f} ms", f"{recorded / seconds:,.0f}x", str(len(timeline.episodes))]]
    header = ["pages", "bundle (.tar.gz)", "writing it", "replay", "per page", "vs recorded time", "episodes"]
    report.sections.append(
        "### Replay of a day\n\n"
        f"`kvwatch diagnose --replay` over {hours} h of pages 5 s apart: the capture's page with its counters "
        "advancing every poll, written as `kvwatch capture` writes a .tar.gz bundle, then streamed from it "
        "through the sidecar's Monitor (5 min window, signals, diagnosis) at the recorded times, and folded "
        "into the findings timeline. The baseline is the recorded time itself: how much faster than live "
        "the replay runs.\n\n" + table(header, detail))
    print(plain_table(header, detail), flush=True)
