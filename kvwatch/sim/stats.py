"""Counters and histograms one simulated engine accumulates, with vLLM 0.32's
default bucket bounds. Plain numbers only; `render` turns them into text."""

from __future__ import annotations

from bisect import bisect_left

REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
INTER_TOKEN_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
NUM_PREEMPTIONS_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# prometheus_client's default buckets, which a Python RAG service gets unless it sets its own.
APP_DEFAULT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)

# SGLang's default load_back_duration_seconds bounds (RadixCacheMetricsCollector).
LOAD_BACK_BUCKETS = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.02, 0.03, 0.04, 0.05,
                     0.1, 0.2, 0.5, 1.0)

FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def request_token_buckets(max_model_len: int) -> tuple[int, ...]:
    """1-2-5 series up to max_model_len, as vLLM sizes its token histograms."""
    bounds: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_model_len:
                return tuple(bounds)
            bounds.append(value)
        scale *= 10


class Histogram:
    """Cumulative-on-render histogram: counts[i] holds observations in
    (bounds[i-1], bounds[i]]; the last slot is +Inf."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += times
        self.sum += value * times
        self.count += times

    def cumulative(self) -> list[int]:
        running = 0
        out = []
        for count in self.counts:
            running += count
            out.append(running)
        return out

    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0


class EngineStats:
    """Everything `vllm:` counts for one engine, in vLLM's units (tokens, seconds)."""

    def __init__(self, max_model_len: int) -> None:
        token_buckets = request_token_buckets(max_model_len)
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        # Tokens of preempted requests, computed again when they resume
        # (SGLang's num_retracted_{input,output}_tokens_total).
        self.retracted_prompt_tokens = 0
        self.retracted_generation_tokens = 0
        self.prompt_tokens = 0
        self.prompt_tokens_local_compute = 0
        self.prompt_tokens_local_cache_hit = 0
        # Loaded from the LMCache tier (kvwatch sim --lmcache), as vLLM counts a KV connector's tokens.
        self.prompt_tokens_external = 0
        self.external_prefix_cache_queries = 0
        self.external_prefix_cache_hits = 0
        # The tier's transfers as SGLang's HiCache counts its host tier's: each load
        # back to the GPU (seconds), the bytes loaded back and the bytes stored
        # into the tier; and the seconds of the steps' prefill work.
        self.tier_load_back = Histogram(LOAD_BACK_BUCKETS)
        self.tier_load_back_bytes = 0
        self.tier_backup_bytes = 0
        self.prefill_forward_seconds = 0.0
        self.generation_tokens = 0
        self.request_success = dict.fromkeys(FINISH_REASONS, 0)
        self.admission_rejections = {"max_num_queued_reqs": 0, "max_num_queued_tokens": 0}
        self.request_prompt_tokens = Histogram(token_buckets)
        self.request_generation_tokens = Histogram(token_buckets)
        self.iteration_tokens = Histogram(ITERATION_TOKEN_BUCKETS)
        self.request_max_num_generation_tokens = Histogram(token_buckets)
        self.request_params_n = Histogram(PARAMS_N_BUCKETS)
        self.request_params_max_tokens = Histogram(token_buckets)
        self.time_to_first_token = Histogram(TTFT_BUCKETS)
        self.inter_token_latency = Histogram(INTER_TOKEN_BUCKETS)
        self.request_time_per_output_token = Histogram(INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_num_preemptions = Histogram(NUM_PREEMPTIONS_BUCKETS)
        self.request_prefill_kv_computed_tokens = Histogram(token_buckets)
