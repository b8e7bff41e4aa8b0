"""kvwatch's own families, declared once: the poll's health, identity,
configuration and findings (HEALTH), Prometheus' series about kvwatch's
targets (SCRAPE), LMCache's, central mode's and the KV-event stream's health;
and the units and good directions every catalogue entry names. The
exporter, the rules, the dashboards and docs/metrics.md read them through
kvwatch.signals.catalogue."""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.signals.series import IDENTITY, INFO_KEYS

# A catalogue unit -> how each surface shows it: Grafana's unit, and the word
# a person reads beside a bare number on the status page and in the CLI ("" where
# the formatted value already says it: 12.5%, 340 ms, 3.1/s).
@dataclass(frozen=True)
class Unit:
    grafana: str
    label: str


UNITS: dict[str, Unit] = {
    "ratio": Unit("percentunit", ""),
    "seconds": Unit("s", ""),
    "tokens": Unit("short", "tokens"),
    "requests": Unit("short", "requests"),
    "per_second": Unit("ops", ""),
    "bytes": Unit("bytes", "bytes"),
    "blocks": Unit("short", "blocks"),
    "state": Unit("short", ""),
    "preemptions": Unit("short", "preemptions"),
    "failures": Unit("short", "failures"),
    "notifications": Unit("short", "notifications"),
    "transfers": Unit("short", "transfers"),
    "descriptors": Unit("short", "descriptors"),
    "stores": Unit("short", "stores"),
}


# Which side of a threshold a person wants a value on: "high" (hit ratio,
# headroom, up), "low" (usage, latency, errors, findings) or None (neither:
# throughput, running requests). Declared once per entry below; the
# dashboards colour every threshold and value mapping from it, so a panel
# cannot turn red on the good side.
GOOD_DIRECTIONS = ("high", "low", None)


# --------------------------------------------------------------------------
# kvwatch's own families: the poll's health, identity, configuration, findings
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class HealthFamily:
    """One of kvwatch's own families: the poll's health, its identity, the
    engine's configuration and the active findings."""

    name: str  # as the client library names it (a counter without _total)
    kind: str  # gauge | counter | untyped
    labels: tuple[str, ...]
    help: str
    good: str | None = None  # GOOD_DIRECTIONS

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name


HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_up", "gauge", (), "1 if the latest poll of the engine's /metrics succeeded, else 0.", good="high"),
    HealthFamily("kvwatch_stats_disabled", "gauge", (),
                 "1 while the engine answers its /metrics without engine series (vLLM with --disable-log-stats, "
                 "or another program at the target): not unreachable, but blind; else 0.", good="low"),
    HealthFamily("kvwatch_build_info", "gauge", ("version",), "kvwatch's version; always 1."),
    HealthFamily("kvwatch_polls", "counter", (), "Polls of the engine's /metrics."),
    HealthFamily("kvwatch_poll_errors", "counter", ("reason",),
                 "Failed polls by reason (refused, dns, timeout, tls, http_3xx/4xx/5xx, content_type, too_large, "
                 "truncated, decode, no_engine_metrics, ...).", good="low"),
    HealthFamily("kvwatch_parse_errors", "counter", (),
                 "Malformed lines in the engine's pages (skipped; the rest of the page counts).", good="low"),
    HealthFamily("kvwatch_dropped_series", "counter", (), "(model, engine) pairs dropped by the max_series cap.", good="low"),
    HealthFamily("kvwatch_poll_duration_seconds", "gauge", (), "Wall time of the latest poll.", good="low"),
    HealthFamily("kvwatch_page_late_seconds", "gauge", (),
                 "How long the engine took to answer the latest page kvwatch read (a busy vLLM answers /metrics "
                 "seconds late under load; the page is kept and stamped at the time it was answered); after a poll "
                 "that timed out while the engine was busy (kvwatch_busy), the deadline waited.", good="low"),
    HealthFamily("kvwatch_busy", "gauge", (),
                 "1 while the engine is busy, not down: its /metrics answered at least busy_late_seconds late, or "
                 "not within the deadline shortly after a page (busy_timeout_seconds), while requests ran or waited; "
                 "kvwatch_page_late_seconds says how late (for a timeout, the deadline waited: at least). 0 "
                 "otherwise; KvwatchEngineUnreachable leaves a busy engine out.", good="low"),
    HealthFamily("kvwatch_starting", "gauge", (),
                 "1 while the engine has not answered /metrics since kvwatch started and load_grace has not passed "
                 "(a model loading its weights: starting, not down); 0 once it answered, for good, or after the "
                 "grace. KvwatchEngineUnreachable leaves a starting engine out.", good="low"),
    HealthFamily("kvwatch_poll_cpu_seconds", "gauge", (),
                 "CPU time of the latest poll (fetch, parse, signals, diagnosis).", good="low"),
    HealthFamily("kvwatch_last_success_timestamp_seconds", "gauge", (), "Unix time of the latest successful poll."),
    HealthFamily("kvwatch_window_seconds", "gauge", (), "Span the windowed signals cover now."),
    HealthFamily("kvwatch_engine_info", "gauge", IDENTITY + INFO_KEYS,
                 "The engine's KV-cache configuration (from vllm:cache_config_info); changes() on it marks a "
                 "configuration change."),
    HealthFamily("kvwatch_engine_spelling_info", "gauge", ("spelling",),
                 "1, labelled with the namespace the engine's sample lines are spelled in: vllm: or sglang:, or "
                 "vllm_ / sglang_ once OpenMetrics' escaping=underscores rewrote them (ray_vllm: under Ray Serve; "
                 "several joined by a comma on a page that mixes them). A query or rule over the engine's own "
                 "series must name this spelling; absent while no page was read."),
    HealthFamily("kvwatch_source_present", "gauge", ("family",),
                 "1 if the engine's latest page carried this family (vLLM's newest name for it), 0 if not: unknown "
                 "is not zero, so a signal whose families are 0 here is absent, never 0 (/api/v1/signals "
                 "dark_signals names the flag that lights a config-gated one)."),
    HealthFamily("kvwatch_finding", "gauge", ("symptom", "cause", "severity") + IDENTITY,
                 "1 for each active diagnosis finding (absent when not active); a finding stays active until its "
                 "condition has been clear for the hold (diagnosis: finding_hold_seconds); see "
                 "/api/v1/diagnosis for its evidence and clearing_since. One cause per symptom per engine: the "
                 "primary (other causes found at once are kvwatch_finding_contributor).", good="low"),
    HealthFamily("kvwatch_finding_contributor", "gauge", ("symptom", "cause", "contributor") + IDENTITY,
                 "1 for each contributing factor of an active finding: another cause of the same symptom on the "
                 "same engine that the diagnosis also found, weaker than the primary `cause` (absent when none).",
                 good="low"),
    HealthFamily("kvwatch_finding_alternative", "gauge", ("symptom", "cause", "alternative", "decided_by") + IDENTITY,
                 "1 for each cause an active finding cannot be told apart from, once per source that would decide "
                 "(`decided_by`: kv_cache_metrics, kv_events, request_lengths); absent when the finding is decided.",
                 good=None),
    HealthFamily("kvwatch_renders_refused", "counter", ("route",),
                 "Renders of kvwatch's own routes (route: /metrics, /, /api/v1/*) refused because they passed the "
                 "render bound (16 MiB): /metrics then serves this counter alone, the page and the JSON routes "
                 "answer 503 with one sentence. Hostile label values, not a fleet, get there.", good="low"),
    # Untyped: Prometheus' lint refuses a `quantile` label on a gauge, and the
    # label names the quantile it marks (Prometheus stores it as a gauge).
    HealthFamily("kvwatch_source_fault", "gauge", ("family", "fault") + IDENTITY,
                 "1 for each value of the engine's latest page (or ratio of the window) that cannot be true: "
                 "fault=below_zero, above_one (a share above 1), not_finite (NaN, infinity), part_above_whole (hits "
                 "that rose more than their lookups). A fault of the engine's metrics: the value is not clamped, it "
                 "is left out, so its signals are absent; /api/v1/signals source_faults has the value read.",
                 good="low"),
    HealthFamily("kvwatch_source_faults", "counter", ("fault",),
                 "Values that cannot be true read since kvwatch started, by fault (one per value per poll; "
                 "`undescribed` counts those beyond the hundred a page's faults describe).", good="low"),
    HealthFamily("kvwatch_quantile_pinned", "untyped", ("signal", "quantile", "bound") + IDENTITY,
                 "1 for each windowed quantile pinned at a bucket edge, where its value is a bound and not an "
                 "estimate: bound=\"upper\" (pinned in the first bucket; the value is that bucket's bound and the "
                 "quantile is at most it), bound=\"lower\" (pinned at the last finite bucket; the quantile is at "
                 "least it). `signal` is the exported family (kvwatch_model_* with engine=\"\" per model); absent "
                 "when no quantile is pinned.", good=None),
)
HEALTH_BY_NAME = {family.name: family for family in HEALTH}

