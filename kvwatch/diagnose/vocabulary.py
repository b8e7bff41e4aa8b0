"""The diagnosis' vocabulary: symptoms, their causes, severities, the next
check for each cause, and the Finding record every rule returns. The
`symptom`/`cause` values are also the labels of `kvwatch_finding` and of the
generated alert rules; do not rename them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SEVERITIES = ("critical", "warning", "info")
CONFIDENCES = ("high", "medium", "low")

# symptom -> causes, in the order the rules consider them.
CAUSES: dict[str, tuple[str, ...]] = {
    "exhaustion": ("concurrency_beyond_capacity", "long_requests", "capacity_below_max_num_seqs"),
    "low_hit_rate": ("caching_disabled", "cold_cache", "prefix_changed", "eviction_before_reuse", "no_reuse"),
    "slow_first_token": ("queueing_kv_bound", "queueing_compute_bound", "prefill", "front_end", "upstream",
                         "preemption"),
    "change": ("model_changed", "lora_changed", "cache_dtype_changed", "cache_config_changed", "engine_restarted",
               "prefix_cache_cleared"),
    # Judged across the replicas of one model (diagnose/fleet.py); a replica
    # alone cannot show them.
    "fleet": ("imbalance", "lost_prefix_affinity", "cold_replica"),
    # The engine's KV-cache event stream itself (diagnose/stream.py), where kv_events is set.
    "kv_events": ("events_stopped", "events_missed"),
}


# The one severity table: cause -> severity. The diagnosis' findings and the
# generated alerts (kvwatch/mixin/config.py) both read it. Severity says who
# must act and how soon: critical wakes someone (users lose work now),
# warning goes to the owning team's queue the same day, info is a fact.
SEVERITY: dict[str, str] = {
    # A full cache that makes requests wait: users feel it, nothing is lost yet.
    "concurrency_beyond_capacity": "warning",
    "long_requests": "warning",
    # Sizing advice: the scheduler admits more than the cache holds.
    "capacity_below_max_num_seqs": "warning",
    # Facts about the workload or the deployment, worth knowing, not paging.
    "caching_disabled": "info",
    "cold_cache": "info",
    "no_reuse": "info",
    # Something changed or something crowds the cache out: someone should look.
    "prefix_changed": "warning",
    "eviction_before_reuse": "warning",
    "queueing_kv_bound": "warning",
    "queueing_compute_bound": "warning",
    "prefill": "warning",
    "front_end": "warning",
    "upstream": "warning",
    # The first-token time the queue and prefill histograms miss while the
    # cache is exhausted: requests preempted and re-queued, their KV recomputed.
    "preemption": "warning",
    # Changes are context for the other findings.
    "model_changed": "info",
    "lora_changed": "info",
    "cache_dtype_changed": "info",
    "cache_config_changed": "info",
    "engine_restarted": "info",
    "prefix_cache_cleared": "info",
    # The stream kvwatch decides hit-rate causes by went quiet or lost messages:
    # its decisions are off or low; the page's signals stand.
    "events_stopped": "warning",
    "events_missed": "info",
    # Across the replicas of one model.
    "imbalance": "warning",
    "lost_prefix_affinity": "warning",
    "cold_replica": "info",
}
# Exhaustion with preemptions: vLLM throws away running requests' KV and
# recomputes it, so throughput collapses while the load stays; users lose
# work now. The same causes without preemptions keep SEVERITY's level.
PREEMPTING_SEVERITY: dict[str, str] = {
    "concurrency_beyond_capacity": "critical",
    "long_requests": "critical",
}
assert set(SEVERITY) == {cause for causes in CAUSES.values() for cause in causes}
assert set(PREEMPTING_SEVERITY) <= set(CAUSES["exhaustion"])


# The alert that reports each symptom (kvwatch/mixin/config.py ALERTS agrees,
# tests/test_rules_promtool.py checks), for the runbook link a finding carries.
SYMPTOM_ALERTS = {"exhaustion": "VllmKvCacheExhausted", "low_hit_rate": "VllmPrefixCacheHitRateLow",
                  "slow_first_token": "VllmTimeToFirstTokenSlow", "fleet": "VllmFleetReplicaOutlier"}
# kvwatch serves the runbooks (GET /runbooks): a finding's link is relative
# to the kvwatch that reports it (the status page, the JSON API).
RUNBOOK_PATH = "runbooks"


def runbook_link(symptom: str, cause: str, alert_causes: dict[str, tuple[str, ...]] | None = None) -> str | None:
    """The runbook section of a finding: its alert and cause's section (the
    anchors of mixin/alerts.py runbook_anchor), or the alert's when no rule
    names the cause; None for changes, which have no alert."""
    alert = SYMPTOM_ALERTS.get(symptom)
    if alert is None:
        return None
    anchor = alert.lower()
    if alert_causes is None or cause in alert_causes.get(alert, ()):
        anchor += "-" + cause.replace("_", "-")
    return f"{RUNBOOK_PATH}#{anchor}"


def severity_of(cause: str, preempting: bool = False) -> str:
    """The severity of a cause, from the one table."""
    if preempting and cause in PREEMPTING_SEVERITY:
        return PREEMPTING_SEVERITY[cause]
    return SEVERITY[cause]


# alert -> the causes its generated rules name (a `cause` label and a runbook
# section each): the mixin builds the rules from it, the sidecar links each
# finding to its runbook section by it.
ALERT_CAUSES = {
    "VllmKvCacheExhausted": ("concurrency_beyond_capacity", "long_requests"),
    # A forecast, not a diagnosis: the one cause is the trend itself.
    "VllmKvCacheExhaustionSoon": ("usage_rising",),
    "VllmPrefixCacheHitRateLow": CAUSES["low_hit_rate"],
    "VllmTimeToFirstTokenSlow": CAUSES["slow_first_token"],
    "KvwatchDown": ("kvwatch_unreachable", "kvwatch_absent"),
    "KvwatchEngineUnreachable": ("engine_unreachable",),
    # vLLM answers without its statistics (--disable-log-stats): not unreachable, blind.
    "VllmEngineStatsDisabled": ("stats_disabled",),
    "VllmFleetReplicaOutlier": CAUSES["fleet"],
}
assert set(ALERT_CAUSES["VllmKvCacheExhausted"]) <= set(CAUSES["exhaustion"])


@dataclass(frozen=True)
class Finding:
    symptom: str  # exhaustion | low_hit_rate | slow_first_token | change
    cause: str
    severity: str  # critical | warning | info
    confidence: str  # high | medium | low
    model: str
    engine: str | None
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next_check: str = ""
    # Set while the finding is held (diagnose/hold.py): its condition has been
    # clear since this time (epoch seconds), for less than the hold; the
    # finding is still active and reported as it was last seen.
    clearing_since: float | None = None
    # Other causes of the same symptom on the same engine that the rules also
    # found, weaker than this one (diagnose/arbitration.py): each
    # {"cause", "severity", "confidence", "summary"}.
    contributing: tuple[dict[str, Any], ...] = ()
    # Causes the data cannot tell from this one, each {"cause", "decided_by":
    # [sources that would decide, arbitration.DECIDERS], "how"}.
    alternatives: tuple[dict[str, Any], ...] = ()


def finding_order(finding: Finding) -> tuple:
    """The order findings are listed in: active ones before those held while
    clearing, most severe first within each (the page's banner shows the
    first, and draws clearing ones muted below the active)."""
    return (finding.clearing_since is not None,
            SEVERITIES.index(finding.severity) if finding.severity in SEVERITIES else 9, finding.symptom,
            finding.model, finding.engine or "", finding.cause)


NEXT_CHECK = {
    "prefix_cache_cleared":
        "The engine reset its prefix cache (vLLM's /reset_prefix_cache, or its own reset after a change of "
        "weights or adapters; the KV-cache events say AllBlocksCleared): every cached block is gone and the hit "
        "ratio refills from 0. Find who reset it; compare hit ratios only from after it.",
    "events_stopped":
        "The engine's KV-cache events stopped while it serves: check that it runs with --kv-events-config pointing "
        "at kvwatch's --kv-events endpoint (publisher zmq; kvwatch binds unless --kv-events-connect), that nothing "
        "else holds the port, and kvwatch_kv_events_publisher_restarts; the hit-rate causes fall back to the page.",
    "events_missed":
        "Sequence gaps (kvwatch_kv_events_missed_messages) are messages the engine's publisher dropped past its hwm "
        "or the connection lost; drops (kvwatch_kv_events_dropped_messages) are kvwatch's intake full under a flood: "
        "raise the publisher's hwm, give kvwatch CPU, and read the stream's counts as lower bounds meanwhile.",
    "concurrency_beyond_capacity":
        "Compare kvwatch_requests_running_max and waiting with kvwatch_kv_cache_capacity_requests: cap concurrency in "
        "front of the engine near that bound, add replicas, or give the cache more memory (gpu_memory_utilization, a "
        "smaller kv cache dtype, more tensor parallelism).",
    "long_requests":
        "Find the long requests (vllm:request_prompt_tokens and request_generation_tokens p95, the gateway log): cap "
        "max_tokens or max_model_len, or route long-context requests to engines sized for them; more replicas of the "
        "same size help less than sizing for length.",
    "capacity_below_max_num_seqs":
        "Lower --max-num-seqs to about kvwatch_kv_cache_capacity_requests or enlarge the cache, so the scheduler stops "
        "admitting requests it must later preempt; `kvwatch capacity` computes the bound for a model and memory budget.",
    "caching_disabled":
        "If prompts share prefixes (system prompt, few-shot examples, documents), start vLLM with "
        "--enable-prefix-caching; until then hit ratios are not measured.",
    "cold_cache":
        "Expected after a restart: compare hit ratios only after the cache warmed up (a few repeats of each prefix), "
        "and find why the engine restarted (deploy, OOM, crash).",
    "prefix_changed":
        "Diff the prompt templates and system prompts deployed at that time: per-request text (timestamps, ids) placed "
        "before the shared text breaks reuse; keep shared text first and byte-identical.",
    "eviction_before_reuse":
        "Run vLLM with --kv-cache-metrics and compare kv_block_idle_before_evict with kv_block_reuse_gap; give idle "
        "prefixes room (more KV memory, fewer concurrent long requests) or route requests that share a prefix to the "
        "same engine.",
    "no_reuse":
        "Nothing to repair in the cache: these prompts share no prefix. If they should, put the shared text first and "
        "keep it byte-identical across requests. When the evidence says prefix_shorter_than_block, the shared text is "
        "shorter than one KV block and can never hit: lengthen the shared part past block_size or use a smaller "
        "--block-size.",
    "queueing_kv_bound":
        "The queue waits for KV blocks (see the exhaustion finding): fewer or shorter concurrent requests, or a larger "
        "cache, shorten it.",
    "queueing_compute_bound":
        "The queue waits for compute or scheduler slots, not KV blocks, so a bigger KV cache does not shorten it: add "
        "replicas or lower the arrival rate; check step time, --max-num-seqs and --max-num-batched-tokens.",
    "prefill":
        "Long uncached prompts: raise prefix reuse (shared text first), shorten prompts, tune chunked prefill "
        "(--max-num-batched-tokens) or separate prefill from decode.",
    "preemption":
        "The cache is exhausted (see the exhaustion finding): preempted requests go back to the queue and their KV is "
        "recomputed, time that neither vLLM's queue nor its prefill histogram counts. Relieve the cache as the "
        "exhaustion finding says (fewer or shorter concurrent requests, more KV memory); the front end is not the "
        "cause while this lasts.",
    "front_end":
        "Time outside queue and prefill: tokenization, multimodal preprocessing, API-server CPU, scheduling gaps; "
        "check the API server's CPU and --api-server-count.",
    "upstream":
        "Most of the time to first token is spent before the engine: look at the upstream stage (retrieval, gateway) "
        "named by the histogram; a bigger or smaller KV cache does not repair it.",
    "model_changed":
        "Compare signals only within one model; recheck capacity and thresholds for the new model.",
    "lora_changed":
        "Adapters share the engine's KV cache and batch: compare hit ratios and latency per adapter set, not across "
        "the change.",
    "cache_dtype_changed":
        "Re-evaluate task accuracy on the new KV-cache dtype (a quantised cache can change outputs); capacity and "
        "latency baselines changed too.",
    "cache_config_changed":
        "Baselines from before the change are not comparable: recheck kvwatch_kv_cache_capacity_requests and the "
        "exhaustion evidence against the new block size and capacity.",
    "engine_restarted":
        "Find why it restarted (deploy, OOM, crash in the engine log); its counters restarted from zero and its "
        "prefix cache is cold.",
    "imbalance":
        "A routing problem, not a capacity one: other replicas of the model have room, so more KV memory is not the "
        "fix. Check the load balancer (sticky sessions, connection reuse, a least-request policy that counts "
        "connections and not queued work, a replica missing from the endpoints).",
    "lost_prefix_affinity":
        "Requests that share a prefix no longer reach the replica that holds it: check the gateway's or router's "
        "prefix-aware (consistent hash, session affinity) routing for this replica; its peers show the reuse the "
        "traffic has.",
    "cold_replica":
        "Expected after a restart while it refills; if it does not warm up within minutes, check that the router "
        "sends it its share of prefix-sharing traffic, and why it restarted (deploy, OOM, crash).",
}


# One short instruction per cause, for places with room for a sentence (the
# status page's banner); NEXT_CHECK above is the full advice on the card.
NEXT_ACTION = {
    "prefix_cache_cleared": "Find who reset the prefix cache, and compare hit ratios only after it.",
    "events_stopped": "Check the engine's --kv-events-config endpoint and that kvwatch listens there.",
    "events_missed": "Raise the publisher's hwm or give kvwatch more CPU; counts are low meanwhile.",
    "concurrency_beyond_capacity": "Cap concurrency near the cache's capacity, add replicas or give the cache more memory.",
    "long_requests": "Find the long requests and cap max_tokens or route them to engines sized for them.",
    "capacity_below_max_num_seqs": "Lower --max-num-seqs to about the cache's capacity in requests, or enlarge the cache.",
    "caching_disabled": "Start vLLM with --enable-prefix-caching if prompts share prefixes.",
    "cold_cache": "Wait for the cache to warm up before comparing hit ratios, and find why the engine restarted.",
    "prefix_changed": "Diff the prompt templates deployed at that time and keep the shared text first and identical.",
    "eviction_before_reuse": "Give idle prefixes room (more KV memory, fewer long requests) or route shared prefixes to one engine.",
    "no_reuse": "Put shared text first in the prompts if they should share a prefix; else nothing to repair.",
    "queueing_kv_bound": "Shorten the queue with fewer or shorter concurrent requests, or a larger cache.",
    "queueing_compute_bound": "Add replicas or lower the arrival rate: a bigger KV cache does not help.",
    "prefill": "Raise prefix reuse, shorten prompts or tune chunked prefill.",
    "front_end": "Check the API server's CPU, tokenization and preprocessing.",
    "preemption": "Relieve the exhausted cache: preempted requests are re-queued and recomputed.",
    "upstream": "Look at the stage before the engine (retrieval, gateway) named by the histogram.",
    "model_changed": "Recheck capacity and thresholds for the new model; compare signals only within one model.",
    "lora_changed": "Compare hit ratios and latency per adapter set, not across the change.",
    "cache_dtype_changed": "Re-evaluate task accuracy on the new KV-cache dtype.",
    "cache_config_changed": "Recheck the cache's capacity against the new block size and memory.",
    "engine_restarted": "Find why the engine restarted (deploy, OOM, crash) in its log.",
    "imbalance": "Check the load balancer: other replicas of the model have room.",
    "lost_prefix_affinity": "Check the router's prefix-aware routing for this replica.",
    "cold_replica": "Wait for it to warm up; if it does not, check that the router sends it its share.",
}
assert set(NEXT_ACTION) == set(SEVERITY) and set(NEXT_CHECK) == set(SEVERITY)



def is_actionable(finding: Finding) -> bool:
    """Warning and critical findings: what makes `kvwatch diagnose` exit 1."""
    return finding.severity in ("critical", "warning")
