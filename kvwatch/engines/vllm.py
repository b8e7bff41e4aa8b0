"""The vLLM adapter: one canonical Snapshot per poll from any vLLM between the
V0 engine (0.4) and 0.33.

All version knowledge lives in the alias tables (vllm_names.py, re-exported
here): for each canonical key, the vLLM families that have carried it, newest
first. The first one present for an engine wins, so a version that emits both
names (0.9.2 to 0.11 emit `kv_cache_usage_perc` and `gpu_cache_usage_perc`)
reads the current one. How a page is read fast (the series cache, the folds,
the histogram and page plans) is in vllm_plan.py.

Label handling:
- a missing `engine` label means "0" (V0 and V1 before 0.8.3 had none);
- a missing `model_name` means "unknown";
- any other label that is not the family's own dimension (`pid` in
  multiprocess mode, Ray's `WorkerId`/`NodeAddress`/...) is folded by type:
  counters and histograms are summed (each request is recorded by exactly one
  process), gauges take the maximum (each pid keeps the last value it wrote,
  and for usage the maximum is the one that matters). A summed counter must
  not fall when one replica goes away or restarts (the window would read the
  fall as a reset of the sum, and count the whole sum as one step's
  increase): _Folds keeps what each replica had counted, so the sum only
  ever grows by the replicas' own increases;
- the same series twice on one page (same name and labels) is a parse error:
  the first value counts, the others are reported, never added.
"""

from __future__ import annotations

import math
import operator
import time as _time
from typing import Any

from kvwatch.engines.base import EngineAdapter
from kvwatch.engines.plausible import screen
from kvwatch.engines.vllm_names import (  # noqa: F401 (re-exported)
    CACHE_CONFIG, COUNTERS, COUNTER_FALLBACKS, ENGINE_ONLY_GAUGES, GATES, GAUGES, HISTOGRAMS, HISTOGRAM_FALLBACKS,
    IDENTITY_LABELS, KEY_FAMILIES, LABELLED_COUNTERS, LABELLED_GAUGES, LATE_PREEMPTIONS, LORA, MODEL_ONLY_COUNTERS,
    PREFIXES, RELOOKUPS, RESTART_MARKER, VERSIONS, all_families, counting_caveats, key_families,
)
from kvwatch.engines.vllm_plan import (
    _LAYOUT, _UNPLANNED, _Folds, _PagePlan, _SeriesCache, _engine_order, _fell, _first_present, _fold_max,
    _histogram_fell, _histogram_plus, _histograms, _nan_faults, _process_start,
)
from kvwatch.exposition import Family, FamilySelector
from kvwatch.labels import bounded_label, bounded_labels
from kvwatch.snapshot import EngineSnapshot, Histogram, Snapshot


