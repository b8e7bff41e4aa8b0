"""alerts/runbooks.md: one section per alert and one per cause, each saying
what it means, how to confirm it on the dashboards, what to do and what not
to do. The anchors are the ones the alerts' runbook_url and the panels'
runbook links point at."""

from __future__ import annotations

from kvwatch.mixin.alerts import alert_specs, runbook_anchor
from kvwatch.mixin.config import ALERT_CAUSES, MixinConfig, seconds
from kvwatch.mixin.dashboards import DASHBOARDS
from kvwatch.mixin.promql import num

D_OVERVIEW = DASHBOARDS["overview"][1]
D_EXHAUSTION = DASHBOARDS["exhaustion"][1]
D_PREFIX = DASHBOARDS["prefix_cache"][1]
D_TTFT = DASHBOARDS["first_token"][1]
D_FLEET = DASHBOARDS["fleet"][1]
THROUGHPUT_ANCHOR = "throughput-and-failures"


def _pct(x: float) -> str:
    return f"{x * 100:g}%"


def _alert_intros(c: MixinConfig) -> dict[str, str]:
    w = c.rate_window
    return {
        "VllmKvCacheExhausted": (
            f"An engine's KV cache ran out of room over the last {w}: requests were preempted (vLLM preempts "
            "only when it cannot allocate a block, so this counts even when no scrape caught the usage peak), "
            f"or waited for room while usage peaked above {_pct(c.exhaustion_usage_ratio)}, for "
            f"{c.for_duration('VllmKvCacheExhausted')}. vLLM counts evictable prefix-cache blocks as free, so "
            "usage this high means blocks held by running requests. Preempted requests are recomputed later "
            "and waiting ones get no first token: users see latency, the GPU redoes work.\n\n"
            "The cause is told apart by the share of the cache one running request holds (mean usage / mean "
            "running requests over the rate window) and by the queue: a share of at least "
            f"{_pct(c.long_request_capacity_share)} with no more requests waiting than running means a few long "
            "requests fill it (`long_requests`); a smaller share, or a longer queue, means many requests do "
            "(`concurrency_beyond_capacity`). The queue matters because preemption thins the batch: the few "
            "requests left running each hold a large share while many wait. The two rules exclude each other, "
            "so exactly one cause fires per engine; kvwatch's in-process diagnosis decides with the same "
            "definition over its window and names the same one (and may add `capacity_below_max_num_seqs`, "
            "which needs `--max-num-seqs`, not exported by vLLM)."),
        "VllmKvCacheExhaustionSoon": (
            "An engine's KV usage is rising, and at its least-squares trend over the last 5m "
            "(`kvwatch_kv_cache_exhaustion_eta_seconds`, PromQL `deriv()`) it reaches 100% in under "
            f"{num(c.exhaustion_eta_minutes)} minutes, for {c.for_duration('VllmKvCacheExhaustionSoon')}, while "
            "nothing is preempted or waits for room yet. It is a forecast: it fires before preemption starts, "
            "and falls silent once the cache is exhausted, when VllmKvCacheExhausted takes over. Flat or falling "
            "usage, and usage below its own 5-minute mean (a cache that just emptied), never fire it. "
            "`kvwatch_kv_cache_requests_fit_now` falls beside it as running requests decode and grow (usable "
            "blocks x running / used blocks): when it nears the running count, the next admissions will preempt."),
        "VllmPrefixCacheHitRateLow": (
            f"Over the last {w}, fewer than {_pct(c.hit_ratio_low)} of the prompt tokens an engine looked up in "
            f"its prefix cache were found there (at least {num(c.min_query_tokens)} tokens looked up), for "
            f"{c.for_duration('VllmPrefixCacheHitRateLow')}; or prefix caching is off while the engine serves "
            "prompts. Every miss is prefill recomputed: more GPU time and a later first token.\n\n"
            "The causes exclude each other, so at most one fires per engine: caching disabled; a cold cache (the "
            f"engine restarted within {c.cold_cache_window}: its counters reset or its cache configuration "
            "changed; a Prometheus with less history than that sees no restart and does not guess one); else, "
            f"after a healthy baseline (at least {_pct(c.hit_ratio_low)} in the {c.hit_ratio_baseline_window} "
            "before), eviction before reuse (mean KV usage above "
            f"{_pct(c.eviction_usage_ratio)} with the cache not exhausted) or a changed prefix; no reuse (low "
            "before as well) only when the mixin config sets `no_reuse_alert`.\n\n"
            "**While the KV cache is exhausted** (VllmKvCacheExhausted's condition: the cache full while "
            "requests wait, or preemptions), a full cache explains a low hit ratio by itself: requests that "
            "share nothing miss, and idle prefixes are evicted to make room. Then only caching disabled, a cold "
            "cache, and a changed prefix whose drop already showed in a rate window without exhaustion (within "
            f"the {c.hit_ratio_baseline_window} before) fire; a drop that came with the exhaustion names no "
            "cause (eviction and changed prompts look alike in the counters; vLLM's `--kv-cache-metrics` "
            "histograms tell them apart, and kvwatch's in-process finding uses them when exported). Treat the "
            "exhaustion first."),
        "VllmTimeToFirstTokenSlow": (
            f"An engine's mean time to first token over the last {w} was above {num(c.ttft_mean_seconds)}s"
            + (f" (counting the upstream stage {c.upstream_histogram} before the engine)" if c.upstream_histogram
               else "")
            + f", for {c.for_duration('VllmTimeToFirstTokenSlow')}.\n\n"
            "The mean splits exactly into parts: queue (vllm:request_queue_time_seconds), prefill "
            "(vllm:request_prefill_time_seconds), front end (the rest of the engine's TTFT: HTTP, "
            "tokenization, scheduling)"
            + (", and upstream" if c.upstream_histogram else "")
            + ". The largest part is the cause; a queue is KV-bound when the cache was exhausted in the window "
            "(VllmKvCacheExhausted's condition: usage above "
            f"{_pct(c.exhaustion_usage_ratio)} while requests waited for room, or preemptions), compute-bound "
            "otherwise. "
            "Exactly one cause fires per engine, and KV-bound and compute-bound queueing never fire together. "
            "Means rather than quantiles, because only means add up (the dashboards show p50/p95/p99 too)."),
        "KvwatchDown": (
            f"Prometheus has failed to scrape a kvwatch target ({c.kvwatch_selector}) for "
            f"{c.for_duration('KvwatchDown')} (`kvwatch_unreachable`), or there is no kvwatch target to scrape "
            "at all (`kvwatch_absent`). While it lasts, the vLLM alerts for those pods cannot fire."),
        "KvwatchEngineUnreachable": (
            f"kvwatch is up but its polls of the vLLM engine's /metrics have failed for "
            f"{c.for_duration('KvwatchEngineUnreachable')} (kvwatch_up == 0). kvwatch exports no engine series "
            "while it cannot read them, so the vLLM alerts for that pod are blind too."),
        "VllmEngineStatsDisabled": (
            "kvwatch reads the engine's /metrics, but the page carries no engine series "
            f"(kvwatch_stats_disabled == 1) for {c.for_duration('VllmEngineStatsDisabled')}: vLLM runs "
            "with `--disable-log-stats`, which turns its Prometheus statistics off, or the target is another "
            "program. The engine may serve requests perfectly well, so this is not KvwatchEngineUnreachable "
            "(which it excludes): it is blindness. kvwatch, its findings and every vLLM alert, the objectives' "
            "pages included, see nothing for this engine while it lasts."),
        "VllmFleetReplicaOutlier": (
            f"One replica of a model behaves unlike the other replicas of the same model over the last {w} "
            f"(replicas told apart by `{c.instance_label}`, models by `model_name` within "
            f"{', '.join(c.group_labels)}), for {c.for_duration('VllmFleetReplicaOutlier')}. These are problems no "
            "single replica shows: each needs its peers for comparison, and kvwatch's sidecar sees one replica, "
            "so they come from these rules and from `kvwatch diagnose --prometheus` (the same definitions, "
            "kvwatch/diagnose/fleet.py). The causes: one replica exhausted or queueing while peers have room "
            "(`imbalance`), a warm replica reusing far fewer prefixes than its warm peers "
            "(`lost_prefix_affinity`), a replica that restarted while its peers did not (`cold_replica`)."),
    }


