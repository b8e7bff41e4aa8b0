"""The simulated engines' pages in other engines' dialects: the same engine
model (kvwatch/sim/engine.py) as vLLM's page, spelled as SGLang, llama.cpp or
TensorRT-LLM would spell what it counts, traps included, so kvwatch's
adapters, signals, dashboards and alerts can be run end to end on each:

- SGLang: two tensor-parallel ranks repeat every scheduler series (an
  adapter that sums them doubles everything); `cache_hit_rate` is a gauge of
  the last interval; `num_retracted_requests_total` appears only after the
  first preemption; tokenizer-side series (histograms, token counters) carry
  no rank.
- llama.cpp (as tools/server/server-task.cpp writes it): no labels, no
  histograms; `prompt_tokens_total` excludes cached tokens, counted apart in
  `prompt_tokens_cached_total`; `n_tokens_max` is typed a counter but is a
  maximum.
- TensorRT-LLM: the iteration gauges (usage, running, waiting) change only
  when a request completes; block counters for prefix reuse.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvwatch.sim.engine import Engine
from kvwatch.sim.render import _fmt, _head, _histogram_lines, _labels
from kvwatch.sim.stats import FINISH_REASONS

DIALECTS = ("vllm", "sglang", "llamacpp", "trtllm")


def _counter(out: list[str], name: str, help_text: str, series) -> None:
    _head(out, f"{name}_total", help_text, "counter")
    for labels, value in series:
        out.append(f"{name}_total{_labels(labels)} {_fmt(value)}")


def _gauge(out: list[str], name: str, help_text: str, series, kind: str = "gauge") -> None:
    _head(out, name, help_text, kind)
    for labels, value in series:
        out.append(f"{name}{_labels(labels)} {_fmt(value)}")


def _merged(engines: Sequence[Engine], attribute: str):
    """One histogram of all engines (a tokenizer sees every request)."""
    histograms = [getattr(engine.stats, attribute) for engine in engines]
    merged = type(histograms[0])(histograms[0].bounds)
    for histogram in histograms:
        merged.counts = [a + b for a, b in zip(merged.counts, histogram.counts)]
        merged.sum += histogram.sum
        merged.count += histogram.count
    return merged


# --- SGLang ----------------------------------------------------------------

SGLANG_TP_RANKS = ("0", "1")
SGLANG_HISTOGRAMS = (
    ("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", "time_to_first_token"),
    ("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", "inter_token_latency"),
    ("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
     "e2e_request_latency"),
    ("sglang:queue_time_seconds", "Histogram of queueing time in seconds.", "request_queue_time"),
    ("sglang:prompt_tokens_histogram", "Histogram of prompt token length.", "request_prompt_tokens"),
    ("sglang:generation_tokens_histogram", "Histogram of generation token length.", "request_generation_tokens"),
)


def render_sglang(engines: Sequence[Engine], model_name: str) -> list[str]:
    out: list[str] = []
    ranks = [({"model_name": model_name, "engine_type": "unified", "dp_rank": str(engine.index), "tp_rank": tp,
               "pp_rank": "0", "moe_ep_rank": "0"}, engine)
             for engine in engines for tp in SGLANG_TP_RANKS]
    _sglang_gauges(out, ranks)
    _sglang_rank_counters(out, engines, ranks)
    _sglang_forward_and_tier(out, engines, ranks)
    _sglang_tokenizer(out, engines, {"model_name": model_name, "engine_type": "unified"})
    return out


def _sglang_gauges(out: list[str], ranks: list[tuple[dict, Engine]]) -> None:
    _gauge(out, "sglang:num_running_reqs", "The number of running requests.",
           [(labels, engine.num_running) for labels, engine in ranks])
    _gauge(out, "sglang:num_queue_reqs", "The number of requests in the waiting queue.",
           [(labels, engine.num_waiting) for labels, engine in ranks])
    _gauge(out, "sglang:num_used_tokens", "The number of used tokens.",
           [(labels, round(engine.pool.usage() * engine.config.kv_cache_size_tokens)) for labels, engine in ranks])
    _gauge(out, "sglang:token_usage", "The token usage.", [(labels, engine.pool.usage()) for labels, engine in ranks])
    # The token pools (one full-attention pool here): slots held by running
    # requests, free, and radix-cached but reclaimable (counted free in the
    # usage, as token_usage counts them); used / (used + available +
    # evictable) is the usage.
    pools = [(labels, engine.pool.accounting(), engine.config.block_size) for labels, engine in ranks]
    for state, help_text, count in (
            ("used", "The number of used tokens in the KV pool.", lambda a: a["used"]),
            ("available", "The number of available tokens in the KV pool.", lambda a: a["free_uncached"]),
            ("evictable", "The number of evictable tokens in the KV pool.", lambda a: a["free_cached"])):
        _gauge(out, f"sglang:kv_{state}_tokens", help_text,
               [(labels, count(accounting) * block) for labels, accounting, block in pools])
    _gauge(out, "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool.",
           [(labels, engine.config.kv_cache_size_tokens) for labels, engine in ranks])
    _gauge(out, "sglang:page_size", "The page size of the KV cache.",
           [(labels, engine.config.block_size) for labels, engine in ranks])
    # A gauge of the last prefill batch: kvwatch must not read it. Here it is
    # the lifetime ratio, which a windowed ratio tells apart in every test.
    _gauge(out, "sglang:cache_hit_rate", "The prefix cache hit rate.",
           [(labels, engine.stats.prefix_cache_hits / engine.stats.prefix_cache_queries
             if engine.stats.prefix_cache_queries else 0.0) for labels, engine in ranks])


def _sglang_rank_counters(out: list[str], engines: Sequence[Engine], ranks: list[tuple[dict, Engine]]) -> None:
    _counter(out, "sglang:realtime_tokens", "Total number of tokens processed, updated on each log interval.",
             [({**labels, "mode": mode}, value(engine.stats)) for labels, engine in ranks
              for mode, value in (("prefill_compute", lambda s: s.prompt_tokens_local_compute),
                                  ("prefill_cache", lambda s: s.prompt_tokens_local_cache_hit),
                                  ("decode", lambda s: s.generation_tokens))])
    # Pre-seeded at 0 for every mode (SGLang does so); the hit modes are the
    # HiCache tiers. The simulator's cache is the device's; its LMCache tier
    # (external) stands for the host tier here.
    _counter(out, "sglang:prefill_effective_tokens", "Effective prefill tokens with retracted-request re-counts "
             "excluded, updated on each log interval. mode: device_hit, host_hit, storage_hit, input.",
             [({**labels, "mode": mode}, value(engine.stats)) for labels, engine in ranks
              for mode, value in (("input", lambda s: s.prompt_tokens_local_compute),
                                  ("device_hit", lambda s: s.prompt_tokens_local_cache_hit),
                                  ("host_hit", lambda s: s.prompt_tokens_external),
                                  ("storage_hit", lambda s: 0))])
    if any(engine.stats.num_preemptions for engine in engines):
        _counter(out, "sglang:num_retracted_requests", "Total number of retracted requests.",
                 [(labels, engine.stats.num_preemptions) for labels, engine in ranks])
        _counter(out, "sglang:num_retracted_input_tokens", "Total number of retracted input tokens.",
                 [(labels, engine.stats.retracted_prompt_tokens) for labels, engine in ranks])
        _counter(out, "sglang:num_retracted_output_tokens", "Total number of retracted output tokens.",
                 [(labels, engine.stats.retracted_generation_tokens) for labels, engine in ranks])


def _sglang_forward_and_tier(out: list[str], engines: Sequence[Engine], ranks: list[tuple[dict, Engine]]) -> None:
    # SGLANG_ENABLE_METRICS_DEVICE_TIMER=1's forward seconds (extend passes: the
    # steps' prefill work), and with a tier (--lmcache, standing for HiCache's
    # host tier) the radix cache's load-back and backup families, labelled as
    # newer builds label them: cache_type and ranks, no model_name.
    _counter(out, "sglang:forward_execution_seconds", "Total time that GPU is busy executing model forward passes. "
             "Refer to ForwardMode for category labels.",
             [({**labels, "category": "forward_extend"}, engine.stats.prefill_forward_seconds)
              for labels, engine in ranks])
    if any(engine.tier is not None for engine in engines):
        radix = [({"cache_type": "HiRadixCache", "tp_rank": labels["tp_rank"], "pp_rank": "0",
                   "dp_rank": labels["dp_rank"]}, engine) for labels, engine in ranks]
        _head(out, "sglang:load_back_duration_seconds", "Time taken to load KV cache from CPU back to GPU in seconds.",
              "histogram")
        for labels, engine in radix:
            _histogram_lines(out, "sglang:load_back_duration_seconds", labels, engine.stats.tier_load_back)
        _counter(out, "sglang:load_back_bytes", "Bytes loaded back from local host DRAM (L2) to GPU, all pools "
                 "combined.", [(labels, engine.stats.tier_load_back_bytes) for labels, engine in radix])
        _counter(out, "sglang:hicache_backup_bytes", "Bytes backed up from GPU to local host DRAM (L2), all pools "
                 "combined.", [(labels, engine.stats.tier_backup_bytes) for labels, engine in radix])


def _sglang_tokenizer(out: list[str], engines: Sequence[Engine], tokenizer: dict[str, str]) -> None:
    """The tokenizer manager's families: one series for the model, summed over its engines."""
    _counter(out, "sglang:prompt_tokens", "Number of prefill tokens processed.",
             [(tokenizer, sum(engine.stats.prompt_tokens for engine in engines))])
    _counter(out, "sglang:generation_tokens", "Number of generation tokens processed.",
             [(tokenizer, sum(engine.stats.generation_tokens for engine in engines))])
    _counter(out, "sglang:cached_tokens", "Number of cached prompt tokens.",
             [({**tokenizer, "cache_source": "device"},
               sum(engine.stats.prompt_tokens_local_cache_hit for engine in engines)),
              ({**tokenizer, "cache_source": "host"}, sum(engine.stats.prompt_tokens_external for engine in engines))])
    _counter(out, "sglang:num_requests", "Number of requests processed.",
             [(tokenizer, sum(sum(engine.stats.request_success.values()) for engine in engines))])
    for name, help_text, attribute in SGLANG_HISTOGRAMS:
        _head(out, name, help_text, "histogram")
        _histogram_lines(out, name, tokenizer, _merged(engines, attribute))


