"""From query results back to what a poll would have read: each replica's
values at one step, as the parser's families (`Replica.families`, handed to
VllmAdapter.adapt_families) or as the text of the /metrics page
(`Replica.page`, for the adapter's parser; the reference the families are
tested against).

Why not Snapshots built here: the adapter owns every alias of every vLLM
version, the folding of `pid` and Ray labels, the cache configuration,
`_created` and the process start time. Handing it what its parser would
have produced keeps one reader of vLLM's vocabulary, without writing and
parsing text at every step: the label dicts and the layout of a replica's
families are the same objects from step to step, so the adapter's caches
work as they do on a sidecar's polls.

Two sources, whichever the store has (`auto` prefers vLLM's own series):
- `vllm`: vLLM's series as Prometheus stored them, in any version's
  spelling (`vllm:` or `vllm_`), written back under their own names;
- `kvwatch`: the sidecar's re-exported `kvwatch_engine_*` series, written
  under the newest vLLM name of their canonical key (kvwatch.signals.
  ENGINE_SERIES says which key each one carries), `kvwatch_engine_info` as
  `vllm:cache_config_info`. The sidecar's own process start time is not the
  engine's, so restarts come from counters that fell.

A replica is one value of the replica labels (default job, instance,
namespace, pod: the scrape target); those labels are dropped from the page,
every other label is kept for the adapter.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from kvwatch.diagnose import NOT_DIAGNOSED_KEYS
from kvwatch.engines import vllm
from kvwatch.exposition import Family, sample_names
from kvwatch.history.matrix import RawPairs, pairs_of
from kvwatch.labels import bounded_label
from kvwatch.signals import ENGINE_SERIES, INFO_KEYS

DEFAULT_REPLICA_LABELS = ("job", "instance", "namespace", "pod")
PROCESS_START = "process_start_time_seconds"
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created", "")


def _families() -> dict[str, str]:
    """vLLM family (no prefix) -> its kind: gauge, counter or histogram."""
    kinds: dict[str, str] = {}
    for table, kind in ((vllm.GAUGES, "gauge"), (vllm.COUNTERS, "counter"), (vllm.HISTOGRAMS, "histogram")):
        for aliases in table.values():
            for alias in aliases:
                kinds.setdefault(alias, kind)
    for family, _ in vllm.LABELLED_GAUGES.values():
        kinds[family] = "gauge"
    for family, _ in vllm.LABELLED_COUNTERS.values():
        kinds[family] = "counter"
    kinds[vllm.CACHE_CONFIG] = "gauge"
    kinds[vllm.LORA] = "gauge"
    return kinds


VLLM_FAMILIES = _families()
# The series of each kind the adapter reads (a counter's `_created` only for
# the family that marks a restart).
_WANTED_SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def vllm_sample_name(name: str) -> tuple[str, str, str] | None:
    """(prefix, family, suffix) of a stored series name the adapter reads, or None."""
    for prefix in vllm.PREFIXES:
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        for suffix in _SUFFIXES:
            if suffix and not rest.endswith(suffix):
                continue
            family = rest[: len(rest) - len(suffix)] if suffix else rest
            kind = VLLM_FAMILIES.get(family)
            if kind is None:
                continue
            if suffix in _WANTED_SUFFIXES[kind] or (suffix == "_created" and family == vllm.RESTART_MARKER):
                return prefix, family, suffix
    return None


def _newest(key: str) -> str | None:
    for table in (vllm.GAUGES, vllm.COUNTERS, vllm.HISTOGRAMS):
        if key in table:
            return table[key][0]
    base = key[:-2] if key.endswith("/*") else key
    for labelled in (vllm.LABELLED_GAUGES, vllm.LABELLED_COUNTERS):
        if base in labelled:
            return labelled[base][0]
    return None


def _kvwatch_names() -> dict[str, tuple[str, str]]:
    """kvwatch_engine_* sample name -> (vLLM sample name, role); role is
    "sample", or "config/<key>" for a value that becomes a cache_config label."""
    names: dict[str, tuple[str, str]] = {"kvwatch_engine_info": ("vllm:" + vllm.CACHE_CONFIG, "sample")}
    for series in ENGINE_SERIES:
        if series.key.startswith("config/"):
            names[series.name] = ("", series.key)
            continue
        family = _newest(series.key)
        if family is None:
            continue  # capacity_tokens: kvwatch_engine_info carries what it derives from
        if series.kind == "histogram":
            for suffix in ("_bucket", "_sum", "_count"):
                names[series.name + suffix] = (f"vllm:{family}{suffix}", "sample")
        elif series.kind == "counter":
            names[series.sample_name] = (f"vllm:{family}_total", "sample")
        else:
            names[series.name] = (f"vllm:{family}", "sample")
    return names


KVWATCH_NAMES = _kvwatch_names()


def name_matcher(source: str) -> str:
    """The __name__ matcher of the series a source's diagnosis reads."""
    if source == "kvwatch":
        return '__name__=~"kvwatch_engine_.+"'
    return '__name__=~"(ray_)?vllm[:_].+"'


