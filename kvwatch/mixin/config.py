"""The mixin's one configuration object: selectors, windows, thresholds,
`for:` durations, severities, link patterns and Grafana settings. Every query
in the generated dashboards, recording rules and alerts is built from it.

Defaults that mean the same thing as a diagnosis threshold come from
`kvwatch.diagnose.DEFAULT_THRESHOLDS`, so the alerts and the in-process
findings judge with the same numbers unless someone changes one on purpose.

`load_config(path)` reads a YAML mapping of field -> value on top of the
defaults and reports every problem in the file at once. Each field's help
text says when to change it; `kvwatch generate --print-config` prints them all.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from kvwatch import __version__
from kvwatch.diagnose.causes import ALERT_CAUSES, ALERT_LIST, CAUSE_LIST, SEVERITIES  # noqa: F401
from kvwatch.diagnose.thresholds import DEFAULT_THRESHOLDS
from kvwatch.history.query import check_selector as store_selector_problem
from kvwatch.history.shard import MAX_SHARDS
from kvwatch.kvevents.ledger import DEFAULT_TABLE_BYTES
from kvwatch.kvevents.source import INTAKE_HELD_BYTES
from kvwatch.mixin import config_kinds as k
from kvwatch.mixin.config_kinds import described
from kvwatch.mixin.objectives import DEFAULT_BURN_RATE_WINDOWS
from kvwatch.mixin.paging import ALERTS, DEFAULT_FOR, DEFAULT_SEVERITIES, PREEMPTING_SUFFIX  # noqa: F401 (re-exported)
from kvwatch.settings import PARSERS
from kvwatch.units import (did_you_mean, is_prometheus_duration, parse_prometheus_duration, prometheus_duration,
                           yaml_problem)



# The runbooks an alert links by default: alerts/runbooks.md as published with
# this version's documentation, reachable from an on-call laptop (a pod's address is not).
PUBLISHED_RUNBOOKS_URL = f"https://github.com/kvwatch/kvwatch/blob/v{__version__}/alerts/runbooks.md"
DASHBOARD_PATH_PATTERN = "/d/{uid}?var-model={model_name}&var-engine={engine}&viewPanel={panel_id}"


# ---------------------------------------------------------------- deploy
# The manifests' settings: the `deploy:` mapping of this one config.

# The sidecar's memory limit: the worst measured page shape plus a quarter (history: docs/reliability.md).
WORST_PAGE_PEAK_MIB = 450
WORST_PAGE_PEAK_WITH_KV_EVENTS_MIB = 624
EVERYDAY_PEAK_MIB = 80
KVWATCH_MEMORY_LIMIT_MIB = -(-max(WORST_PAGE_PEAK_MIB * 5 // 4, 2 * EVERYDAY_PEAK_MIB) // 32) * 32
KVWATCH_RESOURCES = {"requests": {"cpu": "20m", "memory": "96Mi"},
                     "limits": {"memory": f"{KVWATCH_MEMORY_LIMIT_MIB}Mi"}}

# The sidecar's only probe. A pod is Ready only when all its containers are,
# so kvwatch has no readiness probe: a hung or starved kvwatch must never take
# the vLLM pod out of its Service. Liveness restarts kvwatch alone, and only
# after /healthz went unanswered for failures x period (5 minutes): long enough
# for a starved node (20m of CPU) to import Python and for a GC pause or a
# worst-case page (8 MiB) to pass; no startup probe, because a native
# sidecar's startup probe holds back the containers after it (vLLM).
SIDECAR_LIVENESS = {"periodSeconds": 30, "timeoutSeconds": 5, "failureThreshold": 10}


def kv_events_resources(resources: dict) -> dict:
    """The sidecar's resources with the KV-event stream on (kv_events): the
    request grows by the block ledger's table (kv_events_table_bytes, which it
    fills on a busy engine), the limit by the stream's part plus a quarter,
    rounded up to 32 MiB: the larger of everything the stream may hold at
    once (the table, kvwatch's intake queue, ZMQ's receive queue and the
    message being read at their byte bounds, in kvwatch/kvevents) and what
    the worst-page probe measured it to add (the rich run with and without
    the stream)."""
    mib = 1024 * 1024
    table = DEFAULT_TABLE_BYTES // mib
    held = max((DEFAULT_TABLE_BYTES + INTAKE_HELD_BYTES) / mib,
               WORST_PAGE_PEAK_WITH_KV_EVENTS_MIB - WORST_PAGE_PEAK_MIB)
    out = json.loads(json.dumps(resources))

    def add(section: str, extra: int) -> None:
        value = str(out[section]["memory"])
        if not value.endswith("Mi"):
            raise ValueError(f"resources: memory {value!r} is not in Mi; give kv_events resources yourself")
        out[section]["memory"] = f"{int(value[:-2]) + extra}Mi"

    add("requests", table)
    add("limits", _round_up(held * 5 / 4, 32))
    return out

# Central mode's Deployment (`kvwatch serve --prometheus`): its memory grows
# with the replicas it keeps (one window each), its CPU with the replicas it
# reads per refresh. Measured with 64 replicas at the default 30 s refresh:
# ~390 MiB resident and ~1.3 s of CPU per refresh (~43 millicores on average).
# The request scales that linearly to the replicas the Deployment keeps
# (--max-replicas), which overstates large fleets a little (the fixed part of
# the process is counted per replica too); the memory limit is the request
# plus a quarter, rounded up to 32 MiB, and --max-replicas keeps kvwatch
# under it whatever the fleet's size (the replicas beyond are counted as
# dropped, never loaded). No CPU limit, as for the sidecar: a throttled
# refresh only arrives later.
CENTRAL_MEASURED_REPLICAS = 64
CENTRAL_MEASURED_RESIDENT_MIB = 390
CENTRAL_MEASURED_CPU_SECONDS_PER_REFRESH = 1.3
CENTRAL_REFRESH_SECONDS = 30
CENTRAL_MAX_REPLICAS = 128


def _round_up(value: float, step: int) -> int:
    return int(-(-value // step) * step)


def central_resources(max_replicas: int = CENTRAL_MAX_REPLICAS) -> dict:
    scale = max_replicas / CENTRAL_MEASURED_REPLICAS
    memory_request = _round_up(CENTRAL_MEASURED_RESIDENT_MIB * scale, 32)
    memory_limit = _round_up(memory_request * 5 / 4, 32)
    cpu = _round_up(1000 * CENTRAL_MEASURED_CPU_SECONDS_PER_REFRESH * scale / CENTRAL_REFRESH_SECONDS * 5 / 4, 10)
    return {"requests": {"cpu": f"{cpu}m", "memory": f"{memory_request}Mi"},
            "limits": {"memory": f"{memory_limit}Mi"}}


@dataclass(frozen=True)
class DeploySettings:
    """What the manifests are built from; see DEPLOY_FIELDS for each field's meaning."""

    namespace: str = "vllm"
    name: str = "vllm"
    replicas: int = 1
    # Empty: no registry serves kvwatch under a default name (image_source.IMAGE_FILE says what then).
    image: str = ""
    image_pull_policy: str = "IfNotPresent"
    vllm_image: str = "vllm/vllm-openai:v0.32.0"
    vllm_model: str = "Qwen/Qwen2.5-0.5B-Instruct"
    vllm_args: tuple[str, ...] = ()
    vllm_port: int = 8000
    vllm_resources: dict = field(default_factory=lambda: {
        "requests": {"cpu": "4", "memory": "16Gi", "nvidia.com/gpu": "1"},
        "limits": {"memory": "16Gi", "nvidia.com/gpu": "1"},
    })
    kvwatch_port: int = 9400
    port_name: str = "kvwatch-metrics"
    poll_interval: str = "5s"
    window: str = "5m"
    log_level: str = "info"
    load_grace: str = "30m"
    scrape_interval: str = "15s"
    scrape_timeout: str = "10s"
    job: str = "kvwatch"
    resources: dict = field(default_factory=lambda: json.loads(json.dumps(KVWATCH_RESOURCES)))
    labels: dict = field(default_factory=lambda: {"app.kubernetes.io/name": "vllm", "app.kubernetes.io/instance": "vllm"})
    monitor_labels: dict = field(default_factory=lambda: {"release": "kube-prometheus-stack"})
    grafana_folder: str = "kvwatch"
    run_as_user: int = 10001
    prometheus_url: str = "http://prometheus-operated.monitoring.svc:9090"
    central_selector: str | None = None
    central_max_replicas: int = CENTRAL_MAX_REPLICAS
    central_shards: int = 4
    central_resources: dict | None = None
    sidecar_native: bool = True
    kv_events_port: int | None = None

    @property
    def config_map_name(self) -> str:
        return "kvwatch-config"

    @property
    def central_name(self) -> str:
        return "kvwatch-central"

    @property
    def store_selector(self) -> str:
        """Central mode's --selector: the configured one, else the vLLM namespace's series."""
        return self.central_selector if self.central_selector is not None else f'{{namespace="{self.namespace}"}}'

    @property
    def central_container_resources(self) -> dict:
        return self.central_resources if self.central_resources is not None \
            else central_resources(self.central_max_replicas)

    @property
    def sidecar_resources(self) -> dict:
        """The kvwatch container's resources: `resources`, grown for the KV-event stream when it is on."""
        return kv_events_resources(self.resources) if self.kv_events_port is not None else self.resources

    @property
    def all_vllm_args(self) -> list[str]:
        # vLLM's image runs `vllm serve`; the model is its positional argument.
        return list(self.vllm_args) or [self.vllm_model, "--host", "0.0.0.0", "--port", str(self.vllm_port)]


