"""How the vLLM adapter reads a page fast and bounded: the per-label-set
cache (_SeriesCache), the folds that keep summed replicas monotonic
(_Folds), histograms grouped from their samples (_histograms, with a
_HistogramPlan per family layout), and the page plan (_PagePlan) that reads
a page with a layout seen before by applying the plan to its values. Used by
kvwatch/engines/vllm.py (VllmAdapter) alone."""

from __future__ import annotations

import itertools
import math
import operator
import sys

from kvwatch.engines.plausible import add_fault, family_name
from kvwatch.engines.vllm_names import (
    CACHE_CONFIG, COUNTERS, COUNTER_FALLBACKS, ENGINE_ONLY_GAUGES, GAUGES, HISTOGRAMS, HISTOGRAM_FALLBACKS,
    LABELLED_COUNTERS, LABELLED_GAUGES, LORA, MODEL_ONLY_COUNTERS, RESTART_MARKER,
)
from kvwatch.exposition import Family
from kvwatch.labels import bounded_label
from kvwatch.snapshot import COUNTER_ROUNDING, EngineSnapshot, Histogram, Snapshot

# canonical key -> (its label, whether a counter) for the flattened families.
_FLAT = {**{key: (dimension, False) for key, (_n, dimension) in LABELLED_GAUGES.items()},
         **{key: (dimension, True) for key, (_n, dimension) in LABELLED_COUNTERS.items()},
         **{key: (dimension, True) for key, (_n, dimension) in MODEL_ONLY_COUNTERS.items()}}
_COUNTER_KEYS = frozenset(COUNTERS) | frozenset(COUNTER_FALLBACKS)


def _nan_faults(snapshot: Snapshot, families: dict[str, Family], series: "_SeriesCache") -> None:
    """The NaN gauges and counters the adapter's reading skipped, described as
    faults of the source (kvwatch.engines.plausible): skipped silently, a counter
    that turned NaN looked like one that stopped. Only the slow path reads
    here; the page plan hands a page with a NaN to it."""
    for key, name in snapshot.sources.items():
        if key in HISTOGRAMS or key in HISTOGRAM_FALLBACKS:
            continue
        family = families.get(name)
        if family is None:
            continue
        dimension, counter = _FLAT.get(key, (None, key in _COUNTER_KEYS))
        for suffix, labels, value in family.samples:
            if value == value or suffix not in ("", "_total"):
                continue
            model, engine = series.engine_key(labels)
            flat = f"{key}/{bounded_label(labels.get(dimension, ''))}" if dimension else key
            add_fault(snapshot, model, engine, flat,
                      family_name({flat: name}, flat, "vllm:", "counter" if counter else "gauge"), "not_finite",
                      value, "counter" if counter else "gauge")


def _process_start(text: str) -> float | None:
    """The page's process_start_time_seconds (prometheus_client's process
    collector; absent in multiprocess mode), or None."""
    name = "process_start_time_seconds "
    if text.startswith(name):
        at = 0
    else:
        at = text.find("\n" + name)
        if at < 0:
            return None
        at += 1
    end = text.find("\n", at)
    try:
        value = float(text[at + len(name):end if end >= 0 else None].split()[0])
    except (ValueError, IndexError):
        return None
    return value if math.isfinite(value) else None


def _fell(now: float, before: float) -> bool:
    return now < before - before * COUNTER_ROUNDING  # within rounding is no fall


def _histogram_fell(now: Histogram, before: Histogram) -> bool:
    return now.minus(before) is None


def _histogram_plus(total: Histogram, more: Histogram) -> Histogram:
    # Bounds that differ: the newer (the later added) win, as in the window.
    return total.plus(more) or more