class _PageReading:
    """One page read family by family into a snapshot (VllmAdapter._read_page,
    the definition _PagePlan follows): each sample to its engine, counters and
    histograms gathered per series before they are folded. `value == value`
    is False only for NaN, and cheaper than math.isnan."""

    def __init__(self, snapshot: Snapshot, families: dict[str, Family], series: _SeriesCache, max_series: int):
        self.snapshot = snapshot
        self.families = families
        self.series = series
        self.max_series = max_series
        self.errors = snapshot.parse_errors
        # (model, engine, canonical key) -> (the engine, {series token: value}),
        # folded once the page is read.
        self.counter_parts: dict[tuple[str, str, str], tuple[EngineSnapshot, dict[tuple, float]]] = {}
        self.histogram_parts: dict[tuple[str, str, str], tuple[EngineSnapshot, dict[tuple, Histogram]]] = {}
        # Count each dropped (model, engine) pair once per poll, not once per
        # sample: the count must not depend on how many families it has.
        self.dropped: set[tuple[str, str]] = set()

    def add_part(self, parts: dict, engine: EngineSnapshot, key: str, token: tuple, value, family: str) -> None:
        entry = parts.get((engine.model, engine.engine, key))
        if entry is None:
            parts[(engine.model, engine.engine, key)] = (engine, {token: value})
            return
        found = entry[1]
        if token in found:
            self.errors.append(f"{family}: duplicate series {dict(token)} (value {value!r}; kept the first, "
                               f"{found[token]!r})")
        else:
            found[token] = value

    def claim(self, key: str, name: str) -> Family | None:
        """The family `name`, recorded as the source of `key`, when the page
        has samples of it."""
        family = self.families.get(name)
        if family is None or not family.samples:
            return None
        self.snapshot.sources[key] = name
        return family

    def engine_of(self, labels: dict[str, str]) -> EngineSnapshot | None:
        engines = self.snapshot.engines
        key = self.series.engine_key(labels)
        found = engines.get(key)
        if found is None:
            if len(engines) >= self.max_series:
                self.dropped.add(key)
                return None
            found = engines[key] = EngineSnapshot(*key)
        return found

    def gauges(self) -> None:
        families, snapshot, series = self.families, self.snapshot, self.series
        for key, aliases in GAUGES.items():
            family = _first_present(families, aliases, snapshot.sources, key)
            if family is None:
                continue
            seen: set[tuple] = set()
            for suffix, labels, value in family.samples:
                if suffix == "" and value == value:
                    engine = self.engine_of(labels)
                    if engine is not None:
                        token = series.other(labels)[1]
                        if token in seen:
                            self.errors.append(f"{family.name}: duplicate series {dict(token)} "
                                               f"(value {value!r}; kept the first)")
                            continue
                        seen.add(token)
                        _fold_max(engine.gauges, key, value)
        for key, (name, dimension) in LABELLED_GAUGES.items():
            family = families.get(name)
            if family is None:
                continue
            snapshot.sources[key] = name
            for suffix, labels, value in family.samples:
                if suffix == "" and value == value:
                    engine = self.engine_of(labels)
                    if engine is not None:
                        _fold_max(engine.gauges, f"{key}/{bounded_label(labels.get(dimension, ''))}", value)

    def counters(self) -> None:
        families, snapshot, series, parts = self.families, self.snapshot, self.series, self.counter_parts
        for key, aliases in COUNTERS.items():
            family = _first_present(families, aliases, snapshot.sources, key)
            if family is None:
                continue
            marks_restart = aliases[0] == RESTART_MARKER
            for suffix, labels, value in family.samples:
                if (suffix == "_total" or suffix == "") and value == value:
                    engine = self.engine_of(labels)
                    if engine is not None:
                        self.add_part(parts, engine, key, series.other(labels)[1], value, family.name)
                elif suffix == "_created" and marks_restart:
                    engine = self.engine_of(labels)
                    if engine is not None:
                        engine.created = value if engine.created is None else min(engine.created, value)
        for key, (name, dimension) in LABELLED_COUNTERS.items():
            family = families.get(name)
            if family is None:
                continue
            snapshot.sources[key] = name
            for suffix, labels, value in family.samples:
                if (suffix == "_total" or suffix == "") and value == value:
                    engine = self.engine_of(labels)
                    if engine is not None:
                        self.add_part(parts, engine, f"{key}/{bounded_label(labels.get(dimension, ''))}",
                                      series.other(labels)[1], value, family.name)
        for key, (name, dimension, wanted) in COUNTER_FALLBACKS.items():
            if key in snapshot.sources or (family := self.claim(key, name)) is None:
                continue
            for suffix, labels, value in family.samples:
                if (suffix == "_total" or suffix == "") and value == value and labels.get(dimension) == wanted:
                    engine = self.engine_of(labels)
                    if engine is not None:
                        self.add_part(parts, engine, key, series.other(labels)[1], value, family.name)

    def histograms(self) -> None:
        families, snapshot, series, parts = self.families, self.snapshot, self.series, self.histogram_parts
        for key, aliases in HISTOGRAMS.items():
            family = _first_present(families, aliases, snapshot.sources, key)
            if family is not None:
                for token, labels, histogram in _histograms(family, self.errors, series):
                    engine = self.engine_of(labels)
                    if engine is not None:
                        self.add_part(parts, engine, key, token, histogram, family.name)
        for key, (name, dimension, wanted) in HISTOGRAM_FALLBACKS.items():
            if key in snapshot.sources or (family := self.claim(key, name)) is None:
                continue
            for token, labels, histogram in _histograms(family, self.errors, series):
                if labels.get(dimension) == wanted:
                    engine = self.engine_of(labels)
                    if engine is not None:
                        self.add_part(parts, engine, key, token, histogram, family.name)

    def engine_and_model_only(self) -> None:
        """Gauges only the engine label names, and counters only the model's (on its first engine)."""
        engines = self.snapshot.engines
        for key, name in ENGINE_ONLY_GAUGES.items():
            if (family := self.claim(key, name)) is None:
                continue
            for suffix, labels, value in family.samples:
                if suffix == "" and value == value:
                    number = bounded_label(labels.get("engine", "0"))
                    for engine in engines.values():
                        if engine.engine == number:
                            _fold_max(engine.gauges, key, value)
        for key, (name, dimension) in MODEL_ONLY_COUNTERS.items():
            if (family := self.claim(key, name)) is None:
                continue
            first_engine: dict[str, EngineSnapshot] = {}
            for engine in engines.values():
                held = first_engine.get(engine.model)
                if held is None or _engine_order(engine.engine) < _engine_order(held.engine):
                    first_engine[engine.model] = engine
            for suffix, labels, value in family.samples:
                if (suffix == "_total" or suffix == "") and value == value:
                    first = first_engine.get(bounded_label(labels.get("model_name", "unknown")))
                    if first is not None:
                        flat = f"{key}/{bounded_label(labels.get(dimension, ''))}"
                        first.counters[flat] = first.counters.get(flat, 0.0) + value


