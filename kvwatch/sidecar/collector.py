"""The prometheus_client Collector over the monitor's latest State.

`collect()` reads one State reference and yields fresh families from it, so a
scrape sees one poll's values, never a mix, and never waits on the engine.
Engine and window series are present only while the latest poll succeeded:
values from a failed poll's past would look current. kvwatch adds no target
labels of its own (Prometheus' exporter guidance); model_name and engine come
from vLLM.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any, TypeGuard

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
    UntypedMetricFamily,
)
from prometheus_client import ProcessCollector
from prometheus_client.samples import Sample
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from kvwatch import __version__
from kvwatch.sidecar import renders
from kvwatch.signals import (
    ENGINE_SERIES, HEALTH_BY_NAME, INFO_KEYS, SIGNALS, STREAM_HEALTH, STREAM_SERIES, STREAM_SIGNALS, STREAM_SIZING,
    TIER_HEALTH, TIER_IDENTITY, TIER_SERIES, TIER_SIGNALS,
    engine_series_value,
)
from kvwatch.signals import IDENTITY as IDENTITY_LABELS
from kvwatch.signals import worth
from kvwatch.signals.health import ROUTER_HEALTH
from kvwatch.routing.tenants import DEFAULT_TOP_K, lora_rows
from kvwatch.engines.plausible import FAULTS
from kvwatch.snapshot import PINNED_LABELS, Histogram
from kvwatch.stream_report import KVEventsIntake, KVEventsLabelRow, KVEventsReport, KVEventsTable, KVEventsTotals

IDENTITY = list(IDENTITY_LABELS)
POLL_ERROR_REASONS = (
    "refused", "dns", "timeout", "tls", "connection", "disconnected", "http_3xx", "http_4xx", "http_5xx",
    "content_type", "too_large", "truncated", "decode", "no_engine_metrics", "error", "internal",
)


class KvwatchCollector(Collector):
    def __init__(self, monitor):
        self.monitor = monitor

    def collect(self):
        state = self.monitor.state
        yield from self._health(state)
        if not state.up or state.snapshot is None:
            return
        yield from self._engine_series(state.snapshot)
        yield from self._sources(state.snapshot, state.lmcache)
        yield from self._tier(state.lmcache)
        yield from self._router(getattr(state, "router", None))
        yield from self._tenants(state.lmcache, getattr(state, "router", None))
        stream: KVEventsReport | None = getattr(state, "kv_events", None)
        yield from self._adapters(stream)
        yield from self._stream(stream)
        yield from self._signals(state)
        yield from self._pinned(state)
        yield from self._findings(state)
        yield from self._faults(state)

    def _faults(self, state):
        family = _health_family("kvwatch_source_fault")
        for fault in state.source_faults:
            family.add_metric([fault.family, fault.fault, fault.model, fault.engine], 1.0)
        yield family

    def _health(self, state):
        info = _health_family("kvwatch_build_info")
        info.add_metric([__version__], 1.0)
        errors = _health_family("kvwatch_poll_errors")
        # Every known reason is present from the start so rate() works at once.
        for reason in sorted(set(POLL_ERROR_REASONS) | set(state.errors_by_reason)):
            errors.add_metric([reason], state.errors_by_reason.get(reason, 0))
        yield info
        yield errors
        faults = _health_family("kvwatch_source_faults")
        # Every kind present from the start, as the poll errors.
        for kind in sorted(set(FAULTS) | set(state.source_faults_by_kind)):
            faults.add_metric([kind], state.source_faults_by_kind.get(kind, 0))
        yield faults
        # The unlabelled ones; None means absent (nothing known yet).
        for name, value in (
            ("kvwatch_up", 1.0 if state.up else 0.0),
            ("kvwatch_stats_disabled", 1.0 if state.reason == "no_engine_metrics" else 0.0),
            ("kvwatch_busy", 1.0 if getattr(state, "busy", None) else 0.0),
            ("kvwatch_starting", 1.0 if getattr(state, "engine_starting", False) else 0.0),
            ("kvwatch_polls", state.polls),
            ("kvwatch_parse_errors", state.parse_errors), ("kvwatch_dropped_series", state.dropped_series),
            ("kvwatch_poll_duration_seconds", state.poll_seconds),
            ("kvwatch_page_late_seconds", state.page_late_seconds),
            ("kvwatch_poll_cpu_seconds", state.poll_cpu_seconds),
            ("kvwatch_last_success_timestamp_seconds", state.last_success_time),
            ("kvwatch_window_seconds", state.window_seconds),
        ):
            if value is not None:
                family = _health_family(name)
                family.add_metric([], value)
                yield family

    def _engine_series(self, snapshot):
        families: dict[str, Any] = {}  # a gauge, counter or histogram family per series
        for series in ENGINE_SERIES:
            labels = IDENTITY + ([series.label] if series.label else [])
            if series.kind == "gauge":
                families[series.name] = GaugeMetricFamily(series.name, series.help, labels=labels, unit="")
            elif series.kind == "counter":
                families[series.name] = CounterMetricFamily(series.name, series.help, labels=labels)
            else:
                families[series.name] = HistogramMetricFamily(series.name, series.help, labels=labels)
        info = _health_family("kvwatch_engine_info")
        for (model, engine_id), engine in sorted(snapshot.engines.items()):
            cache_config = snapshot.cache_config.get(engine_id, {})
            for series in ENGINE_SERIES:
                value = engine_series_value(series, engine, cache_config)
                if value is None:
                    continue
                family = families[series.name]
                if isinstance(value, Histogram):
                    buckets = [(_le(bound), count) for bound, count in zip(value.bounds, value.cumulative)]
                    family.add_metric([model, engine_id], buckets, value.sum)
                elif isinstance(value, dict):
                    for label_value, number in sorted(value.items()):
                        family.add_metric([model, engine_id, label_value], number)
                else:
                    family.add_metric([model, engine_id], value)
            info.add_metric([model, engine_id] + [cache_config.get(k, "") for k in INFO_KEYS], 1.0)
        yield from families.values()
        yield info
        if getattr(snapshot, "spelling", ""):
            spelling = _health_family("kvwatch_engine_spelling_info")
            spelling.add_metric([snapshot.spelling], 1.0)
            yield spelling

    def _sources(self, snapshot, lmcache):
        present = _health_family("kvwatch_source_present")
        for family, on_page in snapshot.present().items():
            present.add_metric([family], 1.0 if on_page else 0.0)
        # LMCache's families, from its own page, while its latest poll read one.
        for family, on_page in sorted(((lmcache or {}).get("families") or {}).items()):
            present.add_metric([family], 1.0 if on_page else 0.0)
        yield present

    def _router(self, router):
        """The router beside the engines (kvwatch/pipeline/router.py): its health
        whenever configured, each model's window only while its latest poll read one."""
        if router is None:
            return
        up = GaugeMetricFamily(ROUTER_HEALTH[0].name, ROUTER_HEALTH[0].help, labels=[])
        up.add_metric([], 1.0 if router.get("up") else 0.0)
        yield up
        if not router.get("up"):
            return
        attributes = ("predicted_ratio", "delivered_ratio", "available_ratio")
        for health, attribute in zip(ROUTER_HEALTH[1:], attributes):
            family = GaugeMetricFamily(health.name, health.help, labels=list(health.labels))
            for window in router.get("windows") or ():
                value = getattr(window, attribute)
                if _finite(value):
                    family.add_metric([window.model], value)
            yield family

    def _adapters(self, kv_events: KVEventsReport | None):
        """Per LoRA adapter, the stream's window's stored-again share, recomputed tokens and the prefill seconds
        they cost (top K and "other"); the seconds only where the window was priced (worth.with_worth)."""
        if not kv_events or not kv_events.get("up"):
            return
        settings = getattr(self.monitor, "settings", None)
        rows = lora_rows(kv_events, settings.tenant_top_k if settings is not None else DEFAULT_TOP_K)
        for health, key in ((ROUTER_HEALTH[5], "stored_again_share"), (ROUTER_HEALTH[6], "recomputed_tokens")):
            family = GaugeMetricFamily(health.name, health.help, labels=list(health.labels))
            for row in rows:
                if _finite(row[key]):
                    family.add_metric(["lora", row["tenant"]], row[key])
            yield family
        lost = worth.lost_by_tenant(rows, worth.priced_rate(kv_events))
        if lost is not None:
            health = ROUTER_HEALTH[7]
            family = GaugeMetricFamily(health.name, health.help, labels=list(health.labels))
            for item in lost:
                if _finite(item["seconds"]):
                    family.add_metric([item["kind"], item["tenant"]], item["seconds"])
            yield family

    def _tenants(self, *reports):
        """Per tenant of each kind, its window's hit ratio: from the router's page (fairness_id) and LMCache's
        multiprocess server (cache_salt), each already cut to the top K and "other"."""
        read = [report for report in reports if report and report.get("up")]
        if not read:
            return
        # The family stands while a tenant source answers, empty until its window has two readings.
        kinds = {kind: rows for report in read for kind, rows in (report.get("tenants") or {}).items()}
        tenants = ROUTER_HEALTH[4]
        family = GaugeMetricFamily(tenants.name, tenants.help, labels=list(tenants.labels))
        for kind, rows in sorted(kinds.items()):
            for row in rows:
                if _finite(row["hit_ratio"]):
                    family.add_metric([kind, row["tenant"]], row["hit_ratio"])
        yield family

    def _tier(self, lmcache):
        """The LMCache tier (kvwatch/pipeline/lmcache.py): its health whenever
        it is configured, its series and signals only while its latest poll
        succeeded (values from a failed poll's past would look current)."""
        family: Any  # a gauge or counter family
        if lmcache is None:
            return
        up = GaugeMetricFamily(TIER_HEALTH[0].name, TIER_HEALTH[0].help, labels=[])
        up.add_metric([], 1.0 if lmcache.get("up") else 0.0)
        yield up
        if not lmcache.get("up"):
            return
        labels = list(TIER_IDENTITY)
        rows = lmcache.get("models") or []
        for series in TIER_SERIES:
            family = CounterMetricFamily(series.name, series.help, labels=labels)
            for row in rows:
                value = row.get("latest", {}).get(series.key)
                if _finite(value):
                    family.add_metric([row["model_name"]], value)
            yield family
        for signal in TIER_SIGNALS:
            family = GaugeMetricFamily(signal.name, signal.help,
                                       labels=labels + [signal.label] if signal.label else labels)
            for row in rows:
                value = row.get("signals", {}).get(signal.name)
                if isinstance(value, dict):
                    for label, one in sorted(value.items()):
                        if _finite(one):
                            family.add_metric([row["model_name"], label], one)
                elif _finite(value):
                    family.add_metric([row["model_name"]], value)
            yield family

    def _stream(self, report: KVEventsReport | None):
        """The engine's KV-cache event stream (kvwatch/kvevents): its
        health whenever it is configured, its counts and signals once an
        event arrived."""
        if report is None:
            return
        yield from _stream_health(report)
        if not report.get("up"):
            return
        yield from _stream_totals(report.get("totals"))
        window = report.get("window")
        for signal in STREAM_SIGNALS:
            value = window.get(signal.key) if window else None
            if _finite(value):
                family = GaugeMetricFamily(signal.name, signal.help, labels=[])
                family.add_metric([], float(value))
                yield family
        points = (report.get("sizing") or {}).get("points") or []
        for signal in STREAM_SIZING:
            family = GaugeMetricFamily(signal.name, signal.help, labels=["extra_cache"])
            for point in points:
                value = point.get(signal.key)
                if _finite(value):
                    family.add_metric([f"{point['extra_cache']:g}"], float(value))
            yield family

    def _signals(self, state):
        for prefix, rows, labels in (
            ("kvwatch_", state.per_engine, IDENTITY),
            ("kvwatch_model_", state.per_model, ["model_name"]),
        ):
            for signal in SIGNALS:
                name = prefix + signal.name[len("kvwatch_"):]
                family_labels = labels + ([signal.label] if signal.label else [])
                make = QuantileMetricFamily if signal.label == "quantile" else GaugeMetricFamily
                family = make(name, signal.help, labels=family_labels)
                for row in rows:
                    identity = [row.model] if row.engine is None else [row.model, row.engine]
                    value = row.values.get(signal.name)
                    if value is None:
                        continue
                    if isinstance(value, dict):
                        for label_value, number in sorted(value.items()):
                            if _finite(number):
                                family.add_metric(identity + [label_value], number)
                    elif _finite(value):
                        family.add_metric(identity, value)
                yield family

    def _pinned(self, state):
        family = _health_family("kvwatch_quantile_pinned")
        for prefix, rows in (("kvwatch_", state.per_engine), ("kvwatch_model_", state.per_model)):
            for row in rows:
                for name, quantiles in sorted(getattr(row, "pinned", {}).items()):
                    exported = prefix + name[len("kvwatch_"):]
                    for quantile, bound in sorted(quantiles.items()):
                        family.add_metric([exported, quantile, PINNED_LABELS[bound], row.model, row.engine or ""], 1.0)
        yield family

    def _findings(self, state):
        # One series per symptom per engine (the primary, diagnose/arbitration.py);
        # its contributing factors and alternatives in companion series.
        family = _health_family("kvwatch_finding")
        contributors = _health_family("kvwatch_finding_contributor")
        alternatives = _health_family("kvwatch_finding_alternative")
        for finding in state.findings:
            identity = [finding.model, finding.engine or ""]
            family.add_metric([finding.symptom, finding.cause, finding.severity, *identity], 1.0)
            for factor in sorted({c["cause"] for c in finding.contributing}):
                contributors.add_metric([finding.symptom, finding.cause, factor, *identity], 1.0)
            for other in finding.alternatives:
                for source in other["decided_by"]:
                    alternatives.add_metric([finding.symptom, finding.cause, other["cause"], source, *identity], 1.0)
        yield family
        yield contributors
        yield alternatives


