"""Synthetic vLLM /metrics pages for the reliability and fuzz tests: the
families kvwatch reads, in the spellings of a current vLLM (`new`) or of the
V1 engine before 0.9 (`old`: gpu_* names, prefix cache in blocks), with every
value chosen by the test."""

from __future__ import annotations

from dataclasses import dataclass, field

TTFT_BOUNDS = (0.1, 0.5, 1.0, 5.0)


@dataclass
class Engine:
    model: str = "m"
    engine: str | None = "0"
    prompt_tokens: float = 0
    generation_tokens: float = 0
    prefix_queries: float = 0
    prefix_hits: float = 0
    preemptions: float = 0
    usage: float = 0.0
    running: float = 0
    waiting: float = 0
    finished_stop: float = 0
    # cumulative counts per TTFT_BOUNDS bound, +Inf last; sum of observations
    ttft_cumulative: tuple[float, ...] = (0, 0, 0, 0, 0)
    ttft_sum: float = 0.0
    ttft_bounds: tuple[float, ...] = TTFT_BOUNDS
    created: float | None = None
    extra_labels: dict[str, str] = field(default_factory=dict)


def escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(engine: Engine, **more: str) -> str:
    pairs = {"model_name": engine.model}
    if engine.engine is not None:
        pairs["engine"] = engine.engine
    pairs.update(engine.extra_labels)
    pairs.update(more)
    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in pairs.items()) + "}"


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))


def page(*engines: Engine, names: str = "new", num_gpu_blocks: int = 128, block_size: int = 32,
         process_start: float | None = None) -> str:
    """A page with one block of each family for all engines, as vLLM writes it."""
    prefix_family = "prefix_cache" if names == "new" else "gpu_prefix_cache"
    usage_family = "kv_cache_usage_perc" if names == "new" else "gpu_cache_usage_perc"
    out: list[str] = []
    if process_start is not None:
        out += ["# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
                "# TYPE process_start_time_seconds gauge", f"process_start_time_seconds {process_start!r}"]

    def family(name: str, kind: str, rows) -> None:
        out.append(f"# HELP vllm:{name} synthetic")
        out.append(f"# TYPE vllm:{name} {kind}")
        out.extend(rows)

    family(usage_family, "gauge", (f"vllm:{usage_family}{_labels(e)} {e.usage!r}" for e in engines))
    family("num_requests_running", "gauge", (f"vllm:num_requests_running{_labels(e)} {e.running!r}" for e in engines))
    family("num_requests_waiting", "gauge", (f"vllm:num_requests_waiting{_labels(e)} {e.waiting!r}" for e in engines))
    for name, attribute in (
        ("prompt_tokens", "prompt_tokens"),
        ("generation_tokens", "generation_tokens"),
        (f"{prefix_family}_queries", "prefix_queries"),
        (f"{prefix_family}_hits", "prefix_hits"),
        ("num_preemptions", "preemptions"),
    ):
        rows = []
        for e in engines:
            rows.append(f"vllm:{name}_total{_labels(e)} {float(getattr(e, attribute))!r}")
        family(name, "counter", rows)
        created_rows = [f"vllm:{name}_created{_labels(e)} {e.created!r}" for e in engines if e.created is not None]
        if created_rows:
            family(f"{name}_created", "gauge", created_rows)
    family("request_success", "counter",
           (f"vllm:request_success_total{_labels(e, finished_reason='stop')} {float(e.finished_stop)!r}" for e in engines))
    rows = []
    for e in engines:
        for bound, count in zip(tuple(e.ttft_bounds) + (float("inf"),), e.ttft_cumulative):
            rows.append(f"vllm:time_to_first_token_seconds_bucket{_labels(e, le=_bound(bound))} {float(count)!r}")
        rows.append(f"vllm:time_to_first_token_seconds_count{_labels(e)} {float(e.ttft_cumulative[-1])!r}")
        rows.append(f"vllm:time_to_first_token_seconds_sum{_labels(e)} {float(e.ttft_sum)!r}")
    family("time_to_first_token_seconds", "histogram", rows)
    engine_ids = sorted({e.engine or "0" for e in engines})
    family("cache_config_info", "gauge", (
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",enable_prefix_caching="True",'
        f'engine="{engine_id}",num_gpu_blocks="{num_gpu_blocks}"}} 1.0' for engine_id in engine_ids))
    return "\n".join(out) + "\n"