# field -> when to change it (also the documentation of the config contract).
DEPLOY_FIELDS = {
    "namespace": "namespace the base's kustomization puts everything in",
    "name": "name of the example vLLM Deployment and its Service; the sidecar Components patch the Deployment "
            "of this name (the one place it is set), and the build fails when there is none",
    "replicas": "vLLM pods in the example Deployment; each carries its own kvwatch",
    "image": "kvwatch image as pushed to your registry; empty (the default): each kustomization that runs kvwatch "
             "reads it from `kvwatch-image.env` beside it, and fails to build without that file",
    "image_pull_policy": "pull policy of the kvwatch container",
    "vllm_image": "vLLM image of the example Deployment",
    "vllm_model": "model the example Deployment serves",
    "vllm_args": "full argument list for `vllm serve` (replaces model/host/port when given)",
    "vllm_port": "port vLLM serves on inside the pod; kvwatch polls http://127.0.0.1:<vllm_port>/metrics",
    "vllm_resources": "resources of the vLLM container",
    "kvwatch_port": "port kvwatch listens on (container port, Service port)",
    "port_name": "name of kvwatch's container and Service port (at most 15 characters); monitors select it",
    "poll_interval": "kvwatch's poll interval (config file key poll_interval)",
    "window": "kvwatch's signal window (config file key window); keep it equal to the rules' rate() range",
    "log_level": "kvwatch's log level",
    "load_grace": "kvwatch's load_grace: how long after kvwatch starts an engine that has not answered yet is "
                  "loading, not down (KvwatchEngineUnreachable waits); cover the slowest model load",
    "scrape_interval": "how often Prometheus scrapes kvwatch (ServiceMonitor/PodMonitor interval)",
    "scrape_timeout": "scrape deadline; below scrape_interval",
    "job": "the job label Prometheus gives kvwatch's series (the rules and dashboards select it)",
    "resources": "kvwatch container resources (default sized from the benchmark)",
    "labels": "labels on the example vLLM pods and Service; the Deployment and Service select pods by them, the "
              "ServiceMonitor the Service (the PodMonitor selects the label kvwatch/sidecar=true every sidecar's "
              "pod gets)",
    "monitor_labels": "labels your Prometheus selects ServiceMonitors, PodMonitors and PrometheusRules by "
                      "(kube-prometheus-stack: release=<helm release>)",
    "grafana_folder": "Grafana folder for the dashboards (grafana_folder annotation of the Grafana sidecar)",
    "run_as_user": "numeric uid kvwatch runs as; matches the image's USER",
    "prometheus_url": "central mode: the Prometheus-compatible store (its query API) the central Deployment reads",
    "central_selector": "central mode: --selector of the replicas' series in the store "
                        "(default: {namespace=\"<namespace>\"}; empty: every vLLM series the store holds)",
    "central_max_replicas": "central mode: --max-replicas, the most replicas kept (the rest are counted as dropped); "
                            "the default resources are sized for it",
    "central_shards": "sharded central mode (kubernetes/central-sharded/): StatefulSet pods, each serving the "
                      "replicas a stable hash gives it (--shard ordinal/N); changing it moves only the replicas "
                      "it must",
    "central_resources": "central Deployment's resources (default: scaled from the measured figure to "
                         "central_max_replicas)",
    "sidecar_native": "the example Deployment runs kvwatch as a native sidecar (an init container with "
                      "restartPolicy: Always, Kubernetes 1.29+); false: a plain second container",
    "kv_events_port": "port on the pod's loopback where kvwatch binds for vLLM's KV-cache events (kv_events); "
                      "vLLM's --kv-events-config endpoint tcp://127.0.0.1:<port> connects to it. Empty: off",
}
if set(DEPLOY_FIELDS) != {f.name for f in fields(DeploySettings)}:
    raise TypeError("DEPLOY_FIELDS and DeploySettings name different fields: each field is documented once")