def _health_family(name: str):
    family = HEALTH_BY_NAME[name]
    make = {"counter": CounterMetricFamily, "untyped": UntypedMetricFamily}.get(family.kind, GaugeMetricFamily)
    return make(family.name, family.help, labels=list(family.labels))


class QuantileMetricFamily(Metric):
    """Windowed quantiles, typed `summary`: that is what they are (phi-
    quantiles over a sliding window, as a client library's summary reports
    them; no _sum or _count, which the window's mean signals carry), and
    Prometheus' lint refuses a `quantile` label on any other type
    (`promtool check metrics` exited 3 on kvwatch's /metrics)."""

    def __init__(self, name: str, documentation: str, labels=None):
        super().__init__(name, documentation, "summary")
        self._labelnames = tuple(labels or ())

    def add_metric(self, labels, value: float) -> None:
        self.samples.append(Sample(self.name, dict(zip(self._labelnames, labels)), value, None))



def _stream_health(report: KVEventsReport) -> Iterator[Metric]:
    """The stream's health: up, the intake's counters, the table's gauges."""
    health = {family.name: family for family in STREAM_HEALTH}
    # Read by key with .get: a report of an older build may lack a part (the union keeps mypy checking the keys).
    intake: KVEventsIntake | dict[str, int] = report.get("intake") or {}
    table: KVEventsTable | dict[str, float] = report.get("table") or {}
    up = GaugeMetricFamily("kvwatch_kv_events_up", health["kvwatch_kv_events_up"].help, labels=[])
    up.add_metric([], 1.0 if report.get("up") else 0.0)
    yield up
    for name, count in (("kvwatch_kv_events_messages", intake.get("messages")),
                        ("kvwatch_kv_events_dropped_messages", intake.get("dropped")),
                        ("kvwatch_kv_events_missed_messages", intake.get("gaps", intake.get("missed"))),
                        ("kvwatch_kv_events_recovered_messages", intake.get("recovered")),
                        ("kvwatch_kv_events_malformed_messages", intake.get("malformed")),
                        ("kvwatch_kv_events_publisher_restarts", intake.get("restarts")),
                        ("kvwatch_kv_events_connections", intake.get("connections"))):
        counter = CounterMetricFamily(name, health[name].help, labels=[])
        counter.add_metric([], float(count or 0))
        yield counter
    for name, value in (("kvwatch_kv_events_tracked_blocks", table.get("entries")),
                        ("kvwatch_kv_events_sampling_ratio", table.get("sampling_rate")),
                        ("kvwatch_kv_events_last_message_age_seconds", report.get("last_message_age_seconds")),
                        ("kvwatch_kv_events_publishers", intake.get("publishers")),
                        ("kvwatch_kv_events_silent_blocks", (report.get("silence") or {}).get("blocks"))):
        if _finite(value):
            gauge = GaugeMetricFamily(name, health[name].help, labels=[])
            gauge.add_metric([], float(value))
            yield gauge


