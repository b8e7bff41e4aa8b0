"""The KV-event stream's report as a type: built in kvwatch/kvevents/source.py
and join.py, read by the signals (worth), the diagnosis (stream.py), routing's
tenants and the pipeline's State. A typed dict built by keyword, since the
page, the JSON API and the CLI serialise it as it is; at the bottom layer, so
every reader may import it."""

from __future__ import annotations

from typing import Any, Literal, TypedDict


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
    # The rate those seconds are priced at: each LoRA adapter's recomputed tokens are priced at it too.
    prefill_seconds_per_token: float | None
    # Tokens a block, as lost counts them: the events' block size, else the page's (vLLM's events may omit it).
    tokens_per_block: float | None


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
