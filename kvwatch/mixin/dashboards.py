"""The Grafana dashboards, built with grafanalib from the signal catalogue.

Four dashboards: an overview (per model and engine: KV usage and headroom,
hit ratio, preemptions, time to first token and its parts, queue,
throughput, failures, active findings) and one drill-down per symptom
(exhaustion, prefix cache, first token). Every query comes from the
catalogue's PromQL twins or from the alert conditions in promql.py, over
`$__rate_interval` and the dashboard's variables, so the panel an alert links
to shows the alert's own numbers; the prefix-cache board's worth row plots
the sidecar's own gauges instead, over kvwatch's window, the figures its
status page shows. A thin house style on top of grafanalib
sets what every panel must have: a unit, a description, a runbook link, the
datasource variable, a stable id and a place in the grid (panels.py).
"""

from __future__ import annotations

from kvwatch.mixin import objectives
from kvwatch.mixin.alerts import runbook_anchor
from kvwatch.mixin.config import MixinConfig
from kvwatch.mixin.panels import (  # noqa: F401 (re-exported)
    DASHBOARDS, DATASOURCE, ENGINE_SEL, FINDING_SEL, GOOD, GRID_WIDTH, NEUTRAL, RATE, SCHEMA_VERSION, TARGET_SEL,
    TIER_SEL, Board, PanelSpec, Views, color_at, threshold_steps, value_mappings,
)
from kvwatch.mixin.promql import Scope, indent, num, paren
from kvwatch.signals import SIGNALS, STREAM_SIGNALS_BY_NAME, STREAM_SIZING, TIER_SIGNALS_BY_NAME, UNITS
from kvwatch.units import parse_prometheus_duration


ANCHOR_EXHAUSTED = runbook_anchor("VllmKvCacheExhausted")
ANCHOR_HIT = runbook_anchor("VllmPrefixCacheHitRateLow")
ANCHOR_TTFT = runbook_anchor("VllmTimeToFirstTokenSlow")
ANCHOR_DOWN = runbook_anchor("KvwatchDown")
ANCHOR_UNREACHABLE = runbook_anchor("KvwatchEngineUnreachable")
ANCHOR_THROUGHPUT = "throughput-and-failures"  # runbooks.THROUGHPUT_ANCHOR
# Seconds per hour: a rate, so Grafana's `s` would read it as a duration.
PER_HOUR_UNIT = "suffix:s/h"


def _findings_panel(v: Views, key: str, symptom: str | None, anchor: str, width: int = 24) -> PanelSpec:
    what = f"{symptom} findings" if symptom else "findings"
    return PanelSpec(
        key, f"Active {what}",
        "kvwatch's in-process diagnosis (kvwatch_finding): one row per active finding with its symptom and likely "
        "cause; /api/v1/diagnosis on the kvwatch instance has the evidence and the next check. Empty when nothing "
        "is wrong.",
        "short", [(v.findings(symptom), "")], kind="table", width=width, height=7, runbook=anchor, instant=True)


def overview(config: MixinConfig) -> Board:
    v = Views(config)
    b = Board("overview", config)
    _engines_now_row(b, v, config)
    # What pages: the objectives' burn rates and budgets.
    _objectives_row(b, v)
    _kv_cache_row(b, v, config)
    _prefix_and_first_token_rows(b, v, config)
    _latency_and_throughput_rows(b, v)
    b.closing.append(_kvwatch_health)
    return b


def _engines_now_row(b: Board, v: "Views", config: MixinConfig) -> None:
    """The engine first: where each model stands now, then what kvwatch found."""
    m = v.model_legend
    b.row("Engines now")
    b.add(PanelSpec("now_kv_usage", "KV cache usage, fullest engine",
                    "KV-cache usage now of each model's fullest engine (vllm:kv_cache_usage_perc). Red from the "
                    "exhaustion threshold: with requests waiting or preempted there, the cache is full "
                    "(VllmKvCacheExhausted).", "percentunit",
                    [(v.sig("kvwatch_kv_cache_usage_ratio", "model"), m)], kind="stat", width=5, height=4,
                    runbook=ANCHOR_EXHAUSTED, threshold=config.exhaustion_usage_ratio,
                    signal="kvwatch_kv_cache_usage_ratio"))
    b.add(PanelSpec("now_hit_ratio", "Prefix-cache hit ratio per model",
                    "Prefix-cache hits over queries (tokens) of each model's engines together, over the rate "
                    "interval. Red below the low-hit-rate threshold (VllmPrefixCacheHitRateLow; the Prefix cache "
                    "board says why).", "percentunit",
                    [(v.sig("kvwatch_prefix_cache_hit_ratio", "model"), m)], kind="stat", width=5, height=4,
                    runbook=ANCHOR_HIT, threshold=config.hit_ratio_low, signal="kvwatch_prefix_cache_hit_ratio"))
    b.add(PanelSpec("now_ttft_p95", "Time to first token p95",
                    "p95 time to first token per model over the rate interval, buckets of all engines summed "
                    f"(vllm:time_to_first_token_seconds). Red above the objective ttft_p95_seconds "
                    f"({num(config.ttft_p95_seconds)}s); the First token board says where the time goes.", "s",
                    [(v.sig("kvwatch_time_to_first_token_seconds", "model", 0.95), m)], kind="stat", width=5,
                    height=4, runbook=ANCHOR_TTFT, threshold=config.ttft_p95_seconds,
                    signal="kvwatch_time_to_first_token_seconds"))
    b.add(PanelSpec("now_waiting", "Requests waiting",
                    "Requests waiting to be scheduled now, per model (vllm:num_requests_waiting). Orange while any "
                    "wait: sustained, it is queueing for KV cache or for compute (Running and waiting requests, "
                    "the First token board).", "short",
                    [(v.sig("kvwatch_requests_waiting", "model"), m)], kind="stat", width=4, height=4,
                    runbook=runbook_anchor("VllmTimeToFirstTokenSlow", "queueing_compute_bound"), threshold=1,
                    signal="kvwatch_requests_waiting", bad_color="orange"))
    b.add(PanelSpec("now_findings", "Active findings (warning, critical)",
                    "How many of kvwatch's diagnosis findings of severity warning or critical are active now "
                    "(kvwatch_finding); the table below names them, their causes and replicas.", "short",
                    [(f'count(kvwatch_finding{{{FINDING_SEL},severity=~"warning|critical"}}) or vector(0)',
                      "findings")], kind="stat", width=5, height=4, runbook=ANCHOR_EXHAUSTED, threshold=1,
                    signal="kvwatch_finding"))
    b.add(_findings_panel(v, "findings", None, ANCHOR_EXHAUSTED))


