"""PromQL building blocks: the catalogue's templates filled in for one scope
(selector, range, aggregation labels), and the per-engine conditions the
alerts are made of. Rules, alerts and dashboards all build their queries here,
so a condition the dashboard shows is the condition the alert tests.

Every fragment yields at most one series per aggregation group (the `by`
labels), so fragments combine with `and`/`unless` and arithmetic without
`on()` clauses; only the upstream stage, which lives on other targets, joins
with `on(<join labels>) group_left`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvwatch.signals import SIGNALS_BY_NAME
from kvwatch.units import parse_prometheus_duration


def num(value: float) -> str:
    """A number as PromQL literal: 0.9, 1024, 1e-06."""
    text = f"{float(value):.6g}"
    return text


def indent(text: str, prefix: str = "  ") -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def paren(text: str) -> str:
    """Wrap in parentheses, on separate lines when the text spans several."""
    if "\n" in text:
        return "(\n" + indent(text) + "\n)"
    return f"({text})"


def join_sel(*parts: str) -> str:
    return ",".join(part for part in parts if part)


@dataclass(frozen=True)
class Scope:
    """Where a query looks: label matchers (no braces), the range of rate()
    and *_over_time(), and the labels kept by aggregations."""

    sel: str
    w: str
    by: tuple[str, ...]

    @property
    def by_text(self) -> str:
        return ", ".join(self.by)

    def signal(self, name: str, q: float | None = None) -> str:
        """A catalogue signal's PromQL twin in this scope."""
        template = SIGNALS_BY_NAME[name].promql
        return template.format(sel=self.sel, w=self.w, by=self.by_text, q=num(q) if q is not None else "{q}")

    def m(self, metric: str, extra: str = "") -> str:
        return f"{metric}{{{join_sel(self.sel, extra)}}}"

    def agg(self, op: str, inner: str) -> str:
        return f"{op} by ({self.by_text}) ({inner})"


