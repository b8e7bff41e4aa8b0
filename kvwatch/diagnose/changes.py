"""Changes that invalidate comparisons: restarts, cache-config, model and
adapter changes, as info findings."""

from __future__ import annotations

from collections import deque
from typing import Any

from kvwatch.diagnose.context import EngineContext, tidy
from kvwatch.diagnose.vocabulary import NEXT_CHECK, Change, Finding, severity_of
from kvwatch.window import Entry, EntryFollower, Window


# Names a change keeps and shows. A gateway that sets one model name per
# request changes the set on every poll: each change carried both whole
# lists, and each finding them again, so memory grew with the square of the
# names (200 new names a poll took RSS from 168 MB to 1.38 GB).
MAX_NAMES = 10
# Characters a change shows of one name: a name is a label value, as long as
# the page admits (MAX_NAMES of 8 MiB each made one event's detail 80 MB).
NAME_MAX_CHARS = 120


def names_text(names) -> str:
    """`['a', 'b']`, or the first MAX_NAMES and how many there are in all;
    a name longer than NAME_MAX_CHARS shows its start and its length."""
    names = [name if len(name) <= NAME_MAX_CHARS else f"{name[:NAME_MAX_CHARS]}...({len(name)} chars)"
             for name in names]
    if len(names) <= MAX_NAMES:
        return repr(names)
    return repr(names[:MAX_NAMES])[:-1] + f", ... ({len(names)} in all)]"


def window_changes(window: Window, events: tuple[Change, ...] | None) -> list[Change]:
    """Changes inside the window: restarts, cache-config and model-set
    changes read from consecutive snapshots (exact keys), plus the monitor's
    events for what a window cannot see (new LoRA adapters, and anything
    recorded without a matching snapshot)."""
    found: list[Change] = []
    if EngineContext.incremental:
        # The same changes, kept as entries arrive and leave (WindowChanges).
        for _entry, changes in WindowChanges.of(window, "diagnosis_changes").changes:
            found.extend(changes)
    else:
        entries = list(window.entries)
        for previous, entry in zip(entries, entries[1:]):
            found.extend(changes_between(previous, entry))
    seen = {(c.time, c.kind, c.engine) for c in found}
    found.extend(event for event in events or () if (event.time, event.kind, event.engine) not in seen)
    return sorted(found, key=lambda c: c.time)


class WindowChanges(EntryFollower):
    """(entry, what changed from the entry before it) for the window's
    entries after the first that changed something, kept as entries arrive
    and leave (window_changes)."""

    def __init__(self) -> None:
        super().__init__()
        self.changes: deque[tuple[Entry, list[Change]]] = deque()

    def reset(self) -> None:
        super().reset()
        self.changes = deque()

    def entered(self, previous: Entry | None, entry: Entry) -> None:
        if previous is not None:
            found = changes_between(previous, entry)
            if found:
                self.changes.append((entry, found))

    def left(self, entry: Entry, first: Entry | None) -> None:
        changes = self.changes
        if changes and changes[0][0] is entry:
            changes.popleft()
        if changes and changes[0][0] is first:
            changes.popleft()  # the first entry's changes (from one that left) no longer count


def changes_between(previous: Entry, entry: Entry) -> list[Change]:
    """What changed from one window entry to the next (restarts, cache
    config, the set of models), read once per entry: an entry keeps its
    predecessor while both stay in the window. The monitor records these as
    events when the entry arrives; the diagnosis reads them for its window."""
    found = entry.derived.get("changes")
    if found is not None:
        return found
    found = []
    now = entry.snapshot
    for (model, engine), step in sorted(entry.steps.items()):
        if step.restarted:
            found.append(Change(now.time, "restart", model, engine,
                                "the engine restarted: a new process start time, or counters that went down"))
    for engine, config in sorted(now.cache_config.items()):
        before = previous.snapshot.cache_config.get(engine)
        if before is not None and before != config:
            keys = tuple(sorted(k for k in set(before) | set(config) if before.get(k) != config.get(k)))
            detail = ", ".join(f"{k}: {before.get(k)} -> {config.get(k)}" for k in keys[:8])
            found.append(Change(now.time, "cache_config", None, engine, detail, keys))
    models_before = {m for m, _ in previous.snapshot.engines}
    models_now = {m for m, _ in now.engines}
    if models_before != models_now:
        names_before, names_after = sorted(models_before), sorted(models_now)
        added = sorted(models_now - models_before)
        found.append(Change(now.time, "models", None, None,
                            f"served models changed: {names_text(names_before)} -> {names_text(names_after)}",
                            before=tuple(names_before[:MAX_NAMES]), after=tuple(names_after[:MAX_NAMES]),
                            added=tuple(added[:MAX_NAMES])))
    entry.derived["changes"] = found
    return found


