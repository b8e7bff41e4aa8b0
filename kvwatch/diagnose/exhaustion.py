"""Exhaustion: the KV cache was full, and why (too many requests, a few long
ones, or a scheduler that admits more than fit). Each cause has its judge
(registered with @judges), asked in the symptom's ranking (causes.py), every
verdict kept. The load shape is decided once per window from its means, as
the generated alert rule decides it over its rate window, so the two agree
and exactly one of concurrency_beyond_capacity and long_requests is named;
the sizing advice (capacity_below_max_num_seqs) rides beside it.

    Adding a cause: its record and its name in the symptom's ranking
    (causes.py), its judge here; check_judges refuses one without the other."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvwatch.diagnose.arbitration import alternative
from kvwatch.diagnose.causes import CAUSE
from kvwatch.diagnose.context import EngineContext, Exhaustion, Poll, max_num_seqs, quantile_value
from kvwatch.diagnose.hit_rate import verdict as hit_rate_verdict
from kvwatch.diagnose.judging import check_judges, in_ranking, registrar
from kvwatch.diagnose.vocabulary import NEXT_CHECK, Finding
from kvwatch.snapshot import config_number, hybrid_cache

log = logging.getLogger("kvwatch")


def _whole(value: float) -> bool:
    return abs(value - round(value)) < 0.05


def count_text(value: float) -> str:
    """A count in a summary: a whole number ("9 waiting", never "9.0"); a
    mean that is not near one keeps one decimal ("2.4 running on average")."""
    return f"{round(value):d}" if _whole(value) else f"{value:.1f}"


def _length_evidence(ctx: EngineContext) -> dict[str, Any]:
    prompt_p95, _ = quantile_value(ctx.histogram("prompt_len"), 0.95)
    generated_p95, _ = quantile_value(ctx.histogram("generation_len"), 0.95)
    return {
        "prompt_tokens_mean": ctx.value("kvwatch_prompt_tokens_per_request_mean"),
        "generation_tokens_mean": ctx.value("kvwatch_generation_tokens_per_request_mean"),
        "prompt_tokens_p95": prompt_p95,
        "generation_tokens_p95": generated_p95,
    }


def _load_shape(ctx: EngineContext) -> dict[str, float | None]:
    """Window means of usage, running and waiting (polls that report usage
    and running), and the share of the cache one running request held: mean
    usage / mean running. The PromQL of the exhaustion alert computes the
    same means with avg_over_time over its rate window."""
    track = ctx.track
    if track is not None and not track.no_usage_or_running and not track.no_waiting:
        # Every poll counts: the same sums over the kept values, in order.
        count = len(track.polls)
        if not count:
            return {"kv_usage_mean": None, "running_mean": None, "waiting_mean": None, "share": None}
        usage = sum(track.usage) / count
        running = sum(track.running) / count
        waiting = sum(track.waiting) / count
        return {"kv_usage_mean": usage, "running_mean": running, "waiting_mean": waiting,
                "share": usage / running if running > 0 else None}
    polls = [p for p in ctx.polls if p.usage is not None and p.running is not None]
    if not polls:
        return {"kv_usage_mean": None, "running_mean": None, "waiting_mean": None, "share": None}
    usage = sum([p.usage or 0.0 for p in polls]) / len(polls)  # none is None: filtered above
    running = sum([p.running or 0.0 for p in polls]) / len(polls)
    waiting = sum([p.waiting or 0.0 for p in polls]) / len(polls)
    return {"kv_usage_mean": usage, "running_mean": running, "waiting_mean": waiting,
            "share": usage / running if running > 0 else None}


def exhaustion_findings(ctx: EngineContext) -> list[Finding]:
    """Every judge asked in the symptom's ranking, each verdict kept: the two
    load shapes read one comparison, so at most one of them is named, and the
    sizing advice rides beside it (a reason the shape hurts, not a rival)."""
    judging = _Judging.of(ctx)
    return [found for judge in in_ranking("exhaustion", JUDGES) if (found := judge(ctx, judging)) is not None]


@dataclass
class _FullCache:
    """While the cache was exhausted: the window's load shape, read once for both shapes' judges."""

    state: Exhaustion
    shares: dict[str, Any]
    common: dict[str, Any]  # what every full-cache finding carries
    long: bool  # a few long requests filled it, not many
    footprint_share: float | None
    when: str
    confidence: str


@dataclass
class _Judging:
    """What each judge of the exhaustion reads: the one detector's state,
    the cache's capacity in requests against the scheduler's bound, and
    (while exhausted, read at the first judge that asks) the load shape."""

    ctx: EngineContext
    state: Exhaustion | None
    bound: dict[str, Any]
    stated_concurrency: float | None
    below: bool  # an inferred bound only counts when strictly more requests ran than fit
    _full: _FullCache | None = None

    @classmethod
    def of(cls, ctx: EngineContext) -> _Judging:
        capacity_requests = ctx.value("kvwatch_kv_cache_capacity_requests")
        max_seqs, max_seqs_source = max_num_seqs(ctx)
        bound = {"kv_cache_capacity_requests": capacity_requests, "max_num_seqs": max_seqs,
                 "max_num_seqs_source": max_seqs_source}
        below = capacity_requests is not None and max_seqs is not None and capacity_requests < max_seqs
        return cls(ctx, ctx.exhaustion, bound, config_number(ctx.cache_config, "kv_cache_max_concurrency"), below)

    def full(self) -> _FullCache | None:
        if self.state is not None and self._full is None:
            self._full = _full_cache(self.ctx, self.state, self.bound["kv_cache_capacity_requests"])
        return self._full


# A cause's judge: the engine's context and the exhaustion's evidence in; its
# finding out, or None where its cause does not apply.
Judge = Callable[[EngineContext, _Judging], "Finding | None"]
JUDGES: dict[str, Judge] = {}
judges = registrar(JUDGES)


@judges("concurrency_beyond_capacity")
def _concurrency_beyond_capacity(ctx: EngineContext, judging: _Judging) -> Finding | None:
    full = judging.full()
    if full is None or full.long:
        return None
    return _severity_said(_concurrency_finding(ctx, full), full.state)


@judges("long_requests")
def _long_requests(ctx: EngineContext, judging: _Judging) -> Finding | None:
    full = judging.full()
    if full is None or not full.long:
        return None
    return _severity_said(_long_requests_finding(ctx, full), full.state)


@judges("capacity_below_max_num_seqs")
def _capacity_below_max_num_seqs(ctx: EngineContext, judging: _Judging) -> Finding | None:
    """The scheduler admits more than the cache holds: a finding while
    exhausted, an advisory before (only on a --max-num-seqs stated)."""
    if not judging.below:
        return None
    if judging.state is not None:
        return _capacity_below_finding(ctx, judging.state, judging.bound, judging.stated_concurrency)
    if ctx.t.max_num_seqs is not None:
        return _capacity_below_advisory(ctx, judging.bound, judging.stated_concurrency)
    return None


def clearly_over(ctx: EngineContext) -> bool:
    """The exhaustion is clearly over on this span (the now span, diagnose/now.py): the detector finds
    nothing (no full poll, no preemption), and its last poll has the cache below eviction_usage_ratio
    with nothing waiting, well under the detector's line (exhaustion_usage_ratio with a queue), so its
    lapse is no flicker near that line. Unknown is not zero: a poll without usage or waiting decides nothing."""
    if not ctx.polls or ctx.exhaustion is not None:
        return False
    last = ctx.polls[-1]
    return (last.usage is not None and last.usage < ctx.t.eviction_usage_ratio
            and last.waiting is not None and last.waiting <= 0)


def _severity_said(finding: Finding, state: Exhaustion) -> Finding:
    """A critical exhaustion says the figure that made it critical: the
    preemptions its alert (critical with preemptions, the same record's
    preempting_severity) reads too."""
    record = CAUSE.get(finding.cause)
    if finding.severity != "critical" or record is None or record.preempting_severity != "critical":
        return finding
    note = (f"critical: {state.preemptions:g} preemption{'s' if state.preemptions != 1 else ''} in the window (vLLM "
            "preempts only when it cannot allocate a KV block: running requests lose their KV and recompute it); "
            f"its alert {record.alert} is critical on the same preemptions")
    return replace(finding, evidence={"severity_because": note, **finding.evidence})


def _capacity_below_advisory(ctx: EngineContext, bound: dict[str, Any], stated_concurrency: float | None) -> Finding:
    capacity_requests, max_seqs = bound["kv_cache_capacity_requests"], bound["max_num_seqs"]
    return ctx.finding(
        "exhaustion", "capacity_below_max_num_seqs", "medium",
        f"Not exhausted in the window, but at current lengths the cache holds {count_text(capacity_requests)} requests "
        f"and the scheduler admits up to {count_text(max_seqs)}: more concurrency will preempt.",
        {**bound, "kv_cache_max_concurrency_at_max_model_len": stated_concurrency, **_length_evidence(ctx)},
        NEXT_CHECK["capacity_below_max_num_seqs"], advisory=True)


def _capacity_below_finding(ctx: EngineContext, state: Exhaustion, bound: dict[str, Any],
                            stated_concurrency: float | None) -> Finding:
    capacity_requests, max_seqs = bound["kv_cache_capacity_requests"], bound["max_num_seqs"]
    stated = ctx.t.max_num_seqs is not None
    return ctx.finding(
        "exhaustion", "capacity_below_max_num_seqs", "high" if stated else "medium",
        f"At current mean lengths the cache holds {count_text(capacity_requests)} requests but the scheduler admits "
        f"{'up to' if stated else 'at least'} {count_text(max_seqs)}, so it starts requests it "
        "cannot keep and preempts them.",
        {**bound, "running_max": ctx.view.running_max,
         "kv_cache_max_concurrency_at_max_model_len": stated_concurrency, "preemptions": state.preemptions,
         **_length_evidence(ctx)},
        NEXT_CHECK["capacity_below_max_num_seqs"])


def _full_share(ctx: EngineContext, limit: float) -> float | None:
    """The largest share one running request held while the cache was full.
    Before any request finished (its final size unknown), it tells the same:
    a full cache and four running requests is 25 % each."""
    known, full_share = ctx.track.for_limits(limit, ctx.t.max_num_seqs).full_share_max() if (
        ctx.track is not None) else (False, None)
    if not known:
        full_shares = [p.usage / p.running for p in ctx.polls
                       if p.usage is not None and p.usage >= limit and p.running]
        full_share = max(full_shares, default=None)
    return full_share


def _hit_rate_evidence(ctx: EngineContext) -> dict[str, Any]:
    try:
        return hit_rate_verdict(ctx).exhaustion_evidence
    except Exception:  # the hit-rate rule's own failure must not drop this finding
        log.exception("diagnosis: judging the hit rate failed for %s/%s", ctx.model, ctx.engine)
        return {}


def _request_tokens_mean(ctx: EngineContext) -> float | None:
    prompt_mean = ctx.value("kvwatch_prompt_tokens_per_request_mean")
    generated_mean = ctx.value("kvwatch_generation_tokens_per_request_mean")
    return prompt_mean + generated_mean if prompt_mean is not None and generated_mean is not None else None


def _full_cache_evidence(ctx: EngineContext, state: Exhaustion, shares: dict[str, Any]) -> dict[str, Any]:
    """What every full-cache finding carries, whichever shape it names."""
    shape = shares["shape"]
    return {
        "kv_usage_max": ctx.value("kvwatch_kv_cache_usage_max_ratio"),
        "kv_usage_now": ctx.value("kvwatch_kv_cache_usage_ratio"),
        "kv_usage_threshold": ctx.t.exhaustion_usage_ratio,
        "preemptions": state.preemptions,
        "preemptions_per_second": ctx.value("kvwatch_preemptions_per_second"),
        **_preemption_shape(ctx),
        "kv_cache_capacity_tokens": ctx.capacity_tokens,
        "kv_cache_capacity_requests": shares["capacity_requests"],
        **_hybrid_evidence(ctx),
        **_length_evidence(ctx),
        "request_tokens_mean": _request_tokens_mean(ctx),
        "kv_usage_mean": shape["kv_usage_mean"],
        "running_mean": shape["running_mean"],
        "waiting_mean": shape["waiting_mean"],
        "capacity_share_per_running_request": shares["share"],
        "capacity_share_per_finished_request": shares["final_share"],
        "capacity_share_per_running_request_when_full_max": shares["full_share"],
        "long_request_capacity_share": ctx.t.long_request_capacity_share,
        **_hit_rate_evidence(ctx),
        "window_seconds": ctx.increase.seconds,
    }


def _request_shares(ctx: EngineContext, capacity_requests) -> dict[str, Any]:
    """The window's load means and the share of the cache one request held:
    on average while running, at its end (1 / capacity_requests), and at most
    while the cache was full."""
    shape = _load_shape(ctx)
    return {"shape": shape, "share": shape["share"], "capacity_requests": capacity_requests,
            "final_share": 1.0 / capacity_requests if capacity_requests else None,
            "full_share": _full_share(ctx, ctx.t.exhaustion_usage_ratio)}


def _few_long_requests(ctx: EngineContext, shares: dict[str, Any]) -> tuple[bool, float | None]:
    """Whether a few long requests filled the cache, and one request's footprint share.

    One cause per window, decided as the alert rule decides it: a few long
    requests when each request's footprint is a large share of the cache and
    no more requests waited than ran; many requests otherwise (also when no
    poll reported usage and running, with only preemptions to go by). The
    footprint is the larger of the share a running request held on average
    (mean usage / mean running) and the share a finished request ends at (its
    mean prompt + generated tokens over the capacity, i.e. 1 / capacity_requests):
    a request that generates grows, and it is its final size that fills the
    cache. In the real capture 4 requests of 200 + 800 tokens preempted with
    nobody waiting while each held only 15 % of the cache on average over its
    life, and ended at 24 %.
    """
    shape = shares["shape"]
    footprint_share = max((x for x in (shares["share"], shares["final_share"], shares["full_share"])
                           if x is not None), default=None)
    long = (footprint_share is not None and footprint_share >= ctx.t.long_request_capacity_share
            and (shape["waiting_mean"] or 0.0) <= (shape["running_mean"] or 0.0))
    return long, footprint_share


def _footprint(ctx: EngineContext, poll: Poll) -> float | None:
    running = poll.running
    if poll.usage is None or not running or not ctx.capacity_tokens:
        return None
    return poll.usage * ctx.capacity_tokens / running


def _at_peak(ctx: EngineContext, poll: Poll | None) -> dict[str, Any]:
    if poll is None:
        return {}
    return {"peak_seconds_ago": ctx.polls[-1].time - poll.time, "kv_usage_at_peak": poll.usage,
            "running_at_peak": poll.running, "waiting_at_peak": poll.waiting,
            "waiting_for_capacity_at_peak": poll.waiting_for_capacity,
            "tokens_per_running_request_at_peak": _footprint(ctx, poll)}


def _when_full(usage_now: float | None, limit: float) -> str:
    """Wording follows the numbers on the same page: a cache at or above the
    threshold now is full now, wherever in the window its peak fell."""
    if usage_now is not None and usage_now >= limit:
        return f"now ({usage_now:.1%})"
    if usage_now is not None:
        return f"earlier in the window (now {usage_now:.1%})"
    return "earlier in the window"


def _full_cache(ctx: EngineContext, state: Exhaustion, capacity_requests: float | None) -> _FullCache:
    shares = _request_shares(ctx, capacity_requests)
    common = _full_cache_evidence(ctx, state, shares)
    long, footprint_share = _few_long_requests(ctx, shares)
    when = _when_full(common["kv_usage_now"], common["kv_usage_threshold"])
    peak = state.peak
    proven = state.full_polls and (state.preemptions > 0 or (peak and peak.gauge("waiting_by_reason/capacity")))
    return _FullCache(state, shares, common, long, footprint_share, when, "high" if proven else "medium")


def _long_requests_finding(ctx: EngineContext, full: _FullCache) -> Finding:
    state, shares = full.state, full.shares
    share, final_share, shape = shares["share"], shares["final_share"], shares["shape"]
    tokens = (full.footprint_share or 0.0) * ctx.capacity_tokens if ctx.capacity_tokens else None
    grows = final_share is not None and (share is None or final_share > share)
    return ctx.finding(
        "exhaustion", "long_requests", full.confidence,
        f"KV cache full {full.when} with few requests: {count_text(shape['running_mean'] or 0)} running on average, each "
        + (f"ending at {final_share:.0%} of the cache" if grows else f"holding {share:.0%} of the cache")
        + (f" (about {tokens:.0f} tokens)" if tokens is not None else "")
        + f", and {count_text(shape['waiting_mean'] or 0)} waiting: a few very long requests fill it.",
        {**full.common, **_at_peak(ctx, state.peak)},
        NEXT_CHECK["long_requests"], preempting=state.preemptions > 0)


def _concurrency_headline(state, demand, capacity_requests) -> tuple[str, tuple]:
    """What the peak's demand says against the cache's size, and the cause it leaves open."""
    if demand is not None and capacity_requests is not None and demand > capacity_requests:
        return (f": {count_text(demand)} requests running or waiting at the peak, the cache holds about "
                f"{count_text(capacity_requests)} at current mean lengths"), ()
    if demand is not None and capacity_requests is not None:
        # The headline never claims more than its evidence: fewer requests
        # than the cache holds at the window's mean lengths filled it, so
        # the ones in flight then were longer than the mean, and the means
        # (which decide between the two shapes, as the alert rule does)
        # cannot say whether many or a few long ones were to blame.
        return (f" with only {count_text(demand)} requests running or waiting at the peak, fewer than "
                f"the roughly {count_text(capacity_requests)} the cache holds at the window's mean "
                "lengths: the requests in flight then were longer than the mean"), (alternative(
                    "long_requests", ("request_lengths", "kv_events"),
                    "the lengths of the requests in flight at the peak (the gateway log), or the blocks each held "
                    "(vLLM's KV-cache events): a few requests near the cache's size are long_requests"),)
    if not state.full_polls:
        return f": {count_text(state.preemptions)} preemptions, no poll caught the cache full", ()
    return "", ()


def _concurrency_finding(ctx: EngineContext, full: _FullCache) -> Finding:
    state, shares = full.state, full.shares
    share, shape, capacity_requests = shares["share"], shares["shape"], shares["capacity_requests"]
    demand = state.peak.demand if state.peak else None
    beyond = capacity_requests is not None and demand is not None and demand > capacity_requests
    headline, alternatives = _concurrency_headline(state, demand, capacity_requests)
    summary = f"KV cache full {full.when}" + headline
    if share is not None:
        summary += (f"; each running request held {share:.0%} of it on average, with "
                    f"{count_text(shape['waiting_mean'])} waiting for {count_text(shape['running_mean'])} running"
                    + ("" if _whole(shape['waiting_mean']) and _whole(shape['running_mean']) else " on average"))
    return ctx.finding(
        "exhaustion", "concurrency_beyond_capacity",
        full.confidence if (beyond or capacity_requests is None) else "low", summary + ".",
        {**full.common, "demand_at_peak": demand, **_at_peak(ctx, state.peak)},
        NEXT_CHECK["concurrency_beyond_capacity"], preempting=state.preemptions > 0, alternatives=alternatives)


def _hybrid_evidence(ctx: EngineContext) -> dict[str, Any]:
    """A hybrid (attention + Mamba) model's state cache, from cache_config_info's
    mamba_* labels: each running request also holds a Mamba state of fixed
    size in the same pool, so the tokens the cache holds depend on how many
    requests run, not only on their lengths."""
    mamba = hybrid_cache(ctx.cache_config)
    if mamba is None:
        return {}
    return {**mamba, "hybrid_model": (
        "Mamba layers: each running request also holds a fixed-size Mamba state in the same pool (mamba_* of "
        "cache_config_info), so more requests at the same lengths fit fewer tokens; block_size is the smallest "
        "over the KV groups")}


def _preemption_shape(ctx) -> dict:
    """Why requests were preempted, from vllm:request_num_preemptions: many
    requests each preempted once (broad pressure: the cache is short for the
    load) or a few preempted again and again (thrash: the same requests are
    readmitted and evicted); and admission rejections, a separate cause (the
    queue limit, not the KV cache)."""
    found = {}
    share = ctx.value("kvwatch_preemptions_on_repeat_requests_ratio")
    if share is not None:
        found["preemptions_on_repeat_requests_ratio_at_least"] = share
        found["preemption_shape"] = "thrash" if share >= 0.5 else "broad_pressure"
    rejections = ctx.value("kvwatch_admission_rejections_per_second")
    if rejections:
        found["admission_rejections_per_second"] = rejections
    return found


check_judges("exhaustion", JUDGES)
