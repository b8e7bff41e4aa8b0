"""JSON views of the monitor's State, shared by the API and the CLI."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvwatch.diagnose.arbitration import caused_by
from kvwatch.diagnose.thresholds import resolve_thresholds
from kvwatch.diagnose.vocabulary import ALERT_CAUSES, finding_key, runbook_link
from kvwatch.engines import ENGINES
from kvwatch.engines.plausible import faults_json
from kvwatch.kvevents.source import public_report as public
from kvwatch.present import clean, public_url
from kvwatch.routing.tenants import DEFAULT_TOP_K, lora_rows
from kvwatch.signals import SIGNALS, WHOLE_BLOCK_SIGNALS, blocks_hold_capacity
from kvwatch.signals import worth
from kvwatch.signals.catalogue import caveats, unlit_reasons
from kvwatch.snapshot import hybrid_cache
from kvwatch.stream_report import KVEventsReport


def public_report(report: KVEventsReport | None) -> dict[str, Any] | None:
    return public(report)


def kv_events_of(state) -> KVEventsReport | None:
    """The State's KV-cache event stream report (None unless kv_events is set), typed for its readers."""
    report: KVEventsReport | None = getattr(state, "kv_events", None)
    return report


def stream_status(stream: KVEventsReport) -> dict[str, Any]:
    """The stream's own up and reason, as /api/v1/status says them."""
    return {"endpoint": stream.get("endpoint"), "mode": stream.get("mode"), "up": stream.get("up"),
            "reason": stream.get("reason"), "detail": stream.get("detail")}


def _rows(rows) -> list[dict[str, Any]]:
    return [
        {
            "model_name": row.model,
            **({"engine": row.engine} if row.engine is not None else {}),
            "signals": {signal.name: clean(row.values.get(signal.name)) for signal in SIGNALS},
            "notes": list(dict.fromkeys(row.notes)),
            # Signal -> {quantile: "<" | ">"}: the quantiles that are bounds, not estimates.
            "pinned": dict(getattr(row, "pinned", {}) or {}),
            # Signal -> the sentence on how this engine's version counts what it reads
            # (re-lookups in the prefix-cache lookups, a preemption counter that trails).
            "caveats": caveats(row.view, row.values),
        }
        for row in rows
    ]


def status_json(state, settings) -> dict[str, Any]:
    return {
        "target": public_url(settings.target),
        "up": state.up,
        "reason": state.reason,
        # One human sentence, never an exception's text (that stays in the log).
        "detail": state.detail if not state.up else "",
        "polls": state.polls,
        "errors_by_reason": state.errors_by_reason,
        "parse_errors": state.parse_errors,
        "last_parse_errors": list(state.last_parse_errors),
        "last_success_time": state.last_success_time,
        "poll_interval_seconds": settings.poll_interval,
        "window_seconds": settings.window,
        "window_covered_seconds": state.window_seconds,
        # One sentence when the window reached its byte bound and forgot
        # pairs or polls before their time (kvwatch.window), else null.
        "window_trimmed": getattr(state, "window_trimmed", None),
        "engine": state.engine,
        # The namespace the engine's sample lines are spelled in ("sglang:", or "sglang_" once OpenMetrics'
        # escaping=underscores rewrote them): what a query of the engine's own series must name; null unknown.
        "engine_spelling": (getattr(state.snapshot, "spelling", "") or None) if state.up and state.snapshot else None,
        # kvwatch serve --replay: what is replayed, how fast, whether it ended
        # (absent when live); `text` is the sentence every surface shows.
        **({"replay": {**replay, "text": replay_text(replay)}} if (replay := getattr(state, "replay", None)) else {}),
        "dark_signals": dark_signals(state.snapshot if state.up else None, state.engine, state.dark_signals,
                                     state.per_engine if state.up else ()),
        # Busy, not down: /metrics late or timed out under load, the lateness measured (None otherwise).
        "busy": clean(getattr(state, "busy", None)),
        # Values that cannot be true (kvwatch.engines.plausible): faults of the engine's metrics, left out, never clamped.
        "source_faults": faults_json(getattr(state, "source_faults", ()) if state.up else ()),
        # The LMCache tier's poll (absent unless lmcache_target is set): its own up and reason.
        **({"lmcache": {key: tier.get(key) for key in ("target", "up", "reason", "detail", "families")}}
           if (tier := getattr(state, "lmcache", None)) else {}),
        # The KV-cache event stream (absent unless kv_events is set): its own up and reason.
        **({"kv_events": stream_status(stream)} if (stream := kv_events_of(state)) else {}),
    }


