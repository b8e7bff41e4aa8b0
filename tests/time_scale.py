"""A test-only rendering of the mixin with time scaled down: every span the
rules read (rate and baseline windows, burn-rate windows, holds, `for:`) is
divided by one factor, so that a simulator running that many times faster
than wall time meets rules that judge it as the defaults judge an engine at
speed 1. Production rules are never rendered this way."""

from __future__ import annotations

from kvwatch.mixin.config import DEFAULT_FOR, MixinConfig, config_from_mapping
from kvwatch.units import parse_prometheus_duration

# The fields that hold one duration each (the rest are thresholds and names).
DURATION_FIELDS = ("rate_window", "finding_hold", "cold_cache_window", "hit_ratio_baseline_window",
                   "kvwatch_absent_window", "hit_ratio_memory")


def milliseconds(seconds: float) -> str:
    """A Prometheus duration: whole minutes or seconds where exact (the recorded series' names carry
    their windows), else milliseconds (a scaled `for:` is rarely whole seconds)."""
    ms = max(1, round(seconds * 1000))
    if ms % 60_000 == 0:
        return f"{ms // 60_000}m"
    return f"{ms // 1000}s" if ms % 1000 == 0 else f"{ms}ms"


def scaled(mapping: dict, factor: float) -> dict:
    """`mapping` (a mixin config) with every duration, its own or the
    default, divided by `factor`; the rules evaluated every second."""
    base = config_from_mapping(mapping)
    out = dict(mapping)
    for name in DURATION_FIELDS:
        out[name] = milliseconds(parse_prometheus_duration(getattr(base, name)) / factor)
    out["for_durations"] = {alert: milliseconds(parse_prometheus_duration(base.for_duration(alert)) / factor)
                            for alert in DEFAULT_FOR}
    out["burn_rate_windows"] = [
        {**pair, "long": milliseconds(parse_prometheus_duration(pair["long"]) / factor),
         "short": milliseconds(parse_prometheus_duration(pair["short"]) / factor)}
        for pair in base.burn_rate_windows]
    out["exhaustion_eta_minutes"] = base.exhaustion_eta_minutes / factor
    out["rule_interval"] = "1s"
    return out


def scaled_config(mapping: dict, factor: float) -> MixinConfig:
    return config_from_mapping(scaled(mapping, factor))
