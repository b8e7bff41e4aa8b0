"""The demo's phase strip: with `demo_target` set (make run points it at the
simulator's /sim/phase), each poll also reads which simulated phase runs now
and which comes next, so the status page can say what the newcomer is looking
at and what to expect. A real deployment never sets it.

Read like any page: a byte cap, a deadline, and what comes back checked field
by field; anything else is dropped (the strip then says the phase is unknown)."""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from kvwatch.pipeline.reports import DemoStatus
from kvwatch.scrape import Fetcher

log = logging.getLogger("kvwatch")

MAX_BYTES = 16 * 1024
# The strip is a nicety: a slow simulator must not hold the engine's poll long.
DEADLINE_SECONDS = 2.0
MAX_TEXT = 200


def _text(value: Any) -> str | None:
    return value[:MAX_TEXT] if isinstance(value, str) else None


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def read_status(text: str | None) -> DemoStatus | None:
    """The fields the page shows, from a /sim/phase body; None when it is
    not one (not JSON, no phase name)."""
    if not text:
        return None
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: brackets nested a thousand deep
        return None
    if not isinstance(raw, dict) or not _text(raw.get("phase")):
        return None
    count = raw.get("phases")
    return DemoStatus(
        scenario=_text(raw.get("scenario")),
        phase=_text(raw.get("phase")),
        note=_text(raw.get("note")) or "",
        next=_text(raw.get("next")),
        next_in_seconds=_seconds(raw.get("next_in_seconds")),
        cycle_seconds=_seconds(raw.get("cycle_seconds")),
        speed=_seconds(raw.get("speed")),
        phases=count if isinstance(count, int) and not isinstance(count, bool) and 0 < count < 1000 else None,
        clock="simulated" if raw.get("clock") == "simulated" else "wall",
    )


class DemoSource:
    def __init__(self, url: str, timeout: float, interval: float | None = None):
        # A quarter of the poll interval at most: a slow (or trickling) phase
        # endpoint must not push the engine's next poll back.
        deadline = min(DEADLINE_SECONDS, timeout, interval / 4 if interval else DEADLINE_SECONDS)
        self.fetcher = Fetcher(url, deadline, MAX_BYTES)

    def poll(self) -> DemoStatus | None:
        """The strip's fields, or None; never raises: it runs inside the
        engine's poll, whose state (kvwatch_up) no answer of this endpoint
        may touch."""
        try:
            result = self.fetcher.fetch()
            return read_status(result.text) if result.ok else None
        except Exception:  # noqa: BLE001 - a nicety's failure is logged, never the engine's
            log.debug("the demo's phase endpoint gave an answer kvwatch cannot read", exc_info=True)
            return None
