"""JSON views of the monitor's State, shared by the API and the CLI."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from kvwatch.diagnose.vocabulary import ALERT_CAUSES, runbook_link
from kvwatch.diagnose.thresholds import resolve_thresholds
from kvwatch.signals import SIGNALS, WHOLE_BLOCK_SIGNALS, blocks_hold_capacity
from kvwatch.snapshot import hybrid_cache



def finding_key(finding) -> tuple[str, str, str, str]:
    return (finding.symptom, finding.cause, finding.model, finding.engine or "")


def public_url(url: str | None) -> str | None:
    """The URL without credentials, for anything a user or scraper can read."""
    if not url:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def public_report(report):
    from kvwatch.kvevents.source import public_report as public

    return public(report)


def _clean(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _rows(rows) -> list[dict[str, Any]]:
    return [
        {
            "model_name": row.model,
            **({"engine": row.engine} if row.engine is not None else {}),
            "signals": {signal.name: _clean(row.values.get(signal.name)) for signal in SIGNALS},
            "notes": list(dict.fromkeys(row.notes)),
            # Signal -> {quantile: "<" | ">"}: the quantiles that are bounds, not estimates.
            "pinned": dict(getattr(row, "pinned", {}) or {}),
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
        "engine": state.engine,
        # kvwatch serve --replay: what is replayed, how fast, whether it ended
        # (absent when live); `text` is the sentence every surface shows.
        **({"replay": {**replay, "text": replay_text(replay)}} if (replay := getattr(state, "replay", None)) else {}),
        "dark_signals": dark_signals(state.snapshot if state.up else None, state.engine, state.dark_signals),
        # The LMCache tier's poll (absent unless lmcache_target is set): its own up and reason.
        **({"lmcache": {key: tier.get(key) for key in ("target", "up", "reason", "detail", "families")}}
           if (tier := getattr(state, "lmcache", None)) else {}),
        # The KV-cache event stream (absent unless kv_events is set): its own up and reason.
        **({"kv_events": {key: stream.get(key) for key in ("endpoint", "mode", "up", "reason", "detail")}}
           if (stream := getattr(state, "kv_events", None)) else {}),
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
    from kvwatch.engines import ENGINES

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


def dark_signals(snapshot, engine: str | None = None, engine_dark: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The signals left dark, in catalogue order, one list for three reasons:
    the engine does not export their inputs at all (`engine_dark`, from the
    adapter), this page lacks a family they need, with the flag that lights
    a config-gated one (else the family is missing from this engine's
    version), or the model is a hybrid one whose blocks are not whole-block
    arithmetic's (its mamba_* labels named). Unknown is not zero: these
    signals are absent, never 0."""
    dark = []
    hybrid = _hybrid_without_whole_blocks(snapshot)
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
        missing = [key for key in signal.needs if key not in snapshot.sources]
        if not missing:
            continue
        flags = sorted({snapshot.gates[key] for key in missing if key in snapshot.gates})
        dark.append({
            "signal": signal.name,
            "missing_families": [snapshot.families.get(key, key) for key in missing],
            "lit_by": flags or None,
            "why": ("config-gated: start the engine with " + " and ".join(flags)) if flags
            else "not exported by this engine's version",
        })
    return dark


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
        "thresholds": resolve_thresholds(settings.diagnosis),
        # The simulator's phase now and the next: only where demo_target is set (make run).
        **({"demo": getattr(state, "demo", None)} if getattr(settings, "demo_target", None) else {}),
    }


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
    return _clean({"model_name": finding.model, **data, "evidence": evidence, "notes": notes, "pinned": pinned,
                   "since": since, "runbook": runbook_link(finding.symptom, finding.cause, ALERT_CAUSES)})


def diagnosis_json(state, settings) -> dict[str, Any]:
    since = getattr(state, "findings_since", {}) or {}
    return {
        **status_json(state, settings),
        "findings": [finding_json(f, since.get(finding_key(f))) for f in state.findings] if state.up else [],
        "events": [asdict(e) for e in state.events],
        "upstream": _clean(state.upstream),
        "lmcache": _clean(getattr(state, "lmcache", None)),
        "kv_events": _clean(public_report(getattr(state, "kv_events", None))),
    }