def _get(source: Any, name: str) -> Any:
    return source.get(name) if isinstance(source, dict) else getattr(source, name, None)


def deploy_settings(config: Any = None) -> DeploySettings:
    """Read DeploySettings fields from `config.deploy`, or `config`, or a dict; absent fields keep defaults.
    kvwatch's window follows the mixin's `rate_window` unless `window` is given, so the
    sidecar's findings and the alerts look at the same span."""
    source = config
    values: dict[str, Any] = {}
    if source is not None:
        nested = _get(source, "deploy")
        if nested is not None:
            rate_window = _get(source, "rate_window")
            if isinstance(rate_window, str):
                values["window"] = rate_window
            source = nested
    for f in fields(DeploySettings):
        if source is None:
            break
        value = _get(source, f.name)
        if value is None:
            continue
        if f.name == "vllm_args":
            value = tuple(str(v) for v in value)
        elif isinstance(value, dict):
            value = json.loads(json.dumps(value))
        values[f.name] = value
    settings = DeploySettings(**values)
    _check(settings)
    return settings


def _check(s: DeploySettings) -> None:
    problems = []
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", s.port_name) or len(s.port_name) > 15 \
            or not re.search("[a-z]", s.port_name):
        problems.append(f"port_name {s.port_name!r} is not a valid port name (lowercase, digits, '-', at most 15)")
    for key in ("kvwatch_port", "vllm_port"):
        if not 1 <= int(getattr(s, key)) <= 65535:
            problems.append(f"{key} {getattr(s, key)!r} is not a port")
    if s.kvwatch_port == s.vllm_port:
        problems.append("kvwatch_port and vllm_port share the pod's network namespace and must differ")
    if not s.labels:
        problems.append("labels must not be empty: the Service and monitors select pods by them")
    # These land in kvwatch.yaml: check them the way `kvwatch serve` will.
    for key in ("poll_interval", "window", "log_level", "load_grace"):
        try:
            PARSERS[key](getattr(s, key))
        except (ValueError, TypeError) as exc:
            problems.append(f"{key}: {exc}")
    for key in ("scrape_interval", "scrape_timeout"):
        if not is_prometheus_duration(str(getattr(s, key)), units="ms|s|m|h"):
            problems.append(f"{key}: {getattr(s, key)!r} is not a Prometheus duration (e.g. 15s)")
    selector_problem = store_selector_problem(s.store_selector)
    if selector_problem:
        problems.append(f"central_selector: {selector_problem}")
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", str(s.prometheus_url)):
        problems.append(f"prometheus_url: {s.prometheus_url!r} is not an http(s) URL")
    if s.kv_events_port is not None and (not isinstance(s.kv_events_port, int) or not 1 <= s.kv_events_port <= 65535
                                         or s.kv_events_port in (s.kvwatch_port, s.vllm_port)):
        problems.append(f"kv_events_port: {s.kv_events_port!r} is not a port apart from kvwatch's and vLLM's")
    if not isinstance(s.sidecar_native, bool):
        problems.append(f"sidecar_native: {s.sidecar_native!r} must be true or false")
    if not isinstance(s.central_max_replicas, int) or s.central_max_replicas < 1:
        problems.append(f"central_max_replicas: {s.central_max_replicas!r} is not a positive whole number")
    if not isinstance(s.central_shards, int) or isinstance(s.central_shards, bool) \
            or not 1 <= s.central_shards <= MAX_SHARDS:
        problems.append(f"central_shards: {s.central_shards!r} is not a whole number from 1 to {MAX_SHARDS}")
    if problems:
        raise ValueError("deploy settings: " + "; ".join(problems))


