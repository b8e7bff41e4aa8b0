"""LMCache, a KV tier inside the engine, read as a second source beside it:
its own page (`lmcache_target`: the engine's /metrics where LMCache shares
vLLM's multiprocess registry, or LMCache's own API server), its own small
window, and its own signals (`TIER_SIGNALS` in the catalogue).

Its counters describe the same requests as the engine's external-cache
counters (vLLM's `external_prefix_cache_*` count connector hits), so they are
never added to the engine's: they stay under `kvwatch_lmcache_*`.

What LMCache's source says (lmcache/observability.py, PrometheusLogger):
- every family carries `model_name` and `worker_id` (the worker's global rank
  in the engine's TP x PP world); builds since the label views add `role`
  (`worker`, `scheduler`) and `served_model_name`;
- each worker process retrieves and stores its own shard of the same tokens
  and counts them (vllm_v1_adapter: every rank calls `retrieve`/`store` with
  the request's tokens), so the ranks repeat one count: the first rank's
  series (lowest `worker_id`, role `worker` or no role) is read, never the sum;
- `num_requested_tokens` counts the tokens the engine asked LMCache to load
  (what its lookup promised, minus what vLLM had), `num_hit_tokens` those it
  delivered: their ratio is the tier's delivery ratio over the window;
- the `retrieve_hit_rate` and `lookup_hit_rate` gauges are "since last log"
  and read 1 (retrieve) or 0 (lookup) when nothing was retrieved: never read.

The multiprocess server of LMCache 0.5 (`lmcache server`, vLLM's
LMCacheMPConnector; lmcache/v1/mp_observability) counts through OpenTelemetry
under `lmcache_mp.`: pushed as OTLP to a collector where `--otlp-endpoint` is
set, else served as a Prometheus page (the HTTP frontend's /metrics). kvwatch
reads the Prometheus page, the server's own or the collector's, never OTLP:
- `lmcache_mp_lookup_requested_tokens_total` and `..._lookup_hit_tokens_total`
  come from one event per completed lookup (the chunk-aligned tokens asked
  for, the contiguous prefix found in L1 or L2); `..._lookup_hit_l1_tokens_total`
  and `..._lookup_hit_l2_tokens_total` split the hit by tier (l1 + l2 = hit);
- one process, no worker ranks; labels `model_name` and `cache_salt` (a
  tenant): the `cache_salt` series are disjoint and summed per model.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from kvwatch.exposition import FamilySelector
from kvwatch.labels import bounded_label
from kvwatch.pipeline.reports import LMCacheModel, LMCacheReport
from kvwatch.scrape import SECOND_SOURCE_MAX_BYTES, Fetcher
from kvwatch.present import origin, public_url
from kvwatch.routing.tenants import tenant_sums, window_rows
from kvwatch.signals import TIER_SERIES, TIER_SIGNALS, View, evaluate_tier
from kvwatch.snapshot import EngineSnapshot, Snapshot
from kvwatch.window import Window

PREFIXES = ("lmcache:", "lmcache_")
# canonical key -> LMCache family (its name without `lmcache:` and `_total`), from the catalogue
COUNTERS = {series.key: series.family for series in TIER_SERIES}
# The engine slot of the tier's rows in its window and report.
TIER = "lmcache"
_INF = float("inf")
# The most models the tier keeps a poll (max_series when smaller): LMCache
# runs inside one engine, which serves a model or a few; a page of a new
# served name per line kept 1,000 of them in the tier's window every poll
# (benchmarks/worst_page_probe.py).
MAX_MODELS = 100


# The multiprocess server's families (OpenTelemetry's names, `lmcache_mp_...`).
MP = "mp_"


def family_name(key: str) -> str:
    base = COUNTERS[key]
    return ("lmcache_" if base.startswith(MP) else "lmcache:") + base


def _rank(labels: dict[str, str]) -> tuple:
    """Which series of a model is read: a worker's (or one without a role)
    before any other role's, then the lowest worker_id."""
    role = labels.get("role", "")
    worker = labels.get("worker_id", "")
    # ASCII digits only, and few of them: `"²".isdigit()` is true and int()
    # refuses it (a traceback every poll), and int() refuses over 4,300 digits.
    rank = int(worker) if worker.isascii() and worker.isdigit() and len(worker) <= 18 else 1 << 62
    return (0 if role in ("", "worker") else 1, rank, worker, role)


def read_page(page, max_models: int = 1000) -> tuple[dict[str, EngineSnapshot], dict[str, str]]:
    """The counters of each model's first worker (at most `max_models`
    models, the first in name order), and key -> family for the families the
    page carried with samples."""
    chosen: dict[str, tuple] = {}
    for base in COUNTERS.values():
        family = page.families.get(base)
        if family is None:
            continue
        for suffix, labels, _value in family.samples:
            if suffix not in ("", "_total"):
                continue
            model = bounded_label(labels.get("served_model_name") or labels.get("model_name", ""))
            rank = _rank(labels)
            if model not in chosen or rank < chosen[model]:
                chosen[model] = rank
    if len(chosen) > max_models:
        chosen = {model: chosen[model] for model in sorted(chosen)[:max_models]}
    engines: dict[str, EngineSnapshot] = {}
    sources: dict[str, str] = {}
    for key, base in COUNTERS.items():
        family = page.families.get(base)
        if family is None:
            continue
        for suffix, labels, value in family.samples:
            if suffix not in ("", "_total") or not 0.0 <= value < _INF:  # a counter: finite, never below 0
                continue
            model = bounded_label(labels.get("served_model_name") or labels.get("model_name", ""))
            if model not in chosen:
                continue
            counters = engines.setdefault(model, EngineSnapshot(model, TIER)).counters
            if base.startswith(MP):
                # One server: every series of the model (a cache_salt each) counts its own tokens.
                counters[key] = counters.get(key, 0.0) + value
            elif _rank(labels) == chosen[model]:
                counters[key] = value
            else:
                continue
            sources[key] = family_name(key)
    return engines, sources


