"""A table-driven adapter for engines other than vLLM.

Each engine's file declares its table: for every canonical key it provides,
the engine's family, its type, its unit and what to know about it (Row), and
for every canonical key it does not provide, why (MISSING). TableAdapter reads
the rows off a page; the engine's file adds what a table cannot say (sums of
two families, a family that appears late, gauges that go stale) in `finish`.

Labels: `model_label` names the model (absent: "unknown"); `engine_label`
names the engine (a data-parallel rank; absent: "0"). Labels in `rank_labels`
(tensor/pipeline-parallel ranks) repeat the same series once per rank: one
rank is read (the lowest present), never the sum. Any other label is folded
as vLLM's adapter folds `pid`: counters and histograms summed, gauges by max.
"""

from __future__ import annotations

import math
import time as _time
from dataclasses import dataclass, field

from kvwatch.engines.base import EngineAdapter
from kvwatch.exposition import Family, FamilySelector
from kvwatch.labels import bounded_label
from kvwatch.engines.plausible import add_fault, screen
from kvwatch.snapshot import EngineSnapshot, Histogram, Snapshot


@dataclass(frozen=True)
class Row:
    """One canonical key from one engine family."""

    key: str  # canonical key (kvwatch.snapshot); "<key>/*" with `label` for a labelled family
    family: str  # the engine's family, without its prefix or `_total`
    kind: str  # gauge | counter | histogram
    unit: str
    note: str = ""
    # Only samples whose labels match (e.g. {"mode": "prefill_cache"}).
    where: tuple[tuple[str, str], ...] = ()
    # For "<key>/*": the label whose value completes the key.
    label: str | None = None
    # Write the value under this key; several rows may add into one key (a
    # sum of two families), which `finish` or the table says.
    adds: bool = False


@dataclass
class Folded:
    """Values of one family folded per (model, engine)."""

    values: dict[tuple[str, str], float] = field(default_factory=dict)