# cause -> what to do in the first five minutes (before the medium-term fix).
FIRST_FIVE = {
    "concurrency_beyond_capacity":
        "Shed or spread load now: lower the gateway's concurrency limit for this model, or scale out "
        "(`kubectl scale deployment/<name> -n <namespace> --replicas=<n+1>`). With preemptions every minute "
        "recomputes running requests; a replica that starts takes minutes to load the model.",
    "long_requests":
        "Find the long requests in the gateway log and cap `max_tokens` for their callers, or route them to a "
        "larger engine. Scaling out helps less: each replica still holds only a few of them.",
    "caching_disabled":
        "Nothing urgent. Confirm in the pod's arguments that `--enable-prefix-caching` is absent (or "
        "`--no-enable-prefix-caching` present).",
    "cold_cache":
        "Nothing urgent: confirm the restart (`kubectl get pod -n <namespace> <pod>` restarts and age, "
        "`kubectl logs --previous -c vllm`) and whether it was planned.",
    "eviction_before_reuse":
        "Check whether load rose (running requests, prompt tokens per second); shed or scale out if latency "
        "suffers. Nothing is lost yet: prefixes are recomputed.",
    "prefix_changed":
        "Ask what was deployed when the ratio fell (application, gateway, prompt templates); roll it back if "
        "the extra prefill costs latency. Silence the alert once the change is known to be intended.",
    "no_reuse":
        "Nothing urgent: compare with the workload you expect (should its prompts share text?).",
    "queueing_kv_bound":
        "Treat the exhaustion first (VllmKvCacheExhausted): shed load or scale out.",
    "queueing_compute_bound":
        "Shed load or scale out; check the pod's `--max-num-seqs` against running requests.",
    "prefill":
        "Check prompt lengths (gateway log, prompt tokens per request); rate-limit the callers sending the longest "
        "prompts if latency objectives are breached.",
    "preemption":
        "Treat the exhaustion first (VllmKvCacheExhausted for the same engine): shed load or scale out.",
    "front_end":
        "Check the vLLM container's CPU (`kubectl top pod -n <namespace> <pod> --containers`) and throttling.",
    "upstream":
        "Check the upstream stage's own dashboard and error rate; the engine is not the bottleneck.",
    "kvwatch_unreachable":
        "`kubectl get pod -n <namespace> <pod>` (is the kvwatch container running and ready?), then "
        "`kubectl logs -n <namespace> <pod> -c kvwatch --tail=50`. Serving is unaffected.",
    "kvwatch_absent":
        "`kubectl get pods,servicemonitors,podmonitors -n <namespace>`; Prometheus' Targets page for the job. If "
        "the fleet was scaled to zero on purpose, silence the alert.",
    "stats_disabled":
        "Read the engine's arguments (`kubectl get pod -n <namespace> <pod> -o jsonpath='{.spec.containers[?(@.name"
        "==\"vllm\")].args}'`): `--disable-log-stats` there means vLLM exports no statistics. `curl` kvwatch's "
        "target: a page of only process_* and python_* series confirms it.",
    "engine_unreachable":
        "`kubectl get pod -n <namespace> <pod>` and `kubectl logs -n <namespace> <pod> -c vllm --tail=100`: is "
        "the engine running, restarting, out of memory? kvwatch's `/readyz` and status page say why polls fail.",
    "usage_rising": (
        "Open the exhaustion dashboard for the engine in the alert. (1) *Time until the KV cache is full* "
        "still falling and *Free KV blocks* still dropping: the trend holds. (2) *Running requests: now and peak* rising: "
        "more requests, so move or shed load now (the router's weights, the gateway's concurrency limit) or "
        "start a replica; running steady while usage climbs: the same requests are growing, so find the "
        "long generations. (3) If the ETA jumps back up or the alert resolves, the ramp levelled off: note it "
        "and watch the next peak."),
    "imbalance":
        f"Open {D_FLEET}'s *Replicas of each model* table: which replica is full or queueing, which have room. "
        "Check the load balancer's view of the endpoints (`kubectl get endpointslices -n <namespace> -l "
        "kubernetes.io/service-name=<service>`): a replica missing there, or a sticky/prefix-aware router pinning "
        "one hot key to one replica. Draining the hot replica's sessions spreads the load now.",
    "lost_prefix_affinity":
        "Compare the replica's request path with its peers': does its traffic come through the prefix-aware "
        "router, or straight through a Service (round robin)? Check the router's recent config change or "
        "restart (affinity tables lost). Nothing is down: prefixes are recomputed.",
    "cold_replica":
        "Nothing urgent: confirm the restart (`kubectl get pod -n <namespace> <pod>` restarts and age, "
        "`kubectl logs --previous -n <namespace> <pod> -c vllm`) and whether it was planned (a rollout).",
}