# Prometheus' own series about kvwatch's targets, which the dashboards and
# alerts read beside kvwatch's (not exported by kvwatch).
SCRAPE: tuple[HealthFamily, ...] = (
    HealthFamily("up", "gauge", (), "1 while Prometheus scraped the target (kvwatch) successfully, else 0.",
                 good="high"),
)


# --------------------------------------------------------------------------
# LMCache's health (its series: kvwatch.signals.series; its signals: catalogue.py)
# --------------------------------------------------------------------------

TIER_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_lmcache_up", "gauge", (),
                 "1 if the latest poll of LMCache's page (lmcache_target) succeeded and carried its counters, else 0; "
                 "absent unless lmcache_target is set. The engine's signals do not depend on it.", good="high"),
)

# A router's page read beside the engines (`router_target`, kvwatch/pipeline/router.py): each model's
# window split into what the router predicted, what the engines delivered and what the best replica held.
ROUTER_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_router_up", "gauge", (),
                 "1 if the latest poll of the router's page (router_target) succeeded and carried a router's "
                 "prefix prediction, else 0; absent unless router_target is set.", good="high"),
    HealthFamily("kvwatch_router_predicted_hit_ratio", "gauge", ("model_name",),
                 "Prompt tokens the router predicted the replicas it chose hold, over the prompt tokens it measured "
                 "against, over the window (llm-d: llm_d_epp_prefix_predicted_cached_tokens_sum over "
                 "llm_d_epp_prefix_prompt_tokens_sum; Dynamo and older llm-d: a mean of per-request ratios).",
                 good="high"),
    HealthFamily("kvwatch_router_delivered_hit_ratio", "gauge", ("model_name",),
                 "The engines' prefix-cache hits over their queried tokens for the model over the same window "
                 "(vllm:prefix_cache_hits over vllm:prefix_cache_queries, summed over the model's engines).",
                 good="high"),
    HealthFamily("kvwatch_router_available_hit_ratio", "gauge", ("model_name",),
                 "What the best candidate replica held, over the prompt tokens, over the window (llm-d: "
                 "llm_d_epp_prefix_best_available_cached_tokens_sum); absent where the router does not say it.",
                 good="high"),
    HealthFamily("kvwatch_tenant_hit_ratio", "gauge", ("kind", "tenant"),
                 "Per tenant over the window, the prompt tokens served from cache over those sent "
                 "(llm-d: llm_d_epp_request_cached_tokens_sum over llm_d_epp_request_input_tokens_sum by "
                 "fairness_id, kind fairness_id; LMCache's multiprocess server: lookup hit over requested tokens by "
                 "cache_salt, kind cache_salt); the tenant_top_k tenants with the most prompt tokens, the rest "
                 "summed as tenant=\"other\": at most tenant_top_k + 1 series per kind.", good="high"),
    HealthFamily("kvwatch_tenant_stored_again_ratio", "gauge", ("kind", "tenant"),
                 "Per LoRA adapter (kind lora, from the KV-cache event stream's BlockStored lora_name; (base) for the "
                 "base model) over the stream's window: blocks stored again after their eviction over blocks "
                 "stored, the share recomputed; the tenant_top_k adapters that stored most, the rest as other.",
                 good="low"),
    HealthFamily("kvwatch_tenant_recomputed_tokens", "gauge", ("kind", "tenant"),
                 "Per LoRA adapter (kind lora, from the KV-cache event stream; (base) for the base model) over the "
                 "stream's window: prompt tokens recomputed because their blocks were evicted before their reuse "
                 "(GPU blocks stored again after their eviction times the events' block size); the "
                 "tenant_top_k adapters that stored most by name, the rest summed as tenant=\"other\": at most "
                 "tenant_top_k + 1 series.", good="low"),
    HealthFamily("kvwatch_tenant_lost_prefill_seconds", "gauge", ("kind", "tenant"),
                 "Per LoRA adapter (kind lora; (base) for the base model) over the stream's window: the prefill "
                 "seconds its recomputed tokens cost (kvwatch_tenant_recomputed_tokens x the page's prefill seconds "
                 "per computed token, the rate kvwatch_kv_events_lost_prefill_seconds is priced at); the same "
                 "tenant_top_k adapters and other. Absent without the page's prefill time to price them at.",
                 good="low"),
)

