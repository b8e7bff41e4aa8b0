"""The cause catalogue: one record per cause kvwatch names, by its in-process
diagnosis or by its generated alerts, holding everything said about it:
its symptom, its severity rule, the page's title for it, the next check (a
finding's full advice) and the next action (the banner's one sentence), the
evidence that decides it (highlighted on its card), who owns the fix (the
alert routes), what "no data" means for its Grafana rule, the alert it routes
to, and its place in the arbitration between causes of one symptom. Its
runbook prose lives beside this module, in runbooks/<cause>.md, and
kvwatch/mixin/runbooks.py composes it.

Everything else reads these records: the diagnosis rules (severity, next
check), diagnose/arbitration.py (subordinate, weight; the symptom's ranking), the status page
and the CLI (titles, actions, deciding evidence), the mixin (severities,
`for:` durations, panels, owners, no-data states, the runbook sections).

    Adding a cause: its Cause record below and its name in its symptom's
    `ranking`, its judge (@judges in the symptom's diagnose/ module:
    hit_rate.py, exhaustion.py), its runbooks/<cause>.md if an alert reports it; tests.
    Routing it to an alert: `alert=` and `owner=` in its record, and
    `routed_by_finding=True` (the alert fires on kvwatch_finding), or its
    CauseAlert record in kvwatch/mixin/alert_records.py (a PromQL twin:
    Prometheus decides it alone). The alert's advice is `next_check`.
    Adding an alert: its Alert record below and runbooks/<Alert>.md; the
    causes it reports name it in their records; a test.

The `symptom`/`cause` names are the labels of `kvwatch_finding` and of the
generated alert rules: do not rename them.
"""

from __future__ import annotations

from dataclasses import dataclass

SEVERITIES = ("critical", "warning", "info")
CONFIDENCES = ("high", "medium", "low")
# Who fixes a cause: the team an alert is routed to (the Alertmanager and
# Grafana notification examples). Platform: whoever runs, sizes and scales the
# engines (and kvwatch beside them). Application: whoever owns prompts, the
# application, the gateway or router. None: nobody's queue, a ticket.
OWNERS = ("platform", "application")

# Grafana's no-data state of a rule whose query is a filter (the default).
FILTER_NO_DATA = (
    "OK", "The query is a filter: it returns a series only for an engine where the condition holds, so no data is "
          "the healthy answer. A blind kvwatch (no scrape, no poll) is reported by KvwatchDown and "
          "KvwatchEngineUnreachable, not by every vLLM rule at once.")


@dataclass(frozen=True)
class Symptom:
    name: str
    # What the banner and the cards call it (None: the page shows the name).
    title: str | None = None
    # The alert that reports the symptom, whose runbook a finding links and
    # which holds while the finding is held (keep_firing_for).
    alert: str | None = None
    # Whether its causes compete for one story per engine (arbitration.py);
    # changes and the event stream's findings are facts, each true.
    arbitrated: bool = False
    # An arbitrated symptom's diagnosed causes, the preferred first when the
    # evidence is otherwise equal (arbitration.py's last tie-break): a new
    # cause is one name in this list, its siblings keep theirs.
    ranking: tuple[str, ...] = ()
    # Hysteresis (hold.py), in seconds: `quiet`, how long its condition must
    # be clear before a finding shows as ended (a shorter lapse is not shown,
    # so the page does not toggle); `lead`, how long a new cause must lead its
    # story before it replaces the cause on the page; `handover`, how long a
    # shown cause the rules no longer find stays shown while another cause of
    # the symptom is found (its successor's own evidence says the story moved
    # on, so it waits less than a lapse, which is hidden for `quiet`).
    quiet: float = 0.0
    lead: float = 0.0
    handover: float = 0.0


@dataclass(frozen=True)
class Cause:
    name: str
    symptom: str | None
    # Severity says who must act and how soon: critical wakes someone (users
    # lose work now), warning goes to the owning team's queue the same day,
    # info is a fact.
    severity: str
    # The severity while the engine preempts (exhaustion): the page's, and the
    # alert's for its `<cause>_preempting` rule (one severity per finding).
    preempting_severity: str | None = None
    # The page's words for it (None: the page shows the name).
    title: str | None = None
    # A finding's full advice (its card and its alert's description), and one
    # short instruction for places with room for a sentence (the banner).
    next_check: str = ""
    next_action: str = ""
    # The two or three evidence values that decided it, highlighted on its
    # card (the first present win); the rest of the evidence is folded.
    deciding: tuple[str, ...] = ()
    # The alert that reports it (a `cause` label and a runbook section), if any.
    alert: str | None = None
    # How that alert decides it: False, by its PromQL twin (the diagnosis
    # written again in PromQL, kvwatch/mixin/alert_records.py, so Prometheus decides
    # without kvwatch's diagnosis); True, by kvwatch's own finding
    # (kvwatch_finding for this cause; nothing to write in the mixin).
    routed_by_finding: bool = False
    # Grafana's state when its rule's query returns no series, and why.
    no_data: tuple[str, str] = FILTER_NO_DATA
    # Who fixes it (OWNERS), for the alert routes.
    owner: str | None = None
    # Arbitration (diagnose/arbitration.py; its place among its symptom's
    # causes is the symptom's `ranking`): `subordinate`: only the reason
    # another cause could happen, primary only alone; `weight`: the evidence
    # value (0..1) saying how much of the symptom it explains.
    subordinate: bool = False
    weight: str | None = None
    # False for an alert's own cause that the in-process diagnosis never names
    # (kvwatch unreachable, a forecast).
    diagnosed: bool = True
    # Named only while the one exhaustion detector holds (True) or only while
    # it does not (False): a story moving across that line changes at once
    # (hold.py), its old cause's text would contradict the exhaustion shown.
    while_exhausted: bool | None = None
    # One of its symptom's exclusive readings: the rule names exactly one of
    # them per window from the same evidence (the exhaustion's load shape), so
    # another found in its place is a rival reading, never a lapse of this one:
    # it replaces it on the page only after leading for the symptom's `lead`.
    exclusive: bool = False