def _kv_cache_row(b: Board, v: "Views", config: MixinConfig) -> None:
    e = v.engine_legend
    b.row("KV cache")
    b.add(PanelSpec("kv_usage", "KV cache usage",
                    v.help("kvwatch_kv_cache_usage_ratio") + " The red line is the exhaustion threshold.",
                    "percentunit", [(v.sig("kvwatch_kv_cache_usage_ratio"), e)], width=8,
                    runbook=ANCHOR_EXHAUSTED, threshold=config.exhaustion_usage_ratio,
                    signal="kvwatch_kv_cache_usage_ratio"))
    b.add(PanelSpec("kv_free_tokens", "KV headroom (free tokens)", v.help("kvwatch_kv_cache_free_tokens"), "short",
                    [(v.sig("kvwatch_kv_cache_free_tokens"), e)], width=8, runbook=ANCHOR_EXHAUSTED))
    b.add(PanelSpec("capacity_requests", "Requests the cache holds",
                    v.help("kvwatch_kv_cache_capacity_requests"), "short",
                    [(v.sig("kvwatch_kv_cache_capacity_requests"), e)], width=8, runbook=ANCHOR_EXHAUSTED))
    b.add(PanelSpec("preemptions", "Preemptions", v.help("kvwatch_preemptions_per_second"), "ops",
                    [(v.sig("kvwatch_preemptions_per_second"), e)], width=12, runbook=ANCHOR_EXHAUSTED))
    b.add(PanelSpec("running_waiting", "Running and waiting requests",
                    v.help("kvwatch_requests_running") + " " + v.help("kvwatch_requests_waiting"), "short",
                    [(v.sig("kvwatch_requests_running"), "running " + e),
                     (v.sig("kvwatch_requests_waiting"), "waiting " + e)], width=12, runbook=ANCHOR_EXHAUSTED))


def _prefix_and_first_token_rows(b: Board, v: "Views", config: MixinConfig) -> None:
    e = v.engine_legend
    b.row("Prefix cache")
    b.add(PanelSpec("hit_ratio", "Prefix-cache hit ratio",
                    v.help("kvwatch_prefix_cache_hit_ratio") + " Per engine, and per model as a ratio of summed "
                    "rates. The red line is the low-hit-rate threshold.", "percentunit",
                    [(v.sig("kvwatch_prefix_cache_hit_ratio"), e),
                     (v.sig("kvwatch_prefix_cache_hit_ratio", "model"), "all engines of {{model_name}}")],
                    width=12, runbook=ANCHOR_HIT, threshold=config.hit_ratio_low,
                    signal="kvwatch_prefix_cache_hit_ratio"))
    b.add(PanelSpec("cached_share", "Prompt tokens served from cache",
                    v.help("kvwatch_prompt_tokens_cached_ratio"), "percentunit",
                    [(v.sig("kvwatch_prompt_tokens_cached_ratio"), e)], width=12, runbook=ANCHOR_HIT))
    b.row("Time to first token")
    b.add(PanelSpec("ttft_quantiles", "Time to first token",
                    v.help("kvwatch_time_to_first_token_seconds") + " Per model: buckets of all engines summed "
                    "before the quantile.", "s", v.quantile_targets("kvwatch_time_to_first_token_seconds", "model"),
                    width=8, runbook=ANCHOR_TTFT))
    b.add(PanelSpec("ttft_parts", "Time to first token: mean and its parts",
                    "Mean time to first token per model, and its parts: queue (vllm:request_queue_time_seconds), "
                    "prefill (vllm:request_prefill_time_seconds) and the rest (front end, tokenization, scheduling). "
                    "The largest part is the likely cause of a slow first token.", "s",
                    [(v.fm.ttft_mean(), "mean TTFT {{model_name}}"), (v.fm.queue_mean(), "queue {{model_name}}"),
                     (v.fm.prefill_mean(), "prefill {{model_name}}"),
                     (v.fm.front_end_mean(), "front end {{model_name}}")],
                    width=8, runbook=ANCHOR_TTFT, threshold=config.ttft_mean_seconds,
                    signal="kvwatch_time_to_first_token_mean_seconds"))
    b.add(PanelSpec("queue_time", "Queue time", v.help("kvwatch_queue_time_seconds"), "s",
                    v.quantile_targets("kvwatch_queue_time_seconds", "model"), width=8, runbook=ANCHOR_TTFT))


def _latency_and_throughput_rows(b: Board, v: "Views") -> None:
    e = v.engine_legend
    # What users feel after the first token: the gap between output tokens and the whole request.
    b.row("Per output token and end to end")
    b.add(PanelSpec("inter_token_latency", "Inter-token latency (per output token)",
                    v.engine_help("inter_token_latency_seconds") + " Per model: buckets of all engines summed "
                    "before the quantile. Rises with batch size and preemptions, not with queueing.", "s",
                    v.engine_quantile_targets("inter_token_latency_seconds"), width=12, runbook=ANCHOR_THROUGHPUT))
    b.add(PanelSpec("e2e_latency", "End-to-end request latency",
                    v.engine_help("e2e_request_latency_seconds") + " Per model: buckets of all engines summed "
                    "before the quantile. Time to first token plus every output token's gap.", "s",
                    v.engine_quantile_targets("e2e_request_latency_seconds"), width=12, runbook=ANCHOR_THROUGHPUT))
    b.row("Throughput and failures")
    b.add(PanelSpec("tokens_per_second", "Tokens per second",
                    v.help("kvwatch_prompt_tokens_per_second") + " " + v.help("kvwatch_generation_tokens_per_second"),
                    "suffix:tok/s",
                    [(v.sig("kvwatch_prompt_tokens_per_second"), "prompt " + e),
                     (v.sig("kvwatch_generation_tokens_per_second"), "generated " + e)], width=8,
                    runbook=ANCHOR_THROUGHPUT))
    b.add(PanelSpec("finished", "Finished requests by reason", v.help("kvwatch_requests_finished_per_second"),
                    "reqps", [(v.sig("kvwatch_requests_finished_per_second", "model"),
                               "{{finished_reason}} {{model_name}}")], width=8, stacked=True,
                    runbook=ANCHOR_THROUGHPUT))
    b.add(PanelSpec("failed", "Failed requests (abort, error)", v.help("kvwatch_requests_failed_per_second"),
                    "reqps", [(v.sig("kvwatch_requests_failed_per_second"), e)], width=8,
                    runbook=ANCHOR_THROUGHPUT))


