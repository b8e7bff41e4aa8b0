"""The catalogue: every signal kvwatch derives, declared once.

Each entry names the exported metric, its unit, a help text naming its vLLM
sources, how it is derived in-process from a window, its PromQL twin over the
series kvwatch re-exports (for recording rules and dashboards), and the
dashboard group it belongs to. The exporter, the JSON API, the rules, the
dashboards and the README's metrics table are all generated from this file.
How an entry is derived (View, Signal, the derivations, the PromQL helpers)
is in derivations.py; kvwatch's own health families, units and good
directions in health.py. Their public names are importable from here.

Two kinds of entries:
- ENGINE_SERIES: vLLM's own series, re-exported under one stable name per
  concept whatever the vLLM version spelled (`kvwatch_engine_*`). Counters and
  histograms pass through unchanged (resets included; Prometheus' rate()
  handles them), so recording rules can aggregate them correctly across many
  sidecars: ratios of summed rates, `sum by (le)` before quantiles.
- SIGNALS: windowed values computed in-process (`kvwatch_*` per model and
  engine, `kvwatch_model_*` per model), for the status page, the CLI, the
  diagnosis, and for anyone without recording rules.

PromQL templates use `{sel}` for the label selector (without braces), `{w}`
for the range and `{by}` for the aggregation labels.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.signals.derivations import (  # noqa: F401 (the public names re-exported)
    CACHED_BY_SOURCE, LOCAL_COMPUTE, QUANTILES, TREND_RANGE, TREND_SECONDS, Signal, TtftDecomposition, View,
    _cached_share, _capacity_requests, _clamp01, _exhaustion_eta, _failed_rate, _free_blocks, _free_tokens,
    _from_cache, _labelled_rates, _mean, _mean_promql, _offload_rates, _prefix_hit_ratio, _quantile_promql,
    _quantiles, _rate, _ratio_of_rates, _reuse_shortfall_bytes, _sleeping, _usage, _used_blocks, _used_bytes,
    _kv_fetch_by_stage, _offload_lookup_delay, _offload_stores_dropped, _waiting_by_reason, cache_tier_bytes_per_token,
    cache_tier_cost, caveats, lmcache_lookup_by_tier, mean_tokens, preemption_repeat_share, prompt_tokens_by_tier, recomputed_prompt_share, requests_fit_now,
    reuse_shortfall_blocks, token_usage_estimate, ttft_decomposition, ttft_parts, unlit_reasons,
)
from kvwatch.signals.health import (  # noqa: F401 (the public names re-exported)
    CENTRAL_HEALTH, GOOD_DIRECTIONS, HEALTH, HEALTH_BY_NAME, ROUTER_HEALTH, SCRAPE, STREAM_HEALTH, TIER_HEALTH, UNITS, HealthFamily,
    Unit,
)
import kvwatch.signals.worth as worth
from kvwatch.signals.series import ENGINE_SERIES, TIER_SERIES

# Why a quantile's twin differs: only where the quantile falls in the first bucket.
# The per-token rate of what the cache is worth (kvwatch.signals.worth).
_FITTED_RATE = ("kvwatch prices a token at the slope of a least-squares fit over the window's polls (a request's "
                "fixed prefill cost apart); the twin has no per-poll steps to fit and takes one mean inter-token "
                "latency a request off the mean instead, kvwatch's own fallback where the polls cannot tell the two apart")
_POSITION_PRICE = ("kvwatch prices a cached token at its position (a three-term fit over the window's polls of "
                   "prefill time against requests, computed tokens and their positions); the twin has no per-poll "
                   "steps to fit and prices it at the mean less one inter-token latency a request, kvwatch's own "
                   "fallback where the polls cannot tell the terms apart")
_PINNED_QUANTILE = ("a quantile in the first bucket is that bucket's bound in kvwatch (an upper bound, said as "
                    "pinned), where histogram_quantile interpolates from 0")

SIGNALS: tuple[Signal, ...] = (
    # --- cache exhaustion ---
    Signal("kvwatch_kv_cache_usage_ratio", "ratio",
           "KV-cache usage now, 0..1 (vllm:kv_cache_usage_perc).",
           _usage, "exhaustion", "max by ({by}) (kvwatch_engine_kv_cache_usage_ratio{{{sel}}})",
           display="KV cache usage", record=("kvwatch_kv_cache_usage_ratio", "max"), good="low",
           doc=("KV-cache usage now, 0..1 (vllm:kv_cache_usage_perc / vllm:gpu_cache_usage_perc); a reading outside 0..1 is "
           "a fault of the source, absent here and named by kvwatch_source_fault, never clamped.")),
    Signal("kvwatch_kv_cache_usage_max_ratio", "ratio",
           "Highest KV-cache usage seen in the window (vllm:kv_cache_usage_perc).",
           lambda v: _clamp01(v.usage_max), "exhaustion",
           "max by ({by}) (max_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}]))",
           display="KV cache usage, window peak", record=("kvwatch_kv_cache_usage_ratio", "max_over_time{w}"), good="low"),
    Signal("kvwatch_kv_cache_capacity_tokens", "tokens",
           "KV-cache capacity in tokens (vllm:cache_config_info).",
           lambda v: v.capacity_tokens, "exhaustion",
           "sum by ({by}) (kvwatch_engine_kv_cache_capacity_tokens{{{sel}}})",
           display="KV cache capacity", record=("kvwatch_kv_cache_capacity_tokens", "sum"), good="high"),
    Signal("kvwatch_kv_cache_free_tokens", "tokens",
           "KV-cache headroom in tokens: capacity x (1 - usage), whole tokens.",
           _free_tokens, "exhaustion",
           "sum by ({by}) (floor(kvwatch_engine_kv_cache_capacity_tokens{{{sel}}} * (1 - kvwatch_engine_kv_cache_usage_ratio{{{sel}}})))",
           display="KV cache headroom", record=("kvwatch_kv_cache_free_tokens", "sum"), good="high",
           doc=("KV-cache headroom in tokens: capacity x (1 - usage), rounded down to a whole token "
           "(vllm:cache_config_info, vllm:kv_cache_usage_perc).")),
    Signal("kvwatch_kv_cache_used_bytes", "bytes",
           "KV-cache bytes held now: usage x the cache's bytes (vllm:cache_config_info).",
           _used_bytes, "exhaustion",
           "round(sum by ({by}) (clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * kvwatch_engine_kv_cache_memory_bytes{{{sel}}}))",
           panel="overview", title="KV bytes in use",
           display="KV cache in use", record=("kvwatch_kv_cache_used_bytes", "sum"), good="low",
           doc=("KV-cache bytes held now: usage x the cache's bytes, rounded to a whole byte "
           "(vllm:kv_cache_usage_perc, vllm:cache_config_info kv_cache_memory_bytes, a number from vLLM 0.24 or given "
           "--kv-cache-memory-bytes (0.20.2 states it then); absent where it is \"None\", as on 0.10.2).")),
    Signal("kvwatch_kv_cache_capacity_requests", "requests",
           "Concurrent requests the KV cache holds at the window's mean request length (a bound).",
           _capacity_requests, "exhaustion",
           "floor(\nsum by ({by}) (kvwatch_engine_kv_cache_capacity_tokens{{{sel}}})\n/ on ({by}) (\n"
           + _mean_promql("kvwatch_engine_request_prompt_tokens") + "\n+ on ({by})\n"
           + _mean_promql("kvwatch_engine_request_generation_tokens") + "\n)\n)",
           display="Requests the cache holds", record=("kvwatch_kv_cache_capacity_requests", "ratio_rate{w}"), good="high",
           doc=("Concurrent requests the KV capacity holds at the window's mean prompt+generation length, block-rounded and rounded down to a whole request; a bound, not a promise "
           "(vllm:cache_config_info, vllm:request_prompt_tokens, vllm:request_generation_tokens).")),
    Signal("kvwatch_preemptions_per_second", "per_second",
           "Preemptions per second over the window (vllm:num_preemptions_total).",
           _rate("preemptions"), "exhaustion",
           "sum by ({by}) (rate(kvwatch_engine_preemptions_total{{{sel}}}[{w}]))",
           display="Preemptions", record=("kvwatch_preemptions", "rate{w}"), good="low"),
    Signal("kvwatch_requests_running", "requests",
           "Requests running now (vllm:num_requests_running).",
           lambda v: v.gauge("running"), "exhaustion",
           "sum by ({by}) (kvwatch_engine_requests_running{{{sel}}})",
           display="Running", record=("kvwatch_requests_running", "sum")),
    Signal("kvwatch_requests_running_max", "requests",
           "Most requests running at once in the window: the concurrency actually reached (vllm:num_requests_running).",
           lambda v: v.running_max, "exhaustion",
           "sum by ({by}) (max_over_time(kvwatch_engine_requests_running{{{sel}}}[{w}]))",
           display="Running, window peak", record=("kvwatch_requests_running", "max_over_time{w}")),
    Signal("kvwatch_requests_waiting", "requests",
           "Requests waiting now (vllm:num_requests_waiting).",
           lambda v: v.gauge("waiting"), "exhaustion",
           "sum by ({by}) (kvwatch_engine_requests_waiting{{{sel}}})",
           display="Waiting", record=("kvwatch_requests_waiting", "sum"), good="low"),
    Signal("kvwatch_requests_waiting_by_reason", "requests",
           "Requests waiting now by reason: capacity (no KV blocks) or deferred (vllm:num_requests_waiting_by_reason, vLLM 0.20+).",
           _waiting_by_reason, "exhaustion",
           "sum by ({by}, reason) (kvwatch_engine_requests_waiting_by_reason{{{sel}}})", label="reason", output_labels=("reason",),
           record=("kvwatch_requests_waiting", "sum"), needs=("waiting_by_reason",), display="Waiting by reason",
           good="low"),
    # --- KV blocks, occupancy and trend ---
    Signal("kvwatch_kv_cache_used_blocks", "blocks",
           "KV blocks held now: usage x (num_gpu_blocks - 1), whole blocks.",
           _used_blocks, "exhaustion",
           "sum by ({by}) (round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)))",
           record=("kvwatch_kv_cache_used_blocks", "sum"), display="KV blocks in use", good="low",
           doc=("KV blocks held now, whole: usage x (num_gpu_blocks - 1), since vLLM keeps one null block aside "
           "(vllm:kv_cache_usage_perc, vllm:cache_config_info; absent on hybrid models, whose blocks differ by group).")),
    Signal("kvwatch_kv_cache_free_blocks", "blocks",
           "KV blocks free now (evictable prefix blocks count as free), whole blocks.",
           _free_blocks, "exhaustion",
           "sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) - round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)))",
           panel="exhaustion", title="Free KV blocks (the ceiling left)",
           record=("kvwatch_kv_cache_free_blocks", "sum"), display="KV blocks free", good="high",
           doc=("KV blocks free now, whole (evictable prefix-cache blocks count as free): the capacity ceiling left, "
           "(num_gpu_blocks - 1) - used (vllm:kv_cache_usage_perc, vllm:cache_config_info).")),
    Signal("kvwatch_kv_cache_requests_fit_now", "requests",
           "Requests of the running ones' current mean footprint the cache holds now.",
           requests_fit_now, "exhaustion",
           "floor(\nsum by ({by}) (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)\n* sum by ({by}) (kvwatch_engine_requests_running{{{sel}}})\n"
           "/ (sum by ({by}) (round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1))) > 0)\n)",
           record=("kvwatch_kv_cache_requests_fit_now", "ratio"), display="Requests that fit at current lengths",
           good="high",
           doc=("Requests of the running ones' current mean footprint the cache holds, rounded down: usable blocks x "
           "running / used blocks. It falls as decodes grow, before the cache is full; "
           "kvwatch_kv_cache_capacity_requests reads finished requests' lengths instead "
           "(vllm:kv_cache_usage_perc, vllm:num_requests_running, vllm:cache_config_info; absent with nothing "
           "running and on hybrid models).")),
    Signal("kvwatch_kv_cache_token_usage_estimate_ratio", "ratio",
           "Estimated share of the cache's token slots holding tokens (usage counts whole blocks).",
           token_usage_estimate, "exhaustion",
           "sum by ({by}) (clamp_min(round(clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1) * (kvwatch_engine_kv_cache_blocks{{{sel}}} - 1)) * kvwatch_engine_kv_cache_block_size_tokens{{{sel}}} - kvwatch_engine_requests_running{{{sel}}} * (kvwatch_engine_kv_cache_block_size_tokens{{{sel}}} - 1) / 2, 0))\n/\n"
           "sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) * kvwatch_engine_kv_cache_block_size_tokens{{{sel}}})",
           record=("kvwatch_kv_cache_token_usage_estimate", "ratio"), display="KV token slots filled (estimate)", good="low",
           doc=("Estimated share of the cache's token slots holding tokens: usage counts whole blocks and each running "
           "request's last block is on average half filled, so this is (used blocks x block_size - running x "
           "(block_size - 1) / 2) / (usable blocks x block_size); '95 % full' in blocks is fewer tokens "
           "(vllm:kv_cache_usage_perc, vllm:num_requests_running, vllm:cache_config_info).")),
    Signal("kvwatch_kv_cache_exhaustion_eta_seconds", "seconds",
           "Seconds until KV usage reaches 1 at its 5-minute trend; absent unless usage rises.",
           _exhaustion_eta, "exhaustion",
           "min by ({by}) (\n  (1 - clamp(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}, 0, 1))\n  / (deriv(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[" + TREND_RANGE + "]) > 0)\n"
           "  and kvwatch_engine_kv_cache_usage_ratio{{{sel}}} >= avg_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[" + TREND_RANGE + "])\n)",
           panel="exhaustion", title="Time until the KV cache is full at this trend",
           record=("kvwatch_kv_cache_exhaustion_eta_seconds", "deriv" + TREND_RANGE), display="Time until KV cache full", good="high",
           doc=("Seconds until KV usage reaches 1 at its least-squares trend over the last 5 minutes (PromQL deriv()), the "
           "soonest engine; absent unless usage rises and is now at least its 5-minute mean (vllm:kv_cache_usage_perc).")),
    Signal("kvwatch_preemptions_on_repeat_requests_ratio", "ratio",
           "Share of preemptions that fell on requests preempted two or more times (vLLM 0.30+).",
           preemption_repeat_share, "exhaustion",
           "clamp_max(2 * clamp_min(sum by ({by}) (rate(kvwatch_engine_request_num_preemptions_count{{{sel}}}[{w}])) "
           "- sum by ({by}) (rate(kvwatch_engine_request_num_preemptions_bucket{{{sel},le=\"1.0\"}}[{w}])), 0)\n/\n"
           "(sum by ({by}) (rate(kvwatch_engine_request_num_preemptions_sum{{{sel}}}[{w}])) > 0), 1)",
           record=("kvwatch_preemptions_on_repeat_requests", "ratio_rate{w}"), needs=("preemptions_per_request",), display="Preemptions on repeat requests", good="low",
           doc=("At least this share of the preemptions of requests finished in the window fell on requests preempted "
           "two or more times: near 1 a few requests thrash, near 0 many were each preempted once (broad pressure) "
           "(vllm:request_num_preemptions, vLLM 0.30+).")),
    Signal("kvwatch_prefill_recomputed_ratio", "ratio",
           "Share of the window's prefill work spent recomputing preempted requests' prompts.",
           recomputed_prompt_share, "exhaustion",
           "(\n  sum by ({by}) (rate(kvwatch_engine_retracted_prompt_tokens_total{{{sel}}}[{w}]))\n  or\n"
           "  sum by ({by}) (rate(kvwatch_engine_preemptions_total{{{sel}}}[{w}]))\n  * on ({by}) (" + _mean_promql(
               "kvwatch_engine_request_prompt_tokens") + ")\n)\n/ on ({by}) (\n"
           "  sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_compute\"}}[{w}]))\n"
           "  + on ({by}) (\n    sum by ({by}) (rate(kvwatch_engine_retracted_prompt_tokens_total{{{sel}}}[{w}]))\n    or\n"
           "    sum by ({by}) (rate(kvwatch_engine_preemptions_total{{{sel}}}[{w}]))\n    * on ({by}) (" + _mean_promql(
               "kvwatch_engine_request_prompt_tokens") + ")\n  )\n)",
           panel="exhaustion", title="Prefill work spent recomputing preempted prompts",
           record=("kvwatch_prefill_recomputed", "ratio_rate{w}"), needs=("preemptions", "prompt_tokens_by_source"),
           display="Prefill recomputed after preemption", good="low",
           doc=("Share of the window's prefill work spent computing again the prompts of preempted requests: recomputed "
           "/ (prompt tokens computed once + recomputed). SGLang counts the recomputed tokens "
           "(sglang:num_retracted_input_tokens_total over prefill_effective_tokens_total{mode=\"input\"} plus them). "
           "vLLM does not: there it is an ESTIMATE, preemptions x the mean prompt length of the requests finished in "
           "the window (vllm:num_preemptions_total, vllm:request_prompt_tokens) over "
           "vllm:prompt_tokens_by_source_total{source=\"local_compute\"} (each prompt counted once, vLLM 0.16+) plus "
           "the estimate; an upper bound for the prompts (a resumed request may find part of its prompt still cached), "
           "and the generated tokens a resumed request also recomputes are left out. 0 without preemptions; absent "
           "before the preemption family is seen.")),
    Signal("kvwatch_admission_rejections_per_second", "per_second",
           "Requests rejected at a queue limit per second, by reason (vllm:admission_rejections_total).",
           _labelled_rates("admission_rejections"), "exhaustion",
           "sum by ({by}, reason) (rate(kvwatch_engine_admission_rejections_total{{{sel}}}[{w}]))", label="reason", output_labels=("reason",),
           record=("kvwatch_admission_rejections", "rate{w}"), needs=("admission_rejections",), display="Admission rejections", good="low",
           doc=("Requests rejected at a queue limit per second, by reason: a cause apart from the KV cache, the queue "
           "was full (vllm:admission_rejections_total, vLLM 0.32+).")),
    Signal("kvwatch_engine_sleeping", "state",
           "1 while the engine sleeps, 0 while awake (vllm:engine_sleep_state).",
           _sleeping, "exhaustion",
           "max by ({by}) (1 - kvwatch_engine_sleep_state{{{sel},sleep_state=\"awake\"}})",
           record=("kvwatch_engine_sleeping", "max"), needs=("sleep_state",), display="Engine sleeping",
           doc=("1 while the engine sleeps (sleep level 1 or 2), 0 while awake: a sleeping engine is not a down one "
           "(vllm:engine_sleep_state, vLLM 0.11.1+).")),
    # --- prefix cache ---
    Signal("kvwatch_prefix_cache_hit_ratio", "ratio",
           "Prefix-cache lookup hit ratio over the window: hit tokens / queried tokens.",
           _prefix_hit_ratio, "prefix",
           _ratio_of_rates("kvwatch_engine_prefix_cache_hits_total", "kvwatch_engine_prefix_cache_queries_total"),
           display="Prefix cache hit ratio", record=("kvwatch_prefix_cache_hit", "ratio_rate{w}"), good="high",
           doc=("Lookup hit ratio: prefix-cache hits over queries in the window, from token counters, not lifetime totals; "
           "re-lookups after preemption and scheduling retries count again, so it is not the share of prompt tokens "
           "served from a cache (kvwatch_prompt_tokens_from_cache_ratio) "
           "(vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, formerly gpu_prefix_cache_*; V0: vllm:gpu_prefix_cache_hit_rate).")),
    Signal("kvwatch_external_prefix_cache_hit_ratio", "ratio",
           "External (KV connector) prefix-cache hits over queries in the window (vllm:external_prefix_cache_{hits,queries}_total).",
           lambda v: v.increase.ratio("external_prefix_hits", "external_prefix_queries"), "prefix",
           _ratio_of_rates("kvwatch_engine_external_prefix_cache_hits_total", "kvwatch_engine_external_prefix_cache_queries_total"),
           display="External prefix cache hit ratio", record=("kvwatch_external_prefix_cache_hit", "ratio_rate{w}"),
           needs=("external_prefix_queries",), good="high"),
    Signal("kvwatch_prompt_tokens_cached_ratio", "ratio",
           "Share of prompt tokens served from a cache in the window (vllm:prompt_tokens_cached_total).",
           _cached_share, "prefix",
           _ratio_of_rates("kvwatch_engine_prompt_tokens_cached_total", "kvwatch_engine_prompt_tokens_total"),
           record=("kvwatch_prompt_tokens_cached", "ratio_rate{w}"), display="Prompt tokens served from a cache, all tiers", good="high",
           doc=("Share of prompt tokens served from a cache in the window (vllm:prompt_tokens_cached_total / vllm:prompt_tokens_total; "
           "before 0.16 prefix hits / prompt tokens).")),
    Signal("kvwatch_prompt_tokens_from_cache_ratio", "ratio",
           "Share of prompt tokens served from a cache, by tier: local or external (vLLM 0.16+).",
           _from_cache, "prefix",
           "(\n  label_replace(sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_cache_hit\"}}[{w}])), \"tier\", \"local\", \"\", \"\")\n"
           "  or\n  label_replace(sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"external_kv_transfer\"}}[{w}])), \"tier\", \"external\", \"\", \"\")\n)\n"
           "/ ignoring (tier) group_left\nsum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel}}}[{w}]))",
           label="tier", panel="prefix_cache", title="Prompt tokens served from a cache, by tier",
           record=("kvwatch_prompt_tokens_from_cache", "ratio_rate{w}"), needs=("prompt_tokens_by_source",), display="Prompt tokens served from a cache, by tier", good="high",
           doc=("Share of prompt tokens served from a cache, by tier: local (this engine's prefix cache) and external "
           "(a KV connector); the rest was computed. Not the lookup hit ratio, which re-lookups inflate "
           "(vllm:prompt_tokens_by_source_total, vLLM 0.16+).")),
    Signal("kvwatch_prompt_tokens_by_tier_ratio", "ratio",
           "Share of the window's prompt tokens each cache tier served, and computed; sums to 1.",
           prompt_tokens_by_tier, "prefix",
           "sum by ({by}, tier) (\n"
           "  label_replace(rate(kvwatch_engine_prompt_tokens_cached_by_source_total{{{sel}}}[{w}]), \"tier\", \"$1\", \"source\", \"(.*)\")\n"
           "  or\n"
           "  label_replace(rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_compute\"}}[{w}]), \"tier\", \"computed\", \"\", \"\")\n"
           ")\n/ ignoring (tier) group_left\n"
           "sum by ({by}) (\n"
           "  rate(kvwatch_engine_prompt_tokens_cached_by_source_total{{{sel}}}[{w}])\n"
           "  or\n"
           "  rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_compute\"}}[{w}])\n"
           ")",
           label="tier", panel="prefix_cache", title="Prompt tokens by the cache tier that served them, and computed",
           record=("kvwatch_prompt_tokens_by_tier", "ratio_rate{w}"),
           needs=("prompt_tokens_cached_by_source", "prompt_tokens_by_source"),
           display="Prompt tokens by cache tier", good=None,
           doc=("Share of the window's prompt tokens each cache tier served, and the share computed (tier=\"computed\"), "
           "token-weighted: a tier's cached tokens over every tier's plus the computed ones; the shares sum to 1. "
           "Tiers as the engine names them: vLLM device, host, disk, p2p, external_unspecified "
           "(vllm:prompt_tokens_cached_by_source_total and prompt_tokens_by_source_total{source=\"local_compute\"}, "
           "vLLM 0.32+); SGLang device, host, storage (sglang:prefill_effective_tokens_total{mode}, input = computed).")),
    Signal("kvwatch_kv_cache_reuse_shortfall_blocks", "blocks",
           "KV blocks the cache lacks to keep idle prefixes until their reuse (--kv-cache-metrics).",
           reuse_shortfall_blocks, "prefix",
           "ceil(sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) * (1 - avg_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}])))\n* clamp_min(\n"
           "  histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_reuse_gap_seconds_bucket{{{sel}}}[{w}])))\n"
           "  / clamp_min(histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_idle_before_evict_seconds_bucket{{{sel}}}[{w}]))), 0.001)\n  - 1, 0))",
           record=("kvwatch_kv_cache_reuse_shortfall_blocks", "ratio_rate{w}"),
           needs=("kv_block_reuse_gap", "kv_block_idle_before_evict"), display="KV blocks short of keeping reuse", good="low",
           doc=("KV blocks the cache lacks to keep idle prefixes until their typical reuse: free pool x (median reuse "
           "gap / median idle time before eviction - 1), 0 when blocks outlive the reuse gap "
           "(vllm:kv_block_reuse_gap_seconds, vllm:kv_block_idle_before_evict_seconds: --kv-cache-metrics).")),
    Signal("kvwatch_kv_cache_reuse_shortfall_bytes", "bytes",
           "The reuse shortfall in bytes (--kv-cache-metrics).",
           _reuse_shortfall_bytes, "prefix",
           "ceil(sum by ({by}) ((kvwatch_engine_kv_cache_blocks{{{sel}}} - 1) * (1 - avg_over_time(kvwatch_engine_kv_cache_usage_ratio{{{sel}}}[{w}])) * kvwatch_engine_kv_cache_memory_bytes{{{sel}}} / kvwatch_engine_kv_cache_blocks{{{sel}}})\n* clamp_min(\n"
           "  histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_reuse_gap_seconds_bucket{{{sel}}}[{w}])))\n"
           "  / clamp_min(histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_engine_kv_block_idle_before_evict_seconds_bucket{{{sel}}}[{w}]))), 0.001)\n  - 1, 0))",
           record=("kvwatch_kv_cache_reuse_shortfall_bytes", "ratio_rate{w}"),
           needs=("kv_block_reuse_gap", "kv_block_idle_before_evict"), display="KV bytes short of keeping reuse", good="low",
           doc=("The reuse shortfall in bytes: blocks x kv_cache_memory_bytes / num_gpu_blocks (--kv-cache-metrics, "
           "bytes as for kvwatch_kv_cache_used_bytes).")),
    Signal("kvwatch_kv_offload_bytes_per_second", "per_second",
           "Bytes per second stored to and loaded from the KV offload tier, by direction.",
           _offload_rates, "prefix",
           "(\n  label_replace(sum by ({by}) (rate(kvwatch_engine_kv_offload_load_bytes_total{{{sel}}}[{w}])), \"direction\", \"load\", \"\", \"\")\n"
           "  or\n  label_replace(sum by ({by}) (rate(kvwatch_engine_kv_offload_store_bytes_total{{{sel}}}[{w}])), \"direction\", \"store\", \"\", \"\")\n)",
           label="direction", record=("kvwatch_kv_offload_bytes", "rate{w}"),
           needs=("offload_load_bytes", "offload_store_bytes"), display="KV offload transfer rate",
           doc=("Bytes per second moved to (store) and from (load) the KV offload tier (vllm:kv_offload_{load,store}_bytes_total, "
           "else the deprecated vllm:kv_offload_total_bytes_total{transfer_type}, never both; OffloadingConnector only).")),
    Signal("kvwatch_cache_tier_cost_ratio", "ratio",
           "A cache tier's time added over the prefill time it saved (an estimate): below 1 it pays.",
           cache_tier_cost, "prefix",
           "label_replace(\n  sum by ({by}) (\n"
           "    label_replace(rate(kvwatch_engine_kv_offload_load_seconds_total{{{sel}}}[{w}]), \"part\", \"load\", \"\", \"\")\n"
           "    or label_replace(rate(kvwatch_engine_kv_offload_lookup_sync_delay_seconds_sum{{{sel}}}[{w}]), \"part\", \"sync\", \"\", \"\")\n"
           "    or label_replace(rate(kvwatch_engine_kv_offload_lookup_async_delay_seconds_sum{{{sel}}}[{w}]), \"part\", \"async\", \"\", \"\")\n"
           "  )\n"
           "  / on ({by}) (sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"external_kv_transfer\"}}[{w}])) > 0)\n"
           "  / on ({by}) (\n"
           "    (sum by ({by}) (rate(kvwatch_engine_request_prefill_time_seconds_sum{{{sel}}}[{w}])) > 0)\n"
           "    / on ({by}) (sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_compute\"}}[{w}])) > 0)\n"
           "  ),\n  \"tier\", \"offload\", \"\", \"\")\n"
           "or\nlabel_replace(\n"
           "  sum by ({by}) (rate(kvwatch_engine_hicache_load_back_seconds_sum{{{sel}}}[{w}]))\n"
           "  / on ({by}) (sum by ({by}) (rate(kvwatch_engine_prompt_tokens_cached_by_source_total{{{sel},source=\"host\"}}[{w}])) > 0)\n"
           "  / on ({by}) (\n"
           "    (sum by ({by}) (rate(kvwatch_engine_prefill_forward_seconds_total{{{sel}}}[{w}])) > 0)\n"
           "    / on ({by}) (sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"local_compute\"}}[{w}])) > 0)\n"
           "  ),\n  \"tier\", \"host\", \"\", \"\")",
           label="tier", panel="prefix_cache", title="Does the cache tier pay for itself? Time added over compute saved",
           record=("kvwatch_cache_tier_cost", "ratio_rate{w}"),
           needs=("offload_load_seconds|hicache_load_back_time", "prompt_tokens_by_source",
                  "prefill_time|prefill_forward_seconds"),
           display="Cache tier cost over compute saved (estimate)", good="low",
           doc=("Whether a cache tier pays for itself: the seconds it added in the window (its loads and lookups) over the "
           "prefill seconds the tokens it served would have cost to compute; below 1 it saves more time than it "
           "costs, above 1 computing would have been quicker. An ESTIMATE: the compute cost is the window's prefill "
           "seconds per computed token (vllm:request_prefill_time_seconds sum over "
           "prompt_tokens_by_source_total{source=\"local_compute\"}), and with batching both sides are "
           "request-seconds, not wall time. vLLM's offload tier (tier=\"offload\"): vllm:kv_offload_load_time_total "
           "plus the sums of vllm:kv_offload_lookup_{sync,async}_delay_seconds, over the tokens it served "
           "(prompt_tokens_by_source_total{source=\"external_kv_transfer\"}); OffloadingConnector only. SGLang's "
           "HiCache host tier (tier=\"host\"): the sum of sglang:load_back_duration_seconds over the tokens it served "
           "(prefill_effective_tokens_total{mode=\"host_hit\"}), the compute cost from "
           "sglang:forward_execution_seconds_total{category=\"forward_extend\"} over mode=\"input\" "
           "(SGLANG_ENABLE_METRICS_DEVICE_TIMER=1); its storage tier (L3) exports no time and is not weighed.")),
    Signal("kvwatch_cache_tier_moved_bytes_per_token", "bytes",
           "Bytes a cache tier moved (stored and loaded) per prompt token it served.",
           cache_tier_bytes_per_token, "prefix",
           "label_replace(\n  sum by ({by}) (\n"
           "    label_replace(rate(kvwatch_engine_kv_offload_load_bytes_total{{{sel}}}[{w}]), \"direction\", \"load\", \"\", \"\")\n"
           "    or label_replace(rate(kvwatch_engine_kv_offload_store_bytes_total{{{sel}}}[{w}]), \"direction\", \"store\", \"\", \"\")\n"
           "  )\n"
           "  / on ({by}) (sum by ({by}) (rate(kvwatch_engine_prompt_tokens_by_source_total{{{sel},source=\"external_kv_transfer\"}}[{w}])) > 0),\n  \"tier\", \"offload\", \"\", \"\")\n"
           "or\nlabel_replace(\n  sum by ({by}) (\n"
           "    label_replace(rate(kvwatch_engine_hicache_load_back_bytes_total{{{sel}}}[{w}]), \"direction\", \"load\", \"\", \"\")\n"
           "    or label_replace(rate(kvwatch_engine_hicache_backup_bytes_total{{{sel}}}[{w}]), \"direction\", \"store\", \"\", \"\")\n"
           "  )\n"
           "  / on ({by}) (sum by ({by}) (rate(kvwatch_engine_prompt_tokens_cached_by_source_total{{{sel},source=\"host\"}}[{w}])) > 0),\n  \"tier\", \"host\", \"\", \"\")",
           label="tier", panel="prefix_cache", title="Bytes a cache tier moved per token it served",
           record=("kvwatch_cache_tier_moved_bytes_per_token", "ratio_rate{w}"),
           needs=("offload_load_bytes|hicache_load_back_bytes", "prompt_tokens_by_source"),
           display="Cache tier bytes moved per token served",
           good="low",
           doc=("Bytes a cache tier moved (stored and loaded) per prompt token it served in the window: the KV bytes of "
           "one token when every token stored is served once, a multiple of them when stores go unused. vLLM's "
           "offload tier: vllm:kv_offload_{load,store}_bytes_total over "
           "prompt_tokens_by_source_total{source=\"external_kv_transfer\"}; OffloadingConnector only. SGLang's "
           "HiCache host tier: sglang:hicache_backup_bytes_total plus load_back_bytes_total (draft transfers "
           "included) over prefill_effective_tokens_total{mode=\"host_hit\"}; its storage tier (L3) exports no "
           "bytes.")),
    # --- what the cache is worth (kvwatch/signals/worth.py) ---
    Signal("kvwatch_cache_saved_prefill_seconds", "seconds",
           "Prefill seconds the cache saved in the window, by tier: tokens served x their cost at their position.",
           worth.saved_seconds, "prefix", worth.SAVED_PROMQL, label="tier", inexact_twin=_POSITION_PRICE,
           record=("kvwatch_cache_saved_prefill_seconds", "increase{w}"),
           needs=("prompt_tokens_by_source", "prefill_time|prefill_forward_seconds"),
           display="Prefill seconds the cache saved", good="high",
           doc=("Prefill seconds the cache saved in the window, by tier: the prompt tokens each tier served x what "
           "computing a cached token would have cost at its position, less the seconds that tier took to load them "
           "back where the engine measures it. The ASSUMPTION: a token at position p of its prompt costs b + c x p "
           "(its projections and MLP, and attention over the p before it), so a request of P prompt tokens, K "
           "cached, costs a + b x (P - K) + c x (K + ... + P - 1), fitted over the window's polls that finished "
           "one request (only there do the sums of vllm:request_prefill_time_seconds, "
           "vllm:request_prefill_kv_computed_tokens and vllm:request_prompt_tokens, all observed at the request's "
           "end, say where its tokens sat); a cached token is priced b + c x the mean position of the window's "
           "cached tokens (each poll's requests taken as one shape: a lower bound where shapes mix). On the real "
           "vLLM of the CPU tier a long prefix's tokens cost more than the short suffixes computed after it, which "
           "a price linear in the tokens undercounts. Where those polls cannot tell c apart (too few: a busy engine "
           "finishes several requests a poll) or it fits below zero, the marginal rate: the slope b of "
           "vllm:request_prefill_time_seconds "
           "= a x requests + b x computed tokens, fitted over the window's polls (tokens from "
           "vllm:request_prefill_kv_computed_tokens, observed with the time, 0.13+; else "
           "prompt_tokens_by_source_total{source=\"local_compute\"}), so a request's fixed cost a (an engine step, "
           "cached or not) is not charged to its tokens; where the polls cannot tell a from b, the sum less one mean "
           "vllm:inter_token_latency_seconds a request over the computed tokens (SGLang: "
           "forward_execution_seconds_total{category=\"forward_extend\"} over them); with batching those are "
           "request-seconds, not wall time. Tiers: vllm:prompt_tokens_cached_by_source_total (0.32+: device, host, ...), else "
           "prompt_tokens_by_source_total local_cache_hit (tier=\"local\") and external_kv_transfer "
           "(tier=\"external\"); SGLang prefill_effective_tokens_total{mode}. Load-back: vLLM's offload tier "
           "(kv_offload_load_time_total and its lookup delays: tier host from 0.32, external before), SGLang's "
           "load_back_duration_seconds (host). Priced per GPU-hour with gpu_hour_price.")),
    Signal("kvwatch_cache_lost_prefill_seconds", "seconds",
           "Prefill seconds the window spent recomputing preempted requests' prompts (vLLM: an upper bound).",
           worth.lost_seconds, "exhaustion", worth.LOST_PROMQL, inexact_twin=_FITTED_RATE,
           record=("kvwatch_cache_lost_prefill_seconds", "increase{w}"),
           needs=("preemptions", "prompt_tokens_by_source", "prefill_time|prefill_forward_seconds"),
           display="Prefill seconds lost to recomputation, from the page (vLLM: upper bound)", good="low",
           doc=("Prefill seconds the window spent computing again the prompts of preempted (SGLang: retracted) "
           "requests, at the window's prefill seconds per computed token (as kvwatch_cache_saved_prefill_seconds). "
           "SGLang counts the tokens (num_retracted_input_tokens_total); on vLLM it is an UPPER BOUND from the "
           "page, preemptions x the mean prompt of the requests finished in the window, as "
           "kvwatch_prefill_recomputed_ratio. With the event stream on, kvwatch_kv_events_lost_prefill_seconds "
           "counts the blocks actually stored again after their eviction instead. Under heavy preemption the rate "
           "itself runs high (a preempted request's prefill time runs from its first scheduling): on the "
           "simulator's exhaustion scenario 6x the prefill seconds spent recomputing.")),
    Signal("kvwatch_kv_offload_lookup_delay_mean_seconds", "seconds",
           "Mean time of the offload tier's lookups in the window, by kind (sync, async).",
           _offload_lookup_delay, "prefix",
           "label_replace(" + _mean_promql("kvwatch_engine_kv_offload_lookup_sync_delay_seconds") + ", \"kind\", \"sync\", \"\", \"\")\n"
           "or\nlabel_replace(" + _mean_promql("kvwatch_engine_kv_offload_lookup_async_delay_seconds") + ", \"kind\", \"async\", \"\", \"\")",
           label="kind", panel="prefix_cache", title="KV offload lookup delay, mean",
           record=("kvwatch_kv_offload_lookup_delay_seconds", "mean_rate{w}"),
           needs=("offload_lookup_sync_delay",), display="KV offload lookup delay, mean", good="low",
           doc=("Mean time of the offload tier's lookups in the window: kind=\"sync\", inside one lookup call, which the "
           "scheduler's step waits on (vllm:kv_offload_lookup_sync_delay_seconds); kind=\"async\", from a request's "
           "lookup first deferring to the lookup that resolves it (vllm:kv_offload_lookup_async_delay_seconds); "
           "OffloadingConnector only.")),
    Signal("kvwatch_kv_offload_stores_dropped_per_second", "per_second",
           "Offload-tier stores not made per second, by reason.",
           _offload_stores_dropped, "prefix",
           "label_replace(sum by ({by}) (rate(kvwatch_engine_kv_offload_allocation_failures_total{{{sel}}}[{w}])), \"reason\", \"allocation_failure\", \"\", \"\")\n"
           "or\nlabel_replace(sum by ({by}) (rate(kvwatch_engine_kv_offload_stores_skipped_total{{{sel}}}[{w}])), \"reason\", \"below_reuse_threshold\", \"\", \"\")",
           label="reason", output_labels=("reason",), record=("kvwatch_kv_offload_stores_dropped", "rate{w}"),
           needs=("offload_allocation_failures",), display="KV offload stores not made", good="low",
           doc=("Offload-tier stores not made, per second, by reason: allocation_failure, the tier found no room "
           "(vllm:kv_offload_allocation_failure_total); below_reuse_threshold, the block was offered fewer times "
           "than store_threshold asks, a policy (vllm:kv_offload_stores_skipped_total, the CPU tier with "
           "store_threshold >= 2); OffloadingConnector only.")),
    Signal("kvwatch_requests_kv_fetch", "requests",
           "Waiting requests by async KV load stage now (vLLM 0.32+, a KV consumer only).",
           _kv_fetch_by_stage, "exhaustion",
           "sum by ({by}, stage) (kvwatch_engine_requests_kv_fetch_by_stage{{{sel}}})", label="stage",
           record=("kvwatch_requests_kv_fetch", "sum"), needs=("kv_fetch_by_stage",),
           display="Requests waiting on a KV fetch", good="low",
           doc=("Waiting requests by async KV load stage now: waiting_to_start (a fetch intended, no transfer started), "
           "in_progress (receiving KV), completed_waiting (received, waiting to run) "
           "(vllm:num_requests_kv_fetch_by_stage, vLLM 0.32+; a KV consumer only).")),
    # --- first token ---
    Signal("kvwatch_time_to_first_token_seconds", "seconds",
           "Time to first token quantiles over the window (vllm:time_to_first_token_seconds).",
           _quantiles("ttft", "TTFT"), "first_token",
           _quantile_promql("kvwatch_engine_time_to_first_token_seconds"), label="quantile", inexact_twin=_PINNED_QUANTILE,
           display="Time to first token", record=("kvwatch_time_to_first_token_seconds", "histogram_quantile_rate{w}"), good="low",
           doc="Time to first token quantiles over the window, from bucket increases with the scraped bounds (vllm:time_to_first_token_seconds)."),
    Signal("kvwatch_time_to_first_token_mean_seconds", "seconds",
           "Mean time to first token over the window (vllm:time_to_first_token_seconds _sum/_count).",
           _mean("ttft"), "first_token", _mean_promql("kvwatch_engine_time_to_first_token_seconds"),
           display="Time to first token, mean", record=("kvwatch_time_to_first_token_seconds", "mean_rate{w}"), good="low"),
    Signal("kvwatch_queue_time_seconds", "seconds",
           "Queue (WAITING) time quantiles over the window (vllm:request_queue_time_seconds).",
           _quantiles("queue_time", "queue time"), "first_token",
           _quantile_promql("kvwatch_engine_request_queue_time_seconds"), label="quantile", inexact_twin=_PINNED_QUANTILE,
           display="Queue time", record=("kvwatch_queue_time_seconds", "histogram_quantile_rate{w}"), good="low"),
    Signal("kvwatch_queue_time_mean_seconds", "seconds",
           "Mean queue time over the window (vllm:request_queue_time_seconds _sum/_count).",
           _mean("queue_time"), "first_token", _mean_promql("kvwatch_engine_request_queue_time_seconds"),
           display="Queue time, mean", record=("kvwatch_queue_time_seconds", "mean_rate{w}"), good="low"),
    Signal("kvwatch_prefill_time_seconds", "seconds",
           "Prefill time quantiles over the window (vllm:request_prefill_time_seconds).",
           _quantiles("prefill_time", "prefill time"), "first_token",
           _quantile_promql("kvwatch_engine_request_prefill_time_seconds"), label="quantile", inexact_twin=_PINNED_QUANTILE,
           display="Prefill time", record=("kvwatch_prefill_time_seconds", "histogram_quantile_rate{w}"), good="low"),
    Signal("kvwatch_prefill_time_mean_seconds", "seconds",
           "Mean prefill time over the window (vllm:request_prefill_time_seconds _sum/_count).",
           _mean("prefill_time"), "first_token", _mean_promql("kvwatch_engine_request_prefill_time_seconds"),
           display="Prefill time, mean", record=("kvwatch_prefill_time_seconds", "mean_rate{w}"), good="low"),
    Signal("kvwatch_time_to_first_token_share_ratio", "ratio",
           "Share of mean TTFT spent in queue, in prefill and elsewhere, by part.",
           ttft_parts, "first_token",
           # The queue part: its mean over TTFT's, each mean in parentheses (a / b / c / d divides
           # by c then by d), at most 1 as TtftDecomposition clamps it.
           "clamp_max(\n(" + _mean_promql("kvwatch_engine_request_queue_time_seconds") + ")\n/ on ({by})\n("
           + _mean_promql("kvwatch_engine_time_to_first_token_seconds") + "),\n1)", label="part",
           output_labels=("part",), record_labels=(("part", "queue"),),
           display="Time to first token split", record=("kvwatch_time_to_first_token_share", "ratio_rate{w}"), good="low",
           doc=("Share of mean TTFT spent in queue, in prefill, and elsewhere (front end, tokenization, scheduling); the PromQL twin is the queue part "
           "(vllm:time_to_first_token_seconds, vllm:request_queue_time_seconds, vllm:request_prefill_time_seconds).")),
    # --- throughput and failures ---
    Signal("kvwatch_requests_finished_per_second", "per_second",
           "Finished requests per second by reason (vllm:request_success_total).",
           _labelled_rates("finished"), "throughput",
           "sum by ({by}, finished_reason) (rate(kvwatch_engine_requests_finished_total{{{sel}}}[{w}]))",
           label="finished_reason", output_labels=("finished_reason",),
           display="Finished requests", record=("kvwatch_requests_finished", "rate{w}")),
    Signal("kvwatch_requests_failed_per_second", "per_second",
           "Requests ending in abort or error per second (vllm:request_success_total{finished_reason=~\"abort|error\"}).",
           _failed_rate, "throughput",
           "sum by ({by}) (rate(kvwatch_engine_requests_finished_total{{{sel},finished_reason=~\"abort|error\"}}[{w}]))",
           display="Failed requests", record=("kvwatch_requests_failed", "rate{w}"), good="low"),
    Signal("kvwatch_prompt_tokens_per_second", "per_second",
           "Prompt tokens per second, cached included (vllm:prompt_tokens_total).",
           _rate("prompt_tokens"), "throughput",
           "sum by ({by}) (rate(kvwatch_engine_prompt_tokens_total{{{sel}}}[{w}]))",
           display="Prompt tokens", record=("kvwatch_prompt_tokens", "rate{w}")),
    Signal("kvwatch_generation_tokens_per_second", "per_second",
           "Generated tokens per second (vllm:generation_tokens_total).",
           _rate("generation_tokens"), "throughput",
           "sum by ({by}) (rate(kvwatch_engine_generation_tokens_total{{{sel}}}[{w}]))",
           display="Generated tokens", record=("kvwatch_generation_tokens", "rate{w}")),
    Signal("kvwatch_prompt_tokens_per_request_mean", "tokens",
           "Mean prompt tokens per finished request in the window (vllm:request_prompt_tokens).",
           lambda v: mean_tokens(v, "prompt_len", "prompt_tokens"), "throughput",
           _mean_promql("kvwatch_engine_request_prompt_tokens"),
           display="Prompt length, mean", record=("kvwatch_prompt_tokens_per_request", "mean_rate{w}")),
    Signal("kvwatch_generation_tokens_per_request_mean", "tokens",
           "Mean generated tokens per finished request in the window (vllm:request_generation_tokens).",
           lambda v: mean_tokens(v, "generation_len", "generation_tokens"), "throughput",
           _mean_promql("kvwatch_engine_request_generation_tokens"),
           display="Generated length, mean", record=("kvwatch_generation_tokens_per_request", "mean_rate{w}")),
)

SIGNALS_BY_NAME = {signal.name: signal for signal in SIGNALS}


def good_direction(name: str) -> str | None:
    """The declared good side ("high", "low" or None) of a catalogue entry:
    a signal, a re-exported engine series or a health family, by its
    exported name (a counter with or without `_total`)."""
    if name in SIGNALS_BY_NAME:
        return SIGNALS_BY_NAME[name].good
    if name in TIER_SIGNALS_BY_NAME:
        return TIER_SIGNALS_BY_NAME[name].good
    for stream in STREAM_SIGNALS + STREAM_SIZING:
        if name == stream.name:
            return stream.good
    for entry in (ENGINE_SERIES + HEALTH + SCRAPE + TIER_HEALTH + TIER_SERIES + CENTRAL_HEALTH + STREAM_HEALTH
                  + ROUTER_HEALTH):
        if name in (entry.name, entry.sample_name):
            return entry.good
    raise KeyError(f"{name} is not in the catalogue")


# --------------------------------------------------------------------------
# LMCache's signals (its series: kvwatch.signals.series; its health: health.py)
# --------------------------------------------------------------------------

TIER_SIGNALS: tuple[Signal, ...] = (
    Signal("kvwatch_lmcache_hit_ratio", "ratio",
           "LMCache's hit ratio over the window: tokens delivered / tokens asked for.",
           lambda v: v.increase.ratio("hit_tokens", "requested_tokens"), "prefix",
           _ratio_of_rates("kvwatch_lmcache_hit_tokens_total", "kvwatch_lmcache_requested_tokens_total"),
           needs=("hit_tokens", "requested_tokens"), display="LMCache hit ratio", good="high",
           doc=("LMCache's hit ratio over the window: tokens delivered over tokens asked for, from counter deltas "
           "(lmcache:num_hit_tokens / lmcache:num_requested_tokens); absent with no retrievals in the window. "
           "LMCache's retrieve_hit_rate gauge is never read: it covers one log interval and reads 1 with none.")),
    Signal("kvwatch_lmcache_prompt_tokens_served_ratio", "ratio",
           "Share of the prompt tokens LMCache saw that it delivered, over the window.",
           lambda v: v.increase.ratio("hit_tokens", "prompt_tokens"), "prefix",
           _ratio_of_rates("kvwatch_lmcache_hit_tokens_total", "kvwatch_lmcache_prompt_tokens_total"),
           needs=("hit_tokens", "prompt_tokens"), display="Prompt tokens from LMCache", good="high",
           doc=("Share of the prompt tokens LMCache's connector saw that LMCache delivered, over the window: how much "
           "prefill the tier saved (lmcache:num_hit_tokens / lmcache:num_prompt_tokens); absent with no prompt "
           "tokens in the window or in builds without num_prompt_tokens.")),
    Signal("kvwatch_lmcache_retrieved_tokens_per_second", "per_second",
           "Tokens LMCache delivered to the engine per second over the window (lmcache:num_hit_tokens).",
           _rate("hit_tokens"), "prefix",
           "sum by ({by}) (rate(kvwatch_lmcache_hit_tokens_total{{{sel}}}[{w}]))",
           needs=("hit_tokens",), display="LMCache tokens retrieved", good="high"),
    Signal("kvwatch_lmcache_lookup_tokens_by_tier_ratio", "ratio",
           "Share of LMCache's looked-up tokens its L1 held, its L2 added and neither held.",
           lmcache_lookup_by_tier, "prefix",
           "(\n  label_replace(sum by ({by}) (rate(kvwatch_lmcache_lookup_hit_l1_tokens_total{{{sel}}}[{w}])), \"tier\", \"l1\", \"\", \"\")\n"
           "  or\n  label_replace(sum by ({by}) (rate(kvwatch_lmcache_lookup_hit_l2_tokens_total{{{sel}}}[{w}])), \"tier\", \"l2\", \"\", \"\")\n"
           "  or\n  label_replace(clamp_min(sum by ({by}) (rate(kvwatch_lmcache_lookup_requested_tokens_total{{{sel}}}[{w}])) "
           "- sum by ({by}) (rate(kvwatch_lmcache_lookup_hit_tokens_total{{{sel}}}[{w}])), 0), \"tier\", \"not_found\", \"\", \"\")\n)\n"
           "/ ignoring (tier) group_left ()\n(sum by ({by}) (rate(kvwatch_lmcache_lookup_requested_tokens_total{{{sel}}}[{w}])) > 0)",
           label="tier", needs=("lookup_requested_tokens", "lookup_hit_l1_tokens", "lookup_hit_l2_tokens"),
           display="LMCache lookups by tier", good=None,
           doc=("LMCache's multiprocess server (0.5.3+), token-weighted: the share of the window's looked-up tokens "
           "its L1 (CPU memory) held (tier=\"l1\"), its L2 (storage) added (tier=\"l2\", loaded into L1 first) "
           "and neither held (tier=\"not_found\"); the shares sum to 1 (lmcache_mp_lookup_hit_l1_tokens_total, "
           "lmcache_mp_lookup_hit_l2_tokens_total, lmcache_mp_lookup_hit_tokens_total over "
           "lmcache_mp_lookup_requested_tokens_total, summed over cache_salt). Lookups, not deliveries.")),
    Signal("kvwatch_lmcache_stored_tokens_per_second", "per_second",
           "Tokens stored into LMCache per second over the window (lmcache:num_stored_tokens).",
           _rate("stored_tokens"), "prefix",
           "sum by ({by}) (rate(kvwatch_lmcache_stored_tokens_total{{{sel}}}[{w}]))",
           needs=("stored_tokens",), display="LMCache tokens stored"),
)
TIER_SIGNALS_BY_NAME = {signal.name: signal for signal in TIER_SIGNALS}


# --------------------------------------------------------------------------
# The engine's KV-cache event stream's signals (kvwatch/kvevents; its health: health.py)
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class StreamSignal:
    name: str
    unit: str
    key: str  # the report's window key
    help: str
    promql: str
    display: str
    good: str | None = None
    doc: str = ""  # as Signal.doc: what docs/metrics.md shows where the one-line help is not enough


STREAM_SIGNALS: tuple[StreamSignal, ...] = (
    StreamSignal("kvwatch_kv_events_blocks_stored_per_second", "per_second", "stored_per_second",
                 "Blocks stored per second over the window (BlockStored).",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_total{{{sel}}}[{w}]))", "Blocks stored"),
    StreamSignal("kvwatch_kv_events_blocks_evicted_per_second", "per_second", "evicted_per_second",
                 "Blocks evicted per second over the window (BlockRemoved).",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_evicted_total{{{sel}}}[{w}]))", "Blocks evicted",
                 good="low"),
    StreamSignal("kvwatch_kv_events_blocks_stored_again_per_second", "per_second", "stored_again_per_second",
                 "Blocks stored again after their eviction per second over the window: recomputation a larger "
                 "cache would have saved.",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_again_total{{{sel}}}[{w}]))",
                 "Blocks stored again after eviction", good="low"),
    StreamSignal("kvwatch_kv_events_stored_again_ratio", "ratio", "stored_again_ratio",
                 "Share of the window's stored blocks stored again after their eviction.",
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_again_total{{{sel}}}[{w}])) / "
                 "sum by ({by}) (rate(kvwatch_kv_events_blocks_stored_total{{{sel}}}[{w}]))",
                 "Stored again after eviction", good="low",
                 doc=("Share of the window's stored blocks that were stored again after their eviction; absent with "
                 "no stores in the window. High: eviction before reuse; 0 while stores go on: no reuse.")),
    StreamSignal("kvwatch_kv_events_return_after_eviction_seconds", "seconds", "return_seconds_median",
                 "Median time from a block's eviction to its return over the window.",
                 "histogram_quantile(0.5, sum by ({by}, le) (rate(kvwatch_kv_events_eviction_return_seconds_bucket"
                 "{{{sel}}}[{w}])))", "Eviction to return (median)",
                 doc=("Median time from a block's eviction to its return over the window (the bucket bound of "
                 "kvwatch_kv_events_eviction_return_seconds); absent with no returns.")),    StreamSignal("kvwatch_kv_events_lost_prefill_seconds", "seconds", "lost_prefill_seconds",
                 "Prefill seconds the window spent computing again blocks evicted before their reuse.",
                 "max by ({by}) (kvwatch_kv_events_lost_prefill_seconds{{{sel}}})",
                 "Prefill seconds lost to eviction before reuse", good="low",
                 doc=("Prefill seconds the window spent computing again blocks evicted before their reuse, a "
                 "preempted request's evicted prefix included: blocks stored again after their eviction x block "
                 "size x the page's prefill seconds per computed token (as kvwatch_cache_saved_prefill_seconds); "
                 "absent without the page's prefill time to price them at.")),
)
STREAM_SIGNALS_BY_NAME = {signal.name: signal for signal in STREAM_SIGNALS}

# The sizing curve (kvwatch/kvevents/source.py: sizing_curve), per extra cache
# as a multiple of the engine's cache (label `extra_cache`).
STREAM_SIZING: tuple[StreamSignal, ...] = (
    StreamSignal("kvwatch_kv_events_sizing_hit_ratio", "ratio", "hit_ratio",
                 "Estimated prefix-cache hit ratio over the window with a cache larger by `extra_cache` times the "
                 "engine's (its returns whose distance is below the extra blocks counted as hits with the page's "
                 "hits; vllm:prefix_cache_hits / prefix_cache_queries for the rest). An estimate: first order.",
                 "max by ({by}, extra_cache) (kvwatch_kv_events_sizing_hit_ratio{{{sel}}})", "Hit ratio with more cache",
                 good="high"),
    StreamSignal("kvwatch_kv_events_sizing_recomputation_avoided_ratio", "ratio", "recomputation_avoided_ratio",
                 "Estimated share of the window's blocks stored again after eviction that a cache larger by "
                 "`extra_cache` times the engine's would have kept.",
                 "max by ({by}, extra_cache) (kvwatch_kv_events_sizing_recomputation_avoided_ratio{{{sel}}})",
                 "Recomputation avoided", good="high"),    StreamSignal("kvwatch_kv_events_sizing_saved_prefill_seconds_per_hour", "seconds", "saved_prefill_seconds_per_hour",
                 "Estimated prefill seconds per hour a cache larger by `extra_cache` times the engine's would have "
                 "saved (blocks kept x block size x the page's prefill seconds per computed token).",
                 "max by ({by}, extra_cache) (kvwatch_kv_events_sizing_saved_prefill_seconds_per_hour{{{sel}}})",
                 "Prefill seconds per hour more cache buys", good="high"),
    StreamSignal("kvwatch_kv_events_sizing_extra_bytes", "bytes", "extra_bytes",
                 "The memory `extra_cache` times the engine's cache costs: its extra blocks x bytes per block "
                 "(vllm:cache_config_info).",
                 "max by ({by}, extra_cache) (kvwatch_kv_events_sizing_extra_bytes{{{sel}}})",
                 "Extra KV cache memory"),
)
