"""Numbers that cannot be true: a fault of the source, never clamped silently.

An engine's page can carry values no engine state explains: a KV usage of
-0.39 (vllm-ascend on a disaggregated decode instance), a usage above 1, a
counter that is NaN, infinite or below zero, hits that outgrow the lookups
they are hits of. Clamping such a value to 0..1 shows a number the engine
never meant (usage 0 on an instance whose usage is unknown). So each one is:

- taken out of the Snapshot (the signals that read it are absent, and the
  re-exported `kvwatch_engine_*` series with them: unknown is not zero, and
  the in-process value and its PromQL twin agree);
- kept as a SourceFault naming the engine's family, the value it read and a
  sentence, which the status page, the JSON API (`source_faults`) and
  `kvwatch_source_fault` show.

`screen()` runs in every adapter once a page is read; `window_faults()`
checks the window's ratios (a part that rose more than its whole over the
window), which no single page shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# Gauges that are shares, 0..1 by definition.
RATIO_GAUGES = ("kv_usage", "offload_cpu_pinned")
# V0's hit-rate gauge: -1 means "no data yet"; otherwise a share.
SENTINEL_GAUGES = {"v0_prefix_hit_rate": -1.0}

# (part, whole) counter pairs: over any window the part cannot rise more than
# the whole (hits are hits of lookups, cached prompt tokens are prompt tokens).
PART_OF: tuple[tuple[str, str], ...] = (
    ("prefix_hits", "prefix_queries"),
    ("external_prefix_hits", "external_prefix_queries"),
    ("prompt_tokens_cached", "prompt_tokens"),
)

# The kinds of fault, as the `fault` label and the JSON's `fault` say them.
FAULTS = ("below_zero", "above_one", "not_finite", "part_above_whole")
# Faults kept per page (a page of thousands of broken series is counted in
# full, kvwatch_source_faults_total, but only this many are described).
MAX_FAULTS = 100


@dataclass(frozen=True, slots=True)
class SourceFault:
    model: str
    engine: str
    key: str  # canonical key
    family: str  # the engine's family as the page spells it
    fault: str  # FAULTS
    value: float  # what the page said (a ratio for part_above_whole)
    sentence: str

    def json(self) -> dict:
        value = self.value
        return {"model_name": self.model, "engine": self.engine, "key": self.key, "family": self.family,
                "fault": self.fault,
                # JSON has no NaN or infinity: those are written as Prometheus writes them.
                "value": value if math.isfinite(value) else _go_text(value),
                "sentence": self.sentence}


def _go_text(value: float) -> str:
    if value != value:
        return "NaN"
    return "+Inf" if value > 0 else "-Inf"


def _number_text(value: float) -> str:
    return _go_text(value) if not math.isfinite(value) else f"{value:g}"


def family_name(sources: dict[str, str], key: str, prefix: str, kind: str) -> str:
    """The engine's family for a canonical key, spelled as on the page."""
    base = key.split("/", 1)[0]
    name = sources.get(key) or sources.get(base) or base
    if ":" not in name and not name.startswith(prefix.rstrip(":") + "_"):
        name = prefix + name
    if kind == "counter" and not name.endswith("_total") and "{" not in name:
        name += "_total"
    if "/" in key:
        name += f" ({key.split('/', 1)[1]})"
    return name