def _objectives_row(b: Board, v: "Views") -> None:
    """Each objective's burn rate (error ratio / budget) over the pages' first
    long window, and the budget left over the longest window the pairs read
    (the recording rules of kvwatch/mixin/objectives.py)."""
    config = b.config
    pairs = objectives.burn_windows(config)
    first, longest = pairs[0], max(objectives.windows(config), key=parse_prometheus_duration)
    sel = f'{{{TARGET_SEL},model_name=~"$model",engine=~"$engine"}}'
    e = v.engine_legend
    burn, left = [], []
    for objective in objectives.OBJECTIVE_ALERTS:
        budget = num(objectives.budget(config, objective))
        burn.append((f"{objectives.record_name(config, objective, first.long)}{sel} / {budget}", f"{objective} {e}"))
        left.append((f"1 - {objectives.record_name(config, objective, longest)}{sel} / {budget}",
                     f"{objective} {e}"))
    goals = (f"first tokens within {num(config.ttft_objective_seconds)}s for {num(config.ttft_objective * 100)}% "
             f"of requests, {num(config.availability_objective * 100)}% without error, "
             f"{num(config.abort_objective * 100)}% not aborted")
    b.row("Objectives: burn rate and error budget")
    b.add(PanelSpec("objective_burn", f"Burn rate over {first.long}",
                    f"How fast each objective's error budget burns ({goals}): the share of requests that missed it "
                    f"over the last {first.long}, divided by the share allowed. 1 spends the budget exactly; "
                    f"{num(first.factor)} pages when the last {first.short} burns as fast.", "short",
                    burn, width=12, runbook=runbook_anchor("VllmTimeToFirstTokenBudgetBurn")))
    b.add(PanelSpec("objective_budget", f"Error budget left over {longest}",
                    f"The share of each objective's error budget not spent over the last {longest} ({goals}); "
                    "below 0 the objective was missed over that span.", "percentunit",
                    left, width=12, runbook=runbook_anchor("VllmTimeToFirstTokenBudgetBurn")))


def _kvwatch_health(b: Board) -> None:
    """kvwatch's own health, below the engine's: is the monitor seeing?"""
    config = b.config
    b.row("kvwatch's own health")
    b.add(PanelSpec("scrape_up", "Prometheus scraping kvwatch",
                    "up of kvwatch's scrape targets: 1 while Prometheus reaches kvwatch. KvwatchDown fires when it "
                    "stays 0.", "short",
                    [(f"up{{{TARGET_SEL}}}", "{{" + config.instance_label + "}}")], kind="stat", width=6, height=5,
                    runbook=ANCHOR_DOWN, threshold=1, signal="up", mappings=((1, "up"), (0, "down"))))
    b.add(PanelSpec("poll_up", "kvwatch polling vLLM",
                    "kvwatch_up: 1 while kvwatch's latest poll of the engine's /metrics succeeded. "
                    "KvwatchEngineUnreachable fires when it stays 0; kvwatch_poll_errors_total says why.", "short",
                    [(f"kvwatch_up{{{TARGET_SEL}}}", "{{" + config.instance_label + "}}")], kind="stat", width=6,
                    height=5, runbook=ANCHOR_UNREACHABLE, threshold=1, signal="kvwatch_up",
                    mappings=((1, "polling"), (0, "failing"))))
    b.add(PanelSpec("poll_errors", "Failed polls by reason",
                    "kvwatch_poll_errors_total per second by reason (refused, timeout, http_5xx, no_engine_metrics "
                    "...): why kvwatch cannot read the engine.", "ops",
                    [(f"sum by ({config.instance_label}, reason) (rate(kvwatch_poll_errors_total{{{TARGET_SEL}}}[{RATE}]))",
                      "{{" + config.instance_label + "}} {{reason}}")], width=12, height=5,
                    runbook=ANCHOR_UNREACHABLE))