class Fragments:
    """The per-engine conditions of the alerts, in one scope. Each method
    returns an expression with one series per group; conditions are filters
    (their value is irrelevant; `and`/`unless` use only their presence)."""

    def __init__(self, scope: Scope, config):
        self.s = scope
        self.c = config

    # --- values ---------------------------------------------------------------

    def signal(self, name: str) -> str:
        """A catalogue signal's PromQL twin in this scope."""
        return self.s.signal(name)

    def usage_max(self) -> str:
        return self.s.signal("kvwatch_kv_cache_usage_max_ratio")

    def usage_avg(self) -> str:
        return self.s.agg("max", f"avg_over_time({self.s.m('kvwatch_engine_kv_cache_usage_ratio')}[{self.s.w}])")

    def preemption_rate(self) -> str:
        return self.s.signal("kvwatch_preemptions_per_second")

    def full_share_max(self) -> str:
        """The largest share of the cache one running request held at a moment
        the cache was full (usage at the exhaustion threshold): usage over
        running, sampled by a subquery over the rate window."""
        usage, running = self.s.m("kvwatch_engine_kv_cache_usage_ratio"), self.s.m("kvwatch_engine_requests_running")
        return self.s.agg("max", f"max_over_time((({usage} >= {num(self.c.exhaustion_usage_ratio)}) / {running})"
                                 f"[{self.s.w}:])")

    def running_avg(self) -> str:
        return self.s.agg("sum", f"avg_over_time({self.s.m('kvwatch_engine_requests_running')}[{self.s.w}])")

    def waiting_avg(self) -> str:
        """All waiting requests, whatever they wait for: the queue that tells
        a few long requests from many requests."""
        return self.s.agg("sum", f"avg_over_time({self.s.m('kvwatch_engine_requests_waiting')}[{self.s.w}])")

    def waiting_for_capacity_avg(self) -> str:
        """Requests waiting for room: vLLM 0.20+ says so by reason (deferred
        ones wait on LoRA budget or KV transfer); older versions only say waiting."""
        capacity = self.s.m("kvwatch_engine_requests_waiting_by_reason", 'reason="capacity"')
        by_reason = self.s.agg("sum", f"avg_over_time({capacity}[{self.s.w}])")
        total = self.s.agg("sum", f"avg_over_time({self.s.m('kvwatch_engine_requests_waiting')}[{self.s.w}])")
        return f"{by_reason}\nor\n{total}"

    def capacity_share_per_request(self) -> str:
        """Share of the cache one running request holds: mean usage / mean running."""
        return f"{self.usage_avg()}\n/\n{self.running_avg()}"

    def hit_ratio(self) -> str:
        return self.s.signal("kvwatch_prefix_cache_hit_ratio")

    def query_tokens(self) -> str:
        return self.s.agg("sum", f"increase({self.s.m('kvwatch_engine_prefix_cache_queries_total')}[{self.s.w}])")

    def baseline_hit_ratio(self) -> str:
        """The hit ratio over the baseline span just before the rate window."""
        span, offset = self.c.hit_ratio_baseline_window, self.s.w
        hits = self.s.agg("sum", f"rate({self.s.m('kvwatch_engine_prefix_cache_hits_total')}[{span}] offset {offset})")
        queries = self.s.agg("sum", f"rate({self.s.m('kvwatch_engine_prefix_cache_queries_total')}[{span}] offset {offset})")
        return f"{hits}\n/\n{queries}"

    def ttft_mean(self) -> str:
        return self.s.signal("kvwatch_time_to_first_token_mean_seconds")

    def queue_mean(self) -> str:
        return self.s.signal("kvwatch_queue_time_mean_seconds")

    def prefill_mean(self) -> str:
        return self.s.signal("kvwatch_prefill_time_mean_seconds")

    def front_end_mean(self) -> str:
        """Mean TTFT outside queue and prefill: front end, tokenization,
        scheduling gaps. Clamped at zero: queue and prefill are observed when a
        request finishes, TTFT at its first token, so under changing load the
        parts can briefly exceed the whole."""
        return f"clamp_min(\n{indent(paren(self.ttft_mean()))}\n  -\n{indent(paren(self.queue_mean()))}\n  -\n{indent(paren(self.prefill_mean()))},\n  0\n)"

    @property
    def upstream(self) -> bool:
        return bool(self.c.upstream_histogram)

    def upstream_mean(self) -> str:
        """Mean time in the upstream stage, per join group (one series when no join labels)."""
        histogram = self.c.upstream_histogram
        sel = self.c.upstream_selector
        join = ", ".join(self.c.upstream_join_labels)
        by = f" by ({join})" if join else ""
        total = f"sum{by} (rate({histogram}_sum{{{sel}}}[{self.s.w}]))"
        count = f"sum{by} (rate({histogram}_count{{{sel}}}[{self.s.w}]))"
        return f"{total}\n/\n{count}"

    def _on_join(self) -> str:
        return f"on ({', '.join(self.c.upstream_join_labels)})"

    def first_token_mean(self) -> str:
        """The symptom's value: engine TTFT mean, plus the upstream mean when
        an upstream histogram is configured and has data for this engine."""
        engine = self.ttft_mean()
        if not self.upstream:
            return engine
        return (f"{paren(engine)}\n+ {self._on_join()} group_left ()\n{paren(self.upstream_mean())}"
                f"\nor\n{paren(engine)}")

    # --- conditions -------------------------------------------------------------

    def exhausted(self) -> str:
        """The diagnosis' exhaustion detector over the rate window: the cache
        filled up (usage peak above the threshold) and requests waited for
        room (the diagnosis asks both of one poll; here the window's peak and
        mean waiting), or requests were preempted (vLLM preempts only when it
        cannot allocate a block). The exhaustion alert, the KV-bound queue and
        the hit-rate causes all use it."""
        return (f"{paren(self.usage_max())} > {num(self.c.exhaustion_usage_ratio)}"
                f"\nand\n{paren(self.waiting_for_capacity_avg())} > 0"
                f"\nor\n{paren(self.preemption_rate())} > 0")

    def preempting(self) -> str:
        """vLLM preempted requests in the rate window: running requests lost
        their KV and are recomputed (the diagnosis' critical exhaustion)."""
        return f"{paren(self.preemption_rate())} > 0"

    def long_requests(self) -> str:
        """A few requests fill the cache: each request's footprint is a large
        share of it (the share a running request held on average, the share
        one held while the cache was full, or the share a finished request
        ended at: 1 / the requests the cache holds at mean prompt + generated
        length) and no more requests wait than run
        (the diagnosis' definition, over the same means)."""
        limit = num(self.c.long_request_capacity_share)
        return (f"(\n{paren(self.capacity_share_per_request())}\n>= {limit}"
                f"\nor\n1 / {paren(self.s.signal('kvwatch_kv_cache_capacity_requests'))}\n>= {limit}"
                f"\nor\n{paren(self.full_share_max())}\n>= {limit}\n)"
                f"\nand\n{paren(self.waiting_avg())}\n<=\n{paren(self.running_avg())}")

    def usage_while_waiting(self) -> str:
        """The KV usage's peak at the moments requests waited (the diagnosis'
        kv_usage_max_while_waiting), sampled by a subquery over the rate window."""
        usage, waiting = self.s.m("kvwatch_engine_kv_cache_usage_ratio"), self.s.m("kvwatch_engine_requests_waiting")
        return self.s.agg("max", f"max_over_time(({usage} and {waiting} > 0)[{self.s.w}:])")

    def kv_bound(self) -> str:
        """The queue waits for KV blocks (first_token.kv_bound): the exhaustion
        detector above holds and the cache was under pressure while requests
        waited, so a queue for slots that a later preemption overlaps stays
        compute-bound; KV-bound and compute-bound are never reported together."""
        return (f"{paren(self.exhausted())}\nand\n"
                f"{paren(self.usage_while_waiting())} >= {num(self.c.eviction_usage_ratio)}")

    def caching_disabled(self) -> str:
        # Over the rate window, not at this instant: kvwatch drops an engine's
        # series while a poll fails, and one such gap at a scrape must not
        # reset the caching-disabled alert's pending time.
        info = self.s.m("kvwatch_engine_info", 'enable_prefix_caching=~"(?i)false"')
        return self.s.agg("max", f"max_over_time({info}[{self.s.w}])")

    def prompt_traffic(self) -> str:
        return f"{paren(self.s.signal('kvwatch_prompt_tokens_per_second'))} > 0"

    def enough_queries(self) -> str:
        return f"{paren(self.query_tokens())} >= {num(self.c.min_query_tokens)}"

    def cold(self) -> str:
        """The engine restarted within the cold-cache window, so its cache
        is cold: its prompt-token counter reset, or its kvwatch_engine_info
        labels (cache configuration, which vLLM changes only at a start)
        differ from those it had one window ago. Evidence of a restart only:
        a Prometheus with less history than the window sees neither."""
        span = self.c.cold_cache_window
        # Both sides over the rate window, so a failed poll at either moment
        # (kvwatch then drops the series) neither hides nor fakes a change.
        info = f"last_over_time({self.s.m('kvwatch_engine_info')}[{self.s.w}])"
        before = f"last_over_time({self.s.m('kvwatch_engine_info')}[{self.s.w}] offset {span})"
        restarted = self.s.agg("count", f"resets({self.s.m('kvwatch_engine_prompt_tokens_total')}[{span}]) > 0")
        reconfigured = (f"{self.s.agg('count', f'{info} unless {before}')}"
                        f"\nand\n{self.s.agg('count', before)}")
        return f"{restarted}\nor\n{paren(reconfigured)}"

    def cache_pressure(self) -> str:
        """Running requests leave idle cached prefixes little room (judged
        only where the cache is not exhausted)."""
        return f"{paren(self.usage_avg())} > {num(self.c.eviction_usage_ratio)}"

    def healthy_now(self) -> str:
        """The hit ratio over the rate window is healthy and judged."""
        return (f"{paren(self.hit_ratio())}\n>= {num(self.c.hit_ratio_low)}"
                f"\nand\n{paren(self.enough_queries())}")

    def remembered_healthy(self) -> str:
        """The engine's last healthy hit ratio, remembered by the recording
        rules (memory_rules) beyond any window: absent where those rules are
        not installed (Grafana alerting alone), then only the baseline span counts."""
        return self.s.agg("max", f"{self.memory_level}:{MEMORY_LAST_NAME}")

    @property
    def memory_level(self) -> str:
        """The level part of the memory rules' names: the engine labels beyond the group labels."""
        return "_".join(label for label in self.c.engine_labels if label not in self.c.group_labels)

    def healthy_baseline(self) -> str:
        """The hit ratio was fine before the rate window (the baseline span), or
        at any time the recording rules remember: real reuse, so a low ratio now
        is a regression however long it has lasted."""
        return (f"{paren(self.baseline_hit_ratio())}\n>= {num(self.c.hit_ratio_low)}"
                f"\nor\n{paren(self.remembered_healthy())}")

    def low_baseline(self) -> str:
        """The hit ratio was low before the rate window as well, and was never
        healthy in the remembered span."""
        return (f"{paren(self.baseline_hit_ratio())}\n< {num(self.c.hit_ratio_low)}"
                f"\nunless\n{paren(self.remembered_healthy())}")

    def memory_rules(self) -> list[dict]:
        """Two recording rules that carry an engine's last healthy hit ratio and
        when it was seen forward from evaluation to evaluation: refreshed while
        the ratio is healthy, kept while the engine's series exist (gaps up to
        MEMORY_BRIDGE) and for at most hit_ratio_memory since last healthy."""
        last, seen = (f"{self.memory_level}:{name}" for name in (MEMORY_LAST_NAME, MEMORY_SEEN_NAME))
        present = self.s.agg("group", f"last_over_time({self.s.m('kvwatch_engine_info')}"
                                      f"[{MEMORY_BRIDGE}])")
        memory = parse_prometheus_duration(self.c.hit_ratio_memory)
        seen_expr = (f"{paren(self.healthy_now())} * 0 + time()"
                     f"\nor\n(\n  last_over_time({seen}[{MEMORY_BRIDGE}]) > time() - {num(memory)}\n  and\n"
                     f"{indent(paren(present))}\n)")
        last_expr = (f"{paren(self.healthy_now())}"
                     f"\nor\n(\n  last_over_time({last}[{MEMORY_BRIDGE}])\n  and\n  {seen}\n)")
        return [{"record": seen, "expr": seen_expr}, {"record": last, "expr": last_expr}]

    def dropped_with_room(self) -> str:
        """The hit ratio's drop can be told from the exhaustion: the cache had
        room in the window (neither exhausted nor under pressure), or the drop
        already showed in a rate window without exhaustion (low_before_exhaustion)
        while it is exhausted now."""
        return (f"{paren(self.query_tokens())}\nunless\n{paren(self.exhausted())}"
                f"\nunless\n{paren(self.cache_pressure())}"
                f"\nor\n{paren(self.low_before_exhaustion())}\nand\n{paren(self.exhausted())}")

    def low_before_exhaustion(self) -> str:
        """Within the baseline span, some rate window (stepped by the rate
        window, so they tile it) had a low hit ratio over enough queried
        tokens while the cache was not exhausted: a drop that showed apart
        from any exhaustion."""
        low = (f"{paren(self.hit_ratio())}\n< {num(self.c.hit_ratio_low)}"
               f"\nand\n{paren(self.enough_queries())}\nunless\n{paren(self.exhausted())}")
        return f"max_over_time(\n{indent(paren(low) + f'[{self.c.hit_ratio_baseline_window}:{self.s.w}]')}\n)"

    # --- fleet: one replica against the other replicas of its model ------------
    # The definitions of kvwatch/diagnose/fleet.py. The scope's `by` holds the
    # replica (instance label) and engine; the model's group drops both.

    @property
    def fleet_by(self) -> str:
        return ", ".join(label for label in self.s.by if label not in (self.c.instance_label, "engine"))

    def _per_model(self, op: str, inner: str) -> str:
        return f"{op} by ({self.fleet_by}) ({inner})"

    def pressed(self) -> str:
        """The replica is exhausted (the exhaustion detector) or its first
        token is slow mostly from queueing (either queueing cause)."""
        slow_queue = (f"{paren(self.first_token_mean())} > {num(self.c.ttft_mean_seconds)}"
                      f"\nand\n{paren(self.queue_largest())}")
        return f"{paren(self.exhausted())}\nor\n{paren(slow_queue)}"

    def room(self) -> str:
        """The replica has room: its usage peak over the window at most
        fleet_room_usage_ratio, nothing waiting, and not pressed."""
        waiting = self.s.signal("kvwatch_requests_waiting")
        return (f"{paren(self.usage_max())} <= {num(self.c.fleet_room_usage_ratio)}"
                f"\nand\n{paren(waiting)} <= 0\nunless\n{paren(self.pressed())}")

    def restarted(self) -> str:
        """The replica restarted within the cold-cache window (its
        prompt-token counter reset); its value is the number of resets.
        fleet.py looks one diagnosis window back; an alert must hold for its
        `for:`, longer than the rate window, so the rules keep a replica cold
        for cold_cache_window, as the cold_cache cause does."""
        span = self.c.cold_cache_window
        return self.s.agg("sum", f"resets({self.s.m('kvwatch_engine_prompt_tokens_total')}[{span}]) > 0")

    def warm(self) -> str:
        """Replicas that did not restart within the cold-cache window."""
        # Present in the window (an increase is never negative; it exists
        # wherever the counter has two samples).
        present = f"increase({self.s.m('kvwatch_engine_prompt_tokens_total')}[{self.s.w}]) >= 0"
        return f"{self.s.agg('count', present)}\nunless\n{paren(self.restarted())}"

    def imbalance(self) -> str:
        """A pressed replica (value: its usage peak) while a replica of the
        same model has room."""
        roomy = f"{self._per_model('count', self.room())} > 0"
        return chain(self.usage_max(), ("and", self.pressed()), (f"and on ({self.fleet_by})", roomy))

    def cold_replica(self) -> str:
        """A replica that restarted inside the window while a replica of the
        same model did not."""
        warm = f"{self._per_model('count', self.warm())} > 0"
        return chain(self.restarted(), (f"and on ({self.fleet_by})", warm))

    def _warm_increase(self, counter: str) -> str:
        total = self.s.agg("sum", f"increase({self.s.m(counter)}[{self.s.w}])")
        return f"{total}\nunless\n{paren(self.restarted())}"

    def peers_hit_ratio(self) -> str:
        """The other warm replicas' pooled hit ratio (their summed hits over
        their summed queries), per replica."""
        def peers(counter: str) -> str:
            mine = self._warm_increase(counter)
            return f"{self._per_model('sum', mine)}\n- on ({self.fleet_by}) group_right ()\n{paren(mine)}"
        return (f"{paren(peers('kvwatch_engine_prefix_cache_hits_total'))}\n/\n"
                f"{paren(peers('kvwatch_engine_prefix_cache_queries_total'))}")

    def hit_ratio_vs_peers(self) -> str:
        """A warm replica's hit ratio as a share of its peers' pooled ratio."""
        mine = (f"{paren(self._warm_increase('kvwatch_engine_prefix_cache_hits_total'))}\n/\n"
                f"{paren(self._warm_increase('kvwatch_engine_prefix_cache_queries_total'))}")
        return f"{paren(mine)}\n/\n{paren(self.peers_hit_ratio())}"

    def lost_prefix_affinity(self) -> str:
        """hit_ratio_vs_peers where it can be judged: enough queried tokens,
        peers that reuse at least hit_ratio_low, and the replica not
        exhausted (compared with fleet_affinity_fraction by the alert)."""
        return chain(self.hit_ratio_vs_peers(), ("and", self.enough_queries()),
                     ("and", f"{paren(self.peers_hit_ratio())} >= {num(self.c.hit_ratio_low)}"),
                     ("unless", self.exhausted()))

    # TTFT parts: the largest part is the cause; ties go to the earlier part in
    # queue, prefill, front end, upstream order, so exactly one part wins.

    def _beats_upstream(self, part: str, strict: bool = False) -> str:
        op = ">" if strict else ">="
        return (f"{paren(part)}\n{op} {self._on_join()} group_left ()\n{paren(self.upstream_mean())}"
                f"\nor\n{paren(part)}\nunless {self._on_join()}\n{paren(self.upstream_mean())}")

    def _top(self, part: str, wins_against: list[tuple[str, bool]]) -> str:
        conditions = [f"{paren(part)}\n{'>' if strict else '>='}\n{paren(other)}" for other, strict in wins_against]
        if self.upstream:
            conditions.append(self._beats_upstream(part))
        return "\nand\n".join(paren(c) for c in conditions)

    def queue_largest(self) -> str:
        return self._top(self.queue_mean(), [(self.prefill_mean(), False), (self.front_end_mean(), False)])

    def prefill_largest(self) -> str:
        return self._top(self.prefill_mean(), [(self.queue_mean(), True), (self.front_end_mean(), False)])

    def front_end_largest(self) -> str:
        return self._top(self.front_end_mean(), [(self.queue_mean(), True), (self.prefill_mean(), True)])