class _Folds:
    """Counters and histograms summed over the series of several replicas
    (pid, Ray's WorkerId), kept monotonic: what a replica had counted when it
    went away, or before its own count went down (it restarted), is carried
    in the sum. A sum of one series is that series as it is, so its resets
    pass through to the window's per-series rule. Holds only the keys of the
    latest page."""

    def __init__(self) -> None:
        self.last: dict[tuple, dict[tuple, object]] = {}  # key -> {series token: value}
        self.carry: dict[tuple, object] = {}
        self.seen: set[tuple] = set()

    def fold(self, key: tuple, parts: dict, fell, plus):
        self.seen.add(key)
        last = self.last.get(key)
        if last is None and len(parts) == 1:
            return next(iter(parts.values()))
        carry = self.carry.get(key)
        for token, before in (last or {}).items():
            now = parts.get(token)
            if now is None or fell(now, before):
                carry = before if carry is None else plus(carry, before)
        self.last[key] = parts
        if carry is not None:
            self.carry[key] = carry
        total = carry
        for value in parts.values():
            total = value if total is None else plus(total, value)
        return total

    def forget_unseen(self) -> None:
        for key in [key for key in self.last if key not in self.seen]:
            del self.last[key]
            self.carry.pop(key, None)
        self.seen = set()

    def clear(self) -> None:
        self.last.clear()
        self.carry.clear()


def _first_present(families: dict[str, Family], aliases: tuple[str, ...], sources: dict[str, str], key: str) -> Family | None:
    for alias in aliases:
        family = families.get(alias)
        if family is not None and family.samples:
            sources[key] = alias
            return family
    return None


def _engine_order(engine: str) -> tuple[int, str]:
    return (int(engine), "") if engine.isdigit() else (1 << 30, engine)


def _fold_max(target: dict[str, float], key: str, value: float) -> None:
    previous = target.get(key)
    target[key] = value if previous is None else max(previous, value)


def _identity(labels: dict[str, str]) -> tuple[str, str]:
    # Label values kvwatch exports: bounded in bytes by the one rule (kvwatch/labels.py).
    return bounded_label(labels.get("model_name", "unknown")), bounded_label(labels.get("engine", "0"))


# The most the series cache holds, in bytes as it estimates them (below). Its
# entries are keyed by label sets, so a reader handing it new ones each poll
# grows it: label values set per request, or a store's answers read into new
# dicts on every refresh (history, central mode), where the parser's cache,
# which it empties with, is not in the way. Bounded in entries only (50,000),
# new 80 KB label values kept every set seen until 50,000 of them (3.2 MB a
# poll on a page of 40 such series). A real page of 64 engines (vLLM 0.32's
# families) counts 4.4 MiB here, where tracemalloc sees 4.35 MiB were the
# cache the label sets' only holder.
SERIES_CACHE_MAX_BYTES = 16 * 1024 * 1024
_getsizeof = sys.getsizeof
# An entry's own cost beside the objects counted: its slot in a dict (a
# dict grows in steps, about 100 bytes a key at its fullest) and its tuple.
_ENTRY_BYTES = 150


def _labels_bytes(labels: dict[str, str]) -> int:
    """A label set as sys.getsizeof counts it: the dict, its names and values
    (counted in full by every table that keeps the set: an estimate from
    above, since the parser and the other tables may share them)."""
    size = _getsizeof(labels)
    for name, value in labels.items():
        size += _getsizeof(name) + _getsizeof(value)
    return size


