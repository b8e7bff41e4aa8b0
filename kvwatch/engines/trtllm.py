"""The TensorRT-LLM adapter (trtllm-serve `/prometheus/metrics`; families
`trtllm_*`, checked against tensorrt_llm/metrics/collector.py; labels
`model_name` and `engine_type`).

Traps this adapter handles:
- The iteration gauges (`kv_cache_utilization`, `num_requests_running`,
  `num_requests_waiting`) are written only when a request completes, so an
  idle engine's gauges hold whatever the last completion saw. They are read
  only while requests complete: once `request_success_total` has not moved
  for STALE_AFTER seconds (and on the first poll, when nothing says how old
  they are), they are absent, not current.
- `trtllm_kv_cache_hit_rate` is a gauge of the same kind: never read. The hit
  ratio comes from the block counters `kv_cache_reused_blocks_total` over
  `reused + missed` (blocks, not tokens; the ratio is unaffected).
- `trtllm_time_per_output_token_seconds` is the gap between output tokens
  (vLLM's inter-token latency, from which the collector was adapted).
"""

from __future__ import annotations

from kvwatch.engines.table import Row, TableAdapter
from kvwatch.exposition import Family
from kvwatch.snapshot import Snapshot

PREFIXES = ("trtllm_",)
# Seconds without a completed request after which the iteration gauges are stale.
STALE_AFTER = 30.0
STALE_GAUGES = ("kv_usage", "running", "waiting")

ROWS: tuple[Row, ...] = (
    Row("kv_usage", "kv_cache_utilization", "gauge", "ratio", "updated when a request completes; stale when idle"),
    Row("running", "num_requests_running", "gauge", "requests", "updated when a request completes"),
    Row("waiting", "num_requests_waiting", "gauge", "requests", "updated when a request completes"),
    Row("prefix_hits", "kv_cache_reused_blocks", "counter", "blocks"),
    Row("prefix_queries", "kv_cache_reused_blocks", "counter", "blocks", "reused + missed", adds=True),
    Row("prefix_queries", "kv_cache_missed_blocks", "counter", "blocks", "reused + missed", adds=True),
    Row("prompt_tokens", "prompt_tokens", "counter", "tokens"),
    Row("prompt_tokens_cached", "prompt_cached_tokens", "counter", "tokens", "recent builds"),
    Row("generation_tokens", "generation_tokens", "counter", "tokens"),
    Row("finished/*", "request_success", "counter", "requests", "by finished_reason", label="finished_reason"),
    Row("ttft", "time_to_first_token_seconds", "histogram", "seconds"),
    Row("queue_time", "request_queue_time_seconds", "histogram", "seconds"),
    Row("prefill_time", "request_prefill_time_seconds", "histogram", "seconds", "recent builds"),
    Row("decode_time", "request_decode_time_seconds", "histogram", "seconds", "recent builds"),
    Row("inference_time", "request_inference_time_seconds", "histogram", "seconds", "recent builds"),
    Row("e2e_latency", "e2e_request_latency_seconds", "histogram", "seconds"),
    Row("inter_token_latency", "time_per_output_token_seconds", "histogram", "seconds", "gap between output tokens"),
)
MAX_BLOCKS = "kv_cache_max_blocks"
TOKENS_PER_BLOCK = "kv_cache_tokens_per_block"
TABLE_NOTES: tuple[Row, ...] = (
    Row("capacity_tokens", "kv_cache_max_blocks", "gauge", "blocks",
        "x trtllm_kv_cache_tokens_per_block (recent builds)"),
)
MISSING: dict[str, str] = {
    "preemptions": "no preemption counter (num_paused_requests is a gauge of the last iteration)",
    "prompt_len": "no prompt-length histogram",
    "generation_len": "no generation-length histogram",
    "waiting_by_reason/*": "no waiting-reason gauge",
    "external_prefix_queries": "host-pool onboarding is counted in bytes, not as queries and hits",
    "external_prefix_hits": "as external_prefix_queries",
}


class TrtllmAdapter(TableAdapter):
    name = "trtllm"
    title = "TensorRT-LLM"
    prefixes = PREFIXES
    ROWS = ROWS
    MISSING = MISSING
    TABLE_NOTES = TABLE_NOTES
    EXTRA_FAMILIES = (MAX_BLOCKS, TOKENS_PER_BLOCK)

    def __init__(self, max_series: int = 10_000):
        super().__init__(max_series)
        # (model, engine) -> (completed requests, time that count was first seen)
        self.completions: dict[tuple[str, str], tuple[float, float]] = {}

    def finish(self, snapshot: Snapshot, families: dict[str, Family]) -> None:
        for identity, engine in snapshot.engines.items():
            completed = sum(v for k, v in engine.counters.items() if k.startswith("finished/"))
            previous = self.completions.get(identity)
            if previous is None or completed != previous[0]:
                # A count not seen before: its time is this poll's, except on the
                # first poll, when nothing says how long it has stood.
                since = snapshot.time if previous is not None else float("-inf")
                self.completions[identity] = (completed, since)
            if snapshot.time - self.completions[identity][1] > STALE_AFTER:
                for key in STALE_GAUGES:
                    engine.gauges.pop(key, None)
        if len(self.completions) > self.max_series:
            self.completions = {k: v for k, v in self.completions.items() if k in snapshot.engines}

        blocks = self.fold(families.get(MAX_BLOCKS), "gauge")
        per_block = self.fold(families.get(TOKENS_PER_BLOCK), "gauge")
        for (model, engine_name, _), count in blocks.items():
            size = per_block.get((model, engine_name, None))
            if count and size:
                config = snapshot.cache_config.setdefault(engine_name, {"engine": engine_name})
                config["num_gpu_blocks"] = str(int(count))
                config["block_size"] = str(int(size))