def replay_text(replay: dict[str, Any]) -> str:
    """One sentence on a replay, for the page, /api/v1/status and /readyz:
    "replay of capture.tar.gz (recorded, as fast as it reads): finished; serving its last recorded state"."""
    speed = replay.get("speed") or 0
    pace = "as fast as it reads" if speed == 0 else f"at {speed:g}x recorded speed"
    text = f"replay of {replay.get('capture')} (recorded times, {pace}, {replay.get('recorded_polls')} recorded polls)"
    if replay.get("stopped"):
        return f"{text}: stopped early ({replay['stopped']}); serving the last recorded state"
    if replay.get("finished"):
        return f"{text}: finished; serving its last recorded state"
    return f"{text}: running"


def _engine_title(engine: str | None) -> str:
    adapter = ENGINES.get(engine or "")
    return adapter.title if adapter is not None else "this engine"


def _hybrid_without_whole_blocks(snapshot) -> str | None:
    """Why whole-block signals are absent on a hybrid (attention + Mamba)
    model, in words with its cache_config_info `mamba_*` labels; None when
    no engine of the page is one whose blocks do not hold its capacity."""
    if snapshot is None:
        return None
    for engine in sorted(snapshot.cache_config):
        labels = snapshot.cache_config[engine]
        mamba = hybrid_cache(labels)
        if mamba is not None and not blocks_hold_capacity(labels):
            stated = ", ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                               for key, value in mamba.items())
            return (f"a hybrid model (Mamba layers; engine {engine}: {stated}): its KV groups' blocks differ and "
                    "block_size is the smallest, so num_gpu_blocks x block_size is not its capacity and whole-block "
                    "arithmetic is not computed")
    return None


def _versions(engine: str | None) -> dict[str, str]:
    from kvwatch.engines import ENGINES

    adapter = ENGINES.get(engine or "")
    return getattr(adapter, "versions", {}) if adapter is not None else {}


def _unstated_bytes(snapshot) -> str | None:
    """Why KV bytes are unknown where the page states the cache but not its
    bytes: cache_config_info's kv_cache_memory_bytes set to "None" (as
    vLLM 0.10.2 writes it)."""
    if snapshot is None:
        return None
    for engine in sorted(snapshot.cache_config):
        if snapshot.cache_config[engine].get("kv_cache_memory_bytes") == "None":
            return (f'cache_config_info of engine {engine} says kv_cache_memory_bytes="None": the engine states '
                    "no size of its KV cache in bytes")
    return None


BYTE_SIGNALS = ("kvwatch_kv_cache_used_bytes", "kvwatch_kv_cache_reuse_shortfall_bytes")


def _named(need: str, snapshot, engine: str | None) -> str:
    """Of a need's alternatives ("a|b"), the one this engine provides or its
    page names (a gate or a family), else the first."""
    parts = need.split("|")
    adapter = ENGINES.get(engine or "")
    provided = adapter.provides() if adapter is not None and len(parts) > 1 else {}
    return next((part for part in parts
                 if part in provided or part in snapshot.gates or part in snapshot.families), parts[0])


def dark_signals(snapshot, engine: str | None = None, engine_dark: tuple[str, ...] = (),
                 rows=()) -> list[dict[str, Any]]:
    """The signals left dark, in catalogue order, one list for these reasons:
    the engine does not export their inputs at all (`engine_dark`, from the
    adapter), this page lacks a family they need, with the flag that lights
    a config-gated one (else the family is missing from this engine's
    version, named with the releases that have it), the model is a hybrid
    one whose blocks are not whole-block arithmetic's (its mamba_* labels
    named), the cache's bytes are stated as "None", or a value was refused
    (the evaluated `rows` say why: signals.unlit_reasons). Unknown is not
    zero: these signals are absent, never 0."""
    dark: list[dict[str, Any]] = []
    hybrid = _hybrid_without_whole_blocks(snapshot)
    unstated = _unstated_bytes(snapshot)
    versions = _versions(engine)
    refused: dict[str, str] = {}
    for row in rows:
        if row.engine is not None:
            for name, why in unlit_reasons(row.view, row.values).items():
                refused.setdefault(name, why)
    for signal in SIGNALS:
        if hybrid and signal.name in WHOLE_BLOCK_SIGNALS:
            dark.append({"signal": signal.name, "missing_families": [], "lit_by": None, "why": hybrid})
            continue
        if signal.name in engine_dark:
            dark.append({"signal": signal.name, "missing_families": [], "lit_by": None,
                         "why": f"{_engine_title(engine)} does not export what it is computed from"})
            continue
        if snapshot is None:
            continue
        # "a|b": either key lights it (one engine's family or another's).
        missing = [_named(key, snapshot, engine) for key in signal.needs
                   if not any(part in snapshot.sources for part in key.split("|"))]
        if not missing:
            if signal.name in refused:
                dark.append({"signal": signal.name, "missing_families": [], "lit_by": None,
                             "why": refused[signal.name]})
            elif unstated and signal.name in BYTE_SIGNALS:
                dark.append({"signal": signal.name, "missing_families": [], "lit_by": None, "why": unstated})
            continue
        flags = sorted({snapshot.gates[key] for key in missing if key in snapshot.gates})
        families = [snapshot.families.get(key, key) for key in missing]
        since = [f"{family}: {versions[family]}" for family in families if family in versions]
        dark.append({
            "signal": signal.name,
            "missing_families": families,
            "lit_by": flags or None,
            "why": ("config-gated: start the engine with " + " and ".join(flags)) if flags
            else "not exported by this engine's version" + (f" ({'; '.join(since)})" if since else ""),
        })
    return dark