class VllmAdapter(EngineAdapter):
    """Turns the text of a vLLM /metrics page into a Snapshot. Keep one
    instance per target: it caches the parsed spellings and label sets."""

    name = "vllm"
    title = "vLLM"
    prefixes = PREFIXES
    families = KEY_FAMILIES
    gates = GATES
    versions = VERSIONS

    @classmethod
    def provides(cls, older_builds: bool = True) -> dict[str, str]:
        """The alias tables' keys (EngineAdapter.provides), every build's: the
        catalogue is vLLM's, and what one page lacks is said from the page
        (Signal.needs, /api/v1/signals' dark_signals)."""
        found = {key: "gauge" for key in GAUGES | ENGINE_ONLY_GAUGES}
        found.update({key: "counter" for key in COUNTERS})
        found.update({f"{key}/*": "gauge" for key in LABELLED_GAUGES})
        found.update({f"{key}/*": "counter" for key in LABELLED_COUNTERS | MODEL_ONLY_COUNTERS})
        found.update({key: "histogram" for key in HISTOGRAMS})
        # From vllm:cache_config_info.
        found.update({key: "config" for key in ("capacity_tokens", "config/kv_cache_memory_bytes",
                                                "config/num_gpu_blocks", "config/block_size")})
        return found

    def __init__(self, max_series: int = 10_000):
        super().__init__(max_series)
        self._selector: FamilySelector | None = None
        # Derived forms of the parser's cached label sets, which come back as
        # the same objects poll after poll (see _SeriesCache).
        self._series = _SeriesCache()
        self._cache_clears = 0
        self._folds = _Folds()
        self._process_start: float | None = None
        self._spelling: str | None = None
        self._lora = LoraSeries()

    @property
    def selector(self) -> FamilySelector:
        # Built on the first page: a reader that hands over families
        # (adapt_families) never needs it.
        if self._selector is None:
            self._selector = FamilySelector(all_families(), PREFIXES)
        return self._selector

    def adapt(self, text: str, at: float | None = None) -> Snapshot:
        selector = self.selector
        page = selector.parse(text)
        if selector.cache_clears != self._cache_clears:
            self._cache_clears = selector.cache_clears
            self._series.clear()
        snapshot = self.adapt_families(page.families, page.errors, _process_start(text), at)
        # A page the text plan read starts its lines as the last one did:
        # its spelling is the last one's (0.4 ms of text search at 8 engines).
        if not selector.planned or self._spelling is None:
            self._spelling = self.spelling_of(text)
        snapshot.spelling = self._spelling
        return snapshot

    def adapt_families(self, families: dict[str, Family], errors: list, process_start: float | None,
                       at: float | None = None) -> Snapshot:
        """The Snapshot of a page already read into families (keyed by the
        family name without prefix, samples as (suffix, labels, value) in
        page order), as the parser would give them: the history reader
        builds these straight from query results. A reader that hands the
        same label dicts, and the same `layout` object for the same layout,
        from one call to the next gets the caches' speed."""
        snapshot = Snapshot(time=_time.time() if at is None else at, engines={}, parse_errors=errors,
                            families=KEY_FAMILIES, gates=GATES)
        snapshot.process_start = process_start
        if snapshot.process_start is not None and snapshot.process_start != self._process_start:
            if self._process_start is not None:
                self._folds.clear()  # a new process: every replica's count started again
            self._process_start = snapshot.process_start
        series = self._series
        series.trim()
        plan = self._page_plan(families) if self.page_plans else None
        if plan is None or len(plan.engine_keys) > self.max_series or not plan.apply(snapshot, families, self._folds):
            self._read_page(snapshot, families)
        self._read_info(snapshot, families)
        lora = families.get(LORA)
        snapshot.lora_used = self._lora.used(lora.samples if lora is not None else ())
        screen(snapshot, "vllm:")
        snapshot.counting = counting_caveats(families)
        # What a store's answer was spelled in (adapt() replaces it with the
        # page text's own sample lines, the definition).
        spelled = {family.spelling for family in families.values()}
        snapshot.spelling = ",".join(prefix for prefix in self.prefixes if prefix in spelled)
        # Within its bounds between polls too, not only before the next one:
        # a page of new label sets is let go once it is read.
        series.trim()
        return snapshot

    # Whether a page whose layout was seen on the poll before is read by its
    # _PagePlan. Off only in the tests that compare the plan with the reading
    # below, which stays the definition.
    page_plans = True

    def _page_plan(self, families: dict[str, Family]) -> _PagePlan | None:
        """The plan of a page with the same families, in the same layouts, as
        the poll before (made then on this second sight, so a layout seen once
        costs nothing more); None for any other page, or one that the plan
        cannot read (_PagePlan.of)."""
        series = self._series
        names = tuple(families)
        layouts = tuple(map(_LAYOUT, families.values()))
        seen = series.page
        if seen is not None and seen[0] == names and all(map(operator.is_, seen[1], layouts)):
            plan: Any = seen[2]
            if plan is _UNPLANNED:
                plan = _PagePlan.of(families, series)
                series.page = (names, layouts, plan)
            return plan
        series.page = (names, layouts, _UNPLANNED)  # holds the layouts, so their ids are not reused
        return None

    def _read_page(self, snapshot: Snapshot, families: dict[str, Family]) -> None:
        """Every family but the cache configuration and LoRA, into the
        snapshot's engines and sources (and parse errors)."""
        reading = _PageReading(snapshot, families, self._series, self.max_series)
        reading.gauges()
        reading.counters()
        reading.histograms()
        folds = self._folds
        for fold_key, (engine, parts) in reading.counter_parts.items():
            engine.counters[fold_key[2]] = folds.fold(fold_key, parts, _fell, operator.add)
        for fold_key, (holder, pieces) in reading.histogram_parts.items():
            holder.histograms[fold_key[2]] = folds.fold(fold_key + ("histogram",), pieces,
                                                        _histogram_fell, _histogram_plus)
        folds.forget_unseen()
        reading.engine_and_model_only()
        self.dropped_series += len(reading.dropped)
        _nan_faults(snapshot, families, self._series)

    @staticmethod
    def _read_info(snapshot: Snapshot, families: dict[str, Family]) -> None:
        """The cache configuration and LoRA (their labels are their values)."""
        cache_config = families.get(CACHE_CONFIG)
        if cache_config is not None:
            for suffix, labels, _value in cache_config.samples:
                if suffix == "":
                    snapshot.cache_config[bounded_label(labels.get("engine", "0"))] = bounded_labels(labels)

        lora = families.get(LORA)
        if lora is not None:
            latest = max((s for s in lora.samples if s[0] == ""), key=lambda s: s[2], default=None)
            if latest is not None:
                snapshot.lora = latest[1]


