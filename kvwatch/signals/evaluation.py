"""The evaluator: the catalogue's signals over a window, per engine and per
model (engines merged), with what a derivation could not compute noted."""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvwatch.signals.catalogue import SIGNALS, SIGNALS_BY_NAME, TIER_SIGNALS
from kvwatch.signals.derivations import TREND_SECONDS, Signal, View, _clamp01
from kvwatch.snapshot import EngineSnapshot, capacity_tokens, config_number
from kvwatch.window import Increase, Window


# --------------------------------------------------------------------------
# Evaluation over a window
# --------------------------------------------------------------------------


@dataclass
class Evaluated:
    """Signal values of one engine (engine set) or one model (engine None)."""

    model: str
    engine: str | None
    values: Mapping[str, float | dict[str, float] | None]
    notes: list[str]
    view: View
    # Signal name -> {quantile: "<" | ">"}: a quantile pinned in the first
    # bucket is an upper bound (its value is that bucket's bound), one pinned
    # at the last finite bucket a lower bound.
    pinned: dict[str, dict[str, str]] = field(default_factory=dict)


def _view(window: Window, keys: list[tuple[str, str]], trends: dict | None = None) -> View | None:
    """The view of one engine, or of a model's engines merged. `trends`
    (one evaluation's): each engine's usage series and its trend, read from
    the window once for its own view and its model's."""
    latest = window.latest
    if latest is None:
        return None
    present = [key for key in keys if key in latest.engines]
    if not present:
        return None
    merged = EngineSnapshot(present[0][0], present[0][1] if len(present) == 1 else "*")
    increase: Increase | None = None
    span = 0.0
    capacity = None
    block_size = None
    usage_max = None
    running_max = None
    used_bytes: float | None = 0.0
    blocks: BlockSums | None = BlockSums()
    eta = None
    for key in present:
        engine = latest.engines[key]
        config = _engine_config(latest.cache_config.get(key[1], {}))
        found = trends.get(key) if trends is not None else None
        if found is None:
            times, values, ordered, in_unit = window.gauge_columns(key, "kv_usage")
            total = sum(values)
            found = (len(values), _eta_of(times, values, ordered, total),
                     _usage_total_of(values, total, in_unit), window.increase(key))
            if trends is not None:
                trends[key] = found
        points, engine_eta, usage_total, engine_increase = found
        if engine_eta is not None:
            eta = engine_eta if eta is None else min(eta, engine_eta)
        engine_usage = engine.gauges.get("kv_usage")
        if blocks is not None:
            blocks = blocks.add(config, engine_usage, points, usage_total)
        engine_bytes = config.memory
        if used_bytes is not None and engine_bytes is not None and engine_usage is not None:
            used_bytes += _clamp01(engine_usage) * engine_bytes
        else:
            used_bytes = None
        if increase is None:
            merged.gauges = _first_gauges(engine.gauges)
            increase = _first_increase(engine_increase)
        else:
            _merge_gauges(merged.gauges, engine.gauges)
            increase.add(engine_increase)
        span = max(span, engine_increase.seconds)
        engine_capacity = config.capacity
        if engine_capacity is not None:
            capacity = (capacity or 0.0) + engine_capacity
        block_size = block_size or config.block_size
        # The window keeps these maxima as snapshots come and go.
        usage_peak = window.gauge_max(key, "kv_usage")
        if usage_peak is not None:
            usage_max = usage_peak if usage_max is None else max(usage_max, usage_peak)
        running_peak = window.gauge_max(key, "running")
        if running_peak is not None:
            running_max = (running_max or 0.0) + running_peak
    if increase is None:  # present is not empty: never
        return None
    # Engines of one model run side by side over the same span.
    increase.seconds = span
    view = View(merged, increase, usage_max, running_max, capacity, block_size, used_bytes)
    view.counting = latest.counting
    if blocks is not None:
        view.usable_blocks, view.used_blocks, view.block_tokens = blocks.usable, blocks.used, blocks.tokens
        view.bytes_per_block = blocks.bytes_per_block
        view.usage_mean = blocks.usage_weighted / blocks.usable if blocks.usable else None
    view.exhaustion_eta = eta
    return view


# Gauges merged over engines by their maximum (a ratio); the others are summed.
_MAX_GAUGES = ("kv_usage", "v0_prefix_hit_rate")
_ZEROS = itertools.repeat(0.0)