# cause -> (meaning, confirm, do, don't)
def _cause_texts(c: MixinConfig) -> dict[str, tuple[str, str, str, str]]:
    share = _pct(c.long_request_capacity_share)
    return {
        "usage_rising": (
            "Blocks are being taken faster than finished requests give them back: more requests are admitted, "
            "or the running ones grow as they decode (vLLM allocates a block every block_size tokens). At this "
            "rate the free blocks run out, and then vLLM preempts running requests and queues new ones.",
            f"{D_EXHAUSTION}: *Time until the KV cache is full at this trend* falling; *Free KV blocks (the "
            "ceiling left)* falling; *Requests wanting to run vs requests the cache holds* says whether demand "
            "(more requests) or length (the same requests, growing) drives it.",
            "If demand drives it, shed or route new load to other replicas, or start one (it needs the time "
            "this alert leaves); if length does, cap `max_tokens` for the heaviest clients. `kvwatch capacity "
            "--gpu-memory ...` says how many requests a larger card or more tensor parallelism holds.",
            "Do not restart the engine: it drops every running request and empties the prefix cache, and the "
            "load comes straight back. Do not raise `--max-num-seqs` now: it admits more requests into a cache "
            "that is already filling."),
        "concurrency_beyond_capacity": (
            "More requests want to run at once than the KV cache holds at their length. Each request is "
            f"modest (under {share} of the cache), or more wait than run, but together they overflow it, so the "
            "scheduler preempts running requests and leaves new ones waiting.",
            f"{D_EXHAUSTION}: *KV cache usage: now and peak* above the red line; *Preemptions* or *Waiting "
            "requests by reason* (capacity) above zero; *Requests wanting to run vs requests the cache holds* "
            "shows demand well above what the cache holds; *Share of the cache per running request* below "
            "its red line, or waiting requests above running ones.",
            "Cap concurrency near what the cache holds: `--max-num-seqs`, or a concurrency limit in the "
            "gateway or router. Add replicas and spread the load. Give the cache more memory "
            "(`--gpu-memory-utilization`, an fp8 KV cache dtype, more tensor parallelism). `kvwatch capacity` "
            "computes how many requests a memory budget holds. Read `kvwatch_preemptions_on_repeat_requests_ratio` "
            "(vLLM 0.30+): near 0, many requests were each preempted once (broad pressure: the cache is short for "
            "the load); near 1, a few are preempted again and again (thrash: lower `--max-num-seqs`). "
            "`kvwatch_admission_rejections_per_second` is a separate cause: the queue limit, not the cache. "
            "`kvwatch_kv_cache_exhaustion_eta_seconds` says how long the trend leaves before the cache is full.",
            "Do not shorten max_model_len for this: the requests are not long. Do not read high usage alone as "
            "the problem: a busy, healthy cache runs near full without preempting."),
        "long_requests": (
            f"A few requests, each holding at least {share} of the KV cache, fill it, and no more wait than run: "
            "the cache is small for the lengths being served, whatever the concurrency.",
            f"{D_EXHAUSTION}: *Share of the cache per running request* above its red line; *Request length (p95 "
            "and mean)* shows long prompts or generations; *Running requests* low while usage is at the top, "
            "and *Waiting requests by reason* no higher.",
            "Find who sends the long requests (gateway log, prompt and generation p95). Cap `max_tokens` or "
            "`--max-model-len`, route long-context requests to engines sized for them (more KV memory per "
            "engine: tensor parallelism, an fp8 KV cache), and enable chunked prefill so long prompts do not "
            "block the batch.",
            "Do not add more replicas of the same size and expect relief: each one still holds only a few long "
            "requests. Do not lower `--max-num-seqs`: few requests run already."),
        "caching_disabled": (
            "The engine runs without `--enable-prefix-caching` (vllm:cache_config_info enable_prefix_caching="
            "False) while it serves prompts: no prompt token is ever reused, and vLLM does not even count "
            "queries.",
            f"{D_PREFIX}: *Engine cache configuration* shows enable_prefix_caching=False.",
            "If prompts share prefixes (system prompts, few-shot examples, documents, multi-turn history), "
            "enable prefix caching. If they do not, silence this alert for the engine (its severity is info).",
            "Do not tune cache size or routing for hit rate before caching is on."),
        "cold_cache": (
            f"The engine restarted within {c.cold_cache_window} (its prompt-token counter reset, or it came back "
            "with another cache configuration): its cache is empty, and each prefix must be computed once "
            "before it can be reused.",
            f"{D_PREFIX}: *Engine restarts* above zero, or a changed row in *Engine cache configuration*; the hit "
            "ratio climbs as the cache warms up.",
            "Wait for the cache to warm; the alert clears by itself. If the engine restarted unexpectedly, find "
            "out why (deploy, OOM, crash in its log). After a configuration change, recheck capacity on the "
            "exhaustion dashboard.",
            "Do not compare hit ratios across a restart or a configuration change; do not change the "
            "configuration again to fix a cold cache."),
        "eviction_before_reuse": (
            f"Prefixes repeated (the hit ratio was healthy in the {c.hit_ratio_baseline_window} before), but now "
            f"running requests hold so much of the cache (mean usage above {_pct(c.eviction_usage_ratio)}, the "
            "cache not exhausted) that idle cached prefixes are evicted before their next use.",
            f"{D_PREFIX}: *KV usage (mean): room for idle prefixes* above its red line, *Preemptions* at zero, "
            "and *Hit ratio: now and baseline* with the baseline above the red line and the current ratio below. "
            "With vLLM's `--kv-cache-metrics`, kv_block_idle_before_evict shorter than kv_block_reuse_gap "
            "proves it (kvwatch's in-process finding reads them).",
            "`kvwatch_kv_cache_reuse_shortfall_blocks` and `_bytes` (with `--kv-cache-metrics`) say how much more "
            "cache keeps the typical reuse; kvwatch's finding adds what the configured offload tier "
            "(`kv_offloading_size`) buys in idle time. "
            "Give idle prefixes room: more KV memory, fewer concurrent long requests, or more replicas. Route "
            "requests that share a prefix to the same engine (prefix-aware routing) so each engine keeps fewer "
            "distinct prefixes.",
            "Do not change the prompts: they are fine. Do not scale out with random routing alone: each engine "
            "then sees every prefix and keeps none."),
        "prefix_changed": (
            f"The hit ratio was healthy (at least {_pct(c.hit_ratio_low)}) in the {c.hit_ratio_baseline_window} "
            "before and dropped while the cache had room (usage below the eviction line, not exhausted; if the "
            "cache is exhausted now, the drop showed before it): the requests stopped sharing the prefix they "
            "shared. Typically a new prompt template or system prompt puts per-request text (a timestamp, a "
            "user id, a shuffled tool list) before the shared part.",
            f"{D_PREFIX}: *Hit ratio: now and baseline* with the baseline above the red line and the current "
            "ratio below; *KV usage (mean)* below its red line when the drop began; no restart. The drop lines "
            "up with a deploy of the application or gateway.",
            "Diff the prompt templates deployed around the drop. Keep shared text first and byte-identical "
            "across requests; move per-request text after it.",
            "Do not add KV memory: the cache has room, the prompts no longer match."),
        "no_reuse": (
            "The hit ratio is low and was low before too, and the cache is not exhausted: the workload shares "
            "few prefixes (unique documents, no common system prompt). Generated only with `no_reuse_alert: "
            "true` in the mixin config: such a workload would keep this alert firing forever. kvwatch's "
            "in-process finding (`kvwatch_finding{cause=\"no_reuse\"}`, info) shows it either way, and never "
            "while the cache is exhausted.",
            f"{D_PREFIX}: *Hit ratio: now and baseline*, both low; *Preemptions* at zero. With *KV usage (mean)* "
            "above its red line, evicted prefixes look the same: vLLM's `--kv-cache-metrics` tells.",
            "Nothing to repair in the cache. If the prompts should share text, put it first and keep it "
            "byte-identical. A 0 % ratio on prompts no longer than one KV block (kvwatch's finding says "
            "`no_reuse_kind: prefix_shorter_than_block`) is the block floor: vLLM caches whole blocks, so a shared "
            "prefix shorter than `block_size` never hits; lengthen the shared part or lower `--block-size`. Otherwise lower `hit_ratio_low` for this workload or turn `no_reuse_alert` off.",
            "Do not buy KV memory or change routing for hit rate: there is nothing to reuse."),
        "queueing_kv_bound": (
            "Most of the time to first token is spent waiting in the queue, and the KV cache was exhausted "
            "(full while requests waited for room, or preempting): requests wait for KV blocks.",
            f"{D_TTFT}: *Mean time to first token and its parts* with queue the largest; *KV-bound? Usage peak "
            f"and preemptions* above the red line. {D_EXHAUSTION} shows the exhaustion behind it.",
            "Treat it as exhaustion (see VllmKvCacheExhausted): fewer or shorter concurrent requests, more KV "
            "memory, more replicas.",
            "Do not add compute-side tuning (`--max-num-batched-tokens`) first: the queue waits for memory."),
        "queueing_compute_bound": (
            "Most of the time to first token is spent waiting in the queue while the KV cache had room: requests "
            "wait for scheduler slots (`--max-num-seqs`) or for compute.",
            f"{D_TTFT}: queue the largest part; *KV-bound? Usage peak and preemptions* below the red line with no "
            "preemptions; *Running requests* flat at the scheduler's limit while *Waiting requests* grows.",
            "Add replicas or lower the arrival rate. If the GPU has headroom, raise `--max-num-seqs` (the cache "
            "has room) or `--max-num-batched-tokens`.",
            "Do not enlarge the KV cache: a bigger cache does not shorten this queue."),
        "prefill": (
            "Most of the time to first token is prefill: long prompts whose tokens are not in the prefix cache.",
            f"{D_TTFT}: prefill the largest part; *Prefill time quantiles* high; *Prompt tokens per request and "
            "cached share* shows many uncached tokens.",
            "Raise prefix reuse (shared text first), shorten prompts, tune chunked prefill "
            "(`--max-num-batched-tokens`), or separate prefill from decode (disaggregated serving).",
            "Do not add KV memory or replicas for this alone: prefill time per request does not shrink with them."),
        "preemption": (
            "Most of the time to first token is outside queue and prefill while the KV cache is exhausted: "
            "preempted requests go back to the queue and recompute their KV, and neither vLLM's queue nor its "
            "prefill histogram counts that time.",
            f"{D_TTFT}: front end the largest part while *KV-bound? Usage peak and preemptions* shows preemptions "
            "or usage at the red line; VllmKvCacheExhausted fires for the same engine.",
            "Follow VllmKvCacheExhausted's runbook for its cause: fewer or shorter concurrent requests, more KV "
            "memory, or more replicas.",
            "Do not chase the API server: while the cache preempts, the residual is recomputation, not the front "
            "end."),
        "front_end": (
            "Most of the time to first token is outside queue and prefill: the API server (HTTP, tokenization, "
            "chat templating, multimodal preprocessing) or scheduling gaps.",
            f"{D_TTFT}: front end the largest part, queue and prefill small.",
            "Check the API server's CPU (vLLM's process, not the GPU), `--api-server-count`, and image or audio "
            "preprocessing. Compare with the gateway's own latency.",
            "Do not touch the KV cache or the scheduler: they are not where the time goes."),
        "upstream": (
            "Most of the time before the first token is spent before the engine, in the configured upstream "
            f"stage ({c.upstream_histogram or 'upstream_histogram'}): retrieval, a gateway, a tool call.",
            f"{D_TTFT}: the upstream line is the largest part; the engine's own parts are small.",
            "Look at the upstream service (vector store, gateway) and its dependencies.",
            "Do not resize the KV cache or the engine: a bigger or smaller cache does not repair retrieval."),
        "kvwatch_absent": (
            "No kvwatch target exists where there were some (within "
            f"{c.kvwatch_absent_window}), or none at all under the selector: the ServiceMonitor/PodMonitor selects "
            "nothing (labels, namespace selector, port name), or the pods carrying kvwatch are gone. `up < 1` "
            "cannot see this: a target that no longer exists has no `up` series.",
            f"Prometheus' Targets page has no target for the job; {D_OVERVIEW}: every panel empty.",
            "Fix the monitor's selectors (`deploy.labels`, `deploy.monitor_labels`, `deploy.port_name`), or bring "
            "the pods back. A fleet scaled to zero on purpose alerts until the window passes: silence it for "
            "planned scale-downs.",
            "Do not read silence from the other alerts as health: they see nothing either."),
        "imbalance": (
            "One replica of a model is exhausted or queueing while another replica of the same model has room "
            f"(KV usage peak at most {_pct(c.fleet_room_usage_ratio)} over the last {c.rate_window}, nothing "
            "waiting). The fleet as a whole could serve the load; the router sends too much of it to one "
            "replica.",
            f"{D_FLEET}: in *Replicas of each model* one replica's usage peak or waiting is high while its peers' "
            "are low; *Replicas pressed and with room* shows both above zero for the model; *KV usage peak per "
            "replica* shows the one line far above the others.",
            "Fix the routing: the load balancer's algorithm (least requests or KV-aware rather than round robin "
            "for uneven request sizes), session stickiness, a prefix-aware router whose hot prefix lands on one "
            "replica (spread hot prefixes), or a replica missing from the endpoints.",
            "Do not add KV memory or replicas: the peers already have room, and more of them stays idle."),
        "lost_prefix_affinity": (
            "A warm replica's prefix-cache hit ratio is below "
            f"{_pct(c.fleet_affinity_fraction)} of its warm peers' pooled ratio (peers at least "
            f"{_pct(c.hit_ratio_low)}): the traffic does share prefixes, but the requests that share them no "
            "longer reach the replica holding them.",
            f"{D_FLEET}: *Hit ratio as a share of the peers'* below its line for the replica; *Replicas of each "
            f"model* shows its hit ratio far below the others'. On {D_PREFIX}, the replica's ratio fell while "
            "the model's pooled ratio did not.",
            "Restore prefix or session affinity in the router or gateway (consistent hashing on the prefix or "
            "session key), and make sure all traffic goes through it.",
            "Do not enlarge the cache or tune eviction on that replica: the prefixes never reach it."),
        "cold_replica": (
            f"A replica restarted in the last {c.cold_cache_window} (its counters reset) while other replicas of "
            "the model did not: its prefix cache is refilling, so a lower hit ratio and slower first tokens there "
            "are expected for a while, and lost prefix affinity is not named for it meanwhile (nor counted among "
            "the warm peers of the others). `kvwatch diagnose --prometheus` holds it cold for one diagnosis "
            "window; the alert, which must hold for its `for:`, for cold_cache_window.",
            f"{D_FLEET}: *Restarts per replica* above zero for the one replica; its hit ratio climbs back over "
            "the next minutes.",
            "Find out why it restarted (deploy, OOM kill, crash, node drain); if restarts repeat, look at the "
            "pod's events and the engine's log. Warm-up traffic or a readiness delay can hide the cold start.",
            "Do not treat the low hit ratio as a routing or prompt problem while the replica is cold."),
        "kvwatch_unreachable": (
            "Prometheus cannot scrape kvwatch: the container is down, not ready, or the scrape configuration "
            "points elsewhere.",
            f"{D_OVERVIEW}: *Prometheus scraping kvwatch* at 0; Prometheus' Targets page shows the error.",
            "Check the kvwatch container (`kubectl logs -c kvwatch`, restarts, OOM), its /healthz, and the "
            "ServiceMonitor/PodMonitor or scrape job (port name, labels).",
            "Do not assume vLLM is down: kvwatch is a separate container."),
        "stats_disabled": (
            "The engine answers /metrics without its statistics: `--disable-log-stats` is set, or kvwatch's "
            "target is a different program's metrics endpoint.",
            f"{D_OVERVIEW}: *Failed polls by reason* shows no_engine_metrics; kvwatch's status page says the page "
            "has no engine metrics.",
            "Remove `--disable-log-stats` from the vLLM arguments (the statistics cost little), or fix kvwatch's "
            "`target`. kvwatch picks the series up at its next poll.",
            "Do not treat it as an outage: requests may be served normally. Do not restart the engine for it."),
        "engine_unreachable": (
            "kvwatch runs but cannot read vLLM's /metrics: the engine is down, starting or wedged, or kvwatch's "
            "target is wrong. (An engine that answers without statistics is VllmEngineStatsDisabled.)",
            f"{D_OVERVIEW}: *kvwatch polling vLLM* at 0; *Failed polls by reason* says why: refused or timeout "
            "(engine down or wedged), http_4xx (path or auth), too_large.",
            "Check the vLLM container (health endpoint, log, restarts). For http_4xx fix kvwatch's `target` or "
            "token.",
            "Do not restart kvwatch to fix it: it polls on its own and recovers when the engine answers."),
    }