# The lora_requests_info series remembered from one page to the next.
MAX_LORA_SERIES = 64


class LoraSeries:
    """Which LoRA adapters were used since the previous page. vLLM keeps one
    lora_requests_info series per (running, waiting) adapter set, valued with
    the time it was last set, and sets the idle one ("", "") at the steps
    between a LoRA request's too: on most pages of a real run the idle series
    was the newest while an adapter ran, so the newest series alone missed an
    adapter used only between two polls."""

    def __init__(self) -> None:
        self._times: dict[tuple[str, str], float] | None = None  # None before the first page

    def used(self, samples) -> tuple[tuple[str, ...], ...]:
        """The adapter names of each series set since the previous page,
        oldest first. On the first page only the newest series: the older
        ones were set before kvwatch looked, in an order it cannot place."""
        times: dict[tuple[str, str], float] = {}
        labels_of: dict[tuple[str, str], dict[str, str]] = {}
        for suffix, labels, value in samples:
            if suffix == "" and math.isfinite(value):
                # Bounded as label values are: a page of long names is not kept whole until the next one.
                key = (bounded_label(labels.get("running_lora_adapters", "")),
                       bounded_label(labels.get("waiting_lora_adapters", "")))
                if value >= times.get(key, value):
                    times[key], labels_of[key] = value, labels
        newest = sorted(times.items(), key=operator.itemgetter(1))[-MAX_LORA_SERIES:]
        before, self._times = self._times, dict(newest)
        if before is None:
            newest = newest[-1:]
        fresh = (adapter_names(labels_of[key]) for key, at in newest if before is None or before.get(key) != at)
        return tuple(names for names in fresh if names)


def adapter_names(labels: dict[str, str]) -> tuple[str, ...]:
    """The adapter names of one series' running and waiting labels, in order, once each."""
    names = (name.strip() for label in ("running_lora_adapters", "waiting_lora_adapters")
             for name in labels.get(label, "").split(","))
    return tuple(dict.fromkeys(bounded_label(name) for name in names if name))