def _merge_gauges(merged: dict[str, float], gauges: dict[str, float]) -> None:
    for gauge, value in gauges.items():
        if gauge in _MAX_GAUGES:
            previous = merged.get(gauge)
            merged[gauge] = value if previous is None else max(previous, value)
        else:
            merged[gauge] = merged.get(gauge, 0.0) + value


def _first_gauges(gauges: dict[str, float]) -> dict[str, float]:
    """What _merge_gauges({}, gauges) makes (0.0 + each value, the maxima as
    they are), with the additions in C: most views are of one engine."""
    merged = dict(zip(gauges, map(operator.add, _ZEROS, gauges.values())))
    for gauge in _MAX_GAUGES:
        if gauge in gauges:
            merged[gauge] = gauges[gauge]
    return merged


def _first_increase(increase: Increase) -> Increase:
    """What Increase().add(increase) makes (0.0 + each counter), with the
    additions in C; `increase` is left as it is (it is the window's answer)."""
    counters = increase.counters
    return Increase(0.0, dict(zip(counters, map(operator.add, _ZEROS, counters.values()))), dict(increase.histograms),
                    0 + increase.restarts, 0 + increase.steps)


@dataclass(frozen=True, slots=True)
class _EngineConfig:
    """What _view reads from one engine's cache_config_info, parsed once."""

    count: float | None  # num_gpu_blocks
    block_size: float | None
    memory: float | None  # kv_cache_memory_bytes
    capacity: float | None  # capacity_tokens()
    blocks_hold: bool  # blocks_hold_capacity()


def _engine_config(cache_config: dict[str, str]) -> _EngineConfig:
    # Labels change only when an engine is reconfigured: parsed once per set.
    return _parsed_config(tuple(cache_config.items()))


@functools.lru_cache(maxsize=64)
def _parsed_config(labels: tuple[tuple[str, str], ...]) -> _EngineConfig:
    cache_config = dict(labels)
    return _EngineConfig(config_number(cache_config, "num_gpu_blocks"), config_number(cache_config, "block_size"),
                         config_number(cache_config, "kv_cache_memory_bytes"), capacity_tokens(cache_config),
                         blocks_hold_capacity(cache_config))


# Signals of whole-block arithmetic (BlockSums): absent on hybrid models,
# whose KV groups' blocks differ (/api/v1/signals lists them dark there).
WHOLE_BLOCK_SIGNALS = ("kvwatch_kv_cache_used_blocks", "kvwatch_kv_cache_free_blocks", "kvwatch_kv_cache_requests_fit_now",
                       "kvwatch_kv_cache_token_usage_estimate_ratio", "kvwatch_kv_cache_reuse_shortfall_blocks",
                       "kvwatch_kv_cache_reuse_shortfall_bytes")


def blocks_hold_capacity(cache_config: dict[str, str]) -> bool:
    """num_gpu_blocks x block_size is the stated capacity (or none is
    stated): not so on hybrid models, where block_size is the minimum over
    the KV groups."""
    count = config_number(cache_config, "num_gpu_blocks")
    size = config_number(cache_config, "block_size")
    stated = config_number(cache_config, "kv_cache_size_tokens")
    return not (stated and count and size and stated != count * size)


@dataclass
class BlockSums:
    """Whole-block arithmetic over the engines of a view."""

    usable: float = 0.0
    used: float = 0.0
    tokens: float = 0.0
    usage_weighted: float = 0.0
    bytes_per_block: float | None = None

    def add(self, config: _EngineConfig, usage: float | None, points: int, usage_total: float) -> "BlockSums | None":
        """One engine more: its config, its usage now, and its usage series'
        length and _usage_total."""
        count, size = config.count, config.block_size
        if not count or count < 2 or not size or usage is None or not points:
            return None
        if not config.blocks_hold:
            return None  # hybrid: block_size is the minimum over groups, blocks x size is not the capacity
        usable = count - 1
        used = float(round(_clamp01(usage) * usable))
        self.usable += usable
        self.used += used
        self.tokens += used * size
        self.usage_weighted += usable * usage_total / points
        memory = config.memory
        per_block = memory / count if memory else None
        if self.bytes_per_block is None or per_block is None:
            self.bytes_per_block = per_block if self.usable == usable else None
        return self