# Central mode (`kvwatch serve --prometheus`): its own health beside every
# replica's series, without replica labels (kvwatch/central/app.py).
CENTRAL_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_central_store_up", "gauge", (),
                 "Central mode: 1 if the latest refresh read the store's query API, else 0 (the replicas' series "
                 "then stay as last read, their findings marked down on the page).", good="high"),
    HealthFamily("kvwatch_central_replicas", "gauge", (), "Central mode: replicas diagnosed at the latest refresh."),
    HealthFamily("kvwatch_central_replicas_dropped", "gauge", (),
                 "Central mode: replicas the store has beyond --max-replicas at the latest refresh, not diagnosed; "
                 "above 0, raise --max-replicas (and the memory request) or narrow --selector.", good="low"),
    HealthFamily("kvwatch_central_last_success_timestamp_seconds", "gauge", (),
                 "Central mode: Unix time of the latest refresh that read the store."),
)


# --------------------------------------------------------------------------
# The engine's KV-cache event stream's health (kvwatch/kvevents; its signals: catalogue.py)
# --------------------------------------------------------------------------

# One stream per kvwatch (`kv_events`): no model or engine label (vLLM's
# events do not name them; one endpoint is one engine's publisher). Present
# only while `kv_events` is set; the series and signals only once an event
# arrived.
STREAM_HEALTH: tuple[HealthFamily, ...] = (
    HealthFamily("kvwatch_kv_events_up", "gauge", (),
                 "1 while kvwatch listens for the engine's KV-cache events (kv_events) and at least one has arrived, "
                 "else 0; absent unless kv_events is set. The page's signals do not depend on it.", good="high"),
    HealthFamily("kvwatch_kv_events_messages", "counter", (), "Event messages (batches) received from the engine."),
    HealthFamily("kvwatch_kv_events_dropped_messages", "counter", (),
                 "Messages kvwatch dropped because its intake queue was full (a flood faster than it accounts); "
                 "what they held is missing from every count.", good="low"),
    HealthFamily("kvwatch_kv_events_missed_messages", "counter", (),
                 "Sequence numbers found missing (the engine's publisher dropped them past its high-water mark, "
                 "or the connection lost them); those the replay socket answered are "
                 "kvwatch_kv_events_recovered_messages, and what stays lost, the difference, is missing from "
                 "every count.", good="low"),
    HealthFamily("kvwatch_kv_events_recovered_messages", "counter", (),
                 "Missing messages the engine's replay socket answered (--kv-events-replay), accounted late."),
    HealthFamily("kvwatch_kv_events_malformed_messages", "counter", (),
                 "Messages or events that were not vLLM's KV-cache events (bad frames, bad msgpack, absurd block "
                 "counts, over the byte cap); skipped.", good="low"),
    HealthFamily("kvwatch_kv_events_publisher_restarts", "counter", (),
                 "Times the engine's sequence numbers started over (its publisher restarted)."),
    HealthFamily("kvwatch_kv_events_connections", "counter", (),
                 "Publishers whose ZMQ handshake with kvwatch's endpoint succeeded since kvwatch started; with no "
                 "message either, no engine publishes there (an idle engine connects and sends nothing).",
                 good="high"),
    HealthFamily("kvwatch_kv_events_publishers", "gauge", (),
                 "Publishers connected to kvwatch's endpoint now (handshakes less disconnects)."),
    HealthFamily("kvwatch_kv_events_silent_blocks", "gauge", (),
                 "Blocks the engine stored, by its page, since the stream's last message (or since kvwatch listened) "
                 "once the stream has been quiet for kv_events_silence_seconds, else 0: a lower bound, the prompt "
                 "tokens the prefix cache did not serve less a partial block per request. Above 0: the stream "
                 "stopped while the engine works (events_stopped).", good="low"),
    HealthFamily("kvwatch_kv_events_last_message_age_seconds", "gauge", (),
                 "Seconds since the latest event message (an idle engine sends none).", good="low"),
    HealthFamily("kvwatch_kv_events_tracked_blocks", "gauge", (),
                 "Block hashes the ledger tracks now (bounded by kv_events_table_bytes)."),
    HealthFamily("kvwatch_kv_events_sampling_ratio", "gauge", (),
                 "Share of the hash space the ledger tracks: 1 until the table fills, then halved as needed; "
                 "stored-again counts and the sizing curve are scaled from the sample.", good="high"),
)
