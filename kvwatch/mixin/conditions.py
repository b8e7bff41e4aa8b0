"""The cause alerts' logic as recording rules, so each alert reads in a few
lines.

`Recorded` is the alerts' view of the conditions in promql.Fragments: every
value it returns is a recorded series, named `level:metric:operations`:

- the symptom's value is the catalogue signal's PromQL twin, recorded per
  engine in kvwatch-engine.rules (e.g.
  instance_model_name_engine:kvwatch_prefix_cache_hit:ratio_rate5m);
- each condition that tells causes apart (the cache exhausted, a few long
  requests, the queue the largest part of the first token, a healthy baseline
  before ...) is recorded per engine, its expression the Fragments method of
  the same name over kvwatch's series (e.g.
  instance_model_name_engine:kvwatch_kv_cache_exhausted:condition5m).

An alert is then its value filtered by a few of them with `and`/`unless`:

    instance_model_name_engine:kvwatch_kv_cache_usage_ratio:max_over_time5m
    and instance_model_name_engine:kvwatch_kv_cache_exhausted:condition5m
    unless instance_model_name_engine:kvwatch_kv_cache_long_requests:condition5m

A condition's value is irrelevant (the alerts use presence only); a record's
expression is self-contained (kvwatch's series, and the hit-ratio memory).
These records, and the twins the alerts read, sit in the alerts' own group,
before the alerts: a rule reads what an earlier rule of its group wrote in
the same evaluation, but another group's records only as of that group's
previous evaluation (promtool and Prometheus alike), and a lag of one
evaluation would shift every `for:` and `keep_firing_for`. Grafana-managed
rules read no record: rules.expand() puts each expression back in place of
its name.
"""

from __future__ import annotations

from kvwatch.mixin.promql import Fragments, Scope
from kvwatch.signals import SIGNALS_BY_NAME


# Fragments method -> the metric part of its record's name (engine level).
CONDITIONS = {
    "exhausted": "kvwatch_kv_cache_exhausted",
    "preempting": "kvwatch_kv_cache_preempting",
    "long_requests": "kvwatch_kv_cache_long_requests",
    "cache_pressure": "kvwatch_kv_cache_pressure",
    "caching_disabled": "kvwatch_prefix_caching_disabled",
    "prompt_traffic": "kvwatch_prompt_traffic",
    "enough_queries": "kvwatch_prefix_cache_enough_queries",
    "cold": "kvwatch_engine_cold",
    "healthy_baseline": "kvwatch_prefix_cache_healthy_baseline",
    "low_baseline": "kvwatch_prefix_cache_low_baseline",
    "dropped_with_room": "kvwatch_prefix_cache_dropped_with_room",
    "queue_largest": "kvwatch_time_to_first_token_queue_largest",
    "prefill_largest": "kvwatch_time_to_first_token_prefill_largest",
    "front_end_largest": "kvwatch_time_to_first_token_front_end_largest",
    "kv_bound": "kvwatch_time_to_first_token_kv_bound",
    # The fleet's parts, per replica engine.
    "pressed": "kvwatch_fleet_replica_pressed",
    "room": "kvwatch_fleet_replica_with_room",
    "restarted": "kvwatch_fleet_replica_restarted",
    "warm": "kvwatch_fleet_replica_warm",
    "peers_hit_ratio": "kvwatch_prefix_cache_hit_ratio_of_peers",
}
# Fragments method -> the catalogue signal whose engine-level twin it reads.
VALUES = {
    "usage_max": "kvwatch_kv_cache_usage_max_ratio",
    "hit_ratio": "kvwatch_prefix_cache_hit_ratio",
    "ttft_mean": "kvwatch_time_to_first_token_mean_seconds",
}


def engine_level(config) -> str:
    return "_".join(label for label in config.engine_labels if label not in config.group_labels)


def twin_record(config, signal: str) -> str:
    """The engine-level recording rule of a catalogue signal (rules.recording_rules names it so: its
    level names its output labels too)."""
    entry = SIGNALS_BY_NAME[signal]
    metric, ops = entry.record
    # A quantile signal's rules (one per quantile) name the quantile label in their level too.
    level = "_".join((engine_level(config), *entry.output_labels, *(("quantile",) if entry.label == "quantile" else ())))
    return f"{level}:{metric}:{ops.format(w=config.rate_window)}"


class Recorded(Fragments):
    """Fragments whose values and conditions are recorded series (see the module docstring)."""

    def __init__(self, scope: Scope, config):
        super().__init__(scope, config)
        self.base = Fragments(scope, config)
        self.level = engine_level(config)

    def _condition(self, method: str) -> str:
        return f"{self.level}:{CONDITIONS[method]}:condition{self.s.w}"

    def signal(self, name: str) -> str:
        return twin_record(self.c, name)

    def series(self, name: str) -> str:
        """One of kvwatch's own series, under the config's selector."""
        return f"{name}{{{self.c.kvwatch_selector}}}"

    # values
    def usage_max(self) -> str:
        return self.signal(VALUES["usage_max"])

    def hit_ratio(self) -> str:
        return self.signal(VALUES["hit_ratio"])

    def ttft_mean(self) -> str:
        return self.signal(VALUES["ttft_mean"])

    def first_token_mean(self) -> str:
        if not self.upstream:
            return self.ttft_mean()
        return f"{self.level}:kvwatch_time_to_first_token_with_upstream_seconds:mean_rate{self.s.w}"

    def upstream_mean(self) -> str:
        # Aggregated to the join labels (none: one series), so the level part names them alone.
        level = "_".join(label for label in self.c.upstream_join_labels if label not in self.c.group_labels)
        return f"{level}:{self.c.upstream_histogram}:mean_rate{self.s.w}"

    def hit_ratio_vs_peers(self) -> str:
        # The name rules.fleet_rules gives it; recorded in the alerts' group.
        return f"{self.level}:kvwatch_prefix_cache_hit_ratio_vs_peers:ratio_increase{self.s.w}"


def _recorded_method(method: str):
    def read(self) -> str:
        return self._condition(method)
    read.__name__ = method
    read.__doc__ = f"The recorded {CONDITIONS[method]} (Fragments.{method})."
    return read


for _method in CONDITIONS:
    setattr(Recorded, _method, _recorded_method(_method))


def recording_rules(config, scope: Scope, signals: tuple[str, ...]) -> list[dict]:
    """What the alerts read, in the alerts' group: the catalogue twins of
    `signals` (those the alerts' queries read: alerts.signals_read; recorded
    there, not in kvwatch-engine.rules), the values that are not a twin (the
    first token with the upstream stage, the upstream stage, the replica's hit
    ratio against its peers), and each condition once, its expression the
    base Fragments' (self-contained)."""
    recorded = Recorded(scope, config)
    base = recorded.base
    rules = [{"record": twin_record(config, signal), "expr": scope.signal(signal)} for signal in signals]
    rules.append({"record": recorded.hit_ratio_vs_peers(), "expr": base.hit_ratio_vs_peers()})
    if base.upstream:
        rules.append({"record": recorded.upstream_mean(), "expr": base.upstream_mean()})
        rules.append({"record": recorded.first_token_mean(), "expr": base.first_token_mean()})
    for method in CONDITIONS:
        rules.append({"record": getattr(recorded, method)(), "expr": getattr(base, method)()})
    return rules
