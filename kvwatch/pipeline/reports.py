"""What a poll's State carries of its other sources, each a typed dict built
by keyword: the upstream histogram, the LMCache tier, the simulator's phase,
a replay's progress and the busy engine. Dicts, since the page, the JSON API
and the CLI serialise them as they are; typed, so a key one side writes and
the other reads is the same key (mypy checks both). The KV-event stream's
report is typed in kvwatch/stream_report.py (a lower layer: the signals and the
diagnosis read it too)."""

from __future__ import annotations

from typing import Any, Literal, TypedDict


class UpstreamReport(TypedDict):
    """The upstream (router or gateway) TTFT histogram's latest poll (kvwatch/pipeline/upstream.py)."""

    histogram: str
    target: str | None
    up: bool
    reason: str | None
    detail: str
    count: float
    mean_seconds: float | None
    p95_seconds: float | None
    p95_pinned: str | None  # "<" or ">" where p95 is a bound
    window_seconds: float
    time: float


class LMCacheModel(TypedDict):
    """One model's row of the LMCache tier."""

    model_name: str
    signals: dict[str, float | None]
    latest: dict[str, float]
    increase: dict[str, float]
    window_seconds: float
    restarts: int


class _LMCacheTenants(TypedDict, total=False):
    # kind (cache_salt) -> the window's top K tenants and "other" (kvwatch/routing/tenants.py); only where read.
    tenants: dict[str, Any]


class LMCacheReport(_LMCacheTenants):
    """The LMCache tier's latest poll (kvwatch/pipeline/lmcache.py)."""

    target: str | None
    up: bool
    reason: str | None
    detail: str
    # LMCache family -> whether the latest page carried it (None: not read, the fetch failed).
    families: dict[str, bool] | None
    models: list[LMCacheModel]
    time: float


class DemoStatus(TypedDict):
    """The simulator's phase now and the next (kvwatch/pipeline/demo.py)."""

    scenario: str | None
    phase: str | None
    note: str
    next: str | None
    next_in_seconds: float | None
    cycle_seconds: float | None
    speed: float | None
    phases: int | None
    clock: Literal["simulated", "wall"]


class ReplayProgress(TypedDict):
    """A replay's progress (kvwatch serve --replay), updated in place as it runs."""

    capture: str
    speed: float
    recorded_polls: int
    finished: bool
    stopped: str | None  # why it stopped early, in one sentence


class BusyReport(TypedDict):
    """The engine answers late while it has work: busy, not down (Monitor._busy)."""

    late_seconds: float
    timed_out: bool
    running: float
    waiting: float
    since: float | None
    sentence: str
