"""A router's metrics page read into one cumulative RouterReading, whichever
router wrote it. Each dialect's names come from its source (provenance in
tests/fixtures/README.md, `routers/`):

- llm-d's endpoint picker (EPP, llm-d-router): the shared prefix producer's
  histograms, one observation of each per request (pkg/epp/.../prefixmetrics):
  `prefix_predicted_cached_tokens` (what the chosen endpoint was predicted to
  hold), `prefix_best_available_cached_tokens` (the best candidate before
  filtering), `prefix_prompt_tokens` (the prompt measured against); their
  `_sum`s divide one another. Canonical prefix `llm_d_epp_`; builds before the
  rename spelled the same subsystem `llm_d_router_epp_`. Older EPPs (Gateway
  API Inference Extension names, deprecated and no longer emitted) had only
  `inference_extension_prefix_indexer_hit_ratio`, a per-lookup ratio: read as
  a mean of per-request ratios, not tokens. (The KV-cache index series,
  dual-emitted under `kvcache_index_*`, are not read.) Staleness:
  `llm_d_epp_flow_control_stale_endpoints`, the candidate endpoints whose
  metrics are missing or older than the staleness threshold (flow control).
- NVIDIA Dynamo's KV router: `dynamo_component_router_kv_hit_rate`, a
  histogram of per-request predicted hit ratios (a mean of ratios, not
  token-weighted), and `dynamo_component_kv_cache_events_applied`
  (`event_type`, `status`), the KV events its index applied.
- SGLang's router (sgl-model-gateway, SMG): `smg_router_cache_hits_total` and
  `smg_router_cache_misses_total`, requests routed by a cache match or not: a
  share of requests, not of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvwatch.exposition import Family, FamilySelector, Page
from kvwatch.routing.tenants import tenant_sums

# Bases of every family any dialect reads, and the prefixes they come under.
LLM_D_PREFIXES = ("llm_d_epp_", "llm_d_router_epp_")
LLM_D = ("prefix_predicted_cached_tokens", "prefix_best_predicted_cached_tokens",
         "prefix_best_available_cached_tokens", "prefix_prompt_tokens", "flow_control_stale_endpoints",
         "request_total", "request_input_tokens", "request_cached_tokens")
LEGACY = ("inference_extension_prefix_indexer_hit_ratio",)
DYNAMO = ("dynamo_component_router_kv_hit_rate", "dynamo_component_kv_cache_events_applied")
SGLANG = ("smg_router_cache_hits_total", "smg_router_cache_misses_total")
DIALECTS = ("llm-d", "llm-d-legacy", "dynamo", "sglang")
# What a dialect's prediction is a share of: tokens (sums divide one another),
# a mean of per-request ratios, or requests.
BASIS = {"llm-d": "tokens", "llm-d-legacy": "mean_ratio", "dynamo": "mean_ratio", "sglang": "requests"}

_SELECTOR_NAMES = LLM_D + tuple(n.removesuffix("_total") for n in LLM_D if n.endswith("_total"))


@dataclass
class RouterReading:
    """What one router page says, cumulative since the router started.

    Token sums are the histograms' `_sum`s; `requests` their `_count`. A value
    the page does not carry is None (unknown is not zero)."""

    dialect: str | None = None
    spelling: str = ""  # the prefix or name the prediction was read under
    role: str | None = None  # llm-d's endpoint_role: prefill under P/D disaggregation
    requests: float | None = None
    predicted_tokens: float | None = None
    available_tokens: float | None = None
    prompt_tokens: float | None = None
    # A sum of per-request ratios (Dynamo, the legacy EPP) and how many.
    ratio_sum: float | None = None
    # SGLang's router: requests routed by a cache match, and not.
    cache_hits: float | None = None
    cache_misses: float | None = None
    stale_endpoints: float | None = None
    events_applied: float | None = None
    models: list[str] = field(default_factory=list)
    # llm-d's request metrics per fairness_id (a tenant): [input tokens, cached tokens] sums, as the model
    # server answered (llm_d_epp_request_input_tokens, llm_d_epp_request_cached_tokens).
    tenants: dict[str, list[float]] = field(default_factory=dict)

    @property
    def basis(self) -> str | None:
        return BASIS.get(self.dialect) if self.dialect else None


def _selector() -> FamilySelector:
    return FamilySelector(_SELECTOR_NAMES + LEGACY + DYNAMO + tuple(n.removesuffix("_total") for n in SGLANG),
                          LLM_D_PREFIXES + ("",))


_SELECTOR: FamilySelector | None = None


def _histogram(family: Family | None) -> tuple[float, float, str | None] | None:
    """(_sum, _count, endpoint_role) over a histogram's series, or None without samples."""
    if family is None:
        return None
    total = count = 0.0
    roles: set[str] = set()
    seen = False
    for suffix, labels, value in family.samples:
        if not 0.0 <= value < float("inf"):
            continue
        if suffix == "_sum":
            total += value
            seen = True
            if labels.get("endpoint_role"):
                roles.add(labels["endpoint_role"])
        elif suffix == "_count":
            count += value
    if not seen:
        return None
    return total, count, (sorted(roles)[0] if len(roles) == 1 else ("mixed" if roles else None))