def exhaustion(config: MixinConfig) -> Board:
    v = Views(config)
    b = Board("exhaustion", config)
    e = v.engine_legend
    b.row("Is the cache full?")
    b.add(PanelSpec("usage_peak", "KV cache usage: now and peak",
                    "KV usage now and its peak over the rate interval (vllm:kv_cache_usage_perc). "
                    "VllmKvCacheExhausted fires when the peak stays above the red line while requests are "
                    "preempted or wait for room. Evictable prefix-cache blocks count as free.", "percentunit",
                    [(v.sig("kvwatch_kv_cache_usage_max_ratio"), "peak " + e),
                     (v.sig("kvwatch_kv_cache_usage_ratio"), "now " + e)],
                    width=12, runbook=ANCHOR_EXHAUSTED, threshold=config.exhaustion_usage_ratio,
                    signal="kvwatch_kv_cache_usage_max_ratio"))
    b.add(PanelSpec("preemptions", "Preemptions",
                    v.help("kvwatch_preemptions_per_second") + " vLLM preempts only when it cannot allocate a KV "
                    "block; a preempted request is recomputed later.", "ops",
                    [(v.sig("kvwatch_preemptions_per_second"), e)], width=12, runbook=ANCHOR_EXHAUSTED))
    b.add(PanelSpec("waiting_by_reason", "Waiting requests by reason",
                    v.help("kvwatch_requests_waiting_by_reason") + " Older vLLM versions only report the total.",
                    "short", [(v.sig("kvwatch_requests_waiting_by_reason"), "{{reason}} " + e),
                              (v.sig("kvwatch_requests_waiting"), "all " + e)], width=12, runbook=ANCHOR_EXHAUSTED))
    b.add(PanelSpec("free_tokens", "Free and total KV tokens",
                    v.help("kvwatch_kv_cache_free_tokens") + " " + v.help("kvwatch_kv_cache_capacity_tokens"),
                    "short", [(v.sig("kvwatch_kv_cache_free_tokens"), "free " + e),
                              (v.sig("kvwatch_kv_cache_capacity_tokens"), "capacity " + e)], width=12,
                    runbook=ANCHOR_EXHAUSTED))
    b.row("Too many requests or too long ones?")
    b.add(PanelSpec("demand_vs_capacity", "Requests wanting to run vs requests the cache holds",
                    "Running plus waiting requests against how many requests of the current mean length the cache "
                    "holds (kvwatch_kv_cache_capacity_requests). Demand far above the bound: concurrency beyond "
                    "capacity.", "short",
                    [(v.sig("kvwatch_requests_running") + "\n+\n" + v.sig("kvwatch_requests_waiting"), "demand " + e),
                     (v.sig("kvwatch_kv_cache_capacity_requests"), "cache holds " + e),
                     (v.sig("kvwatch_requests_running_max"), "running peak " + e)],
                    width=12, runbook=runbook_anchor("VllmKvCacheExhausted", "concurrency_beyond_capacity")))
    b.add(PanelSpec("share_per_request", "Share of the cache per running request",
                    "Mean KV usage over mean running requests: the share of the cache one running request holds. "
                    "Above the red line, with no more requests waiting than running (Waiting requests by reason, "
                    "Running requests), a few long requests fill the cache (cause long_requests); below it, or "
                    "with a longer queue, many requests do (cause concurrency_beyond_capacity).", "percentunit",
                    [(v.fe.capacity_share_per_request(), e)], width=12,
                    runbook=runbook_anchor("VllmKvCacheExhausted", "long_requests"),
                    threshold=config.long_request_capacity_share,
                    signal="kvwatch_engine_kv_cache_usage_ratio"))
    b.add(PanelSpec("request_lengths", "Request length (p95 and mean)",
                    "Prompt and generated tokens per finished request: p95 from the length histograms (buckets "
                    "summed by le), mean from _sum/_count (vllm:request_prompt_tokens, "
                    "vllm:request_generation_tokens).", "short",
                    [(v.length_quantile("request_prompt_tokens", 0.95), "prompt p95 {{model_name}}"),
                     (v.length_quantile("request_generation_tokens", 0.95), "generated p95 {{model_name}}"),
                     (v.sig("kvwatch_prompt_tokens_per_request_mean", "model"), "prompt mean {{model_name}}"),
                     (v.sig("kvwatch_generation_tokens_per_request_mean", "model"), "generated mean {{model_name}}")],
                    width=12, runbook=runbook_anchor("VllmKvCacheExhausted", "long_requests")))
    b.add(PanelSpec("running", "Running requests: now and peak",
                    v.help("kvwatch_requests_running") + " " + v.help("kvwatch_requests_running_max"), "short",
                    [(v.sig("kvwatch_requests_running"), "now " + e),
                     (v.sig("kvwatch_requests_running_max"), "peak " + e)], width=12, runbook=ANCHOR_EXHAUSTED))
    b.add(_findings_panel(v, "findings", "exhaustion", ANCHOR_EXHAUSTED))
    return b


def prefix_cache(config: MixinConfig) -> Board:
    v = Views(config)
    b = Board("prefix_cache", config)
    e = v.engine_legend
    b.row("Is the hit ratio low?")
    b.add(PanelSpec("hit_ratio_vs_baseline", "Hit ratio: now and baseline",
                    "Prefix-cache hits over queries (tokens) over the rate interval, and over the "
                    f"{config.hit_ratio_baseline_window} before it (the baseline). VllmPrefixCacheHitRateLow fires "
                    "below the red line: after a healthy baseline the prefix changed or (usage high, cache not "
                    "exhausted) prefixes were evicted before reuse; after a low one the workload shares little.",
                    "percentunit",
                    [(v.sig("kvwatch_prefix_cache_hit_ratio"), "now " + e),
                     (v.fe.baseline_hit_ratio(), "baseline " + e)],
                    width=12, runbook=ANCHOR_HIT, threshold=config.hit_ratio_low,
                    signal="kvwatch_prefix_cache_hit_ratio"))
    b.add(PanelSpec("queried_tokens", "Prompt tokens queried",
                    "Prompt tokens looked up in the prefix cache over the rate interval "
                    "(vllm:prefix_cache_queries_total). Below the red line there is too little traffic to judge "
                    "the ratio.", "short", [(v.fe.query_tokens(), e)], width=12, runbook=ANCHOR_HIT,
                    threshold=config.min_query_tokens,
                    signal="kvwatch_engine_prefix_cache_queries", bad_color="orange"))
    b.add(PanelSpec("cached_share", "Prompt tokens served from cache",
                    v.help("kvwatch_prompt_tokens_cached_ratio"), "percentunit",
                    [(v.sig("kvwatch_prompt_tokens_cached_ratio"), e)], width=12, runbook=ANCHOR_HIT))
    b.add(PanelSpec("external_hit_ratio", "External (KV connector) hit ratio",
                    v.help("kvwatch_external_prefix_cache_hit_ratio") + " Empty or NaN without a KV connector.",
                    "percentunit", [(v.sig("kvwatch_external_prefix_cache_hit_ratio"), e)], width=12,
                    runbook=ANCHOR_HIT))
    b.row("Which cause?")
    b.add(PanelSpec("engine_config", "Engine cache configuration",
                    "kvwatch_engine_info (from vllm:cache_config_info): enable_prefix_caching=False means cause "
                    "caching_disabled; a changed row (the engine restarted with another configuration) means a "
                    "cold cache.", "short",
                    [(f"kvwatch_engine_info{{{ENGINE_SEL}}}", "")], kind="table", width=12, height=7,
                    runbook=runbook_anchor("VllmPrefixCacheHitRateLow", "caching_disabled"), instant=True))
    b.add(PanelSpec("restarts", "Engine restarts",
                    f"Counter resets of vllm:prompt_tokens_total over the cold-cache window "
                    f"({config.cold_cache_window}): each is an engine restart with an empty cache (cause "
                    "cold_cache).", "short",
                    [(f"sum by ({v.engine.by_text}) (resets(kvwatch_engine_prompt_tokens_total{{{ENGINE_SEL}}}"
                      f"[{config.cold_cache_window}]))", e)], width=12, height=7,
                    runbook=runbook_anchor("VllmPrefixCacheHitRateLow", "cold_cache")))
    b.add(PanelSpec("usage_mean", "KV usage (mean): room for idle prefixes",
                    "Mean KV usage over the rate interval. Evictable cached blocks count as free, so above the red "
                    "line, after a healthy baseline and with the cache not exhausted, running requests crowd idle "
                    "prefixes out before reuse (cause eviction_before_reuse).",
                    "percentunit", [(v.fe.usage_avg(), e)], width=12,
                    runbook=runbook_anchor("VllmPrefixCacheHitRateLow", "eviction_before_reuse"),
                    threshold=config.eviction_usage_ratio,
                    signal="kvwatch_engine_kv_cache_usage_ratio"))
    b.add(PanelSpec("preemptions", "Preemptions: is the cache exhausted?",
                    v.help("kvwatch_preemptions_per_second") + " Preemptions mean the cache is exhausted (see "
                    "VllmKvCacheExhausted): a full cache explains a low hit ratio by itself, so the hit-rate alert "
                    "then names only caching off, a restart, or a drop that showed before the exhaustion.", "ops",
                    [(v.sig("kvwatch_preemptions_per_second"), e)], width=12, runbook=ANCHOR_HIT))
    b.add(_findings_panel(v, "findings", "low_hit_rate", ANCHOR_HIT))
    _lmcache_row(b, v)
    _stream_row(b, v)
    b.closing.append(lambda board: _worth_row(board, v))
    return b


