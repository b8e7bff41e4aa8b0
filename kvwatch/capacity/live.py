"""What a live engine reports about its KV pool, read through the sidecar's own
fetcher and adapters (the engine recognized from its page; for vLLM every
spelling, the Ray prefix, `pid` folding): one reader of an engine's page in
the whole project."""

from __future__ import annotations

from typing import Any

from kvwatch.capacity.arithmetic import CapacityInputError
from kvwatch.engines import ENGINES, make_adapter, recognize
from kvwatch.engines.coverage import dark_signals
from kvwatch.present import normalize_target
from kvwatch.scrape import Fetcher
from kvwatch.snapshot import Snapshot, config_number, hybrid_cache

FETCH_TIMEOUT_S = 10.0
FETCH_MAX_BYTES = 32 * 2**20


def metrics_url(target: str) -> str:
    """The target's /metrics URL (a bare host:port gets http:// and /metrics)."""
    try:
        return normalize_target(target if "://" in target else f"http://{target}")
    except ValueError as error:
        raise CapacityInputError(f"--target {error}") from None


def fetch_page(url: str) -> str:
    result = Fetcher(url, FETCH_TIMEOUT_S, FETCH_MAX_BYTES).fetch()
    if not result.ok:
        # The sentence kvwatch diagnose says, not the exception's text.
        raise CapacityInputError(f"cannot fetch {url}: {result.sentence}")
    return result.text or ""


def adapt_page(text: str, engine: str | None = None) -> tuple[str, Snapshot]:
    """The engine's name (given, else recognized; vLLM when nothing is) and the page's Snapshot."""
    name = engine or recognize(text) or "vllm"
    return name, make_adapter(name).adapt(text, at=0.0)


def _whole(cache_config: dict[str, str], key: str) -> int | None:
    number = config_number(cache_config, key)
    return int(number) if number is not None else None


def live_capacity(snapshot: Snapshot, engine_name: str = "vllm") -> dict[str, Any]:
    """The KV pool each engine reports in `cache_config_info`, and the running
    requests and KV usage at this poll, sorted by engine; an empty list when
    the page has no cache_config_info."""
    result = []
    usage_source = snapshot.sources.get("kv_usage")
    for engine in sorted(snapshot.cache_config, key=lambda e: (len(e), e)):
        labels = snapshot.cache_config[engine]
        info: dict[str, Any] = {
            "engine": engine,
            "block_size": _whole(labels, "block_size"),
            "num_gpu_blocks": _whole(labels, "num_gpu_blocks"),
            "kv_cache_size_tokens": _whole(labels, "kv_cache_size_tokens"),
            "kv_cache_memory_bytes": _whole(labels, "kv_cache_memory_bytes"),
            "cache_dtype": labels.get("cache_dtype"),
            "kv_cache_max_concurrency": config_number(labels, "kv_cache_max_concurrency"),
            "sliding_window": _whole(labels, "sliding_window"),
            # A hybrid (attention + Mamba) model's state cache: its blocks share
            # the pool with the attention blocks, block_size is the minimum over
            # the KV groups, and prefix hits come in mamba_block_size steps.
            "hybrid": hybrid_cache(labels),
        }
        capacity = snapshot.capacity_tokens(engine)
        info["capacity_tokens"] = int(capacity) if capacity is not None else None
        info["capacity_source"] = (None if capacity is None else "kv_cache_size_tokens"
                                   if info["kv_cache_size_tokens"] else "num_gpu_blocks x block_size")
        served = [e for (_, name), e in sorted(snapshot.engines.items()) if name == engine]
        first = served[0] if served else None
        usage = first.gauges.get("kv_usage") if first else None
        info["num_requests_running"] = first.gauges.get("running") if first else None
        info["num_requests_waiting"] = first.gauges.get("waiting") if first else None
        info["kv_cache_usage"] = usage
        # vLLM's sources are bare family names; the other adapters' are spelled whole.
        spelled = f"vllm:{usage_source}" if engine_name == "vllm" else usage_source
        info["usage_metric"] = spelled if usage is not None and usage_source else None
        info["model_name"] = first.model if first else None
        result.append(info)
    return {"engines": result, "engine": engine_name, "dark_signals": list(dark_signals(ENGINES[engine_name]))}


def read_live_capacity(metrics_text: str, engine: str | None = None) -> dict[str, Any]:
    """live_capacity of a page's text (the command reads a URL; tests a capture)."""
    name, snapshot = adapt_page(metrics_text, engine)
    return live_capacity(snapshot, name)