@dataclass(frozen=True)
class Alert:
    name: str
    # The symptom label its rules carry (None: a health alert).
    symptom: str | None
    # Its default `for:` (the mixin config's for_durations overrides).
    for_: str
    # Where it is shown: (dashboard key, panel key), see mixin/dashboards.py.
    panel: tuple[str, str]
    # The short name in its Grafana rules' uids (kvwatch-<uid>-<cause>): stable.
    uid: str


# Measured with the timeline scorer (docs/diagnosis.md, "The story over time, scored"): the demo's
# true lapses last up to 30 s (a hit rate between two bursts of tenants, a queue that drains between
# long generations), and a phase's end must show ended within 75 s, of which the now span and the
# window's lag take about 35 s: a quiet of 35 s, 25 s for first tokens (a queue that drains for 34 s
# between two readings of one exhaustion is a new episode, not noise). An exhaustion's load shape is
# read again within 35 s of a queue forming behind long generations: its lead is 45 s.
QUIET = 35.0
LEAD = 30.0
HANDOVER = 15.0
SYMPTOM_LIST = (
    # Quiet, lead and handover measured with the timeline scorer (above).
    # Exhaustion: the two load shapes (decided exclusively from the window's
    # means, as the alert decides them) before the sizing advice, a reason the
    # load shape hurts, not a rival to it.
    Symptom("exhaustion", "KV cache exhausted", "VllmKvCacheExhausted", arbitrated=True, quiet=QUIET, lead=45.0,
            handover=HANDOVER,
            ranking=("concurrency_beyond_capacity", "long_requests", "capacity_below_max_num_seqs")),
    Symptom("low_hit_rate", "Low prefix-cache hit rate", "VllmPrefixCacheHitRateLow", arbitrated=True,
            quiet=QUIET, lead=LEAD, handover=HANDOVER,
            ranking=("caching_disabled", "cold_cache", "cache_reset", "prefix_changed", "eviction_before_reuse",
                     "no_reuse")),
    # First token: time upstream of the engine, then the causes of queueing
    # (KV before compute), prefill, and the residual last.
    Symptom("slow_first_token", "Slow first token", "VllmTimeToFirstTokenSlow", arbitrated=True, quiet=25.0,
            lead=LEAD, handover=HANDOVER,
            ranking=("upstream", "queueing_kv_bound", "queueing_compute_bound", "prefill", "preemption",
                     "front_end")),
    # Requests or KV blocks held while nothing moves and no token is counted (diagnose/stuck.py):
    # not exhaustion, which serves. Its two causes exclude each other (requests held, or none).
    Symptom("stuck", "Engine stuck", "VllmEngineStuck"),
    Symptom("change", "Engine changed"),
    # Judged across the replicas of one model (diagnose/fleet.py); a replica
    # alone cannot show them. Arbitrated per replica they name.
    Symptom("fleet", alert="VllmFleetReplicaOutlier", arbitrated=True,
            ranking=("imbalance", "lost_prefix_affinity", "cold_replica")),
    # The engine's KV-cache event stream itself (diagnose/stream.py), where kv_events is set.
    Symptom("kv_events", "KV-cache event stream", "KvwatchKvEventStreamUnhealthy"),
    # The router's prediction against the engines' delivery, per model (kvwatch/routing/).
    Symptom("routing", "Routing", "VllmRouterPrefixRouting"),
)

# The banner's order among findings of one weight (actionable or not): what
# users feel first (a stuck engine, late first tokens: the objectives), then
# what makes them feel it (exhaustion), then what costs compute (hit rate),
# then how the router placed them, then facts about the fleet, kvwatch's own stream and changes.
FELT_ORDER = ("stuck", "slow_first_token", "exhaustion", "low_hit_rate", "routing", "fleet", "kv_events", "change")