def _worth_row(b: Board, v: Views) -> None:
    """What the cache is worth, in the engine's own prefill seconds
    (kvwatch/signals/worth.py): saved by its hits, lost to recomputation,
    bought by more memory. Laid out after the catalogue's cache panels.
    Each panel plots the sidecar's own gauges, over kvwatch's window: the
    figures the status page and /metrics show, one number with one
    definition (the PromQL twins price at the fallback rate over the rate
    interval, a different number on the same axis)."""
    inst = b.config.instance_label
    e = v.engine_legend
    window = " Over kvwatch's window (--window), not the rate interval; request-seconds, not wall time."
    empty = " Empty unless kvwatch reads the engine's KV-cache events (--kv-events)."
    # The stream's series carry no model or engine label: kept where the
    # replica serves a model and engine the dashboard's variables select.
    stream_only = (" The stream's series name no model or engine: shown for the replicas that serve the selected "
                   "$model and $engine.")

    def gauge(name: str, *extra: str) -> str:
        return f"max by ({', '.join((v.engine.by_text, *extra))}) ({v.engine.m(name)})"

    def selected(expr: str) -> str:
        return f"{expr}\nand on ({inst})\ngroup by ({inst}) (kvwatch_engine_info{{{ENGINE_SEL}}})"

    def stream(name: str, *extra: str) -> str:
        return selected(f"max by ({', '.join((inst, *extra))}) ({name}{{{TARGET_SEL}}})")

    b.row("What the cache is worth")
    b.add(PanelSpec("worth_saved", "Prefill seconds the cache saved, by tier",
                    "kvwatch_cache_saved_prefill_seconds, the sidecar's own figure (as on its status page): "
                    + v.help("kvwatch_cache_saved_prefill_seconds") + window, UNITS["seconds"].grafana,
                    [(gauge("kvwatch_cache_saved_prefill_seconds", "tier"), "{{tier}} " + e)], width=8,
                    stacked=True, runbook=ANCHOR_HIT, signal="kvwatch_cache_saved_prefill_seconds"))
    b.add(PanelSpec("worth_lost", "Prefill seconds lost to recomputation",
                    "kvwatch_cache_lost_prefill_seconds, from the page: " + v.help("kvwatch_cache_lost_prefill_seconds")
                    + " With the event stream, kvwatch_kv_events_lost_prefill_seconds counts the blocks stored again "
                    "after their eviction instead (a preempted request's evicted prefix included)." + window
                    + stream_only, UNITS["seconds"].grafana,
                    [(gauge("kvwatch_cache_lost_prefill_seconds"), "preempted, the page's upper bound " + e),
                     (stream("kvwatch_kv_events_lost_prefill_seconds"),
                      "evicted before reuse, the stream's count " + v.instance_legend)],
                    width=8, runbook=ANCHOR_EXHAUSTED, signal="kvwatch_cache_lost_prefill_seconds"))
    b.add(PanelSpec("worth_bought", "Prefill seconds per hour more cache would buy (estimate)",
                    next(s for s in STREAM_SIZING if s.key == "saved_prefill_seconds_per_hour").help
                    + " From kvwatch's window (--window), in prefill seconds per hour (s/h). Each line one size; its GiB: "
                    "kvwatch_kv_events_sizing_extra_bytes." + empty + stream_only, PER_HOUR_UNIT,
                    [(stream("kvwatch_kv_events_sizing_saved_prefill_seconds_per_hour", "extra_cache"),
                      "x{{extra_cache}} more " + v.instance_legend)], width=8, runbook=ANCHOR_HIT,
                    signal="kvwatch_kv_events_sizing_saved_prefill_seconds_per_hour"))