class _SeriesCache:
    """What the adapter derives from a label set, computed once per label set.

    The parser hands out the same dict object for the same label block on
    every poll, so these are keyed by the dict's id; each entry holds the
    dict itself, so the id cannot be reused by another object while the
    entry lives. Bucket bounds are interned too: every poll, and every
    snapshot in the window, shares one bounds tuple per layout. Bounded:
    cleared between polls once it outgrows `limit` entries or `max_bytes`
    (`bytes`, its estimate of what its entries hold; a page with one label
    value per request would otherwise grow it forever)."""

    def __init__(self, limit: int = 50_000, max_bytes: int = SERIES_CACHE_MAX_BYTES):
        self.limit = limit
        self.max_bytes = max_bytes
        # What the entries hold: each new entry adds its label set (or its
        # token, bounds), the tuple it keeps and its slot (_ENTRY_BYTES).
        self.bytes = 0
        self.engine_keys: dict[int, tuple[dict[str, str], tuple[str, str]]] = {}
        # id(labels) -> (labels, identity token, its id, `le` or None, bound or None)
        self.buckets: dict[int, tuple[dict[str, str], tuple, int, str | None, float | None]] = {}
        # id(labels) -> (labels, identity token, its id) for _sum, _count and the rest
        self.others: dict[int, tuple[dict[str, str], tuple, int]] = {}
        # identity tuple -> the one tuple object standing for it (its token)
        self.tokens: dict[tuple, tuple] = {}
        # token -> (labels as a dict, (model_name, engine))
        self.token_labels: dict[tuple, tuple[dict[str, str], tuple[str, str]]] = {}
        # bounds in page order -> (sorted bounds, whether page order was sorted)
        self.bounds: dict[tuple[float, ...], tuple[tuple[float, ...], bool]] = {}
        # histogram family -> (the parser's layout of its samples, _HistogramPlan
        # for that layout or None where the family needs the general path)
        self.plans: dict[str, tuple[object, _HistogramPlan | None]] = {}
        # The last page's (family names, their layouts, its _PagePlan, None
        # where it has none, or _UNPLANNED before its second sight).
        self.page: tuple[tuple[str, ...], tuple[object, ...], object] | None = None

    def trim(self) -> None:
        if (self.bytes > self.max_bytes or len(self.engine_keys) + len(self.buckets) + len(self.others)
                + len(self.tokens) + len(self.bounds) > self.limit):
            self.clear()

    def clear(self) -> None:
        """Every entry dropped: with the parser's label cache (whose dicts
        these entries hold; keeping them would keep what the parser let go)."""
        for table in (self.engine_keys, self.buckets, self.others, self.tokens, self.token_labels, self.bounds,
                      self.plans):
            table.clear()
        self.page = None
        self.bytes = 0

    # Empty label sets are fresh dicts on every line (nothing to reuse), so
    # they are answered without an entry.

    def engine_key(self, labels: dict[str, str]) -> tuple[str, str]:
        if not labels:
            return _identity(labels)
        entry = self.engine_keys.get(id(labels))
        if entry is None:
            entry = self.engine_keys[id(labels)] = (labels, _identity(labels))
            self.bytes += _ENTRY_BYTES + 120 + _labels_bytes(labels)  # two tuples of two
        return entry[1]

    def token(self, identity: tuple) -> tuple:
        token = self.tokens.get(identity)
        if token is None:
            # The pairs' names and values are the label set's own objects.
            token = self.tokens[identity] = identity
            self.bytes += _ENTRY_BYTES + _getsizeof(identity) + 56 * len(identity)
        return token

    def bucket(self, labels: dict[str, str]) -> tuple[dict[str, str], tuple, int, str | None, float | None]:
        if not labels:
            token = self.token(())
            return labels, token, id(token), None, None
        entry = self.buckets.get(id(labels))
        if entry is None:
            le = labels.get("le")
            token = self.token(tuple(sorted((k, v) for k, v in labels.items() if k != "le")))
            try:
                bound = float(le) if le is not None else None
            except ValueError:
                bound = None
            entry = self.buckets[id(labels)] = (labels, token, id(token), le, bound)
            self.bytes += _ENTRY_BYTES + 160 + _labels_bytes(labels)  # its tuple, id and bound
        return entry

    def other(self, labels: dict[str, str]) -> tuple[dict[str, str], tuple, int]:
        if not labels:
            token = self.token(())
            return labels, token, id(token)
        entry = self.others.get(id(labels))
        if entry is None:
            token = self.token(tuple(sorted(labels.items())))
            entry = self.others[id(labels)] = (labels, token, id(token))
            self.bytes += _ENTRY_BYTES + 96 + _labels_bytes(labels)  # its tuple and id
        return entry

    def labels_of(self, token: tuple) -> tuple[dict[str, str], tuple[str, str]]:
        entry = self.token_labels.get(token)
        if entry is None:
            labels = dict(token)
            entry = self.token_labels[token] = (labels, _identity(labels))
            self.bytes += _ENTRY_BYTES + 120 + _getsizeof(labels)  # its names and values are the token's
        return entry

    def sorted_bounds(self, page_order: tuple[float, ...]) -> tuple[tuple[float, ...], bool]:
        entry = self.bounds.get(page_order)
        if entry is None:
            bounds = tuple(sorted(page_order))
            entry = self.bounds[page_order] = (bounds, bounds == page_order)
            self.bytes += _ENTRY_BYTES + 64 + _getsizeof(page_order) + _getsizeof(bounds) + 24 * len(bounds)
        return entry