# The alerts, in the order of their runbook sections. The objectives'
# burn-rate pages are kvwatch/mixin/objectives.py's.
ALERT_LIST = (
    # Long enough that a burst which drains by itself does not page; short
    # enough that a real overload is reported while it still hurts.
    Alert("VllmKvCacheExhausted", "exhaustion", "10m", ("exhaustion", "usage_peak"), "exhausted"),
    # Short against the ETA threshold (15m), so it still warns with about ten
    # minutes left; long enough that one steep ramp that levels off does not.
    Alert("VllmKvCacheExhaustionSoon", "exhaustion", "5m", ("exhaustion", "kvwatch_kv_cache_exhaustion_eta_seconds"),
          "exhaustion-soon"),
    # Hit ratios move slowly and the causes are not urgent; shorter than the
    # cold-cache window, or a cold cache could never be reported.
    Alert("VllmPrefixCacheHitRateLow", "low_hit_rate", "15m", ("prefix_cache", "hit_ratio_vs_baseline"), "hit-rate"),
    Alert("VllmTimeToFirstTokenSlow", "slow_first_token", "10m", ("first_token", "ttft_parts"), "ttft"),
    Alert("KvwatchDown", None, "5m", ("overview", "scrape_up"), "down"),
    Alert("KvwatchEngineUnreachable", None, "5m", ("overview", "poll_up"), "unreachable"),
    # vLLM answers, but without its statistics (--disable-log-stats): kvwatch is blind, serving may be fine.
    Alert("VllmEngineStatsDisabled", None, "5m", ("overview", "poll_up"), "stats-disabled"),
    # As the exhaustion it compares: a routing fault that lasts, not a burst
    # that landed on one replica.
    Alert("VllmFleetReplicaOutlier", "fleet", "10m", ("fleet", "replicas"), "fleet"),
    # Fired by kvwatch's own stuck finding (diagnose/stuck.py), which already waited
    # diagnosis.stuck_seconds with nothing moving: a short `for:` only rides out one missed scrape.
    Alert("VllmEngineStuck", "stuck", "2m", ("overview", "findings"), "stuck"),
    # The stream kvwatch decides hit-rate causes by: its causes already waited
    # (kv_events_silence_seconds, the rate window), so `for:` rides out a restart of either side.
    Alert("KvwatchKvEventStreamUnhealthy", "kv_events", "10m", ("prefix_cache", "kv_events_up"), "kv-events"),
    # Fired by kvwatch's routing finding (kvwatch/routing/), each judged over the window already.
    Alert("VllmRouterPrefixRouting", "routing", "10m", ("overview", "findings"), "routing"),
)