def _stream_row(b: Board, v: Views) -> None:
    """The engine's KV-cache event stream (kvwatch/kvevents): its series
    exist only where kvwatch runs with --kv-events, so without it these
    panels are empty, not failing."""
    inst = b.config.instance_label
    scope = Scope(TARGET_SEL, RATE, (inst,))
    empty = " Empty unless kvwatch reads the engine's KV-cache events (--kv-events)."

    def sig(name: str) -> str:
        return STREAM_SIGNALS_BY_NAME[name].promql.format(sel=scope.sel, w=scope.w, by=scope.by_text)

    def doc(name: str) -> str:
        return STREAM_SIGNALS_BY_NAME[name].help + empty

    b.row("KV-cache events: evicted before reuse, or never reused?")
    b.add(PanelSpec("kv_events_up", "kvwatch reading KV-cache events",
                    "kvwatch_kv_events_up: 1 while kvwatch listens for the engine's KV-cache events and one has "
                    "arrived, 0 otherwise (the status page's kv_events.reason says why); the page's signals do not "
                    "depend on it." + empty, "short",
                    [(f"kvwatch_kv_events_up{{{TARGET_SEL}}}", v.instance_legend)], kind="stat", width=6, height=8,
                    runbook=ANCHOR_HIT, threshold=1, signal="kvwatch_kv_events_up",
                    mappings=((1, "reading"), (0, "no events"))))
    b.add(PanelSpec("kv_events_stored_again_ratio", "Blocks stored again after their eviction",
                    doc("kvwatch_kv_events_stored_again_ratio"), "percentunit",
                    [(sig("kvwatch_kv_events_stored_again_ratio"), v.instance_legend)], width=9, runbook=ANCHOR_HIT,
                    signal="kvwatch_kv_events_stored_again_ratio"))
    b.add(PanelSpec("kv_events_return_seconds", "Eviction to return (median)",
                    doc("kvwatch_kv_events_return_after_eviction_seconds"), UNITS["seconds"].grafana,
                    [(sig("kvwatch_kv_events_return_after_eviction_seconds"), v.instance_legend)], width=9,
                    runbook=ANCHOR_HIT, signal="kvwatch_kv_events_return_after_eviction_seconds"))
    b.add(PanelSpec("kv_events_block_rates", "Blocks stored, evicted and stored again",
                    "Blocks the engine stored, evicted and stored again after their eviction, per second over the "
                    "rate interval (BlockStored, BlockRemoved)." + empty, UNITS["per_second"].grafana,
                    [(sig("kvwatch_kv_events_blocks_stored_per_second"), "stored " + v.instance_legend),
                     (sig("kvwatch_kv_events_blocks_evicted_per_second"), "evicted " + v.instance_legend),
                     (sig("kvwatch_kv_events_blocks_stored_again_per_second"), "stored again " + v.instance_legend)],
                    width=12, runbook=ANCHOR_HIT))
    b.add(PanelSpec("kv_events_sizing", "Hit ratio with more cache (estimate)",
                    STREAM_SIZING[0].help + " Each line one size: `extra_cache` times the engine's cache added."
                    + empty, "percentunit",
                    [(f"kvwatch_kv_events_sizing_hit_ratio{{{TARGET_SEL}}}",
                      "x{{extra_cache}} more " + v.instance_legend)], width=12, runbook=ANCHOR_HIT,
                    signal="kvwatch_kv_events_sizing_hit_ratio"))


def _lmcache_row(b: Board, v: Views) -> None:
    """The LMCache tier beside the engine (kvwatch/pipeline/lmcache.py): its
    series exist only where kvwatch runs with --lmcache-target, so without
    one these panels are empty, not failing."""
    inst = b.config.instance_label
    tier = Scope(TIER_SEL, RATE, (inst, "model_name"))
    legend = v.instance_legend + " {{model_name}}"
    empty = " Empty unless kvwatch reads an LMCache page (--lmcache-target)."

    def sig(name: str) -> str:
        return TIER_SIGNALS_BY_NAME[name].promql.format(sel=tier.sel, w=tier.w, by=tier.by_text)

    def doc(name: str) -> str:
        return TIER_SIGNALS_BY_NAME[name].help + empty

    b.row("LMCache tier")
    b.add(PanelSpec("lmcache_up", "kvwatch reading LMCache",
                    "kvwatch_lmcache_up: 1 while kvwatch's latest poll of LMCache's page succeeded and carried its "
                    "counters, 0 while it fails (the status page's lmcache.reason says why); the engine's signals "
                    "do not depend on it." + empty, "short",
                    [(f"kvwatch_lmcache_up{{{TARGET_SEL}}}", v.instance_legend)], kind="stat", width=6, height=8,
                    runbook=ANCHOR_HIT, threshold=1, signal="kvwatch_lmcache_up",
                    mappings=((1, "reading"), (0, "failing"))))
    b.add(PanelSpec("lmcache_hit_ratio", "LMCache hit ratio", doc("kvwatch_lmcache_hit_ratio"), "percentunit",
                    [(sig("kvwatch_lmcache_hit_ratio"), legend)], width=9, runbook=ANCHOR_HIT,
                    signal="kvwatch_lmcache_hit_ratio"))
    b.add(PanelSpec("lmcache_prompt_tokens_served", "Prompt tokens from LMCache",
                    doc("kvwatch_lmcache_prompt_tokens_served_ratio"), "percentunit",
                    [(sig("kvwatch_lmcache_prompt_tokens_served_ratio"), legend)], width=9, runbook=ANCHOR_HIT,
                    signal="kvwatch_lmcache_prompt_tokens_served_ratio"))
    b.add(PanelSpec("lmcache_lookups_by_tier", "LMCache lookups by tier (multiprocess server)",
                    doc("kvwatch_lmcache_lookup_tokens_by_tier_ratio"), "percentunit",
                    [(sig("kvwatch_lmcache_lookup_tokens_by_tier_ratio"), "{{tier}} " + legend)], width=24,
                    runbook=ANCHOR_HIT, signal="kvwatch_lmcache_lookup_tokens_by_tier_ratio"))
    b.add(PanelSpec("lmcache_token_rates", "LMCache tokens retrieved and stored",
                    "Tokens LMCache delivered to the engine and tokens stored into it, per second over the rate "
                    "interval (lmcache:num_hit_tokens, lmcache:num_stored_tokens; the first worker's, never the sum "
                    "of the ranks)." + empty, UNITS["per_second"].grafana,
                    [(sig("kvwatch_lmcache_retrieved_tokens_per_second"), "retrieved " + legend),
                     (sig("kvwatch_lmcache_stored_tokens_per_second"), "stored " + legend)],
                    width=24, runbook=ANCHOR_HIT))


