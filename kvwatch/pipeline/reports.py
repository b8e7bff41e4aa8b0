"""What a poll's State carries of its other sources, each a typed dict built
by keyword: the upstream histogram, the LMCache tier, the simulator's phase,
a replay's progress and the busy engine. Dicts, since the page, the JSON API
and the CLI serialise them as they are; typed, so a key one side writes and
the other reads is the same key (mypy checks both). The KV-event stream's
report too (built in kvwatch/kvevents/source.py)."""

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


class KVEventsIntake(TypedDict):
    """The intake's and the decoder's counts since the stream started."""

    messages: int
    bytes: int
    batches: int
    dropped: int
    dropped_bytes: int
    missed: int
    restarts: int
    malformed: int
    absurd_events: int
    replay_requests: int
    recovered: int
    gaps: int  # found missing, ever (a counter: never goes back)
    skipped_events: int
    queued: int
    queued_bytes: int
    jumps: int
    labels_folded: int
    connections: int
    publishers: int


class KVEventsTable(TypedDict):
    """The block ledger's table: its entries, bound and sampling."""

    entries: int
    capacity: int
    bytes: int
    sampling_rate: float
    forgotten: int
    horizon_blocks: int


class KVEventsLabelRow(TypedDict):
    """Blocks stored, stored again and reused per (medium, LoRA adapter)."""

    medium: str
    lora_name: str
    stored: float
    stored_again: float
    reused: float


class KVEventsTierRow(TypedDict):
    """Stored, evicted and returned per (medium, locality)."""

    medium: str
    locality: str
    stored: float
    evicted: float
    returned: float
    store_only: bool


class KVEventsTotals(TypedDict):
    """The counts since the stream started."""

    stored: int
    evicted: int
    stored_again: float
    return_seconds_sum: float
    cleared: int
    reused: float
    by_label: list[KVEventsLabelRow]
    evicted_by_medium: dict[str, int]
    tiers: list[KVEventsTierRow]
    return_buckets: list[tuple[float | None, float]]  # (upper bound in seconds, cumulative count)


class KVEventsPart(TypedDict):
    """The counts over a part of the window (the recent part, the earlier)."""

    seconds: float
    stored: int
    evicted: int
    stored_again: float
    stored_again_ratio: float | None
    reused: float


class _KVEventsFlow(TypedDict, total=False):
    # The intake's counts over the window, set after the ledger's (KVEventSource.report).
    missed: int
    dropped: int
    messages: int
    # The prefill seconds lost to blocks stored again, where the page prices them (kvwatch/signals/worth.py).
    lost_prefill_seconds: float | None


class KVEventsWindow(_KVEventsFlow):
    """The counts over the window and their rates."""

    seconds: float
    stored: int
    evicted: int
    stored_again: float
    cleared: int
    stored_per_second: float | None
    evicted_per_second: float | None
    stored_again_per_second: float | None
    reused: float
    reused_per_second: float | None
    stored_again_ratio: float | None
    return_seconds_mean: float | None
    return_seconds_median: float | None
    distance: list[float]  # blocks stored again per distance bucket (kvwatch/kvevents/ledger.py)
    restarted: bool
    by_label: list[KVEventsLabelRow]
    tiers: list[KVEventsTierRow]
    tier_distance: dict[str, list[float]]


class KVEventsChange(TypedDict):
    """A change the stream saw (a publisher that left, a rank that came)."""

    time: float
    kind: str
    detail: str


class KVEventsPause(TypedDict):
    """The latest pause in the engine's stores: its length and how long ago stores resumed."""

    seconds: float
    ended_seconds_ago: float


class KVEventsHits(TypedDict):
    """The hits the stream announced beside the page's prefix hits (kvwatch/kvevents/join.py)."""

    stream_blocks: float
    stream_tokens: float | None
    page_tokens: float | None
    page_queries: float | None
    stream_share_of_page: float | None


class KVEventsPageEngine(TypedDict):
    """The page's engine the stream is joined with."""

    model_name: str
    engine: str | None


class _KVEventsJoined(TypedDict, total=False):
    # Added by the poll beside the page (kvwatch/kvevents/join.py, the monitor); absent in the source's own report.
    hits: KVEventsHits
    page_engine: KVEventsPageEngine | None
    silence: dict[str, Any]  # kvwatch/kvevents/join.py silence()


class KVEventsReport(_KVEventsJoined):
    """The KV-event stream's report for one poll (KVEventSource.report)."""

    endpoint: str
    mode: Literal["connect", "bind"]
    up: bool
    reason: str | None
    detail: str
    last_message_age_seconds: float | None
    listening_seconds: float | None
    last_malformed: str | None
    labels_note: str | None
    intake: KVEventsIntake
    table: KVEventsTable
    totals: KVEventsTotals
    window: KVEventsWindow
    recent: KVEventsPart
    earlier: KVEventsPart
    configured_seconds: float
    block_size: int | None
    cached_blocks_peak: float
    ranks: list[int]
    sizing: dict[str, Any]  # sizing_curve(): the curve's points per extra size, per lower tier
    changes: list[KVEventsChange]
    pause: KVEventsPause | None
    evictor: dict[str, Any] | None  # EvictionLedger.finding()
    time: float
