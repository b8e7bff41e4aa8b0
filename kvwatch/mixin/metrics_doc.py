"""docs/metrics.md, generated from the catalogue: every metric kvwatch exports."""

from __future__ import annotations

from kvwatch.signals import ENGINE_SERIES, HEALTH, IDENTITY, SIGNALS

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
    lines += [_row(f.sample_name, f.kind, ", ".join(f.labels), f.help) for f in HEALTH]
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