def first_token(config: MixinConfig) -> Board:
    v = Views(config)
    b = Board("first_token", config)
    e = v.engine_legend
    f = v.fe
    b.row("Where does the time go?")
    parts = [(f.first_token_mean(), "mean first token " + e), (f.queue_mean(), "queue " + e),
             (f.prefill_mean(), "prefill " + e), (f.front_end_mean(), "front end " + e)]
    if f.upstream:
        groups = "".join(" {{" + label + "}}" for label in config.upstream_join_labels)
        parts.append((f.upstream_mean(), f"upstream ({config.upstream_histogram}){groups}"))
    b.add(PanelSpec("ttft_parts", "Mean time to first token and its parts",
                    "Mean time to first token per engine (plus the upstream stage when configured) and its parts: "
                    "queue, prefill, front end (the rest of the engine's TTFT)"
                    + (", upstream" if f.upstream else "") + ". VllmTimeToFirstTokenSlow fires above the red line "
                    "and names the largest part as the cause.", "s", parts,
                    width=24, height=9, runbook=ANCHOR_TTFT, threshold=config.ttft_mean_seconds,
                    signal="kvwatch_time_to_first_token_mean_seconds"))
    b.add(PanelSpec("ttft_quantiles", "Time to first token quantiles",
                    v.help("kvwatch_time_to_first_token_seconds"), "s",
                    v.quantile_targets("kvwatch_time_to_first_token_seconds"), width=12, runbook=ANCHOR_TTFT))
    b.add(PanelSpec("queue_share", "Queue share of time to first token",
                    v.help("kvwatch_time_to_first_token_share_ratio"), "percentunit",
                    [(v.sig("kvwatch_time_to_first_token_share_ratio"), e)], width=12, runbook=ANCHOR_TTFT))
    b.row("Queue: for KV cache or for compute?")
    b.add(PanelSpec("queue_quantiles", "Queue time quantiles", v.help("kvwatch_queue_time_seconds"), "s",
                    v.quantile_targets("kvwatch_queue_time_seconds"), width=12,
                    runbook=runbook_anchor("VllmTimeToFirstTokenSlow", "queueing_compute_bound")))
    b.add(PanelSpec("kv_bound", "KV-bound? Usage peak and preemptions",
                    "KV usage peak over the rate interval, and preemptions per second. Queueing is KV-bound when "
                    "the cache is exhausted: the peak passes the red line (the exhaustion threshold) while requests "
                    "wait for room, or requests are preempted; otherwise it waits for compute or scheduler slots "
                    "and a bigger cache does not help.", "percentunit",
                    [(f.usage_max(), "usage peak " + e), (f.preemption_rate(), "preemptions/s " + e)], width=12,
                    runbook=runbook_anchor("VllmTimeToFirstTokenSlow", "queueing_kv_bound"),
                    threshold=config.exhaustion_usage_ratio,
                    signal="kvwatch_kv_cache_usage_max_ratio"))
    b.add(PanelSpec("waiting", "Waiting requests", v.help("kvwatch_requests_waiting"), "short",
                    [(v.sig("kvwatch_requests_waiting"), e)], width=12,
                    runbook=runbook_anchor("VllmTimeToFirstTokenSlow", "queueing_compute_bound")))
    b.add(PanelSpec("running", "Running requests", v.help("kvwatch_requests_running"), "short",
                    [(v.sig("kvwatch_requests_running"), e)], width=12,
                    runbook=runbook_anchor("VllmTimeToFirstTokenSlow", "queueing_compute_bound")))
    b.row("Prefill and prompts")
    b.add(PanelSpec("prefill_quantiles", "Prefill time quantiles", v.help("kvwatch_prefill_time_seconds"), "s",
                    v.quantile_targets("kvwatch_prefill_time_seconds"), width=12,
                    runbook=runbook_anchor("VllmTimeToFirstTokenSlow", "prefill")))
    b.add(PanelSpec("prompt_length", "Prompt tokens per request and cached share",
                    v.help("kvwatch_prompt_tokens_per_request_mean") + " " + v.help("kvwatch_prompt_tokens_cached_ratio"),
                    "short", [(v.sig("kvwatch_prompt_tokens_per_request_mean"), "mean prompt tokens " + e),
                              (v.sig("kvwatch_prompt_tokens_cached_ratio") + "\n*\n"
                               + v.sig("kvwatch_prompt_tokens_per_request_mean"), "of which cached " + e)],
                    width=12, runbook=runbook_anchor("VllmTimeToFirstTokenSlow", "prefill")))
    b.add(_findings_panel(v, "findings", "slow_first_token", ANCHOR_TTFT))
    return b


ANCHOR_FLEET = runbook_anchor("VllmFleetReplicaOutlier")


def fleet(config: MixinConfig) -> Board:
    v = Views(config)
    b = Board("fleet", config)
    e = v.engine_legend
    f = v.fe
    inst = config.instance_label
    b.row("Replicas")
    b.add(PanelSpec("replicas", "Replicas of each model",
                    "A row per replica engine, now, over the rate window: KV usage peak, requests waiting, "
                    "prefix-cache hit ratio, that ratio as a share of its warm peers' pooled one, and restarts "
                    "inside the window. A replica full or queueing beside peers with room is imbalance; a share "
                    f"below {config.fleet_affinity_fraction:g} is lost prefix affinity; a restart while its peers "
                    "did not is a cold replica.", "short",
                    [(f.usage_max(), "usage peak"), (v.sig("kvwatch_requests_waiting"), "waiting"),
                     (f.hit_ratio(), "hit ratio"), (f.hit_ratio_vs_peers(), "hit ratio / peers"),
                     (f.restarted(), "restarts")],
                    kind="table", width=24, height=10, runbook=ANCHOR_FLEET, instant=True))
    b.add(PanelSpec("fleet_findings", "Fleet findings",
                    "The fleet alert's causes per replica, now: imbalance (value: usage peak), lost prefix affinity "
                    "(value: hit ratio / peers, below the line), cold replica (value: restarts).", "short",
                    [(f.imbalance(), "imbalance {{" + inst + "}} {{model_name}}"),
                     (f"{paren(f.lost_prefix_affinity())} < {num(config.fleet_affinity_fraction)}",
                      "lost affinity {{" + inst + "}} {{model_name}}"),
                     (f.cold_replica(), "cold {{" + inst + "}} {{model_name}}")],
                    kind="table", width=24, height=6, runbook=ANCHOR_FLEET, instant=True))
    b.row("Over time")
    b.add(PanelSpec("usage_peak_by_replica", "KV usage peak per replica",
                    "The window's KV usage peak of each replica: one high while the others stay low is the load "
                    f"routed unevenly. The line is fleet_room_usage_ratio ({config.fleet_room_usage_ratio:g}).",
                    "percentunit", [(f.usage_max(), e)], width=12, runbook=ANCHOR_FLEET,
                    threshold=config.fleet_room_usage_ratio,
                    signal="kvwatch_kv_cache_usage_max_ratio"))
    b.add(PanelSpec("hit_ratio_vs_peers", "Hit ratio as a share of the peers'",
                    "Each warm replica's prefix-cache hit ratio divided by its warm peers' pooled ratio: near 1 "
                    "when prefixes reach the replica that holds them. The line is fleet_affinity_fraction.",
                    "percentunit", [(f.hit_ratio_vs_peers(), e)], width=12, runbook=ANCHOR_FLEET,
                    threshold=config.fleet_affinity_fraction,
                    signal="kvwatch_prefix_cache_hit_ratio"))
    b.add(PanelSpec("replicas_pressed", "Replicas pressed and with room",
                    "Per model: replicas exhausted or queueing, and replicas with room (usage peak at most "
                    "fleet_room_usage_ratio, nothing waiting). Both above zero at once is imbalance.", "short",
                    [(f"count by ({f.fleet_by}) (\n{indent(f.pressed())}\n)", "pressed {{model_name}}"),
                     (f"count by ({f.fleet_by}) (\n{indent(f.room())}\n)", "with room {{model_name}}")],
                    width=12, runbook=ANCHOR_FLEET))
    b.add(PanelSpec("restarts_by_replica", "Restarts per replica",
                    "Counter resets inside the window per replica (kvwatch_engine_prompt_tokens_total): a replica "
                    "that restarted refills its cache while its peers are warm.", "short",
                    [(f.restarted(), e)], width=12, runbook=ANCHOR_FLEET))
    _router_row(b, v)
    return b


