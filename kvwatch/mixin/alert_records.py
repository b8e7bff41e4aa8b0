"""The alerts that Prometheus decides alone: one CauseAlert record per cause
whose record (kvwatch/diagnose/causes.py) routes it to an alert without
kvwatch's finding. A record is the rule, declared: its query over the
recorded series (kvwatch/mixin/conditions.py, `f`), the comparison and
threshold, the summary and the description. The alert name, `for:`,
severity, symptom, panel and the advice that ends the description come from
the cause's record; kvwatch/mixin/alerts.py expands the records into rules.

The description is a template: {where} (the engine, by its labels),
{peer_where} (a replica among its peers), {instance}, {job}, {for} (the
alert's `for:`), {value:pct}, {value:duration} or {value:count} (the alert's value), any
mixin config field ({rate_window}; {hit_ratio_low:pct} as a percentage), and
{preemption_state}/{and_preempting} in a record split on preemption.

The causes of one symptom partition it (each excludes the others with
`unless`), so at most one cause fires per engine: exhaustion-driven queueing
and compute-bound queueing are never reported together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Union

from kvwatch.mixin.conditions import Recorded
from kvwatch.mixin.config import MixinConfig

# A query: one expression, or a value and its ("and"|"unless", condition)
# filters, joined by promql.chain.
Query = Union[str, list]

# Symptoms kvwatch's own diagnosis may decide where the PromQL twin cannot
# (the KV-event stream names a low-hit-rate cause from blocks returning, over
# a part of the window the ratio does not judge): each PromQL-decided cause of
# one also fires from kvwatch_finding where no PromQL-decided cause of the
# symptom holds (alerts.py, the two routes of a symptom).
FINDING_DECIDED = ("low_hit_rate",)


@dataclass(frozen=True, kw_only=True)
class CauseAlert:
    """One cause's alert rule, declared."""

    cause: str
    query: Callable[[Recorded], Query]
    op: str  # ">" fires above the threshold, "<" below
    # A number, a MixinConfig field's name, or a function of the config.
    threshold: float | str | Callable[[MixinConfig], float]
    summary: str
    description: str  # a template (the module docstring names its placeholders)
    # Generated only where the config asks (the upstream stage, no_reuse).
    when: Callable[[MixinConfig], bool] = lambda config: True
    # Two rules, with and without preemptions, where the config sets the
    # cause's preempting severity (<cause>_preempting) apart; else one.
    split_on_preemption: bool = False

    def threshold_for(self, config: MixinConfig) -> float:
        if isinstance(self.threshold, str):
            return getattr(config, self.threshold)
        if callable(self.threshold):
            return self.threshold(config)
        return self.threshold


# Where the page cannot tell a cause from eviction before reuse, the
# description says so and names what decides; kvwatch_finding_alternative
# carries the same as data.
UNDECIDED = ("Without vLLM's --kv-cache-metrics or its KV-cache events this reads the same as prefixes evicted "
             "before reuse: kvwatch_finding_alternative names the alternative and what would decide it.")

# The alert fires on the exhaustion detector alone, as the diagnosis does: a
# preemption means vLLM could not allocate a block, even when no scrape caught
# the usage peak. The value is the usage peak the scrapes did catch.
EXHAUSTED = ("The KV cache of {where} ran out of room in the last {rate_window}: requests were preempted, or waited "
             "for room while usage peaked above {exhaustion_usage_ratio:pct} (highest usage scraped: {value:pct})"
             "{preemption_state}, and ")
LOW_HIT = ("The prefix-cache hit ratio of {where} was {value:pct} over the last {rate_window} (below "
           "{hit_ratio_low:pct})")
SLOW = ("Mean time to first token of {where} was {value:duration} over the last {rate_window} (objective "
        "{ttft_mean_seconds}s)")


def _hit_judged(f: Recorded, *steps: tuple[str, str]) -> list:
    """The hit ratio where it is judged: enough queries, caching on."""
    return [f.hit_ratio(), ("and", f.enough_queries()), ("unless", f.caching_disabled()), *steps]


def _kvwatch_absent(f: Recorded) -> str:
    # up{} < 1 sees only targets Prometheus still has: nothing under the
    # selector is absent(); a group that had targets within the window and
    # has none now is the fleet-level vanish (one pod replaced is not).
    up, groups, window = f.series("up"), ", ".join(f.c.group_labels), f.c.kvwatch_absent_window
    return (f"absent({up})\nor\n(\n  group by ({groups}) (max_over_time({up}[{window}]))\n"
            f"  unless\n  group by ({groups}) ({up})\n  and on ()\n  count({up})\n)")