def _usage_total(series: list[tuple[float, float]]) -> float:
    """The sum of a usage series' values, each clamped to 0..1 (read once per
    engine by its own view and its model's)."""
    values = list(map(_SECOND, series))
    return _usage_total_of(values, sum(values), all(0.0 <= v <= 1.0 for v in values))


def _usage_total_of(values: list[float], total: float, in_unit: bool) -> float:
    """_usage_total of the series' values, given their sum and whether each
    lies within 0..1 (the window keeps that as the series moves)."""
    # Within 0..1 (and no NaN) every value is its own _clamp01: the same sum.
    if not in_unit:
        total = sum([(v if v < 1.0 else 1.0) if v > 0.0 else 0.0 for v in values])  # _clamp01, inline
    return total


def _eta(series: list[tuple[float, float]]) -> float | None:
    """Seconds until usage reaches 1 at the least-squares slope of the last
    TREND_SECONDS (PromQL deriv()); None unless usage rises and is now at
    least its mean over that span (a cache that just emptied is not filling)."""
    if len(series) < 2:
        return None
    times = list(map(_FIRST, series))
    values = list(map(_SECOND, series))
    return _eta_of(times, values, all(map(operator.lt, times, itertools.islice(times, 1, None))), sum(values))


def _eta_of(times: list[float], values: list[float], ordered: bool, total: float) -> float | None:
    """_eta of a series given as its times and values, whether the times
    strictly increase, and the sum of all its values (the window keeps the
    order as the series moves; the sum is the usage total's too)."""
    if len(times) < 2:
        return None
    horizon = times[-1] - TREND_SECONDS
    if ordered:
        # In time order (a window's series always is): the points kept are
        # those from the first at or after the horizon on.
        start = bisect.bisect_left(times, horizon)
        if start:
            times, values = times[start:], values[start:]
            total = sum(values)
    else:
        kept = list(map(operator.ge, times, itertools.repeat(horizon)))
        times, values = list(itertools.compress(times, kept)), list(itertools.compress(values, kept))
        total = sum(values)
    n = len(times)
    if n < 2:
        return None
    # The definition's sums (sum(v) / n, sum(t - t0) / n, sum((t - t0 - mean_t) ** 2), ...)
    # term by term and in the same order, with each term computed once (and
    # each operation mapped in C: the same float operations as written out).
    if values[-1] < total / n:
        return None
    t0 = times[0]
    offsets = list(map(operator.sub, times, itertools.repeat(t0)))  # t - t0
    mean_t = sum(offsets) / n
    mean_v = total / n
    centred = list(map(operator.sub, offsets, itertools.repeat(mean_t)))  # offset - mean_t
    var = sum(map(pow, centred, itertools.repeat(2)))  # d ** 2
    if var <= 0:
        return None
    slope = sum(map(operator.mul, centred, map(operator.sub, values, itertools.repeat(mean_v)))) / var  # d * (v - mean_v)
    if slope <= 0:
        return None
    return max(0.0, 1.0 - _clamp01(values[-1])) / slope


_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


# The View fields a derivation reads besides `latest`, `increase`, `notes`
# and `pinned` (_inputs handles those): every other field, so a field added
# to View joins the comparison by itself.
_PLAIN_VIEW_FIELDS = tuple(f.name for f in fields(View) if f.name not in ("latest", "increase", "notes", "pinned"))
_plain_view_fields = operator.attrgetter(*_PLAIN_VIEW_FIELDS)  # a tuple of them, read in C


def _inputs(view: View) -> tuple:
    """Everything the derivations read from a view but the increase's
    seconds, copied (callers may change the view's dicts afterwards): of
    `latest` only its gauges (the derivations read no counter or histogram
    of it, only the increase; keep it so, or add them here), the rest of the
    increase, every other field, and the notes it came with."""
    increase = view.increase
    return ((dict(view.latest.gauges), dict(increase.counters), dict(increase.histograms),
             increase.restarts, increase.steps, tuple(view.notes))
            + _plain_view_fields(view))


def _copied(values: dict) -> dict:
    """The values, each dict among them copied too."""
    copy = dict(values)
    # The names of the dict values, picked in C (most values are floats or None).
    for name in itertools.compress(values, map(operator.is_, map(type, values.values()), itertools.repeat(dict))):
        copy[name] = dict(copy[name])
    return copy