class _HistogramPlan:
    """Where each histogram of a family sits in its samples, for a family in
    the plain shape: each series' buckets consecutive, bounds strictly
    increasing up to +Inf, at most one _sum and one _count per series, no
    other suffix, and no two series of one (model_name, engine). Then a
    histogram is its slice of the values; anything else (folded `pid`
    series, a missing +Inf, odd `le`) takes the general path every time."""

    __slots__ = ("histograms",)

    def __init__(self, histograms: list[tuple[tuple, dict[str, str], tuple[float, ...], int, int, int | None,
                                              int | None]]):
        self.histograms = histograms  # (token, labels, bounds, first bucket, end, _sum index, _count index)

    @staticmethod
    def of(family: Family, cache: _SeriesCache) -> _HistogramPlan | None:
        groups: dict[int, list] = {}  # id(token) -> [token, bounds, first, end, sum index, count index]
        for index, (suffix, labels, _value) in enumerate(family.samples):
            if suffix == "_bucket":
                _labels, token, token_id, le, bound = cache.bucket(labels)
                if le is None or bound is None or bound != bound:
                    return None
                group = groups.get(token_id)
                if group is None:
                    group = groups[token_id] = [token, [], index, index, None, None]
                elif group[3] != index or (group[1] and bound <= group[1][-1]):
                    return None  # not consecutive, or bounds not increasing
                group[1].append(bound)
                group[3] = index + 1
            elif suffix == "_sum" or suffix == "_count":
                _labels, token, token_id = cache.other(labels)
                group = groups.get(token_id)
                if group is None:
                    group = groups[token_id] = [token, [], None, None, None, None]
                slot = 4 if suffix == "_sum" else 5
                if group[slot] is not None:
                    return None
                group[slot] = index
            elif suffix not in _NOT_HISTOGRAM_SERIES:
                return None
        histograms = []
        keys = set()
        for token, bounds, first, end, total, count in groups.values():
            if not bounds or bounds[-1] != math.inf:
                return None
            interned, in_order = cache.sorted_bounds(tuple(bounds))
            labels, key = cache.labels_of(token)
            if not in_order or key in keys:
                return None
            keys.add(key)
            histograms.append((token, labels, interned, first, end, total, count))
        return _HistogramPlan(histograms)

    def apply(self, family: Family) -> list[tuple[tuple, dict[str, str], Histogram]]:
        values = list(map(_VALUE, family.samples))
        return [(token, labels, _histogram_at(values, bounds, first, end, total, count))
                for token, labels, bounds, first, end, total, count in self.histograms]


def _histogram_at(values: list[float], bounds: tuple[float, ...], first: int, end: int, total: int | None,
                  count: int | None) -> Histogram:
    """The histogram whose buckets are values[first:end] (bounds increasing),
    its _sum and _count at those indexes where it has them."""
    # `+ 0.0` as the general path's first addition into an empty bucket.
    cumulative = tuple(map(operator.add, values[first:end], _ZEROS))
    return Histogram(bounds, cumulative, (values[total] if total is not None else None) or 0.0,
                     values[count] if count is not None else cumulative[-1])


_VALUE = operator.itemgetter(2)
# Series a histogram family may carry that are not its buckets, sum or count:
# `_created`, and the OpenMetrics suffixes the parser files under the family
# (a gauge histogram's `_gcount`/`_gsum`, an info series) that kvwatch does
# not read as a histogram.
_NOT_HISTOGRAM_SERIES = frozenset(("_created", "_info", "_gcount", "_gsum"))
_ZEROS = itertools.repeat(0.0)


