"""Recording a target: fetch through the sidecar's own Fetcher (so TLS, the
bearer token, the size cap and the deadline behave as in `kvwatch serve`)
once per interval, and write each page with its fetch time.

No secret reaches a capture: the target is stored without its credentials and
query string, failure details are the Fetcher's (already redacted), and a page
that contains a credential of the fetch is not stored (the entry records
`secret_in_page` instead: a page is byte-exact or absent, never edited).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from kvwatch import __version__
from kvwatch.capture.bundle import CaptureWriter, Entry
from kvwatch.engines import make_adapter, recognize
from kvwatch.scrape import Fetcher
from kvwatch.present import public_url

Progress = Callable[[Entry, CaptureWriter], None]


def fetcher_secrets(fetcher: Fetcher) -> list[str]:
    # The Fetcher knows what it must never show (query, user info, the token
    # it last read); a capture keeps the same promise.
    return fetcher._secrets()


def describe_page(text: str) -> dict[str, Any]:
    """What the manifest says of the engine behind a page."""
    engine = recognize(text)
    found: dict[str, Any] = {"engine": engine}
    if engine is not None:
        snapshot = make_adapter(engine).adapt(text, at=0.0)
        found["cache_config_info"] = snapshot.cache_config
        found["models"] = sorted({model for model, _ in snapshot.engines})
    return found


def record(
    fetcher: Fetcher,
    writer: CaptureWriter,
    interval: float,
    duration: float,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    count: int | None = None,
    give_up: Callable[[], bool] | None = None,
) -> int:
    """Fetch at 0, interval, 2*interval, ... up to `duration` or `count`
    fetches, or until `give_up()` says so after a fetch (a slow fetch skips
    the slots it missed, never bursts); returns the fetches made. A
    KeyboardInterrupt propagates: the caller closes the writer, which keeps
    what was recorded."""
    started = monotonic()
    deadline = started + duration
    slot = 0
    fetches = 0
    while True:
        at = clock()
        result = fetcher.fetch()
        fetches += 1
        text, reason, detail = result.text, result.reason, result.detail
        if text is not None and any(secret in text for secret in fetcher_secrets(fetcher)):
            text, reason, detail = None, "secret_in_page", "the page contains a credential of the fetch; not stored"
        entry = writer.add(at, result.seconds, text, reason, detail)
        if text is not None and writer.manifest.get("engine") is None:
            writer.update(**describe_page(text))
        if progress is not None:
            progress(entry, writer)
        now = monotonic()
        slot = max(slot + 1, int((now - started) / interval) + 1) if interval > 0 else slot + 1
        next_due = started + slot * interval
        if next_due > deadline + 1e-9 or (count is not None and fetches >= count) or (give_up and give_up()):
            return fetches
        sleep(max(0.0, next_due - monotonic()))


def manifest_for(target: str, interval: float, duration: float) -> dict[str, Any]:
    return {
        "kvwatch_version": __version__,
        "target": public_url(target),
        "interval_seconds": interval,
        "duration_seconds": duration,
        "started_at": time.time(),
        "engine": None,
        "cache_config_info": {},
    }