def _first_five(config: MixinConfig, alert: str, cause: str, spec_list) -> list[str]:
    """The first-five-minutes block: the alert's PromQL to paste, how to
    read the pod's vLLM arguments, and the cause's immediate step."""
    deploy = config.deploy_settings
    out = [f"**First five minutes.** {FIRST_FIVE[cause]}", ""]
    if spec_list:
        out += ["Paste into Prometheus (the alert's own query; one series per affected engine):", "", "```promql",
                spec_list[0].query, "```", ""]
    if alert.startswith("Vllm"):
        out += ["Read the pod's vLLM arguments (cache size, `--max-num-seqs`, `--max-model-len`, prefix caching):",
                "", "```sh",
                f"kubectl get pod -n {deploy.namespace} <pod> -o jsonpath='{{.spec.containers[?(@.name==\"vllm\")].args}}'",
                "```", ""]
    return out


def _severity_text(spec_list) -> str:
    by_variant = {spec.variant: spec.severity for spec in spec_list}
    if set(by_variant) == {"preempting", ""}:
        return f"{by_variant['preempting']} with preemptions, {by_variant['']} without"
    return ", ".join(sorted(set(by_variant.values())))


def _objective_sections(config: MixinConfig, specs) -> list[str]:
    """One section per objective's burn-rate alert: what pages and why."""
    from kvwatch.mixin import objectives

    pairs = objectives.burn_windows(config)
    table = ["| long window | short window | burn rate | budget spent when it fires | severity |",
             "|---|---|---|---|---|"]
    for pair in pairs:
        spent = pair.factor * seconds(pair.long) / (30 * 86400)
        table.append(f"| {pair.long} | {pair.short} | {num(pair.factor)}x | {_pct(round(spent, 4))} of 30 days' | "
                     f"{pair.severity} |")
    texts = {
        "first_token": (
            f"Too many requests got their first token later than {num(config.ttft_objective_seconds)}s: the "
            f"objective is {_pct(config.ttft_objective)} within that bound (mixin config `ttft_objective`, "
            "`ttft_objective_seconds`), read per engine from vLLM's TTFT histogram (the bucket at the bound over "
            "the count). Users wait for the first word of every answer; this is the page for it.",
            "Open the cause alerts that fire beside it for the same engine (the page's `cause_alerts` annotation "
            "names them; Alertmanager groups them by engine and model): `VllmKvCacheExhausted` and "
            "`VllmTimeToFirstTokenSlow` say whether the queue waits for KV cache, for compute, for prefill or "
            "for something upstream, and their runbook sections say what to do. With no cause alert yet, open "
            f"{D_TTFT}: the largest part of the mean is where the time goes."),
        "availability": (
            f"Requests end in error: the objective is {_pct(config.availability_objective)} of finished requests "
            "without error (`availability_objective`), from vllm:request_success_total by finished_reason. An "
            "error is the engine's (an exception in the model runner, an out-of-memory, a bad request the "
            "engine failed), not the client's.",
            "Read the engine's log for the errors (`kubectl logs -n <namespace> <pod> -c vllm --since=15m`). "
            "Errors together with exhaustion or restarts point at memory; errors alone at the model, the "
            "request payloads or the engine version."),
        "aborts": (
            f"Clients abort requests: the objective is {_pct(config.abort_objective)} not aborted "
            "(`abort_objective`). Clients abort for their own reasons (a closed tab, a retry, a gateway "
            "timeout), so this never pages, whatever the window: rising aborts beside slow first tokens are "
            "users giving up; aborts alone are usually the client's or the gateway's timeouts.",
            "Compare with the first-token objective: aborts rising with it are waits too long for users; "
            "alone, check the gateway's timeouts and the client's retry policy."),
    }
    out = ["## Pages: objectives and burn rates", "",
           "Pages follow what users feel: late first tokens and failed requests, each an objective with an "
           "error budget (1 - objective). Each objective alerts on multi-window, multi-burn-rate pairs (the SRE "
           "workbook's): the share of bad requests over the long window AND over the short one above burn rate "
           "x budget. The long window says enough budget is gone to matter; the short one that it still burns, "
           "so a short spike does not page and the page resolves minutes after the harm stops. The cause alerts "
           "below are warnings that say where to look. Pairs (`burn_rate_windows`):", "", *table, ""]
    from kvwatch.mixin.alerts import runbook_anchor as anchor_of

    for objective, (alert, _, _) in objectives.OBJECTIVE_ALERTS.items():
        meaning, do = texts[objective]
        spec_list = specs.get((alert, objective), [])
        severity = ", ".join(f"{s.severity} ({s.variant})" for s in spec_list)
        out += [f'<a id="{anchor_of(alert)}"></a>', "", f"### {alert}", "",
                f"*{spec_list[0].summary}* Severity by window: {severity}.", "",
                f"**What it means.** {meaning}", "", f"**First five minutes.** {do}", "",
                "Paste into Prometheus (the first pair's query; one series per affected engine):", "",
                "```promql", spec_list[0].query, "```", ""]
    return out