# --- llama.cpp -------------------------------------------------------------


def render_llamacpp(engines: Sequence[Engine]) -> list[str]:
    """llama-server's page: one server, no labels (engines are summed)."""
    out: list[str] = []
    stats = [engine.stats for engine in engines]
    prompt_seconds = sum(s.request_prefill_time.sum for s in stats)
    decode_seconds = sum(s.request_decode_time.sum for s in stats)
    computed = sum(s.prompt_tokens_local_compute for s in stats)
    cached = sum(s.prompt_tokens_local_cache_hit for s in stats)
    generated = sum(s.generation_tokens for s in stats)
    steps = sum(engine.steps for engine in engines)
    busy = sum(engine.num_running for engine in engines)
    longest = max((engine.config.max_model_len for engine in engines if engine.stats.request_prompt_tokens.count),
                  default=0)
    for name, help_text, value in (
        ("prompt_tokens_total", "Number of prompt tokens processed, excluding cached tokens", computed),
        ("prompt_tokens_cached_total", "Number of prompt tokens reused from the cache", cached),
        ("prompt_seconds_total", "Total time spent processing prompts", prompt_seconds),
        ("tokens_predicted_total", "Number of generation tokens processed", generated),
        ("tokens_predicted_seconds_total", "Total time spent generating tokens", decode_seconds),
        ("n_decode_total", "Total number of llama_decode() calls, excluding speculative decoding and multimodal "
                           "decoding", steps),
        # Typed a counter, but the largest sequence seen: not a counter.
        ("n_tokens_max", "Largest observed sequence length (prompt + generation)", longest),
        ("spec_decode_num_draft_tokens_total", "Speculative: Total draft tokens generated", 0),
        ("spec_decode_num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model", 0),
        ("spec_decode_num_drafts_total", "Speculative: Total speculative decoding verification steps", 0),
    ):
        _gauge(out, f"llamacpp:{name}", help_text, [({}, value)], kind="counter")
    for name, help_text, value in (
        ("prompt_tokens_seconds", "Average prompt throughput in tokens/s",
         computed / prompt_seconds if prompt_seconds else 0.0),
        ("predicted_tokens_seconds", "Average generation throughput in tokens/s",
         generated / decode_seconds if decode_seconds else 0.0),
        ("requests_processing", "Number of requests processing", busy),
        ("requests_deferred", "Number of requests deferred", sum(engine.num_waiting for engine in engines)),
        ("n_busy_slots_per_decode", "Average number of busy slots per llama_decode() call",
         busy / steps if steps else 0.0),
    ):
        _gauge(out, f"llamacpp:{name}", help_text, [({}, value)])
    return out