# In the order the rules consider them within a symptom.
CAUSE_LIST = (
    # --- exhaustion. A full cache that makes requests wait: users feel it, nothing is lost yet
    # (warning). With preemptions vLLM throws away running requests' KV and recomputes it, so
    # throughput collapses while the load stays: users lose work now (critical); the alert stays a
    # warning (the objectives page on what users feel) unless the mixin config says otherwise.
    Cause(
        name="concurrency_beyond_capacity",
        symptom="exhaustion",
        severity="warning",
        preempting_severity="critical",
        title="more concurrent requests than the cache holds",
        next_check=(
            "Compare kvwatch_requests_running_max and waiting with kvwatch_kv_cache_capacity_requests: cap "
            "concurrency in front of the engine near that bound, add replicas, or give the cache more memory "
            "(gpu_memory_utilization, a smaller kv cache dtype, more tensor parallelism)."),
        next_action=(
            "Cap concurrency near the cache's capacity, add replicas or give the cache more memory."),
        deciding=("kv_usage_max", "waiting_at_peak", "preemptions", "demand_at_peak"),
        alert="VllmKvCacheExhausted",
        owner="platform",
        exclusive=True),
    Cause(
        name="long_requests",
        symptom="exhaustion",
        severity="warning",
        preempting_severity="critical",
        title="a few very long requests fill the cache",
        next_check=(
            "Find the long requests (vllm:request_prompt_tokens and request_generation_tokens p95, the gateway "
            "log): cap max_tokens or max_model_len, or route long-context requests to engines sized for them; "
            "more replicas of the same size help less than sizing for length."),
        next_action=(
            "Find the long requests and cap max_tokens or route them to engines sized for them."),
        deciding=("kv_usage_max", "capacity_share_per_running_request", "running_mean"),
        alert="VllmKvCacheExhausted",
        owner="platform",
        exclusive=True),
    # Sizing advice: the scheduler admits more than the cache holds. It needs --max-num-seqs, which
    # vLLM does not export, so Prometheus cannot decide it: no alert.
    Cause(
        name="capacity_below_max_num_seqs",
        symptom="exhaustion",
        severity="warning",
        title="the scheduler admits more requests than the cache holds",
        next_check=(
            "Lower --max-num-seqs to about kvwatch_kv_cache_capacity_requests or enlarge the cache, so the "
            "scheduler stops admitting requests it must later preempt; `kvwatch capacity` computes the bound for "
            "a model and memory budget."),
        next_action=(
            "Lower --max-num-seqs to about the cache's capacity in requests, or enlarge the cache."),
        deciding=("kv_cache_capacity_requests", "max_num_seqs", "preemptions"),
        subordinate=True),
    # --- low hit rate. Facts about the workload or the deployment (info), or something changed
    # or crowds the cache out (warning).
    Cause(
        name="caching_disabled",
        symptom="low_hit_rate",
        severity="info",
        title="prefix caching is off",
        next_check=(
            "If prompts share prefixes (system prompt, few-shot examples, documents), start vLLM with "
            "--enable-prefix-caching; until then hit ratios are not measured."),
        next_action="Start vLLM with --enable-prefix-caching if prompts share prefixes.",
        deciding=("enable_prefix_caching", "prompt_tokens"),
        alert="VllmPrefixCacheHitRateLow",
        owner="application"),
    Cause(
        name="cold_cache",
        symptom="low_hit_rate",
        severity="info",
        title="the cache is cold after a restart",
        next_check=(
            "Expected after a restart: compare hit ratios only after the cache warmed up (a few repeats of each "
            "prefix), and find why the engine restarted (deploy, OOM, crash)."),
        next_action=(
            "Wait for the cache to warm up before comparing hit ratios, and find why the engine restarted."),
        deciding=("hit_ratio_since_restart", "hit_ratio_before_restart"),
        alert="VllmPrefixCacheHitRateLow"),
    Cause(
        name="cache_reset",
        symptom="low_hit_rate",
        severity="info",
        title="the prefix cache was reset",
        next_check=(
            "Expected for a while after a reset of the prefix cache (vLLM's /reset_prefix_cache, or its own reset "
            "after new weights or adapters): compare hit ratios only once the cache has warmed up again, and find "
            "who reset it (the engine's access log); a reset repeated on a schedule keeps the cache cold."),
        next_action="Find who reset the prefix cache, and compare hit ratios only once it has warmed up.",
        deciding=("kv_cache_cleared_seconds_ago", "hit_ratio_since_reset", "hit_ratio_before_reset"),
        alert="VllmPrefixCacheHitRateLow",
        routed_by_finding=True),
    Cause(
        name="prefix_changed",
        symptom="low_hit_rate",
        severity="warning",
        title="the prompt prefix changed",
        next_check=(
            "Diff the prompt templates and system prompts deployed at that time: per-request text (timestamps, "
            "ids) placed before the shared text breaks reuse; keep shared text first and byte-identical."),
        next_action=(
            "Diff the prompt templates deployed at that time and keep the shared text first and identical."),
        deciding=("hit_ratio_baseline", "hit_ratio_recent", "kv_usage_recent_max", "kv_usage_max"),
        alert="VllmPrefixCacheHitRateLow",
        owner="application"),
    Cause(
        name="eviction_before_reuse",
        symptom="low_hit_rate",
        severity="warning",
        title="prefixes are evicted before they are reused",
        next_check=(
            "Run vLLM with --kv-cache-metrics and compare kv_block_idle_before_evict with kv_block_reuse_gap; "
            "give idle prefixes room (more KV memory, fewer concurrent long requests) or route requests that "
            "share a prefix to the same engine."),
        next_action=(
            "Give idle prefixes room (more KV memory, fewer long requests) or route shared prefixes to one "
            "engine."),
        deciding=("hit_ratio_baseline", "hit_ratio_recent", "kv_usage_recent_max", "kv_usage_max"),
        alert="VllmPrefixCacheHitRateLow",
        owner="platform"),
    Cause(
        name="no_reuse",
        symptom="low_hit_rate",
        severity="info",
        title="the requests share little prefix",
        next_check=(
            "Nothing to repair in the cache: these prompts share no prefix. If they should, put the shared text "
            "first and keep it byte-identical across requests. When the evidence says prefix_shorter_than_block, "
            "the shared text is shorter than one KV block and can never hit: lengthen the shared part past "
            "block_size or use a smaller --block-size."),
        next_action=(
            "Put shared text first in the prompts if they should share a prefix; else nothing to repair."),
        deciding=("hit_ratio", "kv_usage_mean"),
        alert="VllmPrefixCacheHitRateLow",
        owner="application"),
    # --- slow first token: the queue (bound by KV or by compute), prefill, the front end, time
    # upstream of the engine, or the residual while the cache is exhausted (preemption).
    Cause(
        name="queueing_kv_bound",
        while_exhausted=True,
        symptom="slow_first_token",
        severity="warning",
        title="requests queue for KV blocks",
        next_check=(
            "The queue waits for KV blocks (see the exhaustion finding): fewer or shorter concurrent requests, or"
            " a larger cache, shorten it."),
        next_action="Shorten the queue with fewer or shorter concurrent requests, or a larger cache.",
        deciding=("ttft_p95_seconds", "queue_share", "kv_usage_max_while_waiting"),
        alert="VllmTimeToFirstTokenSlow",
        owner="platform",
        weight="queue_share"),
    Cause(
        name="queueing_compute_bound",
        while_exhausted=False,
        symptom="slow_first_token",
        severity="warning",
        title="requests queue for compute, not KV",
        next_check=(
            "The queue waits for compute or scheduler slots, not KV blocks, so a bigger KV cache does not shorten"
            " it: add replicas or lower the arrival rate; check step time, --max-num-seqs and "
            "--max-num-batched-tokens."),
        next_action="Add replicas or lower the arrival rate: a bigger KV cache does not help.",
        deciding=("ttft_p95_seconds", "queue_share", "kv_usage_max_while_waiting"),
        alert="VllmTimeToFirstTokenSlow",
        owner="platform",
        weight="queue_share"),
    Cause(
        name="prefill",
        symptom="slow_first_token",
        severity="warning",
        title="long uncached prompts (prefill)",
        next_check=(
            "Long uncached prompts: raise prefix reuse (shared text first), shorten prompts, tune chunked prefill"
            " (--max-num-batched-tokens) or separate prefill from decode."),
        next_action="Raise prefix reuse, shorten prompts or tune chunked prefill.",
        deciding=("ttft_p95_seconds", "prefill_share", "uncached_prompt_tokens_mean"),
        alert="VllmTimeToFirstTokenSlow",
        owner="platform",
        weight="prefill_share"),
    Cause(
        name="front_end",
        while_exhausted=False,
        symptom="slow_first_token",
        severity="warning",
        title="time outside queue and prefill (front end)",
        next_check=(
            "Time outside queue and prefill: tokenization, multimodal preprocessing, API-server CPU, scheduling "
            "gaps; check the API server's CPU and --api-server-count."),
        next_action="Check the API server's CPU, tokenization and preprocessing.",
        deciding=("ttft_p95_seconds", "other_share", "other_lower_bound_seconds"),
        alert="VllmTimeToFirstTokenSlow",
        owner="application",
        weight="other_share"),
    Cause(
        name="upstream",
        symptom="slow_first_token",
        severity="warning",
        title="time spent before the engine (upstream)",
        next_check=(
            "Most of the time to first token is spent before the engine: look at the upstream stage (retrieval, "
            "gateway) named by the histogram; a bigger or smaller KV cache does not repair it."),
        next_action=(
            "Look at the stage before the engine (retrieval, gateway) named by the histogram."),
        deciding=("upstream_mean_seconds", "upstream_share", "ttft_mean_seconds"),
        alert="VllmTimeToFirstTokenSlow",
        owner="application",
        weight="upstream_share"),
    # The first-token time the queue and prefill histograms miss while the cache is exhausted:
    # requests preempted and re-queued, their KV recomputed.
    Cause(
        name="preemption",
        while_exhausted=True,
        symptom="slow_first_token",
        severity="warning",
        title="requests preempted and recomputed in a full cache",
        next_check=(
            "The cache is exhausted (see the exhaustion finding): preempted requests go back to the queue and "
            "their KV is recomputed, time that neither vLLM's queue nor its prefill histogram counts. Relieve the"
            " cache as the exhaustion finding says (fewer or shorter concurrent requests, more KV memory); the "
            "front end is not the cause while this lasts."),
        next_action="Relieve the exhausted cache: preempted requests are re-queued and recomputed.",
        deciding=("ttft_p95_seconds", "other_share", "preemptions"),
        alert="VllmTimeToFirstTokenSlow",
        owner="platform",
        weight="other_share"),
    # --- stuck: nothing moves and no token is counted for diagnosis.stuck_seconds.
    # Requests that hang: users wait for answers that will not come (critical).
    Cause(
        name="requests_stalled",
        symptom="stuck",
        severity="critical",
        title="requests held, no token produced",
        next_check=(
            "The engine holds running or waiting requests and produces nothing: not a full cache (that serves and"
            " its queue moves) and no load to shed. Check the engine's log for a hung step (a collective that "
            "waits on a dead rank, a KV transfer that never completes: vllm:num_requests_kv_fetch_by_stage, NIXL "
            "failures), its process and GPU state (nvidia-smi: utilization at 0 with memory held); abort the "
            "requests or restart the engine, and find the request that wedged it before it recurs."),
        next_action="Check the engine's log for a hung step or transfer; restart it if it does not recover.",
        deciding=("running", "waiting", "stuck_seconds", "tokens_counted"),
        alert="VllmEngineStuck",
        routed_by_finding=True,
        owner="platform"),
    # KV blocks held with nothing running: capacity lost until a restart (warning).
    Cause(
        name="kv_held_idle",
        symptom="stuck",
        severity="warning",
        title="KV blocks held with no request",
        next_check=(
            "KV usage stays above 0 with no request running or waiting and no token counted: blocks held by "
            "requests the engine no longer reports (aborted or disconnected requests whose blocks were never "
            "freed, a KV transfer that never completed). On a disaggregated prefill instance blocks wait for the "
            "decode peer to fetch them until the lease expires (vLLM's NIXL abort timeout); otherwise the "
            "capacity is lost until a restart: check the engine's log for aborts and transfers, and restart it "
            "in a quiet moment."),
        next_action="Find the requests or transfers holding the blocks; restart the engine if they never free.",
        deciding=("kv_usage", "stuck_seconds", "tokens_counted"),
        alert="VllmEngineStuck",
        routed_by_finding=True,
        owner="platform"),
    # --- changes: context for the other findings (info), each an event of its own.
    Cause(
        name="model_changed",
        symptom="change",
        severity="info",
        title="the model changed",
        next_check=(
            "Compare signals only within one model; recheck capacity and thresholds for the new model."),
        next_action=(
            "Recheck capacity and thresholds for the new model; compare signals only within one model."),
        deciding=("detail", "seconds_ago")),
    Cause(
        name="lora_changed",
        symptom="change",
        severity="info",
        title="the LoRA adapters changed",
        next_check=(
            "Adapters share the engine's KV cache and batch: compare hit ratios and latency per adapter set, not "
            "across the change."),
        next_action="Compare hit ratios and latency per adapter set, not across the change.",
        deciding=("detail", "seconds_ago")),
    Cause(
        name="cache_dtype_changed",
        symptom="change",
        severity="info",
        title="the KV-cache dtype changed",
        next_check=(
            "Re-evaluate task accuracy on the new KV-cache dtype (a quantised cache can change outputs); capacity"
            " and latency baselines changed too."),
        next_action="Re-evaluate task accuracy on the new KV-cache dtype.",
        deciding=("detail", "seconds_ago")),
    Cause(
        name="cache_config_changed",
        symptom="change",
        severity="info",
        title="the cache configuration changed",
        next_check=(
            "Baselines from before the change are not comparable: recheck kvwatch_kv_cache_capacity_requests and "
            "the exhaustion evidence against the new block size and capacity."),
        next_action="Recheck the cache's capacity against the new block size and memory.",
        deciding=("detail", "seconds_ago")),
    Cause(
        name="engine_restarted",
        symptom="change",
        severity="info",
        title="the engine restarted",
        next_check=(
            "Find why it restarted (deploy, OOM, crash in the engine log); its counters restarted from zero and "
            "its prefix cache is cold."),
        next_action="Find why the engine restarted (deploy, OOM, crash) in its log.",
        deciding=("detail", "seconds_ago")),
    Cause(
        name="prefix_cache_cleared",
        symptom="change",
        severity="info",
        next_check=(
            "The engine reset its prefix cache (vLLM's /reset_prefix_cache, or its own reset after a change of "
            "weights or adapters; the KV-cache events say AllBlocksCleared): every cached block is gone and the "
            "hit ratio refills from 0. Find who reset it; compare hit ratios only from after it."),
        next_action="Find who reset the prefix cache, and compare hit ratios only after it."),
    # --- fleet: across the replicas of one model.
    Cause(
        name="imbalance",
        symptom="fleet",
        severity="warning",
        next_check=(
            "A routing problem, not a capacity one: other replicas of the model have room, so more KV memory is "
            "not the fix. Check the load balancer (sticky sessions, connection reuse, a least-request policy that"
            " counts connections and not queued work, a replica missing from the endpoints)."),
        next_action="Check the load balancer: other replicas of the model have room.",
        alert="VllmFleetReplicaOutlier",
        owner="application"),
    Cause(
        name="lost_prefix_affinity",
        symptom="fleet",
        severity="warning",
        next_check=(
            "Requests that share a prefix no longer reach the replica that holds it: check the gateway's or "
            "router's prefix-aware (consistent hash, session affinity) routing for this replica; its peers show "
            "the reuse the traffic has."),
        next_action="Check the router's prefix-aware routing for this replica.",
        alert="VllmFleetReplicaOutlier",
        owner="application"),
    Cause(
        name="cold_replica",
        symptom="fleet",
        severity="info",
        next_check=(
            "Expected after a restart while it refills; if it does not warm up within minutes, check that the "
            "router sends it its share of prefix-sharing traffic, and why it restarted (deploy, OOM, crash)."),
        next_action=(
            "Wait for it to warm up; if it does not, check that the router sends it its share."),
        alert="VllmFleetReplicaOutlier",
        owner="platform"),
    # --- the KV-cache event stream kvwatch decides hit-rate causes by went quiet or lost
    # messages: its decisions are off or low; the page's signals stand.
    Cause(
        name="events_stopped",
        symptom="kv_events",
        severity="warning",
        title="KV-cache events stopped",
        next_check=(
            "The engine's KV-cache events stopped while it stores blocks (its page counts prompt tokens the prefix "
            "cache did not serve): check that it still runs with --kv-events-config pointing at kvwatch's "
            "--kv-events endpoint, kvwatch_kv_events_publishers (0: its publisher disconnected) and "
            "kvwatch_kv_events_publisher_restarts; the hit-rate causes fall back to the page meanwhile."),
        next_action="Check the engine's --kv-events-config endpoint and that kvwatch listens there.",
        deciding=("blocks_unseen", "last_message_age_seconds", "prompt_tokens_since"),
        alert="KvwatchKvEventStreamUnhealthy",
        owner="platform"),
    Cause(
        name="events_missed",
        symptom="kv_events",
        severity="warning",
        title="KV-cache events lost",
        next_check=(
            "Sequence gaps (kvwatch_kv_events_missed_messages) are messages the engine's publisher dropped past "
            "its hwm or the connection lost; drops (kvwatch_kv_events_dropped_messages) are kvwatch's intake full"
            " under a flood: raise the publisher's hwm, give kvwatch CPU, and read the stream's counts as lower "
            "bounds meanwhile."),
        next_action="Raise the publisher's hwm or give kvwatch more CPU; counts are low meanwhile.",
        deciding=("missed_messages", "dropped_messages"),
        alert="KvwatchKvEventStreamUnhealthy",
        owner="platform"),
    Cause(
        name="events_never_connected",
        symptom="kv_events",
        severity="warning",
        title="KV-cache events never connected",
        next_check=(
            "kvwatch reads KV-cache events (--kv-events) but no publisher ever reached it: start the engine with "
            "--kv-events-config (enable_kv_cache_events, publisher zmq) on the same endpoint; kvwatch binds a "
            "loopback endpoint and the engine connects, and with a publisher that binds tcp://*:N kvwatch needs "
            "--kv-events-connect and the engine's address. A router reading the same stream is blind as well."),
        next_action="Point the engine's --kv-events-config at kvwatch's --kv-events endpoint.",
        deciding=("configured_seconds", "connections", "detail"),
        alert="KvwatchKvEventStreamUnhealthy",
        owner="platform"),
    # --- causes only an alert names. A forecast from the usage trend: nothing hurts yet; it warns
    # while there is time to act (shed or route load, add a replica) before preemption starts.
    Cause(
        name="usage_rising",
        symptom="exhaustion",
        severity="warning",
        next_check=(
            "On the exhaustion dashboard, see what rises (running requests or their length); shed or route load to "
            "other replicas, or add one now, before vLLM starts preempting."),
        alert="VllmKvCacheExhaustionSoon",
        owner="platform",
        diagnosed=False),
    # kvwatch itself not scraped: the other alerts are blind, but serving may be fine.
    Cause(
        name="kvwatch_unreachable",
        symptom=None,
        severity="warning",
        next_check="Check the kvwatch container (its log, /healthz), the pod, and the scrape configuration.",
        alert="KvwatchDown",
        no_data=("OK", (
            "No `up` series means no target at all: the kvwatch_absent rule reports that with its own labels; "
            "NoData here would page twice for one fault.")),
        owner="platform",
        diagnosed=False),
    # No kvwatch target at all where there were some: the monitor selects nothing, or the pods
    # went away; blind, serving may be fine.
    Cause(
        name="kvwatch_absent",
        symptom=None,
        severity="warning",
        next_check=(
            "Check `kubectl get pods,servicemonitors,podmonitors -n <namespace>`, Prometheus' Targets page for the "
            "job, and whether the fleet was scaled to zero on purpose (then silence this alert)."),
        alert="KvwatchDown",
        no_data=("OK", (
            "The query is absent(): it returns a series exactly when targets are missing, so no data means "
            "targets exist. A Prometheus that cannot be queried is an error (execErrState), not no data.")),
        owner="platform",
        diagnosed=False),
    # Central mode answers, but cannot read its store: every replica's series it exports are
    # stale; blind, serving may be fine.
    Cause(
        name="store_unreachable",
        symptom=None,
        severity="warning",
        next_check=("Open central mode's status page (the store, its last good refresh and why the latest "
                    "failed), then the store's address, token and CA bundle, and the store's own health."),
        alert="KvwatchDown",
        no_data=("OK", (
            "No kvwatch_central_store_up series means Prometheus does not scrape central mode, which the "
            "kvwatch_unreachable and kvwatch_absent rules report.")),
        owner="platform",
        diagnosed=False),
    # The engine's own /metrics does not answer on the pod's loopback: the engine is down or
    # wedged, or stats logging is off.
    Cause(
        name="engine_unreachable",
        symptom=None,
        severity="critical",
        next_check="Check kvwatch's status page and /readyz, then the engine's log.",
        alert="KvwatchEngineUnreachable",
        no_data=("OK", (
            "No kvwatch_up series means Prometheus does not scrape kvwatch, which KvwatchDown reports.")),
        owner="platform",
        diagnosed=False),
    # vLLM serves its /metrics without engine series (--disable-log-stats): requests may be served
    # fine; kvwatch and every vLLM alert are blind.
    Cause(
        name="stats_disabled",
        symptom=None,
        severity="warning",
        next_check=(
            "Remove --disable-log-stats from the engine's arguments, or point kvwatch's target at the engine."),
        alert="VllmEngineStatsDisabled",
        no_data=("OK", (
            "No kvwatch_stats_disabled series means Prometheus does not scrape kvwatch, which KvwatchDown "
            "reports.")),
        owner="platform",
        diagnosed=False),
    # --- routing: the router's prediction against the engines' delivery (kvwatch/routing/attribution.py).
    Cause(
        name="routing_miss",
        symptom="routing",
        severity="warning",
        title="the router routes to prefixes the replicas no longer hold",
        next_check=(
            "The router predicted prefix reuse the engines did not deliver: its index of which replica holds what "
            "is stale. Check that it is fed the engines' KV-cache events (a precise index) or that its approximate "
            "index forgets as fast as the replicas evict; compare its predicted tokens with the engines' "
            "prefix-cache hits per replica."),
        next_action="Give the router the engines' KV-cache events, or shorten its index's memory.",
        deciding=("predicted_tokens", "delivered_tokens", "delivered_fraction"),
        alert="VllmRouterPrefixRouting",
        routed_by_finding=True,
        owner="application"),
    Cause(
        name="stale_router_metrics",
        symptom="routing",
        severity="warning",
        title="the router decides on stale metrics",
        next_check=(
            "The router's view of the replicas is older than its staleness bound: poll the replicas more often "
            "than the bound (or raise the bound), check the endpoints it cannot read (path, port, TLS, "
            "authentication), and that its KV index receives events from every replica."),
        next_action="Make the router poll its replicas more often than its staleness bound.",
        deciding=("stale_endpoints", "stale_share", "events_applied"),
        alert="VllmRouterPrefixRouting",
        routed_by_finding=True,
        owner="application"),
)