def _histograms(family: Family, errors: list, cache: _SeriesCache | None = None) -> list[tuple[tuple, dict[str, str], Histogram]]:
    """Group a histogram family's samples into one Histogram per label set
    (minus `le`): (its token, its labels, the histogram). Series that differ
    only in folded labels stay apart here; the adapter folds them."""
    if cache is None:
        cache = _SeriesCache()
    if family.layout is not None:
        # Same layout as a page seen before: same suffixes and label sets in
        # the same order, so the same plan (made on the first such page, which
        # itself takes the general path below).
        known = cache.plans.get(family.name)
        if known is not None and known[0] is family.layout:
            if known[1] is not None:
                return known[1].apply(family)
        else:
            cache.plans[family.name] = (family.layout, _HistogramPlan.of(family, cache))
    # Groups are keyed by the id of their interned identity tuple (an int
    # hashes faster than a tuple of pairs); the token itself keeps the id live.
    groups: dict[int, list] = {}  # id(token) -> [token, buckets, sum, count]
    # The caches' dicts are read inline: this loop runs once per bucket line.
    bucket_entries = cache.buckets
    other_entries = cache.others
    for suffix, labels, value in family.samples:
        if suffix == "_bucket":
            entry = bucket_entries.get(id(labels))
            if entry is None:
                entry = cache.bucket(labels)
            _labels, token, token_id, le, bound = entry
            if le is None:
                continue
            group = groups.get(token_id)
            if group is None:
                group = groups[token_id] = [token, {}, None, None]
            if bound is None:  # an `le` that is not a number
                continue
            buckets = group[1]
            if bound in buckets:
                errors.append(f"{family.name}: duplicate bucket le={le!r} of {dict(token)} (value {value!r}; "
                              f"kept the first, {buckets[bound]!r})")
                continue
            buckets[bound] = value + 0.0
        elif suffix in _NOT_HISTOGRAM_SERIES:
            continue
        else:
            other = other_entries.get(id(labels))
            if other is None:
                other = cache.other(labels)
            _labels, token, token_id = other
            group = groups.get(token_id)
            if group is None:
                group = groups[token_id] = [token, {}, None, None]
            slot = 2 if suffix == "_sum" else 3 if suffix == "_count" else None
            if slot is not None:
                if group[slot] is not None:
                    errors.append(f"{family.name}: duplicate {suffix} of {dict(token)} (value {value!r}; kept the "
                                  f"first, {group[slot]!r})")
                else:
                    group[slot] = value

    found = []
    for token, buckets, total, count in groups.values():
        if not buckets or math.inf not in buckets:
            errors.append(f"{family.name}: histogram without a +Inf bucket, ignored")
            continue
        bounds, in_order = cache.sorted_bounds(tuple(buckets))
        cumulative = tuple(buckets.values()) if in_order else tuple(buckets[b] for b in bounds)
        histogram = Histogram(bounds, cumulative, total or 0.0, count if count is not None else cumulative[-1])
        labels, _key = cache.labels_of(token)
        found.append((token, labels, histogram))
    return found


_LAYOUT = operator.attrgetter("layout")
_SAMPLES = operator.attrgetter("samples")
_UNPLANNED = object()  # a page seen once: its plan is made if the next page has its layout


class _NoPlan(Exception):
    """A page the plan does not read (it takes VllmAdapter._read_page)."""


