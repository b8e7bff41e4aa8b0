"""Prometheus text (format 0.0.4) for the simulator, written by hand so that it
matches a real vLLM 0.32 `/metrics` page line for line: the same families in the
same order, the same HELP/TYPE lines, labels sorted by name, `_created` gauge
families, `le` values in Go float style, histogram series as buckets, `_count`,
`_sum`. Also the `http_*` families of vLLM's HTTP instrumentation, the Python
process collectors, and the RAG application's own page."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, generate_latest
from prometheus_client.utils import floatToGoString

from kvwatch.sim.engine import Engine
from kvwatch.sim.stats import FINISH_REASONS, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_MFU_HELP = "(for Model Flops Utilization calculations)."
WAITING_REASON_HELP = (
    "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for scheduling capacity; "
    "'deferred' = deferred by transient constraints (LoRA budget, KV transfer, blocked status). "
    "Sum of all reasons equals vllm:num_requests_waiting."
)
SLEEP_HELP = (
    "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
    "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2."
)
CACHED_BY_SOURCE_HELP = (
    "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host (offloaded to DRAM), "
    "disk, p2p (transferred from another vLLM instance) or external_unspecified. Counted at admission; sums to "
    "vllm:prefix_cache_hits + vllm:external_prefix_cache_hits."
)

# (family, help, attribute of EngineStats) in the order vLLM 0.32 registers them.
HISTOGRAMS = (
    ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", "request_prompt_tokens"),
    ("vllm:request_generation_tokens", "Number of generation tokens processed.", "request_generation_tokens"),
    ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", "iteration_tokens"),
    (
        "vllm:request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        "request_max_num_generation_tokens",
    ),
    ("vllm:request_params_n", "Histogram of the n request parameter.", "request_params_n"),
    ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", "request_params_max_tokens"),
    ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "time_to_first_token"),
    ("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "inter_token_latency"),
    (
        "vllm:request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
        "request_time_per_output_token",
    ),
    ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", "e2e_request_latency"),
    ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", "request_queue_time"),
    (
        "vllm:request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        "request_inference_time",
    ),
    (
        "vllm:request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        "request_prefill_time",
    ),
    ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", "request_decode_time"),
    (
        "vllm:request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
        "request_num_preemptions",
    ),
    (
        "vllm:request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
        "request_prefill_kv_computed_tokens",
    ),
)

HTTP_REQUESTS_HELP = "Total number of requests by method, status and handler."
HTTP_REQUEST_SIZE_HELP = (
    "Content length of incoming requests by handler. Only value of header is respected. Otherwise ignored. "
    "No percentile calculated. "
)
HTTP_RESPONSE_SIZE_HELP = (
    "Content length of outgoing responses by handler. Only value of header is respected. Otherwise ignored. "
    "No percentile calculated. "
)
HTTP_HIGHR_HELP = "Latency with many buckets but no API specific labels. Made for more accurate percentile calculations. "
HTTP_DURATION_HELP = (
    "Latency with only few buckets by handler. Made to be only used if aggregation by handler is important. "
)
HTTP_HIGHR_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 7.5, 10.0, 30.0, 60.0,
)
HTTP_DURATION_BUCKETS = (0.1, 0.5, 1.0)

APP_RETRIEVAL_HELP = "Time spent retrieving context before calling the model, in seconds."

_fmt = floatToGoString


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(pairs: dict[str, str]) -> str:
    if not pairs:
        return ""
    return "{" + ",".join(f'{key}="{escape_label_value(pairs[key])}"' for key in sorted(pairs)) + "}"


def _head(out: list[str], name: str, help_text: str, kind: str) -> None:
    out.append(f"# HELP {name} {help_text}")
    out.append(f"# TYPE {name} {kind}")


# (family, labels, bounds) -> the series names with labels of its buckets, _count
# and _sum; a page repeats the same few hundred of them on every scrape.
_histogram_keys: dict[tuple, tuple[list[str], str, str]] = {}


def _histogram_lines(out: list[str], name: str, base: dict[str, str], histogram: Histogram) -> None:
    key = (name, tuple(base.items()), histogram.bounds)
    keys = _histogram_keys.get(key)
    if keys is None:
        buckets = [f"{name}_bucket{_labels({**base, 'le': _fmt(bound)})} " for bound in histogram.bounds]
        buckets.append(f"{name}_bucket{_labels({**base, 'le': '+Inf'})} ")
        keys = (buckets, f"{name}_count{_labels(base)} ", f"{name}_sum{_labels(base)} ")
        if len(_histogram_keys) < 10000:
            _histogram_keys[key] = keys
    buckets, count_key, sum_key = keys
    running = 0
    for prefix, count in zip(buckets, histogram.counts):
        running += count
        out.append(prefix + _fmt(running))
    out.append(count_key + _fmt(histogram.count))
    out.append(sum_key + _fmt(histogram.sum))


def _counter(out, base_name, help_text, series, created):
    """series: [(labels, value)]; prints `<base>_total` and `<base>_created`."""
    _head(out, f"{base_name}_total", help_text, "counter")
    for labels, value in series:
        out.append(f"{base_name}_total{_labels(labels)} {_fmt(value)}")
    _head(out, f"{base_name}_created", help_text, "gauge")
    created_text = _fmt(created)
    for labels, _ in series:
        out.append(f"{base_name}_created{_labels(labels)} {created_text}")


def _gauge(out, name, help_text, series):
    _head(out, name, help_text, "gauge")
    for labels, value in series:
        out.append(f"{name}{_labels(labels)} {_fmt(value)}")


def cache_config_labels(engine: Engine) -> dict[str, str]:
    """The label set of vLLM 0.32's `cache_config_info`, values from the sim config."""
    config = engine.config
    size_tokens = config.kv_cache_size_tokens
    return {
        "_block_size_resolved": "True",
        "block_size": str(config.block_size),
        "cache_dtype": str(config.cache_dtype),
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(config.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(bool(config.enable_prefix_caching)),
        "engine": str(engine.index),
        "gpu_memory_utilization": str(config.gpu_memory_utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(size_tokens / config.max_model_len),
        "kv_cache_memory_bytes": str(size_tokens * config.kv_bytes_per_token),
        "kv_cache_size_tokens": str(size_tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(config.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "sha256",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "True",
    }


def render_vllm(engines: Sequence[Engine], model_name: str, created: float) -> list[str]:
    """The `vllm:` families for these engines, one series per engine."""
    out: list[str] = []
    bases = [{"engine": str(engine.index), "model_name": model_name} for engine in engines]
    stats = [engine.stats for engine in engines]
    pairs = list(zip(bases, engines, stats))
    _vllm_gauges(out, bases, pairs, created)
    _vllm_cache_counters(out, bases, pairs, created)
    _vllm_token_counters(out, pairs, stats, model_name, created)
    created_text = _fmt(created)
    for name, help_text, attribute in HISTOGRAMS:
        _head(out, name, help_text, "histogram")
        for base, _, s in pairs:
            _histogram_lines(out, name, base, getattr(s, attribute))
        _head(out, f"{name}_created", help_text, "gauge")
        for base in bases:
            out.append(f"{name}_created{_labels(base)} {created_text}")
    _head(out, "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", "gauge")
    for engine in engines:
        out.append(f"vllm:cache_config_info{_labels(cache_config_labels(engine))} 1.0")
    return out


def _vllm_gauges(out: list[str], bases: list[dict], pairs: list[tuple], created: float) -> None:
    """The MFU estimates (always zero here), then the scheduler's and the cache's gauges."""
    for what in ("flops", "read_bytes", "write_bytes"):
        noun = {"flops": "number of floating point operations", "read_bytes": "number of bytes read from memory",
                "write_bytes": "number of bytes written to memory"}[what]
        _counter(out, f"vllm:estimated_{what}_per_gpu", f"Estimated {noun} per GPU {_MFU_HELP}",
                 [(base, 0.0) for base in bases], created)
    _gauge(out, "vllm:num_requests_running", "Number of requests in model execution batches.",
           [(base, engine.num_running) for base, engine, _ in pairs])
    _gauge(out, "vllm:num_requests_waiting", "Number of requests waiting to be processed.",
           [(base, engine.num_waiting) for base, engine, _ in pairs])
    # Every waiting request in the model waits for capacity (KV blocks, a
    # sequence slot or token budget); nothing defers requests.
    _gauge(out, "vllm:num_requests_waiting_by_reason", WAITING_REASON_HELP,
           [({**base, "reason": reason}, engine.num_waiting if reason == "capacity" else 0)
            for reason in ("capacity", "deferred") for base, engine, _ in pairs])
    _gauge(out, "vllm:engine_sleep_state", SLEEP_HELP,
           [({**base, "sleep_state": state}, 1 if state == "awake" else 0)
            for state in ("awake", "weights_offloaded", "discard_all") for base in bases])
    _gauge(out, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
           [(base, engine.pool.usage()) for base, engine, _ in pairs])


def _vllm_cache_counters(out: list[str], bases: list[dict], pairs: list[tuple], created: float) -> None:
    _counter(out, "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             [(base, s.prefix_cache_queries) for base, _, s in pairs], created)
    _counter(out, "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             [(base, s.prefix_cache_hits) for base, _, s in pairs], created)
    external = "External prefix cache {} from KV connector cross-instance cache sharing, in terms of number of {} tokens."
    _counter(out, "vllm:external_prefix_cache_queries", external.format("queries", "queried"),
             [(base, s.external_prefix_cache_queries) for base, _, s in pairs], created)
    _counter(out, "vllm:external_prefix_cache_hits", external.format("hits", "cached"),
             [(base, s.external_prefix_cache_hits) for base, _, s in pairs], created)
    _counter(out, "vllm:mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.",
             [(base, 0.0) for base in bases], created)
    _counter(out, "vllm:mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.",
             [(base, 0.0) for base in bases], created)
    _counter(out, "vllm:num_preemptions", "Cumulative number of preemption from the engine.",
             [(base, s.num_preemptions) for base, _, s in pairs], created)


def _vllm_token_counters(out: list[str], pairs: list[tuple], stats: list, model_name: str, created: float) -> None:
    """Prompt tokens (by source, cached), generated tokens, finished requests and admission rejections."""
    _counter(out, "vllm:prompt_tokens", "Number of prefill tokens processed.",
             [(base, s.prompt_tokens) for base, _, s in pairs], created)
    by_source = {
        "local_compute": lambda s: s.prompt_tokens_local_compute,
        "local_cache_hit": lambda s: s.prompt_tokens_local_cache_hit,
        "external_kv_transfer": lambda s: s.prompt_tokens_external,
    }
    _counter(out, "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
             [({**base, "source": source}, value(s)) for source, value in by_source.items() for base, _, s in pairs],
             created)
    _counter(out, "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
             [(base, s.prompt_tokens_local_cache_hit + s.prompt_tokens_external) for base, _, s in pairs], created)
    _counter(out, "vllm:prompt_tokens_cached_by_source", CACHED_BY_SOURCE_HELP,
             [({**base, "source": source}, s.prompt_tokens_local_cache_hit if source == "device"
               else s.prompt_tokens_external if source == "external_unspecified" else 0)
              for source in ("device", "host", "p2p", "disk", "external_unspecified") for base, _, s in pairs],
             created)
    _counter(out, "vllm:generation_tokens", "Number of generation tokens processed.",
             [(base, s.generation_tokens) for base, _, s in pairs], created)
    _counter(out, "vllm:request_success", "Count of successfully processed requests.",
             [({**base, "finished_reason": reason}, s.request_success[reason])
              for reason in FINISH_REASONS for base, _, s in pairs], created)
    # One series per model, not per engine: the API server applies queue limits.
    _counter(out, "vllm:admission_rejections", "Number of admission attempts rejected by a queue limit, by reason.",
             [({"model_name": model_name, "reason": reason}, sum(s.admission_rejections[reason] for s in stats))
              for reason in ("max_num_queued_reqs", "max_num_queued_tokens")], created)


class HttpStats:
    """What prometheus-fastapi-instrumentator records in vLLM's API server.
    Durations are wall-clock seconds of the real HTTP exchange."""

    EXCLUDED = frozenset({"/metrics", "/health", "/load", "/ping", "/version", "/server_info"})

    def __init__(self, created: float) -> None:
        self.created = created
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, str, str], list[float]] = {}  # -> [count, created]
        self.request_size: dict[str, list[float]] = {}  # -> [count, sum, created]
        self.response_size: dict[str, list[float]] = {}
        self.highr = Histogram(HTTP_HIGHR_BUCKETS)
        self.duration: dict[tuple[str, str], list] = {}  # -> [Histogram, created]

    def record(self, handler: str, method: str, status: int, request_bytes: int, response_bytes: int,
               seconds: float, now_unix: float) -> None:
        if handler in self.EXCLUDED:
            return
        group = f"{status // 100}xx"
        with self._lock:
            self.requests.setdefault((handler, method, group), [0, now_unix])[0] += 1
            entry = self.request_size.setdefault(handler, [0, 0.0, now_unix])
            entry[0] += 1
            entry[1] += request_bytes
            entry = self.response_size.setdefault(handler, [0, 0.0, now_unix])
            entry[0] += 1
            entry[1] += response_bytes
            self.highr.observe(seconds)
            self.duration.setdefault((handler, method), [Histogram(HTTP_DURATION_BUCKETS), now_unix])[0].observe(seconds)

    def render(self) -> list[str]:
        out: list[str] = []
        with self._lock:
            _head(out, "http_requests_total", HTTP_REQUESTS_HELP, "counter")
            for (handler, method, status), (count, _) in self.requests.items():
                out.append(f"http_requests_total{_labels({'handler': handler, 'method': method, 'status': status})} {_fmt(count)}")
            _head(out, "http_requests_created", HTTP_REQUESTS_HELP, "gauge")
            for (handler, method, status), (_, created) in self.requests.items():
                out.append(f"http_requests_created{_labels({'handler': handler, 'method': method, 'status': status})} {_fmt(created)}")
            for name, help_text, table in (
                ("http_request_size_bytes", HTTP_REQUEST_SIZE_HELP, self.request_size),
                ("http_response_size_bytes", HTTP_RESPONSE_SIZE_HELP, self.response_size),
            ):
                _head(out, name, help_text, "summary")
                for handler, (count, total, _) in table.items():
                    out.append(f"{name}_count{_labels({'handler': handler})} {_fmt(count)}")
                    out.append(f"{name}_sum{_labels({'handler': handler})} {_fmt(total)}")
                _head(out, f"{name}_created", help_text, "gauge")
                for handler, (_, _, created) in table.items():
                    out.append(f"{name}_created{_labels({'handler': handler})} {_fmt(created)}")
            _head(out, "http_request_duration_highr_seconds", HTTP_HIGHR_HELP, "histogram")
            _histogram_lines(out, "http_request_duration_highr_seconds", {}, self.highr)
            _head(out, "http_request_duration_highr_seconds_created", HTTP_HIGHR_HELP, "gauge")
            out.append(f"http_request_duration_highr_seconds_created {_fmt(self.created)}")
            _head(out, "http_request_duration_seconds", HTTP_DURATION_HELP, "histogram")
            for (handler, method), (histogram, _) in self.duration.items():
                _histogram_lines(out, "http_request_duration_seconds", {"handler": handler, "method": method}, histogram)
            _head(out, "http_request_duration_seconds_created", HTTP_DURATION_HELP, "gauge")
            for (handler, method), (_, created) in self.duration.items():
                out.append(f"http_request_duration_seconds_created{_labels({'handler': handler, 'method': method})} {_fmt(created)}")
        return out


_process_registry: CollectorRegistry | None = None


def process_text() -> str:
    """python_gc_*, python_info and process_* of this process, as vLLM's page
    starts with them (same library, default collectors)."""
    global _process_registry
    if _process_registry is None:
        registry = CollectorRegistry(auto_describe=True)
        GCCollector(registry=registry)
        PlatformCollector(registry=registry)
        ProcessCollector(registry=registry)
        _process_registry = registry
    return generate_latest(_process_registry).decode("utf-8")


def render_metrics(engines: Sequence[Engine], model_name: str, created: float,
                   http: HttpStats | None = None, include_process: bool = True) -> str:
    """The whole `/metrics` page of a simulated vLLM 0.32 API server."""
    head = process_text() if include_process else ""
    lines = render_vllm(engines, model_name, created)
    lines.extend((http or HttpStats(created)).render())
    return head + "\n".join(lines) + "\n"


def render_app_metrics(retrieval: Histogram, created: float) -> str:
    """The RAG application's own page: one histogram of time spent before the engine."""
    out: list[str] = []
    _head(out, "app_retrieval_seconds", APP_RETRIEVAL_HELP, "histogram")
    _histogram_lines(out, "app_retrieval_seconds", {}, retrieval)
    _head(out, "app_retrieval_seconds_created", APP_RETRIEVAL_HELP, "gauge")
    out.append(f"app_retrieval_seconds_created {_fmt(created)}")
    return "\n".join(out) + "\n"