SYMPTOMS: dict[str, Symptom] = {s.name: s for s in SYMPTOM_LIST}
ALERTS: dict[str, Alert] = {a.name: a for a in ALERT_LIST}
CAUSE: dict[str, Cause] = {c.name: c for c in CAUSE_LIST}
DIAGNOSED: tuple[Cause, ...] = tuple(c for c in CAUSE_LIST if c.diagnosed)


class CatalogueError(ValueError):
    """An inconsistent cause catalogue: kvwatch does not import (a real error, not an assert)."""


def _require(holds: object, problem: str) -> None:
    if not holds:
        raise CatalogueError(problem)


def _check() -> None:
    """The catalogue is consistent, or kvwatch does not import."""
    _require(len(CAUSE) == len(CAUSE_LIST) and len(ALERTS) == len(ALERT_LIST), "a name is declared twice")
    for c in CAUSE_LIST:
        _require(c.severity in SEVERITIES and c.preempting_severity in (None, *SEVERITIES),
                 f"{c.name}: a severity is not one of {SEVERITIES}")
        _require(c.owner in (None, *OWNERS), f"{c.name}: owner {c.owner!r} is not one of {OWNERS}")
        _require(c.alert is None or c.alert in ALERTS, f"{c.name}: no alert {c.alert!r} in ALERT_LIST")
        _require(c.alert is None or ALERTS[c.alert].symptom == c.symptom, f"{c.name}: its alert reports another symptom")
        _require(not c.routed_by_finding or (c.alert and c.diagnosed), f"{c.name}: only a finding can route by finding")
        if c.diagnosed:
            _require(c.symptom in SYMPTOMS and c.next_check and c.next_action,
                     f"{c.name}: a diagnosed cause needs a known symptom, next_check and next_action")
        else:
            _require(c.alert is not None, f"{c.name}: a cause no finding names exists only for its alert")
    for symptom in SYMPTOM_LIST:
        diagnosed = sorted(c.name for c in DIAGNOSED if c.symptom == symptom.name)
        _require(sorted(symptom.ranking) == (diagnosed if symptom.arbitrated else []),
                 f"{symptom.name}: its ranking lists each of its diagnosed causes once, where it is arbitrated")
        _require(symptom.alert is None or ALERTS[symptom.alert].symptom == symptom.name,
                 f"{symptom.name}: its alert reports another symptom")
    _require(sorted(FELT_ORDER) == sorted(SYMPTOMS), "FELT_ORDER names every symptom once")