def _stream_totals(totals: KVEventsTotals | None) -> Iterator[Metric]:
    """The stream's counts since it started, one family per STREAM_SERIES."""
    family: Any  # a counter or histogram family
    for series in STREAM_SERIES:
        if series.kind == "histogram":
            buckets = (totals.get("return_buckets") if totals else None) or []
            family = HistogramMetricFamily(series.name, series.help, labels=[])
            family.add_metric([], [(_le(math.inf if bound is None else bound), count) for bound, count in buckets],
                              (totals.get("return_seconds_sum") if totals else None) or 0.0)
            yield family
            continue
        family = CounterMetricFamily(series.name, series.help, labels=list(series.labels))
        if series.key in ("stored", "stored_again", "reused"):
            for row in (totals.get("by_label") if totals else None) or []:
                family.add_metric([row["medium"], row["lora_name"]], float(_label_count(row, series.key)))
        elif series.key == "tiers":
            for tier in (totals.get("tiers") if totals else None) or []:
                for event, count in (("stored", tier["stored"]), ("evicted", tier["evicted"]),
                                     ("returned", tier["returned"])):
                    family.add_metric([tier["medium"], tier["locality"], event], float(count))
        elif series.key == "evicted":
            for medium, evicted in ((totals.get("evicted_by_medium") if totals else None) or {}).items():
                family.add_metric([medium], float(evicted))
        elif series.key == "cleared":
            family.add_metric([], float((totals.get("cleared") if totals else None) or 0))
        else:
            raise ValueError(f"{series.name}: no reading of the stream's totals for {series.key!r}")
        yield family


