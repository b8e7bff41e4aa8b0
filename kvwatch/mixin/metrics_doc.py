"""docs/metrics.md, generated from the catalogue and the vLLM alias tables:
every metric kvwatch exports, and every vLLM family it reads with the
releases that export it and what kvwatch does when it is missing."""

from __future__ import annotations

from kvwatch.engines import vllm
from kvwatch.signals import STREAM_HEALTH, STREAM_SERIES, STREAM_SIGNALS, STREAM_SIZING
from kvwatch.signals import CENTRAL_HEALTH, ENGINE_SERIES, HEALTH, IDENTITY, SIGNALS, TIER_HEALTH, TIER_IDENTITY, TIER_SERIES, TIER_SIGNALS
from kvwatch.signals.health import ROUTER_HEALTH

def _row(name: str, kind: str, labels: str, help_text: str) -> str:
    return f"| `{name}` | {kind} | {labels} | {help_text.replace('|', '/')} |"


def render() -> str:
    identity = ", ".join(IDENTITY)
    lines = [
        "# Metrics kvwatch exports",
        "",
        "Generated from `kvwatch/signals/` by `kvwatch generate`; do not edit by hand.",
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
        "A quantile pinned at a bucket edge is a bound, not an estimate. Pinned in the first bucket its",
        "value is that bucket's bound and the quantile is at most it (shown `< 300 ms`); pinned at the last",
        "finite bucket its value is that bound and the quantile is at least it (shown `> 80 s`). The series",
        "keeps the number; `kvwatch_quantile_pinned{signal, quantile, bound=\"upper\"|\"lower\"}` is 1 beside it",
        "(absent when nothing is pinned), and `/api/v1/signals` carries the same as `pinned`",
        "(`{signal: {quantile: \"<\" | \">\"}}`) on each row. To read a quantile with its bound in PromQL:",
        "`kvwatch_time_to_first_token_seconds * on (model_name, engine, quantile) group_left (bound)",
        "kvwatch_quantile_pinned{signal=\"kvwatch_time_to_first_token_seconds\"}`. The recording rules' twin",
        "(`histogram_quantile`) interpolates inside the first bucket instead, so there it reads below the bound.",
        "",
        "| metric | unit | extra label | meaning and vLLM sources |",
        "|---|---|---|---|",
    ]
    for signal in SIGNALS:
        lines.append(_row(signal.name, signal.unit, signal.label or "", signal.doc or signal.help))
    lines += _tier()
    lines += _router()
    lines += _stream()
    lines += [
        "",
        "## Central mode's own health",
        "",
        "`kvwatch serve --prometheus URL` serves every replica's series above, each with the replica's labels from",
        "the store, and these of its own, without replica labels.",
        "",
        "| metric | type | labels | meaning |",
        "|---|---|---|---|",
    ]
    lines += [_row(f.sample_name, f.kind, ", ".join(f.labels), f.help) for f in CENTRAL_HEALTH]
    lines += _families()
    return "\n".join(lines) + "\n"


def _tier() -> list[str]:
    """The LMCache tier (kvwatch/pipeline/lmcache.py), present only with `lmcache_target`."""
    lines = [
        "",
        "## LMCache tier",
        "",
        "Only with `--lmcache-target` (`KVWATCH_LMCACHE_TARGET`, YAML `lmcache_target:`): LMCache's page, read beside",
        "the engine's and never added to it. Labels `" + ", ".join(TIER_IDENTITY) + "` (LMCache's `served_model_name`,",
        "else its `model_name`); no `engine`: each worker (TP/PP rank) counts the same tokens, so the first worker's",
        "series (lowest `worker_id`, role `worker`) is read, never the sum. Series and signals are present only while",
        "the latest LMCache poll succeeded; `kvwatch_source_present{family=\"lmcache:...\"}` says which families it read.",
        "LMCache's `retrieve_hit_rate` and `lookup_hit_rate` gauges are never read (one log interval each; the first",
        "reads 1 with no retrievals).",
        "",
        "| metric | type | labels | meaning and LMCache sources |",
        "|---|---|---|---|",
    ]
    lines += [_row(f.sample_name, f.kind, ", ".join(f.labels), f.help) for f in TIER_HEALTH]
    lines += [_row(s.sample_name, s.kind, ", ".join(TIER_IDENTITY), s.help) for s in TIER_SERIES]
    lines += [_row(s.name, "gauge", ", ".join(TIER_IDENTITY + ((s.label,) if s.label else ())), s.doc or s.help)
              for s in TIER_SIGNALS]
    lines += ["", "LMCache families read: " + ", ".join(f"`lmcache:{base}` (counter)" for base in (s.family for s in TIER_SERIES)
                                                       if not base.startswith("mp_"))
              + "; any of the spellings `lmcache:`, `lmcache_`, with or without `_total`. The multiprocess server's "
              "(LMCache 0.5, OpenTelemetry names, read from its Prometheus page, not OTLP): "
              + ", ".join(f"`lmcache_{base}_total`" for base in (s.family for s in TIER_SERIES) if base.startswith("mp_"))
              + " (counters, summed over `cache_salt`)."]
    return lines