def _deploy_problems(name: str, value: Any) -> list[str]:
    if not isinstance(value, dict):
        return ["deploy: must be a mapping"]
    unknown = sorted(set(value) - set(DEPLOY_FIELDS))
    problems = [f"deploy: unknown field {key!r}{did_you_mean(key, DEPLOY_FIELDS)} "
                f"(known: {', '.join(sorted(DEPLOY_FIELDS))})" for key in unknown]
    if not unknown:
        try:
            deploy_settings({"deploy": value})
        except (ValueError, TypeError) as exc:
            problems.append(f"deploy: {exc}")
    return problems


DEPLOY = k.Kind(_deploy_problems)


@dataclass(frozen=True)
class MixinConfig:
    # ---------------------------------------------------------------- selection
    selector: str | None = field(default=None, metadata=described(k.OPTIONAL_SELECTOR,
        "PromQL label matchers (without braces) selecting kvwatch's series, e.g. job=\"kvwatch\". Default: "
        "job=\"<deploy.job>\". Change it when your scrape config names kvwatch's job differently, or to "
        "restrict the rules to some namespaces (namespace=~\"llm-.*\")."))
    mode: str = field(default="sidecar", metadata=described(k.MODE,
        "Whose series the rules read. sidecar: each kvwatch scraped as its own target (job=\"<deploy.job>\"; "
        "KvwatchDown reads their `up`). central: central mode's exports, which carry each replica's own labels "
        "from the store (its job, namespace, pod): the selector defaults to the matchers of "
        "deploy.central_selector, and KvwatchDown reads central mode's own health (its targets' `up`, "
        "kvwatch_central_store_up). Unsharded and sharded central mode read the same."))
    group_labels: tuple[str, ...] = field(default=("namespace", "job"), metadata=described(k.LABELS,
        "Target labels every aggregation keeps, so two deployments never mix. Add cluster (or region) when one "
        "Prometheus or Thanos sees several; labels a series lacks are simply empty."))
    instance_label: str = field(default="instance", metadata=described(k.LABEL,
        "The label that tells one kvwatch (one vLLM pod) from another; alerts and dashboard legends name "
        "replicas by it. instance (an address) always exists; on Kubernetes use pod, which the generated scrape "
        "config, PodMonitor and ServiceMonitor all attach, for pod names."))
    # ---------------------------------------------------------------- windows
    rate_window: str = field(default="5m", metadata=described(k.DURATION,
        "Range of rate() and *_over_time() in rules and alerts. At least 4x the scrape interval; keep it equal "
        "to kvwatch's own `window` so alerts and findings look at the same span."))
    rule_interval: str | None = field(default=None, metadata=described(k.OPTIONAL_DURATION,
        "Evaluation interval of the generated rule groups; empty uses Prometheus' global evaluation_interval. "
        "Set it when the global one is longer than the rate window allows."))
    finding_hold: str = field(default=prometheus_duration(DEFAULT_THRESHOLDS.finding_hold_seconds), metadata=described(k.DURATION,
        "`keep_firing_for` of the alerts that report a diagnosis symptom (exhaustion, hit rate, first token, "
        "fleet): a firing alert resolves only after its condition has been clear this long, so one evaluation "
        "that misses it neither resolves and re-fires it nor drops it. kvwatch's own findings (kvwatch_finding, "
        "the page, the API) hold the same span (diagnosis: finding_hold_seconds): keep the two equal. 0s: no "
        "hold. Needs Prometheus 2.42 or later."))
    cold_cache_window: str = field(default="30m", metadata=described(k.DURATION,
        "How long after an engine restart (its counters reset, or its cache configuration changed against the "
        "one it had a window earlier) a low hit ratio is blamed on a cold cache. Only evidence of a restart "
        "counts: a Prometheus with less history than this sees none. Longer than the hit-rate alert's `for:` "
        "(else a cold cache is never reported); raise it for workloads whose prefixes repeat only every "
        "several minutes."))
    hit_ratio_baseline_window: str = field(default="1h", metadata=described(k.DURATION,
        "Span before the rate window whose hit ratio is the baseline: a low ratio after a healthy baseline is a "
        "changed prefix (or, with usage high and the cache not exhausted, eviction before reuse), after a low "
        "one it is no reuse. Also the span searched for a drop that showed before an exhaustion. Shorten it for "
        "workloads that change by the minute."))
    kvwatch_absent_window: str = field(default="1h", metadata=described(k.DURATION,
        "KvwatchDown (cause kvwatch_absent) fires for a group (group_labels) that had kvwatch targets within "
        "this span and has none now; absent() covers a selector that matches nothing at all. Lengthen it to "
        "remember a vanished fleet longer; a fleet scaled to zero on purpose alerts until it passes."))
    hit_ratio_memory: str = field(default="7d", metadata=described(k.DURATION,
        "How long the rules remember an engine's last healthy hit ratio (recording rules "
        "*:kvwatch_prefix_cache_hit_ratio:last_healthy*): a ratio that fell from it stays a changed prefix "
        "(not no reuse) until reuse comes back, someone silences the alert, or this span passes since the "
        "ratio was last healthy. Beyond hit_ratio_baseline_window, which only looks one span back."))
    # ---------------------------------------------------------------- thresholds
    exhaustion_usage_ratio: float = field(default=DEFAULT_THRESHOLDS.exhaustion_usage_ratio, metadata=described(k.RATIO,
        "KV usage (0..1) above which the cache counts as full when requests also wait or are preempted. vLLM "
        "counts evictable prefix blocks as free, and a truly full cache reads 0.97-0.99; lower it only for "
        "engines whose usage gauge stops short of that."))
    long_request_capacity_share: float = field(
        default=DEFAULT_THRESHOLDS.long_request_capacity_share, metadata=described(k.RATIO,
            "A full cache is blamed on long requests when each running request holds at least this share of "
            "it (mean usage / mean running) and no more requests wait than run, and on concurrency otherwise "
            "(kvwatch's diagnosis uses the same definition). 0.2 means five or fewer requests fill the cache; "
            "raise it for long-context deployments where that is normal."))
    exhaustion_eta_minutes: float = field(default=15, metadata=described(k.POSITIVE,
        "VllmKvCacheExhaustionSoon fires when KV usage, at its 5-minute trend (the "
        "kvwatch_kv_cache_exhaustion_eta_seconds signal), reaches 1 within this many minutes, before any "
        "request is preempted. Longer than the alert's `for:`, or it could only fire after the forecast "
        "time; raise it when adding capacity takes longer (a replica that loads for ten minutes)."))
    hit_ratio_low: float = field(default=DEFAULT_THRESHOLDS.hit_ratio_low, metadata=described(k.RATIO,
        "Prefix-cache hit ratio (hit tokens / queried tokens) below which the hit rate is low. Raise it for "
        "workloads built on a long shared system prompt, where 0.5+ is normal."))
    min_query_tokens: float = field(default=DEFAULT_THRESHOLDS.min_query_tokens, metadata=described(k.POSITIVE,
        "Fewer prompt tokens queried in the rate window than this and the hit ratio is not judged (a handful "
        "of requests). Scale it with your traffic."))
    eviction_usage_ratio: float = field(default=DEFAULT_THRESHOLDS.eviction_usage_ratio, metadata=described(k.RATIO,
        "Mean KV usage above which a hit ratio that fell from a healthy baseline is blamed on idle cached "
        "prefixes evicted before reuse (running requests crowd them out), when the cache is not exhausted. "
        "While it is exhausted the full cache explains a low ratio by itself and this cause is not named."))
    ttft_mean_seconds: float = field(default=DEFAULT_THRESHOLDS.ttft_mean_seconds, metadata=described(k.POSITIVE,
        "Mean time to first token (engine, plus the upstream stage when configured) above which the first "
        "token is slow. Means, not quantiles, because the parts (queue, prefill, front end, upstream) add "
        "up only as means. Set it from your latency objective."))
    ttft_p95_seconds: float = field(default=DEFAULT_THRESHOLDS.ttft_p95_seconds, metadata=described(k.POSITIVE,
        "p95 time to first token above which the overview's TTFT stat turns red: the diagnosis' objective of the "
        "same name (diagnosis: ttft_p95_seconds), so keep the two equal. No alert reads it; the alert compares "
        "means (ttft_mean_seconds)."))
    fleet_room_usage_ratio: float = field(default=DEFAULT_THRESHOLDS.fleet_room_usage_ratio, metadata=described(k.RATIO,
        "A replica whose KV usage peak over the rate window is at most this, with nothing waiting, has room: "
        "another replica of the same model exhausted or queueing beside it is a routing problem "
        "(VllmFleetReplicaOutlier, cause imbalance)."))
    fleet_affinity_fraction: float = field(default=DEFAULT_THRESHOLDS.fleet_affinity_fraction, metadata=described(k.RATIO,
        "A warm replica whose hit ratio is below this share of its warm peers' pooled ratio (peers at least "
        "hit_ratio_low) lost prefix affinity: requests sharing a prefix no longer reach it "
        "(VllmFleetReplicaOutlier, cause lost_prefix_affinity)."))
    # ---------------------------------------------------------------- objectives (what pages)
    ttft_objective_seconds: float = field(default=2.5, metadata=described(k.POSITIVE,
        "The first-token objective's threshold: a request is on time when its first token came within this "
        "many seconds. It must be a bound of vLLM's TTFT histogram (0.5, 0.75, 1, 2.5, 5, 7.5, 10 ...), since "
        "the share on time is read from that bucket; 2.5 is the bound at or above the diagnosis' p95 target "
        "(ttft_p95_seconds, 2 s)."))
    ttft_objective: float = field(default=0.99, metadata=described(k.OBJECTIVE,
        "Share of requests whose first token must come within ttft_objective_seconds (0.99: one request in a "
        "hundred may be late). Its burn-rate alerts (VllmTimeToFirstTokenBudgetBurn) page."))
    availability_objective: float = field(default=0.999, metadata=described(k.OBJECTIVE,
        "Share of finished requests that must not end in error (vllm:request_success_total "
        "finished_reason=\"error\"). Its burn-rate alerts (VllmRequestErrorBudgetBurn) page."))
    abort_objective: float = field(default=0.99, metadata=described(k.OBJECTIVE,
        "Share of finished requests that should not end in abort. Clients abort for their own reasons (a closed "
        "tab, a gateway timeout), so its burn-rate alerts (VllmRequestAbortBudgetBurn) are warnings at most."))
    objective_min_requests: int = field(default=100, metadata=described(k.POSITIVE_INTEGER,
        "A model (over all its replicas) pages on an objective only when it served at least this many requests "
        "in the pair's long window. 100: below it one request is a percent or more of the ratio, so two slow "
        "first tokens of a handful would read as a 14.4x burn, and one error alone nears the availability "
        "page's 1.44%. Lower it for models that serve a few requests an hour and whose every failure matters."))
    burn_rate_windows: tuple = field(default=DEFAULT_BURN_RATE_WINDOWS, metadata=described(k.BURN_WINDOWS,
        "The multi-window, multi-burn-rate pairs every objective alerts on (SRE workbook): an alert fires when "
        "the error ratio over `long` and over `short` both exceed factor x (1 - objective); `severity` is its "
        "label (critical pages). Defaults: 1h/5m at 14.4x and 6h/30m at 6x page, 1d/2h at 3x is a warning."))
    # ---------------------------------------------------------------- upstream
    upstream_histogram: str | None = field(default=None, metadata=described(k.OPTIONAL_METRIC,
        "Name of a Prometheus histogram that measures time spent before the engine (retrieval, gateway), e.g. "
        "app_retrieval_seconds. Set it to add the `upstream` cause; it must be scraped by the same Prometheus."))
    upstream_selector: str = field(default="", metadata=described(k.SELECTOR_OR_EMPTY,
        "Label matchers (without braces) for the upstream histogram, e.g. job=\"rag-app\"."))
    upstream_join_labels: tuple[str, ...] = field(default=(), metadata=described(k.LABELS,
        "Labels the upstream histogram shares with kvwatch's series (a subset of group_labels), used to pair "
        "each engine with its upstream. Empty pairs every engine with the whole upstream: right when one "
        "upstream feeds all selected engines."))
    no_reuse_alert: bool = field(default=False, metadata=described(k.FLAG,
        "Generate the VllmPrefixCacheHitRateLow alert for cause no_reuse (severity info). Off by default: a "
        "workload without shared prefixes has a low hit ratio forever and nothing to repair, so the alert would "
        "fire forever; kvwatch_finding{cause=\"no_reuse\"} and the prefix-cache dashboard show it anyway. "
        "Turn it on to hear when a workload that should share prefixes does not."))
    # ---------------------------------------------------------------- alerting
    for_durations: dict = field(default_factory=lambda: dict(DEFAULT_FOR), metadata=described(k.FOR_DURATIONS,
        "`for:` of each alert (alert name -> duration). Shorten to page sooner, lengthen against flapping."))
    severities: dict = field(default_factory=lambda: dict(DEFAULT_SEVERITIES), metadata=described(k.SEVERITY_MAP,
        "severity label of each cause (cause -> critical|warning|info). Routing in Alertmanager or Grafana "
        "keys on it. The defaults are the diagnosis' own (each cause's record in kvwatch/diagnose/causes.py), so "
        "the status page, kvwatch_finding and the alert say the same; an exhaustion cause with preemptions in the "
        "rate window is keyed <cause>_preempting (default critical, as the page says it)."))
    runbook_base_url: str = field(default=PUBLISHED_RUNBOOKS_URL, metadata=described(k.BASE_URL,
        "Where the on-call reader opens the runbooks; every alert's runbook_url (and every panel's Runbook link) "
        "is this plus #<section>. Default: alerts/runbooks.md as published with this version's documentation. "
        "Set it to your own copy, e.g. https://kvwatch.example.org/runbooks (kvwatch's own GET /runbooks behind "
        "an ingress) or your Git server's alerts/runbooks.md. A literal host: a pod address or a "
        "{{ $labels.instance }} template is unreachable from a laptop and empty on an alert without it."))
    runbook_url_pattern: str | None = field(default=None, metadata=described(k.OPTIONAL_RUNBOOK_PATTERN,
        "Overrides runbook_base_url with a pattern in which {anchor} becomes the section of the alert and "
        "cause, e.g. https://git.example.org/ops/kvwatch/blob/main/alerts/runbooks.md#{anchor}."))
    dashboard_base_url: str | None = field(default=None, metadata=described(k.OPTIONAL_BASE_URL,
        "Grafana's URL as the on-call reader opens it, e.g. https://grafana.example.org: every Prometheus alert "
        "then carries a dashboard_url to its panel there (<base>/d/<uid>?var-model=...&viewPanel=<id>). Empty (the "
        "default): no dashboard_url, unless dashboard_url_pattern gives the whole link."))
    dashboard_url_pattern: str | None = field(default=None, metadata=described(k.OPTIONAL_DASHBOARD_PATTERN,
        "Link to the dashboard panel an alert belongs to, e.g. https://grafana.example.org/d/{uid}?var-model="
        "{model_name}&var-engine={engine}&viewPanel={panel_id}; {uid} and {panel_id} are filled in, "
        "{model_name} and {engine} become the alert's labels; overrides dashboard_base_url. Empty (the default): "
        "dashboard_base_url decides (Grafana's own rules link their panel by uid either way)."))
    # ---------------------------------------------------------------- Grafana
    grafana_datasource_uid: str = field(default="prometheus", metadata=described(k.SHORT_NAME,
        "uid of the Prometheus data source the Grafana alert rules query (dashboards use a variable instead). "
        "Set it to your data source's uid (Connections > Data sources, in the URL)."))
    grafana_rule_interval: str = field(default="1m", metadata=described(k.DURATION,
        "Evaluation interval of the Grafana rule group (a multiple of 10s)."))
    grafana_org_id: int = field(default=1, metadata=described(k.POSITIVE_INTEGER, "Grafana organisation the rules are provisioned into."))
    dashboard_uid_prefix: str = field(default="kvwatch", metadata=described(k.SHORT_NAME,
        "Prefix of the dashboards' uids (stable across generations). Change it to install two copies side by side."))
    dashboard_tags: tuple[str, ...] = field(default=("kvwatch", "vllm"), metadata=described(k.STRINGS, "Tags on every dashboard."))
    # ---------------------------------------------------------------- Prometheus Operator
    prometheus_rule_name: str = field(default="kvwatch", metadata=described(k.SHORT_NAME, "metadata.name of the PrometheusRule."))
    prometheus_rule_labels: dict = field(default_factory=dict, metadata=described(k.STRING_MAP,
        "Labels on the PrometheusRule; your Prometheus' ruleSelector must match them (kube-prometheus-stack: "
        "release: <helm release>)."))
    # ---------------------------------------------------------------- deploy
    deploy: dict = field(default_factory=dict, metadata=described(DEPLOY,
        "Kubernetes manifest settings, passed to kvwatch/mixin/manifests.py (fields and defaults: "
        "DEPLOY_FIELDS there, docs/deploy.md)."))

    # ---------------------------------------------------------------- derived

    @property
    def kvwatch_selector(self) -> str:
        if self.selector:
            return self.selector
        if self.mode == "central":
            return central_matchers(self.deploy_settings.store_selector)
        return f'job="{self.deploy_settings.job}"'

    @property
    def deploy_settings(self):
        return deploy_settings(self)

    @property
    def engine_labels(self) -> tuple[str, ...]:
        """Labels of one engine across a fleet: its deployment, its kvwatch, model and engine index."""
        return _unique(self.group_labels + (self.instance_label, "model_name", "engine"))

    @property
    def model_labels(self) -> tuple[str, ...]:
        return _unique(self.group_labels + ("model_name",))

    def severity(self, cause: str) -> str:
        return self.severities.get(cause, DEFAULT_SEVERITIES[cause])

    def for_duration(self, alert: str) -> str:
        return self.for_durations.get(alert, DEFAULT_FOR[alert])

    def runbook_link(self, anchor: str) -> str:
        """The runbook section `anchor` where the on-call reader opens it (a literal host, never a label template)."""
        if self.runbook_url_pattern:
            return self.runbook_url_pattern.format(anchor=anchor)
        return f"{self.runbook_base_url.rstrip('/')}#{anchor}"

    @property
    def dashboard_link_pattern(self) -> str | None:
        """The dashboard_url pattern in effect: the explicit one, else Grafana's base with the panel's path."""
        if self.dashboard_url_pattern:
            return self.dashboard_url_pattern
        return self.dashboard_base_url.rstrip("/") + DASHBOARD_PATH_PATTERN if self.dashboard_base_url else None