def _central_targets(f: Recorded) -> str:
    # Central mode's own scrape targets: those that exported its health within the window (its
    # replicas' series carry the replicas' labels, never its own).
    return (f"up\nand on (job, instance)\ngroup by (job, instance) "
            f"(max_over_time(kvwatch_central_store_up[{f.c.kvwatch_absent_window}]))")


def _central_absent(f: Recorded) -> str:
    # As _kvwatch_absent, over central mode's health family: no central target anywhere, or a
    # namespace and job that had one within the window and has none now.
    health, window = "kvwatch_central_store_up", f.c.kvwatch_absent_window
    return (f"absent({health})\nor\n(\n  group by (namespace, job) (max_over_time({health}[{window}]))\n"
            f"  unless\n  group by (namespace, job) ({health})\n  and on ()\n  count({health})\n)")


def _sidecar(c: MixinConfig) -> bool:
    return c.mode == "sidecar"


def _central(c: MixinConfig) -> bool:
    return c.mode == "central"


def _engine_unreachable(f: Recorded) -> list:
    # Neither an engine that answers without its statistics (its own alert),
    # nor a busy one, whose /metrics answers late under load, nor one still
    # loading its weights (not answered since kvwatch started, within load_grace) is unreachable.
    return [f.series("kvwatch_up"), ("unless", f.series("kvwatch_stats_disabled") + " > 0"),
            ("unless", f.series("kvwatch_busy") + " > 0"), ("unless", f.series("kvwatch_starting") + " > 0")]


def _increase(f: Recorded, counter: str) -> str:
    return f"increase({f.series(counter)}[{f.c.rate_window}])"


def _not_starting(f: Recorded) -> tuple[str, str]:
    return ("unless", f.series("kvwatch_starting") + " > 0")


# --- the engine's KV-cache event stream (kvwatch/kvevents), where kvwatch reads one
# (kv_events): its series exist only then. The diagnosis decides the same
# numbers (kvwatch/diagnose/stream.py): the silent blocks are its, a lower
# bound from the page, so an engine that stores nothing never reads as stopped.
STREAM_ALERTS: tuple[CauseAlert, ...] = (
    CauseAlert(
        cause="events_never_connected",
        query=lambda f: [f"{f.series('kvwatch_kv_events_connections_total')} + "
                         f"{f.series('kvwatch_kv_events_messages_total')}", _not_starting(f)],
        op="<", threshold=1,
        summary="kvwatch reads KV-cache events, but no engine publisher ever reached it.",
        description=(
            "kvwatch at {instance} is configured to read the engine's KV-cache events, and for {for} no publisher "
            "has completed a handshake with its endpoint and no event arrived (the status page's kv_events.detail "
            "says whether kvwatch could listen at all): the stream's decisions are off, and so is every router "
            "index fed by the same configuration.")),
    CauseAlert(
        cause="events_stopped",
        query=lambda f: [f.series("kvwatch_kv_events_silent_blocks"), _not_starting(f)],
        op=">", threshold=0,
        summary="The engine's KV-cache events stopped while it stores blocks.",
        description=(
            "kvwatch at {instance} has received no KV-cache event for longer than kv_events_silence_seconds while "
            "the engine stored at least {value:count} blocks by its page (prompt tokens the prefix cache did not serve, "
            "less a partial block per request): the stream stopped, its decisions are off.")),
    CauseAlert(
        cause="events_missed",
        query=lambda f: (f"{_increase(f, 'kvwatch_kv_events_missed_messages_total')} - "
                         f"{_increase(f, 'kvwatch_kv_events_recovered_messages_total')} + "
                         f"{_increase(f, 'kvwatch_kv_events_dropped_messages_total')}"),
        op=">", threshold=0,
        summary="KV-cache event messages are lost on their way to kvwatch.",
        description=(
            "kvwatch at {instance} lost {value:count} KV-cache event messages in the last {rate_window} (sequence gaps "
            "the replay socket did not answer, or drops of its full intake): the stream's counts are low by what "
            "they held.")),
)


