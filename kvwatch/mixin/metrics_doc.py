"""docs/metrics.md, generated from the catalogue: every metric kvwatch exports."""

from __future__ import annotations

from kvwatch.sidecar.collector import IDENTITY
from kvwatch.signals import ENGINE_SERIES, SIGNALS

HEALTH = (
    ("kvwatch_up", "gauge", "", "1 if the latest poll of the engine's /metrics succeeded, else 0."),
    ("kvwatch_polls_total", "counter", "", "Polls of the engine's /metrics."),
    ("kvwatch_poll_errors_total", "counter", "reason", "Failed polls by reason (refused, dns, timeout, tls, http_3xx/4xx/5xx, content_type, too_large, truncated, decode, no_engine_metrics, ...)."),
    ("kvwatch_parse_errors_total", "counter", "", "Malformed lines in the engine's pages (skipped; the rest of the page counts)."),
    ("kvwatch_dropped_series_total", "counter", "", "(model, engine) pairs dropped by the max_series cap."),
    ("kvwatch_poll_duration_seconds", "gauge", "", "Wall time of the latest poll."),
    ("kvwatch_poll_cpu_seconds", "gauge", "", "CPU time of the latest poll."),
    ("kvwatch_last_success_timestamp_seconds", "gauge", "", "Unix time of the latest successful poll."),
    ("kvwatch_window_seconds", "gauge", "", "Span the windowed signals cover now."),
    ("kvwatch_engine_info", "gauge", "block_size, num_gpu_blocks, cache_dtype, enable_prefix_caching, kv_cache_size_tokens",
     "The engine's KV-cache configuration from vllm:cache_config_info; changes() marks a configuration change."),
    ("kvwatch_finding", "gauge", "symptom, cause, severity", "1 for each active diagnosis finding."),
)


def _row(name: str, kind: str, labels: str, help_text: str) -> str:
    return f"| `{name}` | {kind} | {labels} | {help_text.replace('|', '/')} |"


def render() -> str:
    identity = ", ".join(IDENTITY)
    lines = [
        "# Metrics kvwatch exports",
        "",
        "Generated from `kvwatch/signals.py` by `kvwatch generate`; do not edit by hand.",
        "",
        "## Health of the poll",
        "",
        "| metric | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    lines += [_row(*row) for row in HEALTH]
    lines += [
        "",
        "## vLLM series under stable names",
        "",
        f"Labels `{identity}` on each. Counters and histograms pass through unchanged (resets included;",
        "`rate()` handles them), histograms with the buckets vLLM was configured with.",
        "",
        "| metric | type | labels | meaning and vLLM sources |",
        "|---|---|---|---|",
    ]
    for series in ENGINE_SERIES:
        lines.append(_row(series.sample_name, series.kind, series.label or "", series.help))
    lines += [
        "",
        "## Windowed signals",
        "",
        f"Each as `kvwatch_<name>{{{identity}}}` per engine and `kvwatch_model_<name>{{model_name}}` per model",
        "(engines merged: counters summed, usage the maximum). Computed over `--window` with",
        "Prometheus' counter-reset semantics; absent when there is nothing to compute from",
        "(for example a hit ratio with no queries in the window).",
        "",
        "| metric | unit | extra label | meaning and vLLM sources |",
        "|---|---|---|---|",
    ]
    for signal in SIGNALS:
        lines.append(_row(signal.name, signal.unit, signal.label or "", signal.help))
    return "\n".join(lines) + "\n"
