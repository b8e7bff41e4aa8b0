"""The catalogue of what kvwatch exports and derives, declared once:
catalogue.py (the windowed signals), derivations.py (how each is derived:
View, Signal, the derivations, the PromQL helpers), health.py (kvwatch's own
health families, units and good directions), series.py (the engine's series
re-exported under stable names) and evaluation.py (the signals over a window).
Import from here or from the module (catalogue.py re-exports the public names
of derivations.py and health.py)."""

from kvwatch.signals.catalogue import (  # noqa: F401
    CENTRAL_HEALTH, GOOD_DIRECTIONS, HEALTH, HEALTH_BY_NAME, QUANTILES, SCRAPE, SIGNALS, SIGNALS_BY_NAME,
    STREAM_HEALTH, STREAM_SIGNALS, STREAM_SIGNALS_BY_NAME, STREAM_SIZING, TIER_HEALTH, TIER_SIGNALS,
    TIER_SIGNALS_BY_NAME, TREND_RANGE, TREND_SECONDS, UNITS, HealthFamily, Signal, StreamSignal,
    TtftDecomposition, Unit, View, good_direction, mean_tokens, preemption_repeat_share, requests_fit_now,
    reuse_shortfall_blocks, token_usage_estimate, ttft_decomposition, ttft_parts,
)
from kvwatch.signals.evaluation import (  # noqa: F401
    WHOLE_BLOCK_SIGNALS, BlockSums, Evaluated, LazyValues, blocks_hold_capacity, evaluate, evaluate_tier,
    evaluate_window,
)
from kvwatch.signals.series import (  # noqa: F401
    ENGINE_SERIES, IDENTITY, INFO_KEYS, STREAM_SERIES, TIER_IDENTITY, TIER_SERIES, EngineSeries, StreamSeries,
    TierSeries, engine_series_value,
)