k.require_kinds(MixinConfig)


def central_config(config: "MixinConfig") -> "MixinConfig":
    """The config's rules for central mode: its exports' selector, central mode's own health."""
    return config if config.mode == "central" else replace(config, mode="central", selector=None)


def central_matchers(store_selector: str) -> str:
    """The matchers (without braces) selecting central mode's exports: its
    --selector's, which every replica's series carries from the store; a
    selector of everything, any job (a matcher list is never empty)."""
    inner = store_selector[store_selector.find("{") + 1:store_selector.rfind("}")] if "{" in store_selector else ""
    return inner.strip().strip(",") or 'job!=""'


def _unique(labels) -> tuple[str, ...]:
    seen: list[str] = []
    for label in labels:
        if label not in seen:
            seen.append(label)
    return tuple(seen)


class MixinConfigError(Exception):
    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid mixin configuration:\n" + "\n".join(f"  - {p}" for p in problems))


# ------------------------------------------------------------------ checking


def _check_field(name: str, value: Any) -> list[str]:
    """The problems of one field's value: its declared kind's (config_kinds.py)."""
    return k.kind_of(MixinConfig, name).problems(name, value)


def validate(config: MixinConfig) -> list[str]:
    """Every problem with a config, including those between fields."""
    problems: list[str] = []
    for f in fields(MixinConfig):
        problems.extend(_check_field(f.name, getattr(config, f.name)))
    if problems:
        return problems
    missing = [label for label in config.upstream_join_labels if label not in config.group_labels]
    if missing:
        problems.append(f"upstream_join_labels: {missing} must also be in group_labels (the rules aggregate by them)")
    if config.upstream_histogram is None and (config.upstream_selector or config.upstream_join_labels):
        problems.append("upstream_selector/upstream_join_labels given without upstream_histogram")
    seconds = parse_prometheus_duration  # every duration was checked above
    if seconds(config.cold_cache_window) < seconds(config.rate_window):
        problems.append("cold_cache_window must be at least rate_window (the rate covers the cold start for that long)")
    if seconds(config.cold_cache_window) <= seconds(config.for_duration("VllmPrefixCacheHitRateLow")):
        problems.append("cold_cache_window must be longer than for_durations.VllmPrefixCacheHitRateLow, or the "
                        "cold_cache cause can never fire")
    if config.exhaustion_eta_minutes * 60 <= seconds(config.for_duration("VllmKvCacheExhaustionSoon")):
        problems.append("exhaustion_eta_minutes must be longer than for_durations.VllmKvCacheExhaustionSoon, or "
                        "the warning could only come after the forecast time")
    if seconds(config.cold_cache_window) <= seconds(config.for_duration("VllmFleetReplicaOutlier")):
        problems.append("cold_cache_window must be longer than for_durations.VllmFleetReplicaOutlier, or the "
                        "cold_replica cause can never fire")
    if config.instance_label in ("model_name", "engine"):
        problems.append("instance_label must not be model_name or engine")
    return problems