def screen(snapshot, prefix: str = "") -> None:
    """Move every value of the snapshot that cannot be true into
    `snapshot.faults`. `prefix` spells the engine's families (vLLM's
    sources are kept without it). Cheap when the page is sane: one sum and
    one min per engine and kind, in C."""
    for engine in snapshot.engines.values():
        gauges = engine.gauges
        if gauges and not _sane(gauges.values()) or any(
                key in gauges and not 0.0 <= gauges[key] <= 1.0 for key in RATIO_GAUGES):
            for key, value in list(gauges.items()):
                fault = _gauge_fault(key, value)
                if fault is not None:
                    del gauges[key]
                    _add(snapshot, engine, key, family_name(snapshot.sources, key, prefix, "gauge"), fault, value,
                         "gauge")
        counters = engine.counters
        if counters and not _sane(counters.values()):
            for key, value in list(counters.items()):
                fault = _count_fault(value)
                if fault is not None:
                    del counters[key]
                    _add(snapshot, engine, key, family_name(snapshot.sources, key, prefix, "counter"), fault,
                         value, "counter")
        for key, histogram in list(engine.histograms.items()):
            total = histogram.sum + histogram.count
            if total == total and total != math.inf and histogram.sum >= 0 and histogram.count >= 0:
                continue
            value = histogram.sum if _count_fault(histogram.sum) else histogram.count
            del engine.histograms[key]
            _add(snapshot, engine, key, family_name(snapshot.sources, key, prefix, "histogram"),
                 _count_fault(value) or "not_finite", value, "histogram")


def _sane(values) -> bool:
    """All finite and none below zero: a NaN or an infinity makes the sum
    NaN or infinite."""
    total = sum(values)
    return total == total and -math.inf < total < math.inf and min(values) >= 0.0


def _count_fault(value: float) -> str | None:
    if value != value or value in (math.inf, -math.inf):
        return "not_finite"
    if value < 0:
        return "below_zero"
    return None


def _gauge_fault(key: str, value: float) -> str | None:
    sentinel = SENTINEL_GAUGES.get(key)
    if sentinel is not None and value == sentinel:
        return None
    fault = _count_fault(value)
    if fault is None and (key in RATIO_GAUGES or key in SENTINEL_GAUGES) and value > 1.0:
        return "above_one"
    return fault


_WHAT = {
    "below_zero": "below zero",
    "above_one": "above 1 for a share of 0..1",
    "not_finite": "not a finite number",
}


def _add(snapshot, engine, key: str, family: str, fault: str, value: float, kind: str) -> None:
    add_fault(snapshot, engine.model, engine.engine, key, family, fault, value, kind)


def add_fault(snapshot, model: str, engine: str, key: str, family: str, fault: str, value: float,
              kind: str) -> None:
    """One value that cannot be true, described on the snapshot (an adapter
    that drops it while reading calls this; `screen` for the rest)."""
    left = {"gauge": "kvwatch shows no value for it", "counter": "kvwatch counts no increase of it",
            "histogram": "kvwatch reads nothing of it"}[kind]
    sentence = (f"{model} / engine {engine}: the engine reports {family} = {_number_text(value)}, "
                f"{_WHAT[fault]}, which cannot be true; a fault of the engine's metrics, not clamped: {left} "
                "until it reports a possible value.")
    if len(snapshot.faults) >= MAX_FAULTS:
        snapshot.faults_dropped += 1
        return
    snapshot.faults.append(SourceFault(model, engine, key, family, fault, value, sentence))


def window_faults(per_engine, sources: dict[str, str], prefix: str = "") -> list[SourceFault]:
    """Parts that rose more than their whole over the window, per engine:
    a hit ratio above 1 cannot be true, so the ratio is left unknown
    (Increase.ratio) and the fault reported."""
    found = []
    for row in per_engine:
        if row.engine is None:
            continue
        counters = row.view.increase.counters
        for part, whole in PART_OF:
            above, below = counters.get(part), counters.get(whole)
            if above is None or below is None or above <= below or above <= 0:
                continue
            name = family_name(sources, part, prefix, "counter")
            whole_name = family_name(sources, whole, prefix, "counter")
            ratio = above / below if below > 0 else math.inf
            found.append(SourceFault(
                row.model, row.engine, part, name, "part_above_whole", ratio,
                f"{row.model} / engine {row.engine}: {name} rose by {above:g} over the window while {whole_name} "
                f"rose by {below:g}: a ratio of {_number_text(ratio)} cannot be true; a fault of the engine's "
                "metrics (or a restart that left no trace), so kvwatch leaves the ratio unknown."))
    return found


def faults_json(faults) -> list[dict]:
    return [fault.json() for fault in faults]