# cache_config keys that change what capacity and hit ratios mean.
DTYPE_KEYS = ("cache_dtype",)


# A restarted engine's cache counts as warm again once this many prompt
# tokens were looked up since the restart and at least this share hit
# (the hit-rate rule's own floor and its low mark).
WARM_QUERY_TOKENS = 1024
WARM_HIT_RATIO = 0.2


def _prefix_since(window: Window, change: Change) -> tuple[float, float]:
    """Prefix-cache hits and queried tokens of the restarted engine since the restart."""
    hits = queries = 0.0
    for entry in window.entries:
        if entry.snapshot.time < change.time:
            continue
        for (model, engine), step in entry.steps.items():
            if (change.engine is None or engine == change.engine) and (change.model is None or model == change.model):
                hits += step.counters.get("prefix_hits", 0.0)
                queries += step.counters.get("prefix_queries", 0.0)
    return hits, queries


def change_findings(window: Window, changes: list[Change]) -> list[Finding]:
    latest = window.latest
    now = latest.time if latest else 0.0
    served = sorted({m for m, _ in latest.engines}) if latest else []
    models_of: dict[str, list[str]] = {}
    for model, engine in (latest.engines if latest else {}):
        models_of.setdefault(engine, []).append(model)
    findings = []

    def model_for(change: Change) -> str:
        if change.model:
            return change.model
        candidates = models_of.get(change.engine, served) if change.engine is not None else served
        return candidates[0] if len(candidates) == 1 else "*"

    def add(cause: str, change: Change, summary: str, evidence: dict[str, Any], model: str | None = None) -> None:
        findings.append(Finding("change", cause, severity_of(cause), "high", model or model_for(change), change.engine, summary,
                                tidy({"seconds_ago": now - change.time, "detail": change.detail, **evidence}),
                                NEXT_CHECK[cause]))

    # At most MAX_NAMES model_changed findings in all, the newest changes'
    # first: a gateway that sets a new served name per request changes the
    # set every poll, and ten findings a change filled the page and the API
    # with a window's worth of them.
    room = MAX_NAMES
    named: dict[int, list[str]] = {}
    for index in range(len(changes) - 1, -1, -1):
        if changes[index].kind == "models" and room > 0:
            named[index] = list(changes[index].added or ["*"])[:room]
            room -= len(named[index])
    for index, change in enumerate(changes):
        ago = now - change.time
        if change.kind == "restart":
            hits, queries = _prefix_since(window, change)
            if queries >= WARM_QUERY_TOKENS and hits / queries >= WARM_HIT_RATIO:
                # The cache warmed again: saying "cold" for the rest of the
                # window contradicts the hit ratio on the same page (0.97
                # within seconds of the restart in the real capture).
                state = f"prefix cache warm again (hit ratio {hits / queries:.0%} since the restart)"
            elif queries > 0:
                state = f"prefix cache cold (hit ratio {hits / queries:.0%} since the restart)"
            else:
                state = "prefix cache cold (no prompt since the restart)"
            add("engine_restarted", change, f"Engine restarted {ago:.0f}s ago: counters restarted, {state}.",
                {"hit_ratio_since_restart": hits / queries if queries else None,
                 "prefix_queries_since_restart": queries})
        elif change.kind == "cache_config":
            dtype = [k for k in change.keys if k in DTYPE_KEYS]
            rest = [k for k in change.keys if k not in DTYPE_KEYS]
            if dtype:
                add("cache_dtype_changed", change,
                    f"KV-cache dtype changed {ago:.0f}s ago ({change.detail}): re-evaluate task accuracy; "
                    "comparisons across the change do not hold.", {"changed_keys": ",".join(dtype)})
            if rest or not change.keys:
                add("cache_config_changed", change,
                    f"KV-cache configuration changed {ago:.0f}s ago ({change.detail}): capacity and block "
                    "baselines before it do not compare.", {"changed_keys": ",".join(rest)})
        elif change.kind == "models":
            for model in named.get(index, ()):
                add("model_changed", change, f"Served models changed {ago:.0f}s ago: {change.detail}.",
                    {"models_before": ",".join(change.before), "models_after": ",".join(change.after)}, model)
        elif change.kind == "lora":
            add("lora_changed", change, f"LoRA adapters changed {ago:.0f}s ago: {change.detail}.", {})
        elif change.kind == "kv_cache_cleared":  # from the engine's KV-cache events (kvwatch/kvevents)
            add("prefix_cache_cleared", change,
                f"The engine cleared its prefix cache {ago:.0f}s ago (AllBlocksCleared in its KV-cache events): "
                "every cached block is gone; hit ratios before and after do not compare.", {})
    return findings