def _keys_of_families() -> dict[str, str]:
    """vLLM family (no prefix) -> the canonical key it carries."""
    keys: dict[str, str] = {}
    for table in (vllm.GAUGES, vllm.COUNTERS, vllm.HISTOGRAMS):
        for key, aliases in table.items():
            for alias in aliases:
                keys.setdefault(alias, key)
    for labelled in (vllm.LABELLED_GAUGES, vllm.LABELLED_COUNTERS):
        for key, (family, _label) in labelled.items():
            keys.setdefault(family, key)
    return keys


_KEY_OF_FAMILY = _keys_of_families()


def wanted(name: str, source: str, diagnosed_only: bool = False) -> bool:
    """Whether a stored series is read: one the adapter reads, and with
    `diagnosed_only` (`kvwatch diagnose --prometheus`) not one of the
    families no rule reads (diagnose.NOT_DIAGNOSED_KEYS)."""
    if source == "kvwatch":
        if name not in KVWATCH_NAMES:
            return False
        name = KVWATCH_NAMES[name][0]
        if not name:  # a config/<key> value: part of cache_config
            return True
    read = vllm_sample_name(name)
    if read is None:
        return source == "kvwatch"
    return not (diagnosed_only and _KEY_OF_FAMILY.get(read[1]) in NOT_DIAGNOSED_KEYS)


def family_of(name: str, source: str) -> str:
    """What series are queried together: one vLLM family (its buckets, sum
    and count in one query)."""
    if source == "kvwatch":
        for suffix in ("_bucket", "_sum", "_count", "_total"):
            if name.endswith(suffix) and name[: -len(suffix)] + "_bucket" in KVWATCH_NAMES:
                return name[: -len(suffix)]
        return name
    found = vllm_sample_name(name)
    if found is None:  # not a family the adapter reads: a query of its own
        return name
    return found[0] + found[1]


def family_query(family: str, names: list[str], selector_inner: str) -> str:
    matcher = (f'__name__="{names[0]}"' if len(names) == 1
               else '__name__=~"' + "|".join(re.escape(n) for n in sorted(names)) + '"')
    return "{" + ",".join(p for p in (matcher, selector_inner) if p) + "}"


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _le_order(labels: dict[str, str]) -> float:
    try:
        return float(labels.get("le", "nan"))
    except ValueError:
        return float("inf")


# The parser's reading of a sample name: (family without prefix, suffix).
_SAMPLE_NAMES = sample_names(vllm.all_families(), vllm.PREFIXES)