def config_from_mapping(data: Any, source: str = "config") -> MixinConfig:
    """Defaults overlaid with `data`; raises MixinConfigError listing every problem."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise MixinConfigError([f"{source}: must be a mapping of field: value"])
    known = {f.name for f in fields(MixinConfig)}
    problems = []
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = str(key).replace("-", "_")
        if name not in known:
            problems.append(f"{source}: unknown field {key!r}{did_you_mean(name, known)} (known: {', '.join(sorted(known))})")
            continue
        field_problems = _check_field(name, value)
        if field_problems:
            problems.extend(f"{source}: {p}" for p in field_problems)
            continue
        values[name] = k.kind_of(MixinConfig, name).convert(value)
    if problems:
        raise MixinConfigError(problems)
    config = replace(MixinConfig(), **values)
    cross = validate(config)
    if cross:
        raise MixinConfigError([f"{source}: {p}" for p in cross])
    return config


def load_config(path: str | Path | None) -> MixinConfig:
    """The defaults, or the defaults overlaid with a YAML file."""
    if path is None:
        return MixinConfig()
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise MixinConfigError([f"{path}: {exc.strerror or exc}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise MixinConfigError([f"{path}: not valid YAML: {yaml_problem(exc)}"]) from None
    return config_from_mapping(data, str(path))


def describe_config(config: MixinConfig | None = None) -> str:
    """The config as commented YAML: every field, its value, when to change it."""
    config = config or MixinConfig()
    lines = ["# kvwatch mixin configuration (kvwatch generate --config FILE).",
             "# Every field is optional; these are the values in effect.", ""]
    for f in fields(MixinConfig):
        help_text = f.metadata.get("help", "")
        for line in _wrap(help_text, 96):
            lines.append(f"# {line}")
        value = getattr(config, f.name)
        if isinstance(value, tuple):
            value = list(value)
        dumped = yaml.safe_dump({f.name: value}, sort_keys=True, default_flow_style=False, width=1 << 16)
        lines.extend(dumped.rstrip("\n").splitlines())
        lines.append("")
    return "\n".join(lines)


def _wrap(text: str, width: int) -> list[str]:
    out, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            out.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    if line:
        out.append(line)
    return out