def _plain(family: Family | None, suffixes: tuple[str, ...] = ("", "_total")) -> float | None:
    if family is None:
        return None
    values = [v for s, _labels, v in family.samples if s in suffixes and 0.0 <= v < float("inf")]
    return sum(values) if values else None


def _family(page: Page, base: str) -> Family | None:
    return page.families.get(base) or page.families.get(base.removesuffix("_total"))


def _read_llm_d(page: Page, reading: RouterReading) -> bool:
    predicted = _histogram(_family(page, "prefix_predicted_cached_tokens"))
    if predicted is None:
        return False
    reading.dialect = "llm-d"
    family = _family(page, "prefix_predicted_cached_tokens")
    reading.spelling = (family.spelling or "llm_d_epp_") if family is not None else ""
    reading.predicted_tokens, reading.requests, reading.role = predicted
    available = _histogram(_family(page, "prefix_best_available_cached_tokens"))
    reading.available_tokens = available[0] if available else None
    prompt = _histogram(_family(page, "prefix_prompt_tokens"))
    reading.prompt_tokens = prompt[0] if prompt else None
    return True


def _read_legacy(page: Page, reading: RouterReading) -> bool:
    ratio = _histogram(page.families.get("inference_extension_prefix_indexer_hit_ratio"))
    if ratio is None:
        return False
    reading.dialect = "llm-d-legacy"
    reading.spelling = "inference_extension_prefix_indexer_hit_ratio"
    reading.ratio_sum, reading.requests, _role = ratio
    return True


def _read_dynamo(page: Page, reading: RouterReading) -> bool:
    ratio = _histogram(page.families.get("dynamo_component_router_kv_hit_rate"))
    applied = page.families.get("dynamo_component_kv_cache_events_applied")
    if ratio is None and applied is None:
        return False
    reading.dialect = "dynamo"
    reading.spelling = "dynamo_component_"
    if ratio is not None:
        reading.ratio_sum, reading.requests, _role = ratio
    if applied is not None:
        ok = [v for s, labels, v in applied.samples
              if s in ("", "_total") and labels.get("status", "ok") == "ok" and 0.0 <= v < float("inf")]
        reading.events_applied = sum(ok) if ok else None
    return True


def _read_sglang(page: Page, reading: RouterReading) -> bool:
    hits = _plain(page.families.get("smg_router_cache_hits"))
    misses = _plain(page.families.get("smg_router_cache_misses"))
    if hits is None and misses is None:
        return False
    reading.dialect = "sglang"
    reading.spelling = "smg_router_"
    reading.cache_hits, reading.cache_misses = hits, misses
    reading.requests = (hits or 0.0) + (misses or 0.0)
    return True


# The most fairness_id values kept from one page (llm-d caps its own at 1,000 by default).
MAX_TENANTS = 10_000


def _read_tenants(page: Page, reading: RouterReading) -> None:
    reading.tenants = tenant_sums(page.families, "fairness_id", "request_input_tokens", "request_cached_tokens",
                                  MAX_TENANTS)


def read_router_page(text: str) -> RouterReading:
    """The page's reading; a page of no known router gives dialect None."""
    global _SELECTOR
    if _SELECTOR is None:
        _SELECTOR = _selector()
    page = _SELECTOR.parse(text)
    reading = RouterReading()
    for read in (_read_llm_d, _read_legacy, _read_dynamo, _read_sglang):
        if read(page, reading):
            break
    _read_tenants(page, reading)
    reading.stale_endpoints = _plain(page.families.get("flow_control_stale_endpoints"), ("",))
    requests = _family(page, "request_total")
    if requests is not None:
        reading.models = sorted({labels.get("model_name", "") for s, labels, _v in requests.samples
                                 if s in ("", "_total") and labels.get("model_name")})[:100]
    return reading