@dataclass
class Replica:
    """One scrape target's series over the range: as page lines (`page`, for
    the adapter's parser) or as the parser's families (`families`, the fast
    path: the same Snapshot without writing and parsing the text)."""

    key: tuple[str, ...]
    labels: dict[str, str]
    # [(sample line prefix, sort key, values by step index, (family, suffix,
    # labels, spelling) as the parser reads the line, or None where it skips it)]
    # Values are a RawPairs (as the store wrote them) until _decode makes them list[str | None].
    rows: list[tuple[str, tuple, Any, tuple | None]] = field(default_factory=list)
    # config/<key> values that join the cache_config line: (engine labels, key, values)
    config_rows: list[tuple[tuple, str, Any]] = field(default_factory=list)
    process_start: Any = None
    _ordered: bool = False
    # Whether every series' values are split out (RawPairs -> strings).
    _decoded: bool = False
    # The fast path's plan, made once the rows are complete: per family,
    # (name, spelling, [(suffix, labels, float values)]); and the layout
    # object of each set of present rows, kept from step to step so the
    # adapter reuses what it derived.
    _plan: tuple | None = None
    # The same replica's plan in the chunk before (`carried()` of its
    # Replica), set by whoever diagnoses it: its label dicts and layout
    # objects are taken over where the series are the same, so the adapter's
    # caches, keyed by those objects, hit from one chunk to the next as from
    # one step to the next (else every chunk's first steps read the page the
    # slow way and plan it again: with many replicas the chunks are short).
    earlier: tuple | None = None

    def carried(self) -> tuple | None:
        """What the replica's next chunk takes over (`earlier`): the plan and
        the layouts, without the values."""
        return None if self._plan is None else (self._plan[0], self._plan[4])

    def _order(self) -> None:
        if not self._ordered:
            self.rows.sort(key=lambda row: row[1])
            self._ordered = True
            self._plan = None

    # Sent to a worker process (pickled) with each series' values at every
    # step as one string (pickling a string per value costs several times
    # more than joining and splitting them); a series with a gap, or a
    # value holding the separator, goes as it is.
    def __getstate__(self) -> dict:
        self._order()
        state = dict(self.__dict__)
        state["rows"] = [(prefix, order, _packed(values), read) for prefix, order, values, read in self.rows]
        state["config_rows"] = [(labels, key, _packed(values)) for labels, key, values in self.config_rows]
        if self.process_start is not None:
            state["process_start"] = _packed(self.process_start)
        state["_plan"] = state["earlier"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        state["rows"] = [(prefix, order, _unpacked(values), read) for prefix, order, values, read in state["rows"]]
        state["config_rows"] = [(labels, key, _unpacked(values)) for labels, key, values in state["config_rows"]]
        if state["process_start"] is not None:
            state["process_start"] = _unpacked(state["process_start"])
        self.__dict__.update(state)

    def skeleton(self) -> tuple:
        """The replica without its values: what a worker process that was
        sent the replica once keeps, so that later chunks of the same series
        send their values alone (`values_only`, `from_skeleton`)."""
        self._order()
        return (self.key, self.labels, tuple((prefix, order, read) for prefix, order, _values, read in self.rows),
                tuple((labels, key) for labels, key, _values in self.config_rows), self.process_start is not None)

    def values_only(self) -> tuple:
        """The values of the rows of `skeleton()`, in its order, packed as
        __getstate__ packs them."""
        self._order()
        return ([_sent(values) for _prefix, _order, values, _read in self.rows],
                [_packed(values) for _labels, _key, values in self.config_rows],
                None if self.process_start is None else _packed(self.process_start))

    @classmethod
    def from_skeleton(cls, skeleton: tuple, values: tuple) -> "Replica":
        """The replica `skeleton()` and `values_only()` were taken from, its
        rows' labels and readings the skeleton's own objects."""
        key, labels, rows, config_rows, _has_start = skeleton
        row_values, config_values, process_start = values
        replica = cls(key, labels)
        replica.rows = [(prefix, order, _received(packed), read)
                        for (prefix, order, read), packed in zip(rows, row_values)]
        replica.config_rows = [(engine_labels, config_key, _unpacked(packed))
                               for (engine_labels, config_key), packed in zip(config_rows, config_values)]
        replica.process_start = None if process_start is None else _unpacked(process_start)
        replica._ordered = True
        return replica

    def _decode(self) -> None:
        """The values still as the store wrote them, split out (here, in the
        process that diagnoses the replica, rather than where it was read)."""
        if self._decoded:
            return
        self.rows = [(prefix, order, _strings(values), read) for prefix, order, values, read in self.rows]
        self.config_rows = [(labels, key, _strings(values)) for labels, key, values in self.config_rows]
        if self.process_start is not None:
            self.process_start = _strings(self.process_start)
        self._decoded = True

    def families(self, index: int) -> tuple[dict[str, Family], float | None] | None:
        """What the parser would read from `page(index)`: (families, process
        start time), or None when the replica had no value then."""
        self._order()
        self._decode()
        if self._plan is None:
            self._plan = _taken_over(self._make_plan(), self.earlier)
            self.earlier = None
        plan, steps, complete, any_row, layouts = self._plan
        if not any_row[index]:
            return None
        start = _start(self.process_start[index]) if self.process_start is not None else None
        families: dict[str, Family] = {}
        step = steps[index]
        if complete[index]:  # every series has a value (the usual case)
            for name, spelling, first, end, suffixes, label_sets, config, whole in plan:
                found = list(zip(suffixes, label_sets, step[first:end]))
                if config:
                    found = [(suffix, self._config_labels(labels, index), value) for suffix, labels, value in found]
                families[name] = Family(name, "untyped", spelling, found, None if config else whole)
            return families, start
        for name, spelling, first, end, suffixes, label_sets, config, whole in plan:
            values = step[first:end]
            if None not in values:
                present = None
                found = list(zip(suffixes, label_sets, values))
            else:
                present = tuple(i for i, value in enumerate(values) if value is not None)
                if not present:
                    continue
                found = [(suffixes[i], label_sets[i], values[i]) for i in present]
            if config:
                found = [(suffix, self._config_labels(labels, index), value) for suffix, labels, value in found]
                layout = None
            elif present is None:
                layout = whole
            else:
                layout = layouts.get((name, present))
                if layout is None:
                    layout = layouts[(name, present)] = object()
            families[name] = Family(name, "untyped", spelling, found, layout)
        return families, start

    def _make_plan(self) -> tuple[list, list[list], list[bool], list[bool], dict]:
        """Per family (name, spelling, where its values sit in a step's, their
        suffixes and labels, whether it is the configuration the config rows
        join, the layout of all its series); the values of every family's
        series at each step, in that order; whether every one of them has a
        value at each step; whether the page has any row at each step; and
        the layouts made for sets of present series."""
        by_name: dict[str, list] = {}
        for _prefix, _order, values, read in self.rows:
            if read is None:
                continue
            name, suffix, labels, spelling = read
            by_name.setdefault(name, [spelling, []])[1].append((suffix, labels, values))
        plan = []
        series: list[list[str | None]] = []
        for name, (spelling, samples) in by_name.items():
            plan.append((name, spelling, len(series), len(series) + len(samples), tuple(s[0] for s in samples),
                         tuple(s[1] for s in samples), name == vllm.CACHE_CONFIG and bool(self.config_rows), object()))
            series.extend(s[2] for s in samples)
        # Step by step (a step's values made together lie together in memory,
        # where a step reads them); each family's are a slice of its step's.
        steps = [_numbers(list(step)) for step in zip(*series)] if series else []
        if not steps:
            steps = [[] for _ in range(len(self.rows[0][2]) if self.rows else 0)]
        any_row = [any(column) for column in zip(*(row[2] for row in self.rows))] if self.rows else []
        return plan, steps, [None not in step for step in steps], any_row, {}

    def _config_labels(self, labels: dict[str, str], index: int) -> dict[str, str]:
        """As _with_config writes them: each matching engine's block added in
        front of the info line's labels (the last added first), and a label
        written twice keeps its first place and its last value."""
        extra: dict[tuple, dict[str, str]] = {}
        for engine_labels, key, values in self.config_rows:
            if values[index] is not None:
                extra.setdefault(engine_labels, {})[key] = values[index]
        blocks = [{k: str(_as_int(v)) for k, v in added.items()} for engine_labels, added in extra.items()
                  if all(labels.get(k) == v for k, v in engine_labels)]
        if not blocks:
            return labels
        merged: dict[str, str] = {}
        for block in reversed(blocks):
            merged.update(block)
        merged.update(labels)
        return merged

    def page(self, index: int) -> str | None:
        """The page at step `index`, or None when the replica had no value then."""
        self._order()
        self._decode()
        lines = [prefix + values[index] for prefix, _order, values, _read in self.rows if values[index] is not None]
        if not lines:
            return None
        if self.config_rows:
            lines = self._with_config(lines, index)
        if self.process_start is not None and self.process_start[index] is not None:
            lines.append(f"{PROCESS_START} {self.process_start[index]}")
        lines.append("")
        return "\n".join(lines)

    def _with_config(self, lines: list[str], index: int) -> list[str]:
        """kvwatch's kv_cache_memory_bytes back as a cache_config_info label."""
        extra: dict[tuple, dict[str, str]] = {}
        for engine_labels, key, values in self.config_rows:
            if values[index] is not None:
                extra.setdefault(engine_labels, {})[key] = values[index]
        if not extra:
            return lines
        out = []
        info = f"vllm:{vllm.CACHE_CONFIG}{{"
        for line in lines:
            if line.startswith(info):
                for engine_labels, labels in extra.items():
                    if all(f'{k}="{escape(v)}"' in line for k, v in engine_labels):
                        added = ",".join(f'{k}="{escape(str(_as_int(v)))}"' for k, v in labels.items())
                        line = line.replace("{", "{" + added + ",", 1)
            out.append(line)
        return out


def _taken_over(made: tuple, earlier: tuple | None) -> tuple:
    """A plan (Replica._make_plan) with the label dicts and layout objects
    of `earlier` (Replica.carried) for every family whose series are the
    same (spelling, suffixes, labels, whether the configuration joins it),
    and the layouts made for sets of present series of those families."""
    if earlier is None:
        return made
    plan, steps, complete, any_row, _layouts = made
    before_plan, before_layouts = earlier
    before = {entry[0]: entry for entry in before_plan}
    same = set()
    for position, entry in enumerate(plan):
        name, spelling, first, end, suffixes, label_sets, config, _whole = entry
        old = before.get(name)
        if old is not None and old[1] == spelling and old[4] == suffixes and old[6] == config \
                and old[5] == label_sets:
            plan[position] = (name, spelling, first, end, old[4], old[5], config, old[7])
            same.add(name)
    layouts = {key: layout for key, layout in before_layouts.items() if key[0] in same}
    return plan, steps, complete, any_row, layouts


_SEPARATOR = "\x1f"


def _strings(values) -> Any:
    return values.strings() if isinstance(values, RawPairs) else values


def _packed(values):
    """A series' values as one string where they all are strings (no gap)
    without the separator; else the list itself (_unpacked undoes both).
    Values still as the store wrote them go as they are."""
    if isinstance(values, RawPairs) or not values or None in values:
        return values
    try:
        packed = _SEPARATOR.join(values)
    except TypeError:  # not strings
        return values
    return packed if packed.count(_SEPARATOR) == len(values) - 1 else values


def _sent(values):
    """_packed, and values still as the store wrote them as their text and
    count (a tuple pickles in C; a RawPairs calls __getstate__ each)."""
    return (values.text, values.count) if isinstance(values, RawPairs) else _packed(values)


def _received(values) -> Any:
    return RawPairs(*values) if isinstance(values, tuple) else _unpacked(values)


def _unpacked(values: str | list[str | None]) -> list[str] | list[str | None]:
    return values.split(_SEPARATOR) if isinstance(values, str) else values


def _number(text: str) -> float | None:
    """A value of the query API ("0.25", "NaN", "+Inf") as the parser reads
    it; None for anything else, a line the parser would skip."""
    try:
        return float(text)
    except ValueError:
        return None


def _numbers(values: list[str | None]) -> list[float | None]:
    """_number of each value (None stays None): in one pass in C for a
    series with a value at every step, the usual case."""
    try:
        return list(map(float, values))  # type: ignore[arg-type]  # None raises TypeError, caught
    except (TypeError, ValueError):  # a missing step, or a value the parser would skip
        return [None if v is None else _number(v) for v in values]


def _start(text: str | None) -> float | None:
    """A process start time as the adapter takes it: a finite number, or None."""
    if text is None:
        return None
    try:
        start = float(text)
    except ValueError:
        return None
    return start if math.isfinite(start) else None


def _as_int(text: str) -> str:
    try:
        value = float(text)
    except ValueError:
        return text
    return str(int(value)) if value.is_integer() else text


class KnownSeries:
    """How Pages filed each series (its replica key, line prefix, order and
    reading), by its labels as the store sent them, kept from one chunk of
    steps to the next: a chunk's series are the chunk before's, and working
    out each one's filing from its labels again cost as much per chunk as
    reading the chunk (a fleet of 1,000 replicas has 140,000 series, and
    chunks of 35 steps). The label dicts are then the same objects in every
    chunk, which is what the adapter's caches are keyed by. Bounded: past
    `limit` series (replicas come and go over a long range) it starts over."""

    def __init__(self, limit: int):
        self.limit = max(1, limit)
        self.rows: dict[tuple, tuple] = {}

    def file(self, labels: tuple, filed: tuple) -> None:
        if len(self.rows) >= self.limit:
            self.rows = {}
        self.rows[labels] = filed


class Pages:
    """Every replica's series over the steps of one range."""

    def __init__(self, start: float, step: float, points: int, source: str,
                 replica_labels: tuple[str, ...] = DEFAULT_REPLICA_LABELS, known: "KnownSeries | None" = None):
        self.start = start
        self.step = step
        self.points = points
        self.source = source
        self.replica_labels = tuple(replica_labels)
        self.replicas: dict[tuple[str, ...], Replica] = {}
        # How each series read before was filed (kept by the caller from one
        # chunk of steps to the next), or None to work it out every time.
        self.known = known

    def replica_key(self, labels: dict[str, str]) -> tuple[str, ...]:
        return tuple(labels.get(label, "") for label in self.replica_labels)

    def _replica(self, labels: dict[str, str]) -> Replica:
        key = self.replica_key(labels)
        replica = self.replicas.get(key)
        if replica is None:
            # The key matches the store's own values; the labels are exported (kvwatch/labels.py).
            replica = self.replicas[key] = Replica(
                key, {label: bounded_label(value) for label, value in zip(self.replica_labels, key) if value})
        return replica

    def _values(self, pairs) -> "list[str | None] | RawPairs":
        start, step, points = self.start, self.step, self.points
        # The usual case, a value at every step: the query API answers on
        # the step grid, in time order, one pair per step, so the first at
        # index 0, the last at the last index and one pair per step mean
        # the values are the steps' in order (no index worked out per pair).
        # Values still as the store wrote them (RawPairs) stay so: split
        # where the replica is diagnosed (Replica._decode).
        if pairs and len(pairs) == points:
            try:
                first, last = ((pairs.first_time(), pairs.last_time()) if isinstance(pairs, RawPairs)
                               else (float(pairs[0][0]), float(pairs[-1][0])))
            except (ValueError, TypeError, IndexError):
                first, last = None, None
            if (first is not None and last is not None and int(round((first - start) / step)) == 0
                    and int(round((last - start) / step)) == points - 1):
                return pairs if isinstance(pairs, RawPairs) else [value for _at, value in pairs]
        values: list[str | None] = [None] * points
        for pair in pairs_of(pairs):
            try:
                at, value = pair
                index = int(round((float(at) - start) / step))
            except (ValueError, TypeError, OverflowError):  # not [time, "value"]: a broken answer
                continue
            if 0 <= index < points and isinstance(value, str):
                values[index] = value
        return values

    def add(self, result: list[dict]) -> None:
        """One query's series (Prometheus' matrix result)."""
        known = self.known
        for series in result:
            if known is not None:
                # A series read in a chunk before is filed as it was then:
                # the same replica, line prefix, order and reading, the same
                # objects (its labels are looked at once, not per chunk).
                labels = tuple(series["metric"].items())
                filed = known.rows.get(labels)
                if filed is not None:
                    key, prefix, order, read = filed
                    replica = self.replicas.get(key)
                    if replica is None:
                        replica = self.replicas[key] = Replica(
                            key, {label: value for label, value in zip(self.replica_labels, key) if value})
                    replica.rows.append((prefix, order, self._values(series["values"]), read))
                    replica._ordered = replica._decoded = False
                    continue
            metric = dict(series["metric"])
            name = metric.pop("__name__", "")
            replica = self._replica(metric)
            for label in self.replica_labels:
                metric.pop(label, None)
            values = self._values(series["values"])
            if name == PROCESS_START:
                replica.process_start = values
                replica._decoded, replica._plan = False, None
                continue
            if self.source == "kvwatch":
                target, role = KVWATCH_NAMES.get(name, ("", ""))
                if role.startswith("config/"):
                    engine_labels = tuple(sorted((k, v) for k, v in metric.items() if k in ("engine",)))
                    replica.config_rows.append((engine_labels, role[len("config/"):], values))
                    replica._decoded, replica._plan = False, None
                    continue
                if not target:
                    continue
                if name == "kvwatch_engine_info":
                    metric = {k: v for k, v in metric.items() if k in INFO_KEYS or k == "engine"}
                name = target
            block = ",".join(f'{k}="{escape(v)}"' for k, v in sorted(metric.items()))
            prefix = f"{name}{{{block}}} " if block else f"{name} "
            # Buckets of one series consecutive, in increasing `le`, then _sum and _count.
            base = name
            for suffix in ("_bucket", "_sum", "_count"):
                if name.endswith(suffix):
                    base = name[: -len(suffix)]
            identity = tuple(sorted((k, v) for k, v in metric.items() if k != "le"))
            order = (base, identity, name.endswith("_count"), name.endswith("_sum"), _le_order(metric))
            read = _SAMPLE_NAMES.get(name)
            if read is not None:
                family, suffix = read
                read = (family, suffix, dict(sorted(metric.items())), name[: name.find(family)])
            replica.rows.append((prefix, order, values, read))
            replica._ordered = replica._decoded = False
            if known is not None:
                known.file(labels, (replica.key, prefix, order, read))
