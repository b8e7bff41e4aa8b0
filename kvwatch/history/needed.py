"""The history `kvwatch capacity --prometheus` inverts an objective over
(kvwatch/capacity/needed.py): per model and step, the requests running and
waiting, the replicas, the KV usage summed over them and the first-token
p95; and the cache's shape from vLLM's cache_config_info. vLLM's own
series, read through the bounded client of `diagnose --prometheus`."""

from __future__ import annotations

from kvwatch.capacity.needed import CacheShape, Step
from kvwatch.history.matrix import pairs_of
from kvwatch.history.query import PrometheusClient, merge_selector

_RUNNING = "vllm:num_requests_running"


def _queries(selector: str, window: str) -> dict[str, str]:
    def sel(name: str) -> str:
        return name + merge_selector(selector, "")

    usage = f"({sel('vllm:kv_cache_usage_perc')} or {sel('vllm:gpu_cache_usage_perc')})"
    return {
        "running": f"sum by (model_name) ({sel(_RUNNING)})",
        "waiting": f"sum by (model_name) ({sel('vllm:num_requests_waiting')})",
        "replicas": f"count by (model_name) ({sel(_RUNNING)})",
        "usage_sum": f"sum by (model_name) (clamp({usage}, 0, 1))",
        "ttft_p95": ("histogram_quantile(0.95, sum by (model_name, le) "
                     f"(rate({sel('vllm:time_to_first_token_seconds_bucket')}[{window}])))"),
    }


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


def read_steps(client: PrometheusClient, start: float, end: float, step: float, selector: str,
               window: str) -> dict[str, list[Step]]:
    """model -> its steps, in time order (a step without running requests' series is left out)."""
    found: dict[str, dict[float, dict[str, float | None]]] = {}
    for key, query in _queries(selector, window).items():
        for series in client.query_range(query, start, end, step):
            model = (series.get("metric") or {}).get("model_name", "")
            for at, value in pairs_of(series.get("values") or []):
                found.setdefault(model, {}).setdefault(float(at), {})[key] = _number(value)
    out = {}
    for model, by_time in found.items():
        steps = [Step(at, values["running"] or 0.0, values.get("waiting") or 0.0, values.get("replicas") or 0.0,
                      values.get("usage_sum"), values.get("ttft_p95"))
                 for at, values in sorted(by_time.items()) if values.get("running") is not None]
        if steps:
            out[model] = steps
    return out


def read_shape(client: PrometheusClient, start: float, end: float, selector: str) -> CacheShape | None:
    """The cache of the first replica whose cache_config_info states its blocks."""
    for labels in client.series(merge_selector(selector, '__name__="vllm:cache_config_info"'), start, end):
        blocks, size = _number(labels.get("num_gpu_blocks", "")), _number(labels.get("block_size", ""))
        if not blocks or not size or blocks < 2:
            continue
        memory = _number(labels.get("kv_cache_memory_bytes", ""))
        where = ", ".join(f"{k}={labels[k]}" for k in ("instance", "engine") if k in labels)
        return CacheShape(int(blocks) - 1, int(size), memory / blocks if memory else None,
                          f"vllm:cache_config_info{{{where}}}")
    return None