# The hit-ratio memory's recording rules, named level:metric:operations.
MEMORY_LAST_NAME = "kvwatch_prefix_cache_hit_ratio:last_healthy"
MEMORY_SEEN_NAME = "kvwatch_prefix_cache_hit_ratio:last_healthy_timestamp_seconds"
# Gaps in rule evaluation or in an engine's series shorter than this keep the memory.
MEMORY_BRIDGE = "1h"


_SERIES_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
# One PromQL label matcher: name, operator, double-quoted value.
_MATCHER = re.compile(r'\s*[a-zA-Z_][a-zA-Z0-9_]*\s*(=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*')


def check_selector(text: str) -> str | None:
    """None when `text` is a comma-separated list of PromQL label matchers."""
    rest = text.strip()
    if not rest:
        return "must not be empty"
    position = 0
    while True:
        match = _MATCHER.match(text, position)
        if not match:
            return f"{text!r} is not a list of label matchers like job=\"kvwatch\" (problem at {text[position:]!r})"
        position = match.end()
        if position == len(text):
            return None
        if text[position] != ",":
            return f"{text!r}: expected ',' at {text[position:]!r}"
        position += 1


def chain(value: str, *steps: tuple[str, str]) -> str:
    """value op condition op condition ...: each step is ("and"|"unless",
    condition). `and` and `unless` share one precedence and associate to the
    left, so this reads as a filter pipeline over `value`'s series. A recorded
    series (a bare name) takes one line: `and <name>`."""
    text = value if _SERIES_NAME.fullmatch(value) else paren(value)
    for op, condition in steps:
        if _SERIES_NAME.fullmatch(condition):
            text += f"\n{op} {condition}"
        else:
            text += f"\n{op}\n{paren(condition)}"
    return text