ANCHOR_ROUTING = runbook_anchor("VllmRouterPrefixRouting")


def _router_row(b: Board, v: Views) -> None:
    """The router's prediction against the engines' delivery (kvwatch/pipeline/router.py): its series exist
    only where kvwatch reads a router's page (--router-target), so without one these panels are empty."""
    empty = " Empty unless kvwatch reads a router's page (--router-target)."
    legend = v.instance_legend + " {{model_name}}"
    b.row("Router: predicted against delivered")
    b.add(PanelSpec("router_up", "kvwatch reading the router",
                    "kvwatch_router_up: 1 while kvwatch's latest poll of the router's page succeeded and carried "
                    "its prefix prediction, 0 while it fails." + empty, "short",
                    [(f"kvwatch_router_up{{{TARGET_SEL}}}", v.instance_legend)], kind="stat", width=6, height=8,
                    runbook=ANCHOR_ROUTING, threshold=1, signal="kvwatch_router_up",
                    mappings=((1, "reading"), (0, "failing"))))
    b.add(PanelSpec("router_predicted_delivered", "Predicted, delivered and available per model",
                    "Over the window, per model: the prompt share the router predicted its chosen replicas hold, "
                    "the share the engines delivered from their prefix caches, and the share the best replica "
                    "held. Delivered well below predicted is routing_miss (a stale index); predicted well below "
                    "available is lost prefix affinity (routing without the prefix)." + empty, "percentunit",
                    [(f"kvwatch_router_predicted_hit_ratio{{{TARGET_SEL}}}", "predicted " + legend),
                     (f"kvwatch_router_delivered_hit_ratio{{{TARGET_SEL}}}", "delivered " + legend),
                     (f"kvwatch_router_available_hit_ratio{{{TARGET_SEL}}}", "available " + legend)],
                    width=18, runbook=ANCHOR_ROUTING))
    b.add(PanelSpec("tenant_hit_ratio", "Hit ratio per tenant",
                    "Per tenant (kind fairness_id: llm-d's, from the router's request metrics), now, over the "
                    "window: prompt tokens served from cache over those sent; the tenant_top_k tenants with the "
                    "most prompt tokens by name, the rest as other." + empty, "percentunit",
                    [(f"kvwatch_tenant_hit_ratio{{{TARGET_SEL}}}", "{{kind}} {{tenant}}")],
                    kind="table", width=24, height=8, runbook=ANCHOR_ROUTING, instant=True))
    b.add(PanelSpec("tenant_recomputed_tokens", "Recomputed tokens per tenant",
                    "Per tenant (kind lora: the LoRA adapter the engine's KV-cache events name), over the "
                    "stream's window: prompt tokens recomputed because their blocks were evicted before their "
                    "reuse; the tenant_top_k adapters that stored most by name, the rest as other. Needs the "
                    "event stream (--kv-events).", "short",
                    [(f"kvwatch_tenant_recomputed_tokens{{{TARGET_SEL}}}", "{{kind}} {{tenant}}")],
                    kind="table", width=24, height=8, runbook=ANCHOR_ROUTING, instant=True))
    b.add(PanelSpec("tenant_lost_prefill_seconds", "Prefill seconds lost per tenant",
                    "Per tenant (kind lora), over the stream's window: the prefill seconds its recomputed tokens "
                    "cost, at the page's prefill seconds per computed token (the rate the window's lost is priced "
                    "at, so the adapters' seconds split it); the same tenant_top_k adapters and other. Needs the "
                    "event stream (--kv-events) and the page's prefill time.", "s",
                    [(f"kvwatch_tenant_lost_prefill_seconds{{{TARGET_SEL}}}", "{{kind}} {{tenant}}")],
                    kind="table", width=24, height=8, runbook=ANCHOR_ROUTING, instant=True))


BUILDERS = {"overview": overview, "exhaustion": exhaustion, "prefix_cache": prefix_cache, "first_token": first_token,
            "fleet": fleet}


def catalogue_panels(board: Board, config: MixinConfig) -> Board:
    """A panel for each catalogue signal that names this board, after the
    board's hand-laid panels: a new signal needs no code here."""
    v = Views(config)
    runbooks = {"exhaustion": ANCHOR_EXHAUSTED, "prefix": ANCHOR_HIT, "first_token": ANCHOR_TTFT,
                "throughput": ANCHOR_THROUGHPUT}
    for signal in SIGNALS:
        if signal.panel == board.key:
            board.add(PanelSpec(signal.name, signal.title or signal.name, signal.help, UNITS[signal.unit].grafana,
                                [(v.sig(signal.name), v.engine_legend)], width=8, runbook=runbooks[signal.group],
                                signal=signal.name))
    return board


def boards(config: MixinConfig) -> dict[str, Board]:
    built = {}
    for key, builder in BUILDERS.items():
        board = catalogue_panels(builder(config), config)
        for closing in board.closing:
            closing(board)
        built[key] = board
    return built


def file_name(key: str) -> str:
    return f"kvwatch-{DASHBOARDS[key][0]}.json"


__all__ = ["boards", "file_name", "DASHBOARDS", "Board", "PanelSpec", "indent"]