def render(config: MixinConfig) -> str:
    specs: dict[tuple[str, str], list] = {}
    for spec in alert_specs(config):
        specs.setdefault((spec.alert, spec.cause), []).append(spec)
    intros = _alert_intros(config)
    causes = _cause_texts(config)
    out = [
        "<!-- Generated by `kvwatch generate` (kvwatch/mixin/runbooks.py); edit the generator, not this file. -->",
        "# kvwatch runbooks",
        "",
        "One section per alert and one per cause, each leading with what to do in the first five minutes, then "
        "what it means, how to confirm it and the medium-term fix. The pages come first (the objectives' burn "
        "rates: what users feel), then the cause alerts that explain them. Every alert carries `severity`, "
        "`cause` or `objective` (and `symptom` for the vLLM alerts) labels and a `runbook_url` to its section "
        "here (by default on the kvwatch that raised it, which serves this text at /runbooks; `kvwatch runbook "
        "<section>` prints a section in a terminal), and, where the mixin config sets the pattern, a "
        "`dashboard_url` to the panel that shows it. The same causes are named "
        "by kvwatch's in-process diagnosis (`kvwatch_finding`, `/api/v1/diagnosis`), which also shows the "
        "evidence. Why each severity and `for:`: docs/alerts.md.",
        "",
        "| alert | cause | severity | for |",
        "|---|---|---|---|",
    ]
    for alert, alert_causes in ALERT_CAUSES.items():
        for cause in alert_causes:
            spec_list = specs.get((alert, cause))
            severity = _severity_text(spec_list) if spec_list else f"{config.severity(cause)} (when configured)"
            out.append(f"| {alert} | [{cause}](#{runbook_anchor(alert, cause)}) | {severity} | "
                       f"{config.for_duration(alert)} |")
    out.append("")
    out += _objective_sections(config, specs)
    out += ["## Cause alerts", "",
            "Warnings (and facts) that explain a page, or come before one: each names the likely cause of a "
            "symptom on one engine and the next check.", ""]
    for alert, alert_causes in ALERT_CAUSES.items():
        out += [f'<a id="{runbook_anchor(alert)}"></a>', "", f"## {alert}", "", intros[alert], ""]
        for cause in alert_causes:
            spec_list = specs.get((alert, cause), [])
            meaning, confirm, do, dont = causes[cause]
            if spec_list:
                headline = f"*{spec_list[-1].summary}* Severity {_severity_text(spec_list)}."
            elif cause == "no_reuse":
                headline = "*Only when the mixin config sets `no_reuse_alert: true`* (not in this generation)."
            else:
                headline = ("*Only when the mixin config names an `upstream_histogram`* (not in this "
                            "generation).")
            out += [f'<a id="{runbook_anchor(alert, cause)}"></a>', "", f"### {alert}: {cause}", "", headline, ""]
            out += _first_five(config, alert, cause, spec_list)
            out += [f"**What it means.** {meaning}", "",
                    f"**Confirm on the dashboard.** {confirm}", "",
                    f"**Medium term.** {do}", "",
                    f"**What not to do.** {dont}", ""]
    out += [f'<a id="{THROUGHPUT_ANCHOR}"></a>', "", "## Throughput and failures (no alert)", "",
            "The overview's last row, for context when an alert fires.", "",
            "**Tokens per second.** Prompt tokens (cached ones included) and generated tokens per engine. A drop "
            "with a full queue points at the engine (preemptions recompute work); a drop with an empty queue is "
            "less traffic.", "",
            "**Finished requests by reason.** stop and length are normal ends; abort means the client went "
            "away (often a timeout while waiting for a slow first token: see VllmTimeToFirstTokenSlow); error "
            "and repetition are the engine's.", "",
            "**Failed requests (abort, error).** Rising aborts together with slow first tokens or exhaustion are "
            "users giving up; errors without either are worth the engine's log.", ""]
    return "\n".join(out).rstrip("\n") + "\n"