def caveat_lines(signals: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(engine heading, signal, sentence) for each signal this engine's
    version counts differently (the rows' `caveats`), engines first."""
    lines = []
    for row in (signals.get("engines") or []) + (signals.get("models") or []):
        heading = f"{row['model_name']} / {row['engine']}" if "engine" in row else f"{row['model_name']} (all engines)"
        lines += [(heading, name, text) for name, text in (row.get("caveats") or {}).items()]
    return lines


def signals_json(state, settings) -> dict[str, Any]:
    snapshot = state.snapshot if state.up else None
    return {
        **status_json(state, settings),
        "engines": _rows(state.per_engine) if snapshot else [],
        "models": _rows(state.per_model) if snapshot else [],
        "cache_config": snapshot.cache_config if snapshot else {},
        "sources": snapshot.sources if snapshot else {},
        "source_present": snapshot.present() if snapshot else {},
        "events": [asdict(e) for e in state.events],
        # The diagnosis' thresholds in force (defaults overlaid with the
        # settings' `diagnosis:`): the page colours values by these.
        "thresholds": asdict(resolve_thresholds(settings.diagnosis)),
        # What the cache is worth per engine (kvwatch/signals/worth.py), in seconds and at the price.
        "worth": worth_json(state, settings) if snapshot else [],
        # The simulator's phase now and the next: only where demo_target is set (make run).
        **({"demo": getattr(state, "demo", None)} if getattr(settings, "demo_target", None) else {}),
    }


def worth_json(state, settings) -> list[dict[str, Any]]:
    stream = kv_events_of(state)
    price = getattr(settings, "gpu_hour_price", None)
    adapters = lora_rows(stream, getattr(settings, "tenant_top_k", DEFAULT_TOP_K))
    return [clean(worth.summary(row.model, row.engine, row.values, row.view, stream, price, adapters))
            for row in state.per_engine]


def finding_json(finding, since: float | None = None) -> dict[str, Any]:
    """A finding as JSON: the metrics' label names (`model_name`), numbers in
    `evidence` and prose in `notes`, which evidence values are bounds
    (`pinned`: {"ttft_p95_seconds": "<" | ">"}, from the `<key>_pinned`
    evidence), when it was first seen (`since`, epoch seconds, while
    continuously active) and its runbook section."""
    data = asdict(finding)
    raw = data.pop("evidence")
    data.pop("model")  # `model_name`, as the metrics label it
    pinned = {key[: -len("_pinned")] + "_seconds": value for key, value in raw.items()
              if key.endswith("_pinned") and value in ("<", ">")}
    evidence = {k: v for k, v in raw.items() if not isinstance(v, str) and not k.endswith("_pinned")}
    notes = {k: v for k, v in raw.items() if isinstance(v, str) and not k.endswith("_pinned")}
    return clean({"model_name": finding.model, **data, "evidence": evidence, "notes": notes, "pinned": pinned,
                   "since": since, "runbook": runbook_link(finding.symptom, finding.cause, ALERT_CAUSES)})


# What a card tells of the finding that is its named cause: its place, headline, words and next action.
TOLD_CAUSE = ("model_name", "engine", "symptom", "cause", "severity", "confidence", "summary", "notes", "next_check",
              "runbook")


def findings_json(findings, since: dict) -> list[dict[str, Any]]:
    """The findings as JSON, each listed; one whose named cause is another
    finding (arbitration.caused_by: late first tokens because the cache is
    exhausted) carries it as `caused_by`, and that one says `cause_of`, so
    the page draws one card telling both. `caused_by` holds what the card
    tells of the cause (TOLD_CAUSE); its evidence and the rest are in its own
    row, listed beside it (a full copy was a tenth of the page at 8 engines)."""
    rows = [finding_json(f, since.get(finding_key(f))) for f in findings]
    for higher, lower in caused_by(findings).items():
        rows[higher]["caused_by"] = {key: rows[lower][key] for key in TOLD_CAUSE if key in rows[lower]}
        rows[lower]["cause_of"] = {"symptom": findings[higher].symptom, "cause": findings[higher].cause}
    return rows


def diagnosis_json(state, settings) -> dict[str, Any]:
    since = getattr(state, "findings_since", {}) or {}
    return {
        **status_json(state, settings),
        "findings": findings_json(list(state.findings), since) if state.up else [],
        "events": [asdict(e) for e in state.events],
        "upstream": clean(state.upstream),
        "lmcache": clean(getattr(state, "lmcache", None)),
        "kv_events": clean(public_report(kv_events_of(state))),
    }