def _router() -> list[str]:
    """The router's page read beside the engines, present only with `router_target`."""
    lines = [
        "",
        "## Router",
        "",
        "Only with `--router-target` (`KVWATCH_ROUTER_TARGET`, YAML `router_target:`): a router's page (llm-d's",
        "endpoint picker, NVIDIA Dynamo's KV router, SGLang's gateway) read beside the engines'; docs/diagnosis.md",
        "(`routing`) says how the window is split and judged.",
        "",
        "| metric | type | labels | meaning and sources |",
        "|---|---|---|---|",
    ]
    lines += [_row(f.sample_name, f.kind, ", ".join(f.labels), f.help) for f in ROUTER_HEALTH]
    return lines


def _stream() -> list[str]:
    """The engine's KV-cache event stream (kvwatch/kvevents), present only with `kv_events`."""
    lines = [
        "",
        "## KV-cache event stream",
        "",
        "Only with `--kv-events` (`KVWATCH_KV_EVENTS`, YAML `kv_events:`): vLLM's KV-cache events (`--kv-events-config`,",
        "docs/kv-events.md), read beside the page. No model or engine label: one endpoint is one engine's publisher.",
        "Health is present whenever the stream is configured; counts and signals once an event arrived. Stored-again",
        "counts, return times and the sizing curve are scaled from the ledger's sample (`kvwatch_kv_events_sampling_ratio`,",
        "1 until `kv_events_table_bytes` fills).",
        "",
        "| metric | type | labels | meaning and event sources |",
        "|---|---|---|---|",
    ]
    lines += [_row(f.sample_name, f.kind, ", ".join(f.labels), f.help) for f in STREAM_HEALTH]
    lines += [_row(s.sample_name, s.kind, ", ".join(s.labels), s.help) for s in STREAM_SERIES]
    lines += [_row(s.name, "gauge", "", s.doc or s.help) for s in STREAM_SIGNALS]
    lines += [_row(s.name, "gauge", "extra_cache", s.help) for s in STREAM_SIZING]
    return lines


def _families() -> list[str]:
    """One row per vLLM family the adapter reads (kvwatch/engines/vllm.py)."""
    exported: dict[str, list[str]] = {}
    for series in ENGINE_SERIES:
        exported.setdefault(series.key.removesuffix("/*"), []).append(f"`{series.sample_name}`")
    for signal in SIGNALS:
        for need in signal.needs:
            for key in need.split("|"):
                exported.setdefault(key, []).append(f"`{signal.name}`")
    rows: list[tuple[str, str, str, str]] = []  # family, type, key, when missing

    def missing(key: str) -> str:
        gate = vllm.GATES.get(key)
        where = ("absent unless vLLM runs with " + gate + "; then `kvwatch_source_present` reads 0, the signals "
                 "that need it are absent (never 0) and `/api/v1/signals` lists them under `dark_signals` with "
                 "that flag") if gate else ("absent on releases without it: `kvwatch_source_present` reads 0 and "
                                           "what reads it is absent (never 0)")
        uses = exported.get(key)
        return where + (f"; read into {', '.join(uses)}" if uses else "")

    for kind, table in (("gauge", vllm.GAUGES), ("counter", vllm.COUNTERS), ("histogram", vllm.HISTOGRAMS)):
        for key, aliases in table.items():
            for index, family in enumerate(aliases):
                if index == 0:
                    text = missing(key)
                else:
                    text = f"older name: read only where {', '.join(f'`vllm:{a}`' for a in aliases[:index])} is absent"
                rows.append((family, kind, key, text))
            if key in vllm.COUNTER_FALLBACKS:
                family, label, value = vllm.COUNTER_FALLBACKS[key]
                rows.append((f"{family}{{{label}=\"{value}\"}}", "counter (deprecated)", key,
                             f"read only where `vllm:{aliases[0]}` is absent: both count the same bytes, never added"))
            if key in vllm.HISTOGRAM_FALLBACKS:
                family, label, value = vllm.HISTOGRAM_FALLBACKS[key]
                rows.append((f"{family}{{{label}=\"{value}\"}}", "histogram (deprecated)", key,
                             f"read only where `vllm:{aliases[0]}` is absent: both observe the same transfers, "
                             "never added"))
    for kind, labelled in (("gauge", vllm.LABELLED_GAUGES), ("counter", vllm.LABELLED_COUNTERS),
                           ("counter", vllm.MODEL_ONLY_COUNTERS)):
        for key, (family, label) in labelled.items():
            rows.append((family, f"{kind} by `{label}`", key, missing(key)))
    for key, family in vllm.ENGINE_ONLY_GAUGES.items():
        rows.append((family, "gauge (label `engine` only)", key, missing(key)))
    rows.append((vllm.CACHE_CONFIG, "gauge (info)", "cache_config",
                 "capacity, block and byte signals are absent; the labels are read as an open map, so a label a "
                 "release lacks leaves only what reads it absent"))
    rows.append((vllm.LORA, "gauge (info)", "lora", "no LoRA change events"))
    lines = [
        "",
        "## vLLM families kvwatch reads",
        "",
        "Generated from the alias tables in `kvwatch/engines/vllm.py`. Each is read under any of the spellings "
        "`vllm:`, `vllm_` (OpenMetrics underscore escaping), `ray_vllm:`; a counter with or without `_total`. "
        "Versions are the vLLM releases whose `/metrics` carries the family.",
        "",
        "| vLLM family | type | kvwatch key | vLLM releases | when it is missing |",
        "|---|---|---|---|---|",
    ]
    for family, kind, key, text in rows:
        base = family.split("{")[0]
        lines.append(f"| `vllm:{family}` | {kind} | `{key}` | {vllm.VERSIONS.get(base, '?')} | {text.replace('|', '/')} |")
    return lines