CAUSE_ALERTS: tuple[CauseAlert, ...] = (
    # --- KV cache exhausted: one rule per cause, or two where the config
    # gives the cause another severity while vLLM preempts.
    CauseAlert(
        cause="concurrency_beyond_capacity",
        query=lambda f: [f.usage_max(), ("and", f.exhausted()), ("unless", f.long_requests())],
        op=">", threshold=0, split_on_preemption=True,
        summary="vLLM KV cache full{and_preempting}: more concurrent requests than the cache holds.",
        description=EXHAUSTED + (
            "on average each running request held less than {long_request_capacity_share:pct} of it or more "
            "requests waited than ran: too many requests for the cache (likely cause: concurrency beyond "
            "capacity).")),
    CauseAlert(
        cause="long_requests",
        query=lambda f: [f.usage_max(), ("and", f.exhausted()), ("and", f.long_requests())],
        op=">", threshold=0, split_on_preemption=True,
        summary="vLLM KV cache full{and_preempting}: a few long requests fill it.",
        description=EXHAUSTED + (
            "on average each running request held at least {long_request_capacity_share:pct} of it with no more "
            "requests waiting than running: a few long requests fill the cache (likely cause: long requests).")),
    # --- KV cache full soon: the ETA signal's own twin, absent unless usage
    # rises; silent once the cache is exhausted (VllmKvCacheExhausted speaks).
    CauseAlert(
        cause="usage_rising",
        query=lambda f: [f.signal("kvwatch_kv_cache_exhaustion_eta_seconds"), ("unless", f.exhausted())],
        op="<", threshold=lambda c: c.exhaustion_eta_minutes * 60,
        summary="vLLM KV cache on course to fill up: preemption is minutes away.",
        description=(
            "KV usage of {where} is rising: at its trend over the last 5m the cache is full in {value:duration} "
            "(under {exhaustion_eta_minutes}m), and nothing is preempted yet (likely cause: usage rising).")),
    # --- prefix-cache hit rate low. While the cache is exhausted a full cache
    # explains a low ratio by itself: only caching off, a restart and a drop
    # that showed while the cache had room are named then.
    CauseAlert(
        cause="caching_disabled",
        query=lambda f: [f"0 * ({f.caching_disabled()})", ("and", f.prompt_traffic())],
        op="<", threshold="hit_ratio_low",
        summary="vLLM serves prompts with prefix caching disabled.",
        description=(
            "Prefix caching is off on {where} (kvwatch_engine_info enable_prefix_caching=False) while it serves "
            "prompts, so no prompt token is reused and no hit ratio is measured (likely cause: caching "
            "disabled).")),
    CauseAlert(
        cause="cold_cache",
        query=lambda f: _hit_judged(f, ("and", f.cold())),
        op="<", threshold="hit_ratio_low",
        summary="vLLM prefix-cache hit ratio low: the cache is cold after a restart.",
        description=LOW_HIT + (
            ", and the engine restarted within the last {cold_cache_window} (its counters reset or its cache "
            "configuration changed): the cache has not warmed up (likely cause: cold cache).")),
    CauseAlert(
        cause="eviction_before_reuse",
        query=lambda f: _hit_judged(f, ("unless", f.cold()), ("and", f.healthy_baseline()),
                                    ("unless", f.exhausted()), ("and", f.cache_pressure())),
        op="<", threshold="hit_ratio_low",
        summary="vLLM prefix-cache hit ratio low: cached prefixes are evicted before reuse.",
        description=LOW_HIT + (
            ", after at least {hit_ratio_low:pct} in the {hit_ratio_baseline_window} before, while KV usage "
            "averaged above {eviction_usage_ratio:pct} without exhausting the cache: running requests crowd idle "
            "cached prefixes out before they are reused (likely cause: eviction before reuse).")),
    CauseAlert(
        cause="prefix_changed",
        query=lambda f: _hit_judged(f, ("unless", f.cold()), ("and", f.healthy_baseline()),
                                    ("and", f.dropped_with_room())),
        op="<", threshold="hit_ratio_low",
        summary="vLLM prefix-cache hit ratio dropped: the shared prompt prefix changed.",
        description=LOW_HIT + (
            ", after at least {hit_ratio_low:pct} in the {hit_ratio_baseline_window} before, and the drop showed "
            "while the cache had room: the requests stopped sharing the prefix they shared (likely cause: prefix "
            "changed). " + UNDECIDED)),
    CauseAlert(
        cause="no_reuse",
        when=lambda c: c.no_reuse_alert,
        query=lambda f: _hit_judged(f, ("unless", f.cold()), ("and", f.low_baseline()), ("unless", f.exhausted())),
        op="<", threshold="hit_ratio_low",
        summary="vLLM prefix-cache hit ratio low: the prompts share little prefix.",
        description=LOW_HIT + (
            ", it was low in the {hit_ratio_baseline_window} before as well, and the cache is not exhausted: the "
            "workload shares few prefixes (likely cause: no reuse). " + UNDECIDED)),
    # --- time to first token slow: the largest part of the mean names the cause.
    CauseAlert(
        cause="queueing_kv_bound",
        query=lambda f: [f.first_token_mean(), ("and", f.queue_largest()), ("and", f.kv_bound())],
        op=">", threshold="ttft_mean_seconds",
        summary="vLLM first token slow: requests queue for KV cache.",
        description=SLOW + (
            "; most of it is queueing, and the KV cache was exhausted (full while requests waited, or "
            "preempting) and above {eviction_usage_ratio:pct} while they waited: requests wait for KV blocks "
            "(likely cause: KV-bound queueing).")),
    CauseAlert(
        cause="queueing_compute_bound",
        query=lambda f: [f.first_token_mean(), ("and", f.queue_largest()), ("unless", f.kv_bound())],
        op=">", threshold="ttft_mean_seconds",
        summary="vLLM first token slow: requests queue for compute, not KV cache.",
        description=SLOW + (
            "; most of it is queueing while the KV cache had room: requests wait for scheduler slots or compute "
            "(likely cause: compute-bound queueing), and a bigger KV cache does not shorten this queue.")),
    CauseAlert(
        cause="prefill",
        query=lambda f: [f.first_token_mean(), ("and", f.prefill_largest())],
        op=">", threshold="ttft_mean_seconds",
        summary="vLLM first token slow: prefill of long uncached prompts.",
        description=SLOW + "; most of it is prefill (likely cause: long uncached prompts)."),
    # One story (kvwatch/diagnose/arbitration.py): the residual outside queue
    # and prefill is preemption wherever the exhaustion detector holds, the
    # front end only where it does not.
    CauseAlert(
        cause="front_end",
        query=lambda f: [f.first_token_mean(), ("and", f.front_end_largest()), ("unless", f.exhausted())],
        op=">", threshold="ttft_mean_seconds",
        summary="vLLM first token slow: time outside queue and prefill.",
        description=SLOW + (
            "; most of it is outside queue and prefill while the KV cache had room (likely cause: front end: "
            "tokenization, multimodal preprocessing, API-server CPU, scheduling gaps).")),
    CauseAlert(
        cause="preemption",
        query=lambda f: [f.first_token_mean(), ("and", f.front_end_largest()), ("and", f.exhausted())],
        op=">", threshold="ttft_mean_seconds",
        summary="vLLM first token slow: requests preempted and recomputed in a full KV cache.",
        description=SLOW + (
            "; most of it is outside queue and prefill while the KV cache was exhausted (preempting, or full "
            "while requests waited): preempted requests go back to the queue and recompute their KV, time "
            "neither histogram counts (likely cause: preemption; the front end is not the cause while this "
            "lasts); VllmKvCacheExhausted for the same engine names why the cache is full.")),
    CauseAlert(
        cause="upstream",
        when=lambda c: bool(c.upstream_histogram),
        query=lambda f: [f.first_token_mean(),
                         ("and on (" + ", ".join(f.c.upstream_join_labels) + ")", f.upstream_mean()),
                         ("unless", f.queue_largest()), ("unless", f.prefill_largest()),
                         ("unless", f.front_end_largest())],
        op=">", threshold="ttft_mean_seconds",
        summary="Slow first token: time spent before the engine.",
        description=SLOW + (
            ", counting {upstream_histogram} before the engine; the largest part is that upstream stage (likely "
            "cause: upstream).")),
    # --- fleet: one replica unlike its peers of the same model
    # (kvwatch/diagnose/fleet.py's definitions; Fragments.imbalance and after).
    CauseAlert(
        cause="imbalance",
        query=lambda f: f.imbalance(),
        op=">", threshold=0,
        summary="One vLLM replica is exhausted or queueing while its peers have room.",
        description=(
            "The replica of {peer_where} was exhausted or queueing over the last {rate_window} (KV usage peak "
            "{value:pct}) while another replica of the same model peaked at most {fleet_room_usage_ratio:pct} "
            "with nothing waiting: the load is unevenly routed, not too large (likely cause: imbalance); the "
            "fleet dashboard's replica table shows it.")),
    CauseAlert(
        cause="lost_prefix_affinity",
        query=lambda f: f.lost_prefix_affinity(),
        op="<", threshold="fleet_affinity_fraction",
        summary="One vLLM replica reuses far fewer prefixes than its peers: prefix routing lost.",
        description=(
            "The prefix-cache hit ratio of {peer_where} over the last {rate_window} was {value:pct} of its warm "
            "peers' pooled ratio (below {fleet_affinity_fraction:pct}, peers at least {hit_ratio_low:pct}): "
            "requests sharing a prefix no longer reach the replica that holds it (likely cause: lost prefix "
            "affinity).")),
    CauseAlert(
        cause="cold_replica",
        query=lambda f: f.cold_replica(),
        op=">", threshold=0,
        summary="One vLLM replica restarted and refills its cache while its peers are warm.",
        description=(
            "The replica of {peer_where} restarted in the last {cold_cache_window} (its counters reset) while "
            "other replicas of the model did not: it is refilling its prefix cache, so a lower hit ratio and "
            "slower first tokens there are expected for a while (likely cause: cold replica).")),
    # --- health: kvwatch itself, and the engine beside it.
    CauseAlert(
        cause="kvwatch_unreachable",
        when=_sidecar,
        query=lambda f: f.series("up"),
        op="<", threshold=1,
        summary="Prometheus cannot scrape kvwatch.",
        description=(
            "Prometheus has failed to scrape kvwatch at {instance} (job {job}) for {for}: kvwatch's signals and "
            "the vLLM alerts for that pod are blind.")),
    CauseAlert(
        cause="kvwatch_absent",
        when=_sidecar,
        query=_kvwatch_absent,
        op=">", threshold=0,
        summary="Prometheus has no kvwatch target to scrape.",
        description=(
            "No target matches {kvwatch_selector} (or none is left in this group, which had some within the last "
            "{kvwatch_absent_window}): the ServiceMonitor/PodMonitor selects nothing, or the pods carrying "
            "kvwatch are gone. Every vLLM alert is blind.")),
    # Central mode (mode: central): its own targets, its store, its absence.
    CauseAlert(
        cause="kvwatch_unreachable",
        when=_central,
        query=_central_targets,
        op="<", threshold=1,
        summary="Prometheus cannot scrape kvwatch central mode.",
        description=(
            "Prometheus has failed to scrape kvwatch central mode at {instance} (job {job}) for {for}: the series of "
            "every replica it serves are stale, and their vLLM alerts are blind.")),
    CauseAlert(
        cause="store_unreachable",
        when=_central,
        query=lambda f: "kvwatch_central_store_up",
        op="<", threshold=1,
        summary="kvwatch central mode cannot read its store.",
        description=(
            "kvwatch central mode at {instance} (job {job}) has failed to read its Prometheus-compatible store for "
            "{for} (kvwatch_central_store_up 0): the series of every replica it serves are stale, and their vLLM "
            "alerts are blind.")),
    CauseAlert(
        cause="kvwatch_absent",
        when=_central,
        query=_central_absent,
        op=">", threshold=0,
        summary="Prometheus has no kvwatch central mode target to scrape.",
        description=(
            "No target exports kvwatch_central_store_up (or none is left in this namespace and job, which had one "
            "within the last {kvwatch_absent_window}): central mode's Deployment or StatefulSet is gone, or its "
            "ServiceMonitor selects nothing. Every vLLM alert of central mode is blind.")),
    CauseAlert(
        cause="engine_unreachable",
        query=_engine_unreachable,
        op="<", threshold=1,
        summary="kvwatch cannot read the vLLM engine's /metrics.",
        description=(
            "kvwatch at {instance} has failed to poll its vLLM engine for {for}, after the engine answered once "
            "(or its load_grace passed: a model still loading is starting, not down). kvwatch_poll_errors_total by "
            "reason says why: refused or timeout (engine down or wedged), http_4xx (wrong path or auth), "
            "http_5xx.")),
    CauseAlert(
        cause="stats_disabled",
        query=lambda f: f.series("kvwatch_stats_disabled"),
        op=">", threshold=0,
        summary="vLLM answers, but without its statistics (--disable-log-stats): kvwatch is blind.",
        description=(
            "The engine beside kvwatch at {instance} serves /metrics without any engine series for {for}: vLLM "
            "runs with --disable-log-stats (or the target is another program). Requests may be served fine, but "
            "kvwatch, its findings and every vLLM alert (the objectives too) see nothing.")),
    *STREAM_ALERTS,
)