_SECONDS: Any = Increase.__dict__["seconds"]  # the slot's descriptor


class _WatchedIncrease(Increase):
    """A view's increase while its signals are derived (the same dicts and
    numbers): says whether a derivation read `seconds`, the one input that
    moves at every poll (the window's span), so that a signal that did not
    read it keeps its value while nothing else it reads moves."""

    __slots__ = ("read",)

    def __init__(self, increase: Increase):
        _SECONDS.__set__(self, _SECONDS.__get__(increase))
        self.counters, self.histograms = increase.counters, increase.histograms
        self.restarts, self.steps = increase.restarts, increase.steps
        self.read = False

    @property
    def seconds(self) -> float:
        self.read = True
        return _SECONDS.__get__(self)

    @seconds.setter
    def seconds(self, value: float) -> None:
        _SECONDS.__set__(self, value)


def evaluate(view: View, model: str, engine: str | None, remembered: dict | None = None,
             kept: dict | None = None) -> Evaluated:
    """The signals of one view. With `remembered` (what the window's last
    evaluation kept, by (model, engine)): where the view's inputs equal the
    ones the values were derived from then (an idle engine, a steady load),
    those values again, not derived anew (the derivations are functions of
    the view alone); where only the window's span moved, the values of the
    signals that did not read it again and the others derived anew. `kept`
    receives what this evaluation leaves for the next."""
    if kept is None:
        return _evaluate(view, model, engine)
    inputs = _inputs(view)
    seconds = view.increase.seconds
    found = remembered.get((model, engine)) if remembered else None
    then = None
    if found is not None and found[0] == inputs:
        if found[1] == seconds:
            kept[(model, engine)] = found
            view.notes = list(found[3])
            view.pinned = {}
            return Evaluated(model, engine, _copied(found[2]), view.notes, view,
                             {name: dict(q) for name, q in found[4].items()})
        then = found
    evaluated, read, notes_of = _evaluate_watched(view, model, engine, then)
    kept[(model, engine)] = (inputs, seconds, _copied(evaluated.values), list(evaluated.notes),
                             {name: dict(q) for name, q in evaluated.pinned.items()}, read, notes_of)
    return evaluated


def _evaluate(view: View, model: str, engine: str | None) -> Evaluated:
    values: dict[str, float | dict[str, float] | None] = {}
    pinned: dict[str, dict[str, str]] = {}
    for signal in SIGNALS:
        values[signal.name] = _derive(signal, view, pinned)
    return Evaluated(model, engine, values, view.notes, view, pinned)


def _evaluate_watched(view: View, model: str, engine: str | None, then: tuple | None):
    """_evaluate, with the view's increase watched: also the names of the
    signals whose derivation read its seconds, and the notes each other
    signal added (by name, where it added any; None for none). With `then`
    (what evaluate kept of the same inputs at another span), a signal that
    did not read the span takes its value, notes and pinned quantiles from
    there instead of being derived."""
    values: dict = {}
    pinned: dict = {}
    read: set[str] = set()
    notes_of: dict[str, tuple] = {}
    if then is not None:
        _inputs_then, _seconds_then, values_then, _notes_then, pinned_then, read_then, notes_of_then = then
    increase = view.increase
    watched = view.increase = _WatchedIncrease(increase)
    notes = view.notes
    try:
        for signal in SIGNALS:
            name = signal.name
            if then is not None and name not in read_then:
                value = values_then[name]
                values[name] = dict(value) if type(value) is dict else value
                added = notes_of_then.get(name) if notes_of_then is not None else None
                if added:
                    notes.extend(added)
                    notes_of[name] = added
                quantiles = pinned_then.get(name)
                if quantiles is not None:
                    pinned[name] = dict(quantiles)
                continue
            watched.read = False
            before = len(notes)
            values[name] = _derive(signal, view, pinned)
            if watched.read:
                read.add(name)
            elif len(notes) > before:
                notes_of[name] = tuple(notes[before:])
    finally:
        view.increase = increase
    return Evaluated(model, engine, values, view.notes, view, pinned), _interned(frozenset(read)), notes_of or None