class _PlanBuilder:
    """What _PagePlan is built from, family by family, in _read_page's order:
    the families read (a sample's position is its index in their values,
    concatenated), each engine in the order it first shows, and each value's
    destination. Raises _NoPlan where the page needs _read_page."""

    def __init__(self, families: dict[str, Family], series: _SeriesCache):
        self.families = families
        self.series = series
        self.read: list[str] = []
        self.offsets: dict[str, int] = {}
        self.sources: dict[str, str] = {}
        self.engines: dict[tuple[str, str], int] = {}  # engine key -> its index, in the order of creation
        self.gauges: list[tuple[int, str, int, bool]] = []  # (engine, key, position, whether the key is new)
        self.touched: set[tuple[int, str]] = set()
        # (engine, key) -> [fold key, {series token: position or histogram}]
        self.counter_parts: dict[tuple[int, str], list] = {}
        self.histogram_parts: dict[tuple[int, str], list] = {}
        self.created: list[tuple[int, int]] = []
        self.model_counters: list[tuple[int, str, int]] = []

    def samples(self, name: str) -> list:
        """(position, suffix, labels) of each sample of a family read."""
        if name not in self.offsets:
            self.offsets[name] = sum(len(self.families[read].samples) for read in self.read)
            self.read.append(name)
        base = self.offsets[name]
        return [(base + index, suffix, labels)
                for index, (suffix, labels, _value) in enumerate(self.families[name].samples)]

    def engine_of(self, labels: dict[str, str]) -> int:
        return self.engines.setdefault(self.series.engine_key(labels), len(self.engines))

    def gauge(self, engine: int, key: str, position: int) -> None:
        self.gauges.append((engine, key, position, (engine, key) not in self.touched))
        self.touched.add((engine, key))

    def add_part(self, parts: dict, engine: int, key: str, token: tuple, value) -> None:
        entry = parts.get((engine, key))
        if entry is None:
            entry = parts[(engine, key)] = [(*list(self.engines)[engine], key), {}]  # the fold's key, as _read_page's
        if token in entry[1]:
            raise _NoPlan  # a duplicate series: a parse error
        entry[1][token] = value

    def counter(self, labels: dict[str, str], key: str, position: int) -> None:
        self.add_part(self.counter_parts, self.engine_of(labels), key, self.series.other(labels)[1], position)

    def gauges_and_counters(self) -> None:
        families, sources = self.families, self.sources
        for key, aliases in GAUGES.items():
            if _first_present(families, aliases, sources, key) is None:
                continue
            seen: set[tuple] = set()
            for position, suffix, labels in self.samples(sources[key]):
                if suffix == "":
                    engine = self.engine_of(labels)
                    token = self.series.other(labels)[1]
                    if token in seen:
                        raise _NoPlan
                    seen.add(token)
                    self.gauge(engine, key, position)
        for key, (name, dimension) in LABELLED_GAUGES.items():
            if name not in families:
                continue
            sources[key] = name
            for position, suffix, labels in self.samples(name):
                if suffix == "":
                    self.gauge(self.engine_of(labels), f"{key}/{bounded_label(labels.get(dimension, ''))}", position)
        self.counter_families()

    def counter_families(self) -> None:
        families, sources = self.families, self.sources
        for key, aliases in COUNTERS.items():
            if _first_present(families, aliases, sources, key) is None:
                continue
            marks_restart = aliases[0] == RESTART_MARKER
            for position, suffix, labels in self.samples(sources[key]):
                if suffix == "_total" or suffix == "":
                    self.counter(labels, key, position)
                elif suffix == "_created" and marks_restart:
                    self.created.append((self.engine_of(labels), position))
        for key, (name, dimension) in LABELLED_COUNTERS.items():
            if name not in families:
                continue
            sources[key] = name
            for position, suffix, labels in self.samples(name):
                if suffix == "_total" or suffix == "":
                    self.counter(labels, f"{key}/{bounded_label(labels.get(dimension, ''))}", position)
        for key, (name, dimension, wanted) in COUNTER_FALLBACKS.items():
            if key in sources or name not in families or not families[name].samples:
                continue
            sources[key] = name
            for position, suffix, labels in self.samples(name):
                if (suffix == "_total" or suffix == "") and labels.get(dimension) == wanted:
                    self.counter(labels, key, position)

    def histogram_family(self, key: str, name: str, wanted: tuple[str, str] | None) -> None:
        family = self.families[name]
        series = self.series
        known = series.plans.get(family.name)  # as _histograms keeps it
        if known is None or known[0] is not family.layout:
            known = series.plans[family.name] = (family.layout, _HistogramPlan.of(family, series))
        if known[1] is None:
            raise _NoPlan  # a family _histograms reads apart (and may find errors in)
        self.samples(name)
        base = self.offsets[name]
        for token, labels, bounds, first, end, total, count in known[1].histograms:
            if wanted is None or labels.get(wanted[0]) == wanted[1]:
                self.add_part(self.histogram_parts, self.engine_of(labels), key, token,
                              (bounds, base + first, base + end, None if total is None else base + total,
                               None if count is None else base + count))

    def histogram_families(self) -> None:
        families, sources = self.families, self.sources
        for key, aliases in HISTOGRAMS.items():
            if _first_present(families, aliases, sources, key) is not None:
                self.histogram_family(key, sources[key], None)
        for key, (name, dimension, wanted) in HISTOGRAM_FALLBACKS.items():
            if key in sources or name not in families or not families[name].samples:
                continue
            sources[key] = name
            self.histogram_family(key, name, (dimension, wanted))

    def engine_and_model_only(self) -> None:
        """Gauges only the engine label names, and counters only the model's (on its first engine)."""
        families, sources, engines = self.families, self.sources, self.engines
        for key, name in ENGINE_ONLY_GAUGES.items():
            if name not in families or not families[name].samples:
                continue
            sources[key] = name
            for position, suffix, labels in self.samples(name):
                if suffix == "":
                    its_engine = bounded_label(labels.get("engine", "0"))
                    for engine, (_model, number) in enumerate(engines):
                        if number == its_engine:
                            self.gauge(engine, key, position)
        for key, (name, dimension) in MODEL_ONLY_COUNTERS.items():
            if name not in families or not families[name].samples:
                continue
            sources[key] = name
            first_engine: dict[str, int] = {}
            for engine, (model, number) in enumerate(engines):
                held = first_engine.get(model)
                if held is None or _engine_order(number) < _engine_order(list(engines)[held][1]):
                    first_engine[model] = engine
            for position, suffix, labels in self.samples(name):
                if suffix == "_total" or suffix == "":
                    first = first_engine.get(bounded_label(labels.get("model_name", "unknown")))
                    if first is not None:
                        self.model_counters.append((first, f"{key}/{bounded_label(labels.get(dimension, ''))}",
                                                    position))