_check()

# Views for readers that look causes up by name (each derived, none typed twice).
# symptom -> its diagnosed causes, in the order the rules consider them.
CAUSES: dict[str, tuple[str, ...]] = {s.name: tuple(c.name for c in DIAGNOSED if c.symptom == s.name)
                                      for s in SYMPTOM_LIST}
SEVERITY: dict[str, str] = {c.name: c.severity for c in DIAGNOSED}
PREEMPTING_SEVERITY: dict[str, str] = {c.name: c.preempting_severity for c in DIAGNOSED if c.preempting_severity}
NEXT_CHECK: dict[str, str] = {c.name: c.next_check for c in DIAGNOSED}
NEXT_ACTION: dict[str, str] = {c.name: c.next_action for c in DIAGNOSED}
# alert -> the causes its generated rules name (a `cause` label and a runbook section each).
ALERT_CAUSES: dict[str, tuple[str, ...]] = {a.name: tuple(c.name for c in CAUSE_LIST if c.alert == a.name)
                                            for a in ALERT_LIST}
SYMPTOM_ALERTS: dict[str, str] = {s.name: s.alert for s in SYMPTOM_LIST if s.alert}


def severity_of(cause: str, preempting: bool = False) -> str:
    """The severity of a cause, from its record."""
    record = CAUSE[cause]
    if preempting and record.preempting_severity:
        return record.preempting_severity
    return record.severity


def owned_by(owner: str) -> tuple[str, ...]:
    """The causes whose fix lies with `owner` (OWNERS), for the alert routes."""
    return tuple(c.name for c in CAUSE_LIST if c.owner == owner)