# The sets of signals that read the span, one object per set: most views
# of a process share one or two, kept beside every view's cached values.
_READ_SETS: dict[frozenset, frozenset] = {}


def _interned(read: frozenset) -> frozenset:
    found = _READ_SETS.get(read)
    if found is None:
        if len(_READ_SETS) >= 64:
            _READ_SETS.clear()
        found = _READ_SETS[read] = read
    return found


def _derive(signal: Signal, view: View, pinned: dict):
    """One signal's value; its pinned quantiles filed in `pinned`."""
    view.pinned = {}
    try:
        value = signal.derive(view)
    except (ArithmeticError, ValueError) as exc:  # one bad signal must not hide the rest
        value = None
        view.notes.append(f"{signal.name}: {exc}")
    if view.pinned and value is not None:
        pinned[signal.name] = view.pinned
    view.pinned = {}
    return value


class LazyValues(Mapping):
    """A view's signal values, each derived when first read (the same
    derivation, so the same value, as evaluate() gives, in any order of
    reading: a derivation reads the view alone). For the history diagnosis,
    whose rules read a few signals of each replica at each step and report
    no other: the rest are never derived. Iterating derives them all, in the
    catalogue's order. Notes and pinned quantiles gather as signals are read."""

    __slots__ = ("_view", "_values", "_pinned")

    def __init__(self, view: View, pinned: dict):
        self._view = view
        self._values: dict = {}
        self._pinned = pinned

    def __getitem__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            signal = SIGNALS_BY_NAME[name]  # KeyError for a name that is no signal, as a dict's
        value = self._values[name] = _derive(signal, self._view, self._pinned)
        return value

    def __iter__(self):
        return iter(SIGNALS_BY_NAME)

    def __len__(self) -> int:
        return len(SIGNALS_BY_NAME)


def evaluate_window(window: Window, lazy: bool = False,
                    models: bool = True) -> tuple[list[Evaluated], list[Evaluated]]:
    """Per (model, engine), and per model with its engines merged (none
    without `models`: the now span's rules judge engines). `lazy`: values as
    LazyValues, derived where read (the history diagnosis); the window's
    evaluation cache is then neither read nor kept."""
    latest = window.latest
    if latest is None:
        return [], []
    # Values derived at the window's last evaluation, for views whose inputs
    # did not change since (kept for the engines and models evaluated now).
    remembered = window.evaluated
    kept: dict = {}
    window.evaluated = kept
    if lazy:
        def evaluate_view(view, model, engine):
            pinned: dict = {}
            return Evaluated(model, engine, LazyValues(view, pinned), view.notes, view, pinned)
    else:
        def evaluate_view(view, model, engine):
            return evaluate(view, model, engine, remembered, kept)
    per_engine = []
    trends: dict = {}
    by_key: dict[tuple[str, str], Evaluated] = {}
    by_model: dict[str, list[tuple[str, str]]] = {}
    for key in sorted(latest.engines):
        view = _view(window, [key], trends)
        if view is not None:
            per_engine.append(by_key.setdefault(key, evaluate_view(view, key[0], key[1])))
        by_model.setdefault(key[0], []).append(key)
    per_model: list[Evaluated] = []
    for model, keys in sorted(by_model.items()) if models else ():
        if len(keys) == 1 and keys[0] in by_key:
            # A model of one engine: its view is that engine's (the same
            # inputs, so the same values and notes), evaluated once.
            alone = by_key[keys[0]]
            if lazy:  # the same values, derived once wherever first read
                per_model.append(Evaluated(model, None, alone.values, alone.notes, alone.view, alone.pinned))
                continue
            per_model.append(Evaluated(model, None, dict(alone.values), list(alone.notes), alone.view,
                                       {name: dict(q) for name, q in alone.pinned.items()}))
            continue
        view = _view(window, keys, trends)
        if view is not None:
            per_model.append(evaluate_view(view, model, None))
    return per_engine, per_model


def evaluate_tier(view: View) -> dict[str, float | None]:
    """The tier's signals for one model's view of LMCache's window."""
    values: dict[str, float | None] = {}
    for signal in TIER_SIGNALS:
        try:
            values[signal.name] = signal.derive(view)  # type: ignore[assignment]  # the tier's signals are scalars
        except (ArithmeticError, ValueError):
            values[signal.name] = None
    return values