# --- TensorRT-LLM ----------------------------------------------------------

TRTLLM_HISTOGRAMS = (
    ("trtllm_e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
     "e2e_request_latency"),
    ("trtllm_time_to_first_token_seconds", "Histogram of time to first token in seconds.", "time_to_first_token"),
    ("trtllm_time_per_output_token_seconds", "Histogram of time per output token in seconds.",
     "inter_token_latency"),
    ("trtllm_request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
     "request_queue_time"),
    ("trtllm_request_prefill_time_seconds", "Histogram of prefill (context) phase duration in seconds.",
     "request_prefill_time"),
    ("trtllm_request_decode_time_seconds", "Histogram of decode (generation) phase duration in seconds.",
     "request_decode_time"),
    ("trtllm_request_inference_time_seconds", "Histogram of total inference duration in seconds.",
     "request_inference_time"),
)


class TrtllmGauges:
    """The iteration gauges as TensorRT-LLM leaves them: taken when a request
    completes, then held however the engine changes."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[int, dict[str, float]]] = {}

    def of(self, engine: Engine) -> dict[str, float]:
        finished = sum(engine.stats.request_success.values())
        held = self.held.get(engine.index)
        if held is None or held[0] != finished:
            values = {"usage": engine.pool.usage(), "running": engine.num_running, "waiting": engine.num_waiting}
            if held is None and finished == 0:
                values = {"usage": 0.0, "running": 0, "waiting": 0}  # nothing completed: never written
            held = self.held[engine.index] = (finished, values)
        return held[1]


def render_trtllm(engines: Sequence[Engine], model_name: str, gauges: TrtllmGauges) -> list[str]:
    out: list[str] = []
    base = {"model_name": model_name, "engine_type": "trtllm"}
    stats = [engine.stats for engine in engines]
    block = engines[0].config.block_size
    hits = sum(s.prefix_cache_hits for s in stats)
    queries = sum(s.prefix_cache_queries for s in stats)
    _counter(out, "trtllm_request_success", "Count of successfully processed requests.",
             [({**base, "finished_reason": reason}, sum(s.request_success[reason] for s in stats))
              for reason in FINISH_REASONS if reason != "repetition"])
    for name, help_text, attribute in TRTLLM_HISTOGRAMS:
        _head(out, name, help_text, "histogram")
        _histogram_lines(out, name, base, _merged(engines, attribute))
    _counter(out, "trtllm_prompt_tokens", "Cumulative number of prompt (input) tokens processed.",
             [(base, sum(s.prompt_tokens for s in stats))])
    _counter(out, "trtllm_generation_tokens", "Cumulative number of generation (output) tokens produced.",
             [(base, sum(s.generation_tokens for s in stats))])
    _counter(out, "trtllm_prompt_cached_tokens", "Cumulative number of cached prompt tokens.",
             [(base, sum(s.prompt_tokens_local_cache_hit for s in stats))])
    held = [gauges.of(engine) for engine in engines]
    _gauge(out, "trtllm_kv_cache_hit_rate", "KV cache hit rate", [(base, hits / queries if queries else 0.0)])
    _counter(out, "trtllm_kv_cache_reused_blocks", "Cumulative number of KV cache blocks reused (cache hits)",
             [(base, hits // block)])
    _counter(out, "trtllm_kv_cache_missed_blocks", "Cumulative number of KV cache blocks missed (cache misses)",
             [(base, (queries - hits) // block)])
    _gauge(out, "trtllm_kv_cache_utilization", "KV cache utilization", [(base, max(h["usage"] for h in held))])
    _gauge(out, "trtllm_num_requests_running", "Number of active requests", [(base, sum(h["running"] for h in held))])
    _gauge(out, "trtllm_num_requests_waiting", "Number of queued requests", [(base, sum(h["waiting"] for h in held))])
    _gauge(out, "trtllm_kv_cache_max_blocks", "Maximum number of KV cache blocks",
           [(base, sum(engine.config.num_gpu_blocks for engine in engines))])
    _gauge(out, "trtllm_kv_cache_tokens_per_block", "Tokens per KV cache block", [(base, block)])
    return out


# SGLang's names as published: its own `sglang:`, or `sglang_` where the page
# is served with OpenMetrics' escaping=underscores (sample lines rewritten,
# HELP and TYPE keep `sglang:`).
SGLANG_SPELLINGS = ("sglang:", "sglang_")


def render_dialect(dialect: str, engines: Sequence[Engine], model_name: str, gauges: TrtllmGauges | None,
                   spelling: str = "sglang:") -> str:
    if dialect == "sglang":
        if spelling not in SGLANG_SPELLINGS:
            raise ValueError(f"unknown SGLang spelling {spelling!r} (known: {', '.join(SGLANG_SPELLINGS)})")
        lines = render_sglang(engines, model_name)
        if spelling == "sglang_":
            lines = ["sglang_" + line[len("sglang:"):] if line.startswith("sglang:") else line for line in lines]
    elif dialect == "llamacpp":
        lines = render_llamacpp(engines)
    elif dialect == "trtllm":
        lines = render_trtllm(engines, model_name, gauges or TrtllmGauges())
    else:
        raise ValueError(f"unknown dialect {dialect!r} (known: {', '.join(DIALECTS)})")
    return "\n".join(lines) + "\n"