class TableAdapter(EngineAdapter):
    """Reads ROWS off a page; subclasses set the class attributes below and
    may override `finish`."""

    ROWS: tuple[Row, ...] = ()
    # canonical key -> why the engine cannot provide it.
    MISSING: dict[str, str] = {}
    model_label = "model_name"
    engine_label: str | None = None
    rank_labels: tuple[str, ...] = ()
    # Families read by `finish` rather than by a row.
    EXTRA_FAMILIES: tuple[str, ...] = ()
    # Rows `finish` provides, for the table only.
    TABLE_NOTES: tuple[Row, ...] = ()
    # Keys only some builds of the engine provide (its current builds do not).
    OLDER_BUILDS_ONLY: frozenset[str] = frozenset()

    def __init__(self, max_series: int = 10_000):
        super().__init__(max_series)
        names = {row.family for row in self.ROWS} | set(self.EXTRA_FAMILIES)
        self.selector = FamilySelector(sorted(names), self.prefixes)
        # The namespace of the latest page's sample lines: the families this
        # adapter names (sources, faults) are spelled as a query must name them.
        self.prefix = self.prefixes[0]
        self._spelling: str | None = None

    # --- what the page says, per (model, engine) ---------------------------

    def identity(self, labels: dict[str, str]) -> tuple[str, str]:
        model = labels.get(self.model_label, "unknown") if self.model_label else "unknown"
        engine = labels.get(self.engine_label, "0") if self.engine_label else "0"
        return bounded_label(model), bounded_label(engine)  # exported label values (kvwatch/labels.py)

    def _chosen(self, family: Family, where: tuple[tuple[str, str], ...]) -> list[tuple[str, dict[str, str], float]]:
        """The family's samples that match `where`, of one rank per identity."""
        samples = [s for s in family.samples if all(s[1].get(k) == v for k, v in where)]
        if not self.rank_labels:
            return samples
        lowest: dict[tuple[str, str], tuple] = {}
        for _suffix, labels, _value in samples:
            rank = self._rank(labels)
            identity = self.identity(labels)
            if identity not in lowest or rank < lowest[identity]:
                lowest[identity] = rank
        return [s for s in samples if self._rank(s[1]) == lowest[self.identity(s[1])]]

    def _rank(self, labels: dict[str, str]) -> tuple:
        return tuple(_rank_number(labels.get(name)) for name in self.rank_labels)

    def fold(self, family: Family | None, kind: str, where: tuple[tuple[str, str], ...] = (),
             label: str | None = None) -> dict[tuple[str, str, str | None], float]:
        """(model, engine, label value or None) -> value: counters summed,
        gauges by max, one rank only."""
        found: dict[tuple[str, str, str | None], float] = {}
        if family is None:
            return found
        wanted = ("_total", "") if kind == "counter" else ("",)
        for suffix, labels, value in self._chosen(family, where):
            if suffix not in wanted or value != value:
                continue
            key = (*self.identity(labels), bounded_label(labels.get(label, "")) if label else None)
            previous = found.get(key)
            if previous is None:
                found[key] = value
            elif kind == "counter":
                found[key] = previous + value
            else:
                found[key] = max(previous, value)
        return found

    def histograms(self, family: Family | None, errors: list,
                   where: tuple[tuple[str, str], ...] = ()) -> dict[tuple[str, str], Histogram]:
        """One Histogram per (model, engine), series that differ in folded
        labels summed; bounds are the scraped ones."""
        if family is None:
            return {}
        groups: dict[tuple, list] = {}  # label set without le -> [buckets, sum, count]
        for suffix, labels, value in self._chosen(family, where):
            rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
            group = groups.setdefault(rest, [{}, 0.0, None])
            if suffix == "_bucket":
                try:
                    bound = float(labels.get("le", "nan"))
                except ValueError:
                    continue
                if bound == bound:
                    group[0][bound] = group[0].get(bound, 0.0) + value
            elif suffix == "_sum":
                group[1] = value
            elif suffix == "_count":
                group[2] = value
        found: dict[tuple[str, str], Histogram] = {}
        for rest, (buckets, total, count) in groups.items():
            if math.inf not in buckets:
                errors.append(f"{family.name}: histogram without a +Inf bucket, ignored")
                continue
            bounds = tuple(sorted(buckets))
            cumulative = tuple(buckets[b] for b in bounds)
            histogram = Histogram(bounds, cumulative, total, count if count is not None else cumulative[-1])
            identity = self.identity(dict(rest))
            existing = found.get(identity)
            merged = histogram if existing is None else existing.plus(histogram)
            if merged is not None:
                found[identity] = merged
        return found

    # --- the page ---------------------------------------------------------

    def adapt(self, text: str, at: float | None = None) -> Snapshot:
        page = self.selector.parse(text)
        families = page.families
        # A page the text plan read starts its lines as the last one did.
        if not self.selector.planned or self._spelling is None:
            self._spelling = self.spelling_of(text)
        snapshot = Snapshot(time=_time.time() if at is None else at, engines={}, parse_errors=page.errors,
                            spelling=self._spelling)
        self.prefix = snapshot.spelling.split(",", 1)[0] or self.prefixes[0]
        dropped: set[tuple[str, str]] = set()

        for row in self.ROWS:
            family = families.get(row.family)
            if family is None or not family.samples:
                continue
            if row.kind == "histogram":
                found = self.histograms(family, snapshot.parse_errors, row.where)
                if found:
                    snapshot.sources.setdefault(row.key, self.spelled(row))
                for identity, histogram in found.items():
                    engine = self._engine(snapshot, identity, dropped)
                    if engine is not None:
                        engine.histograms[row.key] = histogram
                continue
            folded = self.fold(family, row.kind, row.where, row.label)
            self._nan_faults(snapshot, family, row)
            if not folded:
                continue
            snapshot.sources[row.key] = (snapshot.sources[row.key] + " + " + self.spelled(row)
                                         if row.adds and row.key in snapshot.sources else self.spelled(row))
            for (model, engine_name, value_label), value in folded.items():
                engine = self._engine(snapshot, (model, engine_name), dropped)
                if engine is None:
                    continue
                target = engine.gauges if row.kind == "gauge" else engine.counters
                key = row.key if row.label is None else f"{row.key[:-2]}/{value_label}"
                if row.adds and key in target:
                    target[key] += value
                else:
                    target[key] = value
        self.finish(snapshot, families)
        screen(snapshot, self.prefix)
        self.dropped_series += len(dropped)
        return snapshot

    def _nan_faults(self, snapshot: Snapshot, family: Family, row: Row) -> None:
        """The NaN samples `fold` skips, described as faults of the source
        (kvwatch.engines.plausible); one per (model, engine) and row."""
        wanted = ("_total", "") if row.kind == "counter" else ("",)
        seen = set()
        for suffix, labels, value in self._chosen(family, row.where):
            if value == value or suffix not in wanted:
                continue
            identity = self.identity(labels)
            key = row.key if row.label is None else f"{row.key[:-2]}/{bounded_label(labels.get(row.label, ''))}"
            if (identity, key) not in seen:
                seen.add((identity, key))
                add_fault(snapshot, *identity, key, self.spelled(row), "not_finite", value, row.kind)

    def _engine(self, snapshot: Snapshot, identity: tuple[str, str], dropped: set) -> EngineSnapshot | None:
        engine = snapshot.engines.get(identity)
        if engine is None:
            if len(snapshot.engines) >= self.max_series:
                dropped.add(identity)
                return None
            engine = snapshot.engines[identity] = EngineSnapshot(*identity)
        return engine

    def spelled(self, row: Row) -> str:
        suffix = "_total" if row.kind == "counter" else ""
        where = ",".join(f'{k}="{v}"' for k, v in row.where)
        return f"{self.prefix}{row.family}{suffix}" + (f"{{{where}}}" if where else "")

    def finish(self, snapshot: Snapshot, families: dict[str, Family]) -> None:
        """What the table cannot say; the default adds nothing."""

    # --- the table, for docs and the status ----------------------------------

    @classmethod
    def provides(cls, older_builds: bool = True) -> dict[str, str]:
        """What the rows fill (EngineAdapter.provides); capacity_tokens is the
        cache's size, a configuration value."""
        return {row.key: "config" if row.key == "capacity_tokens" else row.kind
                for row in cls.ROWS + cls.TABLE_NOTES if older_builds or row.key not in cls.OLDER_BUILDS_ONLY}

    @classmethod
    def table(cls) -> list[dict[str, str]]:
        """canonical key -> family, type, unit, note; then what is missing."""
        rows = [{"key": row.key, "family": cls.prefixes[0] + row.family + ("_total" if row.kind == "counter" else "")
                 + ("{" + ",".join(f'{k}="{v}"' for k, v in row.where) + "}" if row.where else ""),
                 "type": row.kind, "unit": row.unit, "note": row.note} for row in cls.ROWS + cls.TABLE_NOTES]
        rows.extend({"key": key, "family": "", "type": "", "unit": "", "note": f"missing: {why}"}
                    for key, why in cls.MISSING.items())
        return rows


def _rank_number(value: str | None) -> tuple[int, float | str]:
    if value is None:
        return (0, 0.0)
    try:
        return (0, float(value))
    except ValueError:
        return (1, value)
