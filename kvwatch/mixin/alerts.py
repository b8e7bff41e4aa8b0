"""The alerts: one AlertSpec per alert and cause, from the config.

Each spec is a query, a comparison and a threshold: the Prometheus rule is
`(query) > threshold` (or `<`), and the Grafana rule queries the same PromQL
and applies the same threshold, so the two cannot disagree about when an
alert holds. A query keeps the symptom's value (KV usage peak, hit ratio, mean
time to first token) and filters it through its cause's conditions; the
causes of one symptom partition it (each branch excludes the others with
`unless`), so at most one cause fires per engine, and exhaustion-driven
queueing and compute-bound queueing can never be reported together.

The conditions are kvwatch's diagnosis in PromQL (kvwatch/diagnose/): one
exhaustion detector (Fragments.exhausted) decides the exhaustion alert, the
KV-bound queue and whether a low hit rate may be blamed on anything else; the
exhaustion causes use the diagnosis' definition over the same means.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.diagnose.causes import ALERT_LIST, CAUSE, CAUSE_LIST
from kvwatch.diagnose.causes import ALERTS as ALERTS_BY_NAME
from kvwatch.mixin import objectives
from kvwatch.mixin.config import ALERT_CAUSES, ALERTS, PREEMPTING_SUFFIX, MixinConfig
from kvwatch.mixin.conditions import Recorded
from kvwatch.mixin.objectives import OBJECTIVE_ALERTS
from kvwatch.mixin.promql import Scope, chain, num, paren

# Where each alert is shown: (dashboard key, panel key), see dashboards.py;
# the catalogue's alerts say it in their record.
OBJECTIVE_PANEL = ("overview", "objective_burn")
ALERT_PANELS = {
    **{alert.name: alert.panel for alert in ALERT_LIST},
    **{alert: OBJECTIVE_PANEL for alert, _, _ in OBJECTIVE_ALERTS.values()},
}

# Alternatives (issue 32): where the page cannot tell a cause from eviction
# before reuse, the description says so and names what decides;
# kvwatch_finding_alternative carries the same as data.
UNDECIDED = ("Without vLLM's --kv-cache-metrics or its KV-cache events this reads the same as prefixes evicted "
             "before reuse: kvwatch_finding_alternative names the alternative and what would decide it.")

# Stand-in for the alert's value in description templates: Prometheus calls
# it $value, Grafana $values.<refId>.Value.
VALUE = "VALUE"
PROMETHEUS_VALUE = "$value"


@dataclass(frozen=True)
class AlertSpec:
    alert: str
    cause: str
    symptom: str | None
    query: str
    op: str  # ">" or "<"
    threshold: float
    for_: str
    severity: str
    summary: str
    description: str  # Go template with VALUE standing for the value
    dashboard: str
    panel: str
    variant: str = ""  # "preempting" for an exhaustion cause's rule with preemptions; the long window of a burn
    # "cause": the label `cause` names it; "objective": a burn-rate page, the label `objective` names it
    kind: str = "cause"
    extra_labels: tuple[tuple[str, str], ...] = ()

    @property
    def expr(self) -> str:
        return f"{paren(self.query)}\n{self.op} {num(self.threshold)}"

    @property
    def anchor(self) -> str:
        if self.kind == "objective":
            return runbook_anchor(self.alert)
        return runbook_anchor(self.alert, self.cause)

    @property
    def uid(self) -> str:
        """Stable Grafana rule uid (at most 40 characters)."""
        short = "burn" if self.kind == "objective" else ALERTS_BY_NAME[self.alert].uid
        uid = f"kvwatch-{short}-{self.cause.replace('_', '-')}"
        if self.variant:
            return uid[:39 - len(self.variant)] + "-" + self.variant
        return uid[:40]

    def labels(self) -> dict[str, str]:
        if self.kind == "objective":
            labels = {"severity": self.severity, "objective": self.cause}
        else:
            labels = {"severity": self.severity, "cause": self.cause}
        labels.update(self.extra_labels)
        if self.symptom:
            labels["symptom"] = self.symptom
        return labels

    def description_for(self, value_ref: str) -> str:
        return self.description.replace(VALUE, value_ref)


def runbook_anchor(alert: str, cause: str | None = None) -> str:
    anchor = alert.lower()
    return f"{anchor}-{cause.replace('_', '-')}" if cause else anchor


def _lbl(name: str) -> str:
    return "{{ $labels." + name + " }}"


def engine_scope(config: MixinConfig) -> Scope:
    return Scope(config.kvwatch_selector, config.rate_window, config.engine_labels)


def alert_specs(config: MixinConfig) -> list[AlertSpec]:
    # The alerts read recorded values and conditions (kvwatch/mixin/conditions.py).
    f = Recorded(engine_scope(config), config)
    w = config.rate_window
    where = f"engine {_lbl('engine')} of {_lbl('model_name')} on {_lbl(config.instance_label)}"
    pct = lambda x: f"{x * 100:g}%"  # noqa: E731
    specs: list[AlertSpec] = []

    def add(cause, query, op, threshold, summary, description, variant=""):
        # The alert a cause's rule belongs to is its record's route (causes.py).
        alert = CAUSE[cause].alert
        assert alert is not None, f"{cause}: a PromQL twin for a cause its record routes to no alert"
        dashboard, panel = ALERT_PANELS[alert]
        severity = config.severity(cause + PREEMPTING_SUFFIX if variant == "preempting" else cause)
        specs.append(AlertSpec(alert, cause, ALERTS[alert], query, op, threshold, config.for_duration(alert),
                               severity, summary, description, dashboard, panel, variant))

    # --- objectives: what pages ----------------------------------------------------
    for objective, (alert, symptom, _) in OBJECTIVE_ALERTS.items():
        target = objectives.objective_target(config, objective)
        what = {"first_token": f"got their first token later than {num(config.ttft_objective_seconds)}s",
                "availability": "ended in error", "aborts": "were aborted by their client"}[objective]
        goal = {"first_token": f"{pct(target)} of first tokens within {num(config.ttft_objective_seconds)}s",
                "availability": f"{pct(target)} of requests without error",
                "aborts": f"{pct(target)} of requests not aborted"}[objective]
        summary = {"first_token": "vLLM first tokens are late for too many requests: the objective's budget burns.",
                   "availability": "vLLM requests fail: the availability objective's budget burns.",
                   "aborts": "Clients abort many vLLM requests: the abort objective's budget burns."}[objective]
        dashboard, panel = ALERT_PANELS[alert]
        for pair in objectives.burn_windows(config):
            query, threshold = objectives.burn_query(config, objective, pair)
            specs.append(AlertSpec(
                alert, objective, symptom, query, ">", threshold, config.for_duration(alert),
                objectives.severity(objective, pair), summary,
                f"{{{{ {VALUE} | humanizePercentage }}}} of the requests to {where} {what} over the last "
                f"{pair.long}, and more than {pct(threshold)} over the last {pair.short} as well: the budget of "
                f"the objective ({goal}) burns {num(pair.factor)}x faster than it lasts. The alerts firing beside "
                "it for this engine say where to look (annotation cause_alerts; the first-token and exhaustion "
                "dashboards).",
                dashboard, panel, pair.long, "objective",
                (("long_window", pair.long), ("short_window", pair.short))))

    # --- KV cache exhausted ------------------------------------------------------
    usage = f.usage_max()
    share = pct(config.long_request_capacity_share)
    # The alert fires on the exhaustion detector alone, as the diagnosis does:
    # a preemption means vLLM could not allocate a block, even when no scrape
    # caught the usage peak (usage drops the moment a preempted request's
    # blocks are freed). The value is the usage peak the scrapes did catch.
    exhausted_intro = (f"The KV cache of {where} ran out of room in the last {w}: requests were preempted, or "
                       f"waited for room while usage peaked above {pct(config.exhaustion_usage_ratio)} (highest "
                       f"usage scraped: {{{{ {VALUE} | humanizePercentage }}}})")
    exhaustion_causes = {
        "concurrency_beyond_capacity": (
            ("unless", f.long_requests()),
            "more concurrent requests than the cache holds.",
            f"on average each running request held less than {share} of it or more requests waited than ran: "
            "too many requests for the cache (likely cause: concurrency beyond capacity). Next: on the exhaustion "
            "dashboard compare running plus waiting requests with how many the cache holds at current lengths; "
            "cap concurrency near that (--max-num-seqs, the gateway), add replicas, or give the cache more memory."),
        "long_requests": (
            ("and", f.long_requests()),
            "a few long requests fill it.",
            f"on average each running request held at least {share} of it with no more requests waiting than "
            "running: a few long requests fill the cache (likely cause: long requests). Next: check prompt and "
            "generation length p95 on the exhaustion dashboard and the gateway log; cap max_tokens or "
            "--max-model-len, or route long-context requests to engines sized for them."),
    }
    # A cause splits on preemptions only where the two severities differ (the config sets
    # <cause>_preempting apart); by default both are warnings and each cause
    # is one rule: the page is the objective, not the preemption.
    for variant in ("preempting", "", "either"):
        for cause, (split, headline, reason) in exhaustion_causes.items():
            split_here = config.severity(cause + PREEMPTING_SUFFIX) != config.severity(cause)
            if split_here == (variant == "either"):
                continue
            if variant == "either":
                steps = (("and", f.exhausted()), split)
                summary = f"vLLM KV cache full: {headline}"
                state = ""
            elif variant:
                steps = (("and", f.exhausted()), split, ("and", f.preempting()))
                summary = f"vLLM KV cache full and preempting: {headline}"
                state = ", requests are being preempted (their KV recomputed)"
            else:
                steps = (("and", f.exhausted()), split, ("unless", f.preempting()))
                summary = f"vLLM KV cache full: {headline}"
                state = ", requests wait (none preempted)"
            add(cause, chain(usage, *steps), ">", 0, summary,
                f"{exhausted_intro}{state}, and {reason}", "" if variant == "either" else variant)

    # --- KV cache full soon --------------------------------------------------------
    # The ETA signal's own PromQL (the one its recording rule records): absent
    # unless usage rises and is at least its mean over the trend range, so flat
    # or falling usage never fires. Silent once the cache is exhausted: from
    # then on VllmKvCacheExhausted speaks, and this one warns only before.
    minutes = config.exhaustion_eta_minutes
    add("usage_rising",
        chain(f.signal("kvwatch_kv_cache_exhaustion_eta_seconds"), ("unless", f.exhausted())),
        "<", minutes * 60,
        "vLLM KV cache on course to fill up: preemption is minutes away.",
        f"KV usage of {where} is rising: at its trend over the last 5m the cache is full in "
        f"{{{{ {VALUE} | humanizeDuration }}}} (under {num(minutes)}m), and nothing is preempted yet (likely "
        "cause: usage rising). Next: on the exhaustion dashboard, see what rises (running requests or their "
        "length); shed or route load to other replicas, or add one now, before vLLM starts preempting.")

    # --- prefix-cache hit rate low -------------------------------------------------
    # While the cache is exhausted, a full cache explains a low ratio by
    # itself: only caching off, a restart (cold_cache) and a drop that showed
    # while the cache was not exhausted (prefix_changed) are named then.
    hit = f.hit_ratio()
    judged = (("and", f.enough_queries()), ("unless", f.caching_disabled()))
    low_intro = (f"The prefix-cache hit ratio of {where} was {{{{ {VALUE} | humanizePercentage }}}} over the last "
                 f"{w} (below {pct(config.hit_ratio_low)})")
    add("caching_disabled",
        chain(f"0 * {paren(f.caching_disabled())}", ("and", f.prompt_traffic())),
        "<", config.hit_ratio_low,
        "vLLM serves prompts with prefix caching disabled.",
        f"Prefix caching is off on {where} (kvwatch_engine_info enable_prefix_caching=False) while it serves "
        "prompts, so no prompt token is reused and no hit ratio is measured (likely cause: caching disabled). "
        "Next: if prompts share prefixes (system prompt, few-shot examples, documents), start vLLM with "
        "--enable-prefix-caching.")
    add("cold_cache",
        chain(hit, *judged, ("and", f.cold())),
        "<", config.hit_ratio_low,
        "vLLM prefix-cache hit ratio low: the cache is cold after a restart.",
        f"{low_intro}, and the engine restarted within the last {config.cold_cache_window} (its counters reset "
        "or its cache configuration changed): the cache has not warmed up (likely cause: cold cache). Next: "
        "expect the ratio to recover after a few repeats of each prefix; find out why the engine restarted "
        "(deploy, OOM, crash).")
    add("eviction_before_reuse",
        chain(hit, *judged, ("unless", f.cold()), ("and", f.healthy_baseline()), ("unless", f.exhausted()),
              ("and", f.cache_pressure())),
        "<", config.hit_ratio_low,
        "vLLM prefix-cache hit ratio low: cached prefixes are evicted before reuse.",
        f"{low_intro}, after at least {pct(config.hit_ratio_low)} in the {config.hit_ratio_baseline_window} "
        f"before, while KV usage averaged above {pct(config.eviction_usage_ratio)} without exhausting the cache: "
        "running requests crowd idle cached prefixes out before they are reused (likely cause: eviction before "
        "reuse). Next: run vLLM with --kv-cache-metrics and compare kv_block_idle_before_evict with "
        "kv_block_reuse_gap; give the cache more room, or route requests that share a prefix to the same "
        "engine.")
    add("prefix_changed",
        chain(hit, *judged, ("unless", f.cold()), ("and", f.healthy_baseline()),
              ("and", f.dropped_with_room())),
        "<", config.hit_ratio_low,
        "vLLM prefix-cache hit ratio dropped: the shared prompt prefix changed.",
        f"{low_intro}, after at least {pct(config.hit_ratio_low)} in the {config.hit_ratio_baseline_window} "
        "before, and the drop showed while the cache had room: the requests stopped sharing the prefix they "
        "shared (likely cause: prefix changed). Next: diff the prompt templates and system prompts deployed "
        "around the drop; per-request text (timestamps, ids) before the shared text breaks reuse. " + UNDECIDED)
    if config.no_reuse_alert:
        add("no_reuse",
            chain(hit, *judged, ("unless", f.cold()), ("and", f.low_baseline()), ("unless", f.exhausted())),
            "<", config.hit_ratio_low,
            "vLLM prefix-cache hit ratio low: the prompts share little prefix.",
            f"{low_intro}, it was low in the {config.hit_ratio_baseline_window} before as well, and the cache is "
            "not exhausted: the workload shares few prefixes (likely cause: no reuse). Next: nothing to repair "
            "in the cache; if the prompts should share text, put it first and keep it byte-identical. " + UNDECIDED)

    # --- time to first token slow ------------------------------------------------
    ttft = f.first_token_mean()
    slow_intro = (f"Mean time to first token of {where} was {{{{ {VALUE} | humanizeDuration }}}} over the last "
                  f"{w} (objective {num(config.ttft_mean_seconds)}s)")
    add("queueing_kv_bound",
        chain(ttft, ("and", f.queue_largest()), ("and", f.kv_bound())),
        ">", config.ttft_mean_seconds,
        "vLLM first token slow: requests queue for KV cache.",
        f"{slow_intro}; most of it is queueing, and the KV cache was exhausted (full while requests waited, or "
        "preempting): requests wait for KV blocks (likely cause: KV-bound queueing). Next: the exhaustion "
        "dashboard; fewer or shorter concurrent requests, or a larger cache, shorten this queue.")
    add("queueing_compute_bound",
        chain(ttft, ("and", f.queue_largest()), ("unless", f.kv_bound())),
        ">", config.ttft_mean_seconds,
        "vLLM first token slow: requests queue for compute, not KV cache.",
        f"{slow_intro}; most of it is queueing while the KV cache had room: requests wait for scheduler slots "
        "or compute (likely cause: compute-bound queueing), and a bigger KV cache does not shorten this queue. "
        "Next: add replicas or lower the arrival rate; check step time, --max-num-seqs and "
        "--max-num-batched-tokens.")
    add("prefill",
        chain(ttft, ("and", f.prefill_largest())),
        ">", config.ttft_mean_seconds,
        "vLLM first token slow: prefill of long uncached prompts.",
        f"{slow_intro}; most of it is prefill (likely cause: long uncached prompts). Next: check prompt length "
        "and the cached share of prompt tokens on the first-token dashboard; raise prefix reuse, shorten "
        "prompts, tune chunked prefill (--max-num-batched-tokens) or separate prefill from decode.")
    # One story (issue 32, kvwatch/diagnose/arbitration.py): the residual
    # outside queue and prefill is preemption wherever the exhaustion detector
    # holds (a preempted request's re-queueing and recomputation is in neither
    # histogram), front_end only where it does not.
    add("front_end",
        chain(ttft, ("and", f.front_end_largest()), ("unless", f.exhausted())),
        ">", config.ttft_mean_seconds,
        "vLLM first token slow: time outside queue and prefill.",
        f"{slow_intro}; most of it is outside queue and prefill while the KV cache had room (likely cause: front "
        "end: tokenization, multimodal preprocessing, API-server CPU, scheduling gaps). Next: check the API "
        "server's CPU and --api-server-count; a bigger KV cache does not help.")
    add("preemption",
        chain(ttft, ("and", f.front_end_largest()), ("and", f.exhausted())),
        ">", config.ttft_mean_seconds,
        "vLLM first token slow: requests preempted and recomputed in a full KV cache.",
        f"{slow_intro}; most of it is outside queue and prefill while the KV cache was exhausted (preempting, or "
        "full while requests waited): preempted requests go back to the queue and recompute their KV, time "
        "neither histogram counts (likely cause: preemption; the front end is not the cause while this lasts). "
        "Next: VllmKvCacheExhausted for the same engine names why the cache is full; fewer or shorter concurrent "
        "requests, or more KV memory, end it.")
    if f.upstream:
        add("upstream",
            chain(ttft, ("and on (" + ", ".join(config.upstream_join_labels) + ")", f.upstream_mean()),
                  ("unless", f.queue_largest()), ("unless", f.prefill_largest()), ("unless", f.front_end_largest())),
            ">", config.ttft_mean_seconds,
            "Slow first token: time spent before the engine.",
            f"{slow_intro}, counting {config.upstream_histogram} before the engine; the largest part is that "
            "upstream stage (likely cause: upstream). Next: look at the upstream service (retrieval, gateway); "
            "a bigger or smaller KV cache does not repair it.")

    # --- fleet: one replica unlike its peers of the same model -------------------
    # kvwatch/diagnose/fleet.py's definitions across the replicas
    # (instance_label) of a model; see Fragments.imbalance and after.
    peer_where = f"{_lbl('model_name')} on {_lbl(config.instance_label)} (engine {_lbl('engine')})"
    add("imbalance",
        f.imbalance(), ">", 0,
        "One vLLM replica is exhausted or queueing while its peers have room.",
        f"The replica of {peer_where} was exhausted or queueing over the last {w} (KV usage peak "
        f"{{{{ {VALUE} | humanizePercentage }}}}) while another replica of the same model peaked at most "
        f"{pct(config.fleet_room_usage_ratio)} with nothing waiting: the load is unevenly routed, not too large "
        "(likely cause: imbalance). Next: the fleet dashboard's replica table; check the load balancer or gateway "
        "policy (sticky sessions, a prefix-aware router pinning one hot prefix, a replica missing from the "
        "endpoints); more KV memory does not fix it.")
    add("lost_prefix_affinity",
        f.lost_prefix_affinity(), "<", config.fleet_affinity_fraction,
        "One vLLM replica reuses far fewer prefixes than its peers: prefix routing lost.",
        f"The prefix-cache hit ratio of {peer_where} over the last {w} was {{{{ {VALUE} | humanizePercentage }}}} "
        f"of its warm peers' pooled ratio (below {pct(config.fleet_affinity_fraction)}, peers at least "
        f"{pct(config.hit_ratio_low)}): requests sharing a prefix no longer reach the replica that holds it "
        "(likely cause: lost prefix affinity). Next: check the router's prefix or session affinity setting and "
        "whether this replica receives traffic by another path (a Service bypassing the router).")
    add("cold_replica",
        f.cold_replica(), ">", 0,
        "One vLLM replica restarted and refills its cache while its peers are warm.",
        f"The replica of {peer_where} restarted in the last {config.cold_cache_window} (its counters reset) while "
        "other replicas of the "
        "model did not: it is refilling its prefix cache, so a lower hit ratio and slower first tokens there are "
        "expected for a while (likely cause: cold replica). Next: find out why it restarted (deploy, OOM, "
        "crash); if it restarts again, look at its events and logs.")

    # --- health ------------------------------------------------------------------
    add("kvwatch_unreachable",
        f"up{{{config.kvwatch_selector}}}", "<", 1,
        "Prometheus cannot scrape kvwatch.",
        f"Prometheus has failed to scrape kvwatch at {_lbl(config.instance_label)} (job {_lbl('job')}) for "
        f"{config.for_duration('KvwatchDown')}: kvwatch's signals and the vLLM alerts for that pod are blind. "
        "Next: check the kvwatch container (its log, /healthz), the pod, and the scrape configuration.")
    # up{} < 1 sees only targets Prometheus still has: a monitor that selects
    # nothing, or kvwatch gone with its pods, leaves no `up` to be below 1.
    # Nothing at all under the selector is absent(); a group (namespace, job)
    # that had targets within kvwatch_absent_window and has none now is the
    # fleet-level vanish. One pod replaced by another is not (its group keeps
    # targets); a fleet scaled to zero on purpose is, until the window passes
    # (absent() until a target returns): silence it for planned scale-downs.
    up = f"up{{{config.kvwatch_selector}}}"
    groups = ", ".join(config.group_labels)
    add("kvwatch_absent",
        f"absent({up})\nor\n(\n  group by ({groups}) (max_over_time({up}[{config.kvwatch_absent_window}]))\n"
        f"  unless\n  group by ({groups}) ({up})\n  and on ()\n  count({up})\n)",
        ">", 0,
        "Prometheus has no kvwatch target to scrape.",
        f"No target matches {config.kvwatch_selector} (or none is left in this group, which had some within "
        f"the last {config.kvwatch_absent_window}): the ServiceMonitor/PodMonitor selects nothing, or the pods "
        "carrying kvwatch are gone. Every vLLM alert is blind. Next: `kubectl get pods,servicemonitors,"
        "podmonitors -n <namespace>`, Prometheus' Targets page for the job, and whether the fleet was scaled to "
        "zero on purpose (then silence this alert).")
    # An engine that answers without its statistics is not unreachable: it
    # has its own alert (below), and this one leaves it out.
    stats_off = f"kvwatch_stats_disabled{{{config.kvwatch_selector}}} > 0"
    # Nor is a busy one, whose /metrics answers late under load (kvwatch_busy).
    busy = f"kvwatch_busy{{{config.kvwatch_selector}}} > 0"
    add("engine_unreachable",
        chain(f"kvwatch_up{{{config.kvwatch_selector}}}", ("unless", stats_off), ("unless", busy)), "<", 1,
        "kvwatch cannot read the vLLM engine's /metrics.",
        f"kvwatch at {_lbl(config.instance_label)} has failed to poll its vLLM engine for "
        f"{config.for_duration('KvwatchEngineUnreachable')}. kvwatch_poll_errors_total by reason says why: "
        "refused or timeout (engine down or wedged), http_4xx (wrong path or auth), http_5xx. Next: kvwatch's "
        "status page and /readyz, then the engine's log.")
    add("stats_disabled",
        f"kvwatch_stats_disabled{{{config.kvwatch_selector}}}", ">", 0,
        "vLLM answers, but without its statistics (--disable-log-stats): kvwatch is blind.",
        f"The engine beside kvwatch at {_lbl(config.instance_label)} serves /metrics without any engine series "
        f"for {config.for_duration('VllmEngineStatsDisabled')}: vLLM runs with --disable-log-stats (or the "
        "target is another program). Requests may be served fine, but kvwatch, its findings and every vLLM "
        "alert (the objectives too) see nothing. Next: remove --disable-log-stats from the engine's arguments, "
        "or point kvwatch's target at the engine.")

    # --- causes routed by their finding ----------------------------------------
    # A cause whose record routes it to an alert by its finding (no PromQL
    # twin above) fires where kvwatch's own diagnosis names it: kvwatch_finding
    # holds it as long as the finding is held.
    by = ", ".join(config.engine_labels)
    for cause in CAUSE_LIST:
        if cause.alert and cause.routed_by_finding:
            title = cause.title or cause.name.replace("_", " ")
            add(cause.name,
                f'max by ({by}) (kvwatch_finding{{{config.kvwatch_selector},symptom="{cause.symptom}",'
                f'cause="{cause.name}"}})', ">", 0,
                f"kvwatch diagnoses {title}.",
                f"kvwatch's diagnosis names {cause.name} ({cause.symptom}) for {where} (kvwatch_finding; the "
                f"evidence is on kvwatch's status page and /api/v1/diagnosis). Next: {cause.next_action}")

    expected = {(alert, cause) for alert, causes in ALERT_CAUSES.items() for cause in causes}
    if not f.upstream:
        expected.discard(("VllmTimeToFirstTokenSlow", "upstream"))
    if not config.no_reuse_alert:
        expected.discard(("VllmPrefixCacheHitRateLow", "no_reuse"))
    expected |= {(alert, objective) for objective, (alert, _, _) in OBJECTIVE_ALERTS.items()}
    assert {(s.alert, s.cause) for s in specs} == expected, "every alert and cause has exactly one spec"
    return specs


def dashboard_url(config: MixinConfig, uid: str, panel_id: int) -> str:
    return config.dashboard_url_pattern.format(uid=uid, panel_id=panel_id, model_name=_lbl("model_name"),
                                               engine=_lbl("engine"))


# kvwatch serves the runbooks itself (GET /runbooks, kvwatch/sidecar/app.py):
# by default an alert links the kvwatch that raised it.
RUNBOOK_PATH = "/runbooks"


def default_runbook_base(config: MixinConfig) -> str:
    return "http://" + _lbl("instance") + RUNBOOK_PATH


def runbook_url(config: MixinConfig, alert: str, cause: str | None = None) -> str:
    anchor = runbook_anchor(alert, cause)
    if config.runbook_url_pattern:
        return config.runbook_url_pattern.format(anchor=anchor)
    base = (config.runbook_base_url or default_runbook_base(config)).rstrip("/")
    return f"{base}#{anchor}"