class LMCacheSource:
    def __init__(self, settings, window_seconds: float, clock=time.time):
        self.target = settings.lmcache_target
        # Half the poll interval at most, like the upstream source: the
        # engine's fetch comes first in the same poll.
        timeout = min(settings.fetch_timeout, max(0.2, 0.5 * settings.poll_interval))
        # The engine's bearer token goes along only when LMCache is read from
        # the engine's own page (the same origin); never to another service.
        same_origin = origin(settings.lmcache_target) == origin(settings.target or "")
        # LMCache's own server's page is small (SECOND_SOURCE_MAX_BYTES); on
        # the engine's origin it is the engine's page, under the engine's cap.
        cap = settings.max_body_bytes if same_origin else min(settings.max_body_bytes, SECOND_SOURCE_MAX_BYTES)
        self.fetcher = Fetcher(self.target, timeout, cap,
                               settings.bearer_token_file if same_origin else None,
                               settings.ca_bundle, settings.tls_verify)
        self.selector = FamilySelector(list(COUNTERS.values()), PREFIXES)
        self.window = Window(window_seconds)
        self.clock = clock
        self.max_models = min(settings.max_series, MAX_MODELS)
        self._families = {key: family_name(key) for key in COUNTERS}
        # The multiprocess server's lookups per cache_salt (a tenant), one sum per poll over the window.
        self.top_k: int = settings.tenant_top_k
        self._salts: deque[tuple[float, dict[str, list[float]]]] = deque(maxlen=3600)

    def poll(self, page_text: str | None = None, at: float | None = None) -> LMCacheReport:
        """One poll; `page_text` (and its time `at`) is the engine's page when
        LMCache is read from it: fetched once, read twice."""
        if page_text is not None:
            return self.ingest(page_text, self.clock() if at is None else at)
        now = self.clock()
        result = self.fetcher.fetch()
        if not result.ok:
            return self._report(now, False, result.reason, result.detail, None)
        return self.ingest(result.page, now)

    def ingest(self, text: str, now: float) -> LMCacheReport:
        page = self.selector.parse(text)
        engines, sources = read_page(page, self.max_models)
        if not engines:
            return self._report(now, False, "no_lmcache_metrics",
                                "no lmcache:num_hit_tokens / num_requested_tokens (nor the multiprocess server's "
                                "lmcache_mp_lookup_*_tokens) on the page", sources)
        previous = self.window.latest
        if previous is not None and now <= previous.time:
            now = previous.time + 1e-3
        snapshot = Snapshot(now, {(model, TIER): engine for model, engine in engines.items()}, sources=sources,
                            families=self._families)
        self.window.add(snapshot)
        report = self._report(now, True, None, "", sources)
        report["tenants"] = self._tenants(page, now)
        return report

    def _tenants(self, page, now: float) -> dict[str, Any]:
        """kind -> the window's top K cache_salt tenants and "other" (lookup hit over requested tokens)."""
        sums = tenant_sums(page.families, "cache_salt", COUNTERS["lookup_requested_tokens"],
                           COUNTERS["lookup_hit_tokens"])
        if not sums:
            return {}
        self._salts.append((now, sums))
        while self._salts[0][0] < now - self.window.seconds:
            self._salts.popleft()
        rows = window_rows("cache_salt", self._salts[0][1], sums, self.top_k)
        return {"cache_salt": [row.as_dict() for row in rows]}

    def _report(self, now: float, up: bool, reason: str | None, detail: str,
                sources: dict[str, str] | None) -> LMCacheReport:
        models: list[LMCacheModel] = []
        latest = self.window.latest
        if up and latest is not None:
            for (model, tier), engine in sorted(latest.engines.items()):
                increase = self.window.increase((model, tier))
                view = View(engine, increase, None, None, None, None)
                models.append(LMCacheModel(
                    model_name=model,
                    signals=evaluate_tier(view),
                    latest=dict(engine.counters),
                    increase=dict(increase.counters),
                    window_seconds=increase.seconds,
                    restarts=increase.restarts,
                ))
        return LMCacheReport(
            target=public_url(self.target),
            up=up,
            reason=reason,
            detail=detail,
            families=None if sources is None else {
                family: key in sources for key, family in sorted(self._families.items())},
            models=models,
            time=now,
        )


__all__ = ["COUNTERS", "LMCacheSource", "PREFIXES", "TIER", "TIER_SIGNALS", "family_name", "read_page"]