def _label_count(row: KVEventsLabelRow, key: str) -> float:
    """One count of a (medium, LoRA adapter) row, by the series' key."""
    if key == "stored":
        return row["stored"]
    return row["stored_again"] if key == "stored_again" else row["reused"]

def _le(bound: float) -> str:
    if math.isinf(bound):
        return "+Inf"
    return repr(float(bound))


def _finite(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and math.isfinite(value)


def make_registry(monitor) -> CollectorRegistry:
    # A private registry: no process/platform collectors mixed in by default,
    # and tests get a fresh one per case.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvwatchCollector(monitor))
    # kvwatch's own CPU and memory, so its cost in the pod is visible.
    ProcessCollector(registry=registry)
    return registry


# Samples that prometheus_client's text format moves into a gauge family of
# their own after the family's other samples.
_OPENMETRICS_SUFFIXES = ("_created", "_gsum", "_gcount")


class Renderer:
    """The registry in Prometheus' text format, byte for byte what
    prometheus_client's generate_latest writes (tests/test_renderer.py), but
    each series' `name{labels} ` text is kept from one render to the next, so
    a render formats only the values: label values stay the same from poll to
    poll while every value changes. At 8 engines this takes the render from
    about 11 to 6 ms of CPU, and the render is what the first scraper after
    each poll waits for. Only the series of the latest render are kept."""

    def __init__(self, registry: CollectorRegistry):
        self.registry = registry
        self._prefixes: dict[tuple, str] = {}

    def render(self, limit: int | None = None) -> bytes:
        """Raises RenderTooLarge once the text passes `limit` characters
        (RENDER_MAX_BYTES), before the rest of the registry is collected."""
        limit = renders.RENDER_MAX_BYTES if limit is None else limit
        kept, self._prefixes = self._prefixes, {}
        prefixes = self._prefixes
        output: list[str] = []
        size = 0
        for metric in self.registry.collect():
            name, kind = metric.name, metric.type
            if kind == "counter":
                shown = name + "_total"
            elif kind == "info":
                shown, kind = name + "_info", "gauge"
            else:
                shown = name
                kind = {"stateset": "gauge", "gaugehistogram": "histogram", "unknown": "untyped"}.get(kind, kind)
            help_text = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            output.append(f"# HELP {shown} {help_text}\n# TYPE {shown} {kind}\n")
            moved: dict[str, list[str]] = {}
            special = {name + suffix: suffix for suffix in _OPENMETRICS_SUFFIXES}
            for sample in metric.samples:
                key = (sample.name, tuple(sample.labels.items()))
                prefix = prefixes.get(key) or kept.get(key) or _series_text(sample.name, sample.labels)
                prefixes[key] = prefix
                line = prefix + floatToGoString(sample.value)
                if sample.timestamp is not None:
                    line += f" {int(float(sample.timestamp) * 1000):d}"
                suffix = special.get(sample.name)
                size += len(line) + 1
                if suffix is None:
                    output.append(line + "\n")
                else:
                    moved.setdefault(suffix, []).append(line + "\n")
                if size > limit:
                    raise renders.RenderTooLarge("kvwatch's /metrics", limit)
            for suffix, lines in sorted(moved.items()):
                output.append(f"# HELP {name}{suffix} {help_text}\n# TYPE {name}{suffix} gauge\n")
                output.extend(lines)
        return "".join(output).encode("utf-8")


def _series_text(name: str, labels: dict[str, str]) -> str:
    """`name{label="value",...} ` with labels sorted and values escaped as the
    text format wants (kvwatch's metric and label names are all plain)."""
    if not labels:
        return name + " "
    pairs = ",".join(f'{key}="{_escape(value)}"' for key, value in sorted(labels.items()))
    return f"{name}{{{pairs}}} "


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')