class _PagePlan:
    """What VllmAdapter._read_page does with a page, worked out once for its
    layout: where each value it reads goes (which engine, which key, which
    fold). A page with the same families in the same layouts differs only in
    its values, so reading it is applying the plan to them; the steps below
    mirror _read_page's, in its order, so dicts fill in the same order.

    Made only for a page whose families all have a layout (the cache
    configuration and LoRA aside: _read_info reads them every time), whose
    histograms all have a _HistogramPlan, and whose reading adds no parse
    error (no duplicate series); applied only to values without NaN (the
    reading skips those, so engines and folds could differ) and where the
    adapter keeps every engine. Any other page takes _read_page."""

    __slots__ = ("read", "sources", "engine_keys", "gauges", "created", "counters", "histograms", "model_counters")

    @staticmethod
    def of(families: dict[str, Family], series: _SeriesCache) -> _PagePlan | None:
        try:
            return _PagePlan(families, series)
        except _NoPlan:
            return None

    def __init__(self, families: dict[str, Family], series: _SeriesCache):
        for name, family in families.items():
            if family.layout is None and name != CACHE_CONFIG and name != LORA:
                raise _NoPlan
        plan = _PlanBuilder(families, series)
        plan.gauges_and_counters()
        plan.histogram_families()
        plan.engine_and_model_only()
        self.read = tuple(plan.read)
        self.sources = plan.sources
        self.engine_keys = tuple(plan.engines)
        self.gauges = tuple(plan.gauges)
        self.created = tuple(plan.created)
        self.counters = tuple((engine, key, fold_key, tuple(parts.items()))
                              for (engine, key), (fold_key, parts) in plan.counter_parts.items())
        self.histograms = tuple((engine, key, fold_key + ("histogram",), tuple(parts.items()))
                                for (engine, key), (fold_key, parts) in plan.histogram_parts.items())
        self.model_counters = tuple(plan.model_counters)

    def apply(self, snapshot: Snapshot, families: dict[str, Family], folds: _Folds) -> bool:
        """Reads the page into the snapshot as _read_page would; False,
        having changed nothing, where a value read is NaN (or not a number)."""
        values = list(map(_VALUE, itertools.chain.from_iterable(map(_SAMPLES, map(families.__getitem__, self.read)))))
        try:
            total = sum(values)  # NaN if any value is (or +Inf and -Inf are both there): one test in C
        except TypeError:
            return False
        if total != total:
            return False
        snapshot.sources.update(self.sources)
        engines = [EngineSnapshot(model, number) for model, number in self.engine_keys]
        snapshot.engines.update(zip(self.engine_keys, engines))
        for engine, key, position, new in self.gauges:
            gauges = engines[engine].gauges
            # As _fold_max.
            gauges[key] = values[position] if new else max(gauges[key], values[position])
        for index, position in self.created:
            holder = engines[index]
            holder.created = values[position] if holder.created is None else min(holder.created, values[position])
        # One series of a key the folds hold nothing for: fold would hand its
        # value back as it is (marking the key seen only matters to keys in
        # `last`), so the value is taken without building fold's dict.
        held = folds.last
        for engine, key, fold_key, parts in self.counters:
            if len(parts) == 1 and fold_key not in held:
                value = values[parts[0][1]]
            else:
                value = folds.fold(fold_key, {token: values[position] for token, position in parts},
                                   _fell, operator.add)
            engines[engine].counters[key] = value
        for engine, key, fold_key, parts in self.histograms:
            if len(parts) == 1 and fold_key not in held:
                value = _histogram_at(values, *parts[0][1])
            else:
                value = folds.fold(fold_key, {token: _histogram_at(values, *where) for token, where in parts},
                                   _histogram_fell, _histogram_plus)
            engines[engine].histograms[key] = value
        folds.forget_unseen()
        for engine, key, position in self.model_counters:
            counters = engines[engine].counters
            counters[key] = counters.get(key, 0.0) + values[position]
        return True
