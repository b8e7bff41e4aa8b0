"""Slow first token: the queue (bound by KV or by compute), prefill, the front
end, preemption (the residual while the cache is exhausted), or time spent
upstream of the engine (retrieval, a gateway). Each cause has its judge
(registered with @judges), asked in the symptom's ranking (causes.py), every
verdict kept: each part found is a finding, upstream's first and the engine's
parts by their share, and diagnose/arbitration.py keeps one primary and
carries the rest. The window's first-token times are read once for all
judges (FirstTokenJudging)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any

from kvwatch.diagnose.stuck import PROGRESS
from kvwatch.diagnose.context import EngineContext, max_num_seqs, quantile_value
from kvwatch.diagnose.exhaustion import count_text
from kvwatch.diagnose.judging import check_judges, in_ranking, registrar
from kvwatch.signals import ttft_decomposition
from kvwatch.diagnose.vocabulary import NEXT_CHECK, Finding


@dataclass(frozen=True)
class FirstTokenJudging:
    """The window's slow first tokens, read once for every judge: the figures,
    the evidence and headline each finding carries, and the engine's parts
    large enough to name (none where the engine itself met the objective)."""

    slow: dict[str, Any]
    upstream: dict[str, Any] | None
    evidence: dict[str, Any]
    headline: str
    shares: dict[str, float]
    named: tuple[str, ...]
    confidence: str

    def share_text(self, part: str) -> str:
        return f"{self.shares[part]:.0%} of it"


Judge = Callable[[EngineContext, FirstTokenJudging], "Finding | None"]
JUDGES: dict[str, Judge] = {}
judges = registrar(JUDGES)
# The part of the first-token time each engine-side cause explains (ttft_decomposition's names).
PART = {"queueing_kv_bound": "queue", "queueing_compute_bound": "queue", "prefill": "prefill",
        "preemption": "other", "front_end": "other"}


def slow_first_token_findings(ctx: EngineContext, upstream: dict[str, Any] | None) -> list[Finding]:
    slow = _slow_first_token(ctx, upstream)
    if slow is None:
        waiting = _waiting_now(ctx)
        return [waiting] if waiting is not None else []
    judging = _judging(ctx, slow, upstream)
    found = [finding for judge in in_ranking("slow_first_token", JUDGES)
             if (finding := judge(ctx, judging)) is not None]
    # Upstream's first, then the engine's parts, the largest share first.
    order = ["upstream", *sorted(judging.named, key=lambda name: -judging.shares[name])]
    return sorted(found, key=lambda finding: order.index(PART.get(finding.cause, finding.cause)))


def _judging(ctx: EngineContext, slow: dict[str, Any], upstream: dict[str, Any] | None) -> FirstTokenJudging:
    evidence, shares, other_lower = _ttft_evidence(ctx, slow)
    # The span, said where the eye compares: the page's trend ends on shorter spans.
    t = ctx.t
    pinned = slow["pinned"]
    headline = (f"Time to first token over the last {ctx.increase.seconds:.0f}s: p95 "
                f"{(pinned + ' ') if pinned else ''}{slow['p95']:.2f}s, mean {slow['ttft_mean']:.2f}s "
                f"(objective p95 {t.ttft_p95_seconds:g}s, mean {t.ttft_mean_seconds:g}s)")
    named: list[str] = []
    confidence = "medium"
    if slow["engine_slow"] and shares:
        named, confidence = _named_parts(t, shares, other_lower, slow["ttft_mean"])
    return FirstTokenJudging(slow, upstream, evidence, headline, shares, tuple(named), confidence)


@judges("upstream")
def _upstream(ctx: EngineContext, judging: FirstTokenJudging) -> Finding | None:
    return _upstream_finding(ctx, judging.upstream, judging.slow, judging.evidence)


@judges("queueing_kv_bound", "queueing_compute_bound")
def _queue(ctx: EngineContext, judging: FirstTokenJudging) -> Finding | None:
    if "queue" not in judging.named:
        return None
    return _queue_finding(ctx, judging.evidence, judging.headline, judging.share_text("queue"), judging.confidence)


@judges("prefill")
def _prefill(ctx: EngineContext, judging: FirstTokenJudging) -> Finding | None:
    if "prefill" not in judging.named:
        return None
    return _prefill_finding(ctx, judging.evidence, judging.headline, judging.share_text("prefill"),
                            judging.confidence)


@judges("preemption", "front_end")
def _residual(ctx: EngineContext, judging: FirstTokenJudging) -> Finding | None:
    if "other" not in judging.named:
        return None
    return _residual_finding(ctx, judging.evidence, judging.headline, judging.share_text("other"),
                             judging.confidence)


def _slow_first_token(ctx: EngineContext, upstream: dict[str, Any] | None) -> dict[str, Any] | None:
    """The window's first-token times when they (or with the upstream's, the total) miss the objective."""
    t = ctx.t
    ttft = ctx.histogram("ttft")
    if ttft is None or ttft.count < t.ttft_min_requests:
        return None
    ttft_mean = ttft.mean()
    # As every surface reports it: pinned at a bucket edge, the edge and its side ("<" / ">").
    reported = ttft.reported_quantile(0.95)
    p95, pinned = (reported.value, reported.bound) if reported is not None else (None, None)
    upstream_mean = None
    if upstream and upstream.get("up") and (upstream.get("count") or 0) >= t.ttft_min_requests:
        upstream_mean = upstream.get("mean_seconds")
    engine_slow = (p95 is not None and p95 > t.ttft_p95_seconds and pinned != "<") or \
        (ttft_mean is not None and ttft_mean > t.ttft_mean_seconds)
    total_mean = (ttft_mean or 0.0) + (upstream_mean or 0.0)
    total_slow = upstream_mean is not None and total_mean > t.ttft_mean_seconds
    if not engine_slow and not total_slow:
        return None
    return {"ttft": ttft, "ttft_mean": ttft_mean, "p95": p95, "pinned": pinned, "upstream_mean": upstream_mean,
            "total_mean": total_mean, "engine_slow": engine_slow}


def _waiting_now(ctx: EngineContext) -> Finding | None:
    """Lag-aware: requests wait now, every poll since `waiting` ago, and the
    first tokens admitted meanwhile (the histograms observe a request only
    once it is admitted) are too few to say how long: the mean wait by
    Little's law (the mean queue over the admission rate), or, with no
    request admitted, at least how long the queue has stood, past the mean
    objective is a queue found from what waits now; the histograms confirm
    it as requests are admitted."""
    polls, t = ctx.polls, ctx.t
    if not polls or polls[-1].waiting_for_capacity <= 0:
        return None
    start = len(polls) - 1
    while start > 0 and polls[start - 1].waiting_for_capacity > 0:
        start -= 1
    # A preempted request waits again for room, its first token long since
    # out: only those beyond the stretch's preemptions wait for a first token
    # (none can be told apart where the queue is older than the span and it
    # preempted), and as many as the histograms need (ttft_min_requests).
    preempted = sum(p.preempted for p in polls[start + 1:])
    if (start == 0 and preempted > 0) or \
            polls[-1].waiting_for_capacity - preempted < max(1, t.ttft_min_requests):
        return None
    stood = polls[-1].time - polls[start].time
    progress = [ctx.increase.counters[key] for key in PROGRESS if key in ctx.increase.counters]
    if progress and all(value <= 0 for value in progress):
        return None  # nothing moved in the span: an engine stuck (stuck.py), not a queue that drains
    ttft = ctx.histogram("ttft")
    admitted = ttft.count if ttft is not None else 0.0
    queue = sum(p.waiting_for_capacity for p in polls[start:]) / (len(polls) - start)
    seconds = ctx.increase.seconds
    wait = queue / (admitted / seconds) if admitted > 0 and seconds > 0 else stood
    if wait <= t.ttft_mean_seconds or stood < t.ttft_mean_seconds:
        return None
    evidence = {"waiting_now": polls[-1].waiting_for_capacity, "waiting_seconds": stood,
                "queue_from_waiting_seconds": wait, "ttft_requests": admitted,
                "objective_mean_seconds": t.ttft_mean_seconds, "window_seconds": seconds}
    headline = (f"Time to first token over the last {stood:.0f}s: {polls[-1].waiting_for_capacity:.0f} requests "
                f"waiting now, {admitted:.0f} first tokens in {seconds:.0f}s, a mean wait of about {wait:.1f}s "
                f"(objective mean {t.ttft_mean_seconds:g}s) before the histograms see it")
    return _queue_finding(ctx, evidence, headline, "all of it", "low")


def _queue_from_waiting(ctx: EngineContext, ttft) -> float | None:
    """The same lag from the gauges: by Little's law the mean wait is the mean
    queue length over the arrival rate (first tokens per second). It counts
    the requests still waiting, which no histogram has seen yet: evidence
    beside the decomposition, never a second set of shares."""
    track = ctx.track
    if track is not None and not track.no_waiting:
        waiting = list(islice(track.waiting, 1, None))  # every poll's, as below
    else:
        waiting = [p.waiting for p in ctx.polls[1:] if p.waiting is not None]
    if waiting and ctx.increase.seconds > 0:
        return (sum(waiting) / len(waiting)) / (ttft.count / ctx.increase.seconds)
    return None


def _other_lower_bound(ctx: EngineContext, ttft, other: float | None) -> float | None:
    """Requests with a first token but not finished yet have a TTFT and no
    queue or prefill time, so their whole TTFT lands in the rest. Its lower
    bound charges each of them the TTFT p99 before the rest is named."""
    queue_histogram = ctx.histogram("queue_time")
    prefill_histogram = ctx.histogram("prefill_time")
    if other is None or queue_histogram is None or prefill_histogram is None:
        return None
    unfinished = max(0.0, ttft.count - min(queue_histogram.count, prefill_histogram.count))
    p99, _ = quantile_value(ttft, 0.99)
    return max(0.0, other - unfinished * (p99 or 0.0) / ttft.count)


def _ttft_evidence(ctx: EngineContext, slow: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float], float | None]:
    """The evidence every finding carries, the parts' shares of the TTFT, and the rest's lower bound."""
    t, ttft = ctx.t, slow["ttft"]
    # One decomposition for the finding, the signal, the page and the rules.
    parts = ttft_decomposition(ctx.view)
    queue_observed = parts.queue_mean if parts else None
    prefill = parts.prefill_mean if parts else None
    queue_little = _queue_from_waiting(ctx, ttft)
    other = parts.other_mean if parts else None
    other_lower = _other_lower_bound(ctx, ttft, other)
    shares = dict(parts.shares) if parts and queue_observed is not None and prefill is not None else {}
    evidence = {
        "ttft_p95_seconds": slow["p95"], "ttft_p95_pinned": slow["pinned"], "ttft_mean_seconds": slow["ttft_mean"],
        "ttft_requests": ttft.count, "objective_p95_seconds": t.ttft_p95_seconds,
        "objective_mean_seconds": t.ttft_mean_seconds,
        "queue_mean_seconds": queue_observed, "queue_from_waiting_seconds": queue_little,
        "prefill_mean_seconds": prefill, "other_mean_seconds": other,
        "queue_share": shares.get("queue"), "prefill_share": shares.get("prefill"), "other_share": shares.get("other"),
        "other_lower_bound_seconds": other_lower,
        "window_seconds": ctx.increase.seconds,
    }
    if parts is not None and parts.note:
        evidence["histograms_disagree"] = parts.note
    return evidence, shares, other_lower


def _upstream_finding(ctx: EngineContext, upstream: dict[str, Any] | None, slow: dict[str, Any],
                      evidence: dict[str, Any]) -> Finding | None:
    upstream_mean, total_mean = slow["upstream_mean"], slow["total_mean"]
    if upstream_mean is None or upstream is None:
        return None
    upstream_share = upstream_mean / total_mean if total_mean else 0.0
    if upstream_share < ctx.t.upstream_share:
        return None
    return ctx.finding(
        "slow_first_token", "upstream", "medium",
        f"{upstream_mean:.2f}s of {total_mean:.2f}s mean time to first token ({upstream_share:.0%}) is spent "
        f"before the engine, in {upstream.get('histogram')}.",
        {**evidence, "upstream_histogram": upstream.get("histogram"), "upstream_mean_seconds": upstream_mean,
         "upstream_p95_seconds": upstream.get("p95_seconds"), "upstream_share": upstream_share,
         "upstream_requests": upstream.get("count")},
        NEXT_CHECK["upstream"])


def _named_parts(t, shares: dict[str, float], other_lower: float | None, ttft_mean: float) -> tuple[list[str], str]:
    """The parts large enough to name (else the largest, with low confidence).
    The rest is a residual: named only when its lower bound is a part too."""
    named = [name for name, share in shares.items() if share >= t.ttft_part_share]
    confidence = "medium"
    if not named:
        named = [max(shares, key=lambda name: shares[name])]
        confidence = "low"
    if "other" in named and (other_lower is None or other_lower / ttft_mean < t.ttft_part_share):
        named = [name for name in named if name != "other"]
    return named, confidence


def _usage_while_waiting(ctx: EngineContext) -> float | None:
    if ctx.track is not None:
        peaks = ctx.track.waiting_usage_peaks
        return peaks[0][1] if peaks else None
    waiting_polls = [p for p in ctx.polls if (p.waiting or 0) > 0]
    return max((p.usage for p in waiting_polls if p.usage is not None), default=None)


def kv_bound(ctx: EngineContext, usage_while_waiting: float | None) -> bool:
    """The queue waits for KV blocks: the exhaustion detector holds and the
    cache was under pressure (`eviction_usage_ratio`) while requests waited,
    not a queue for slots that a later preemption happens to overlap. With
    no poll that saw one waiting, the span cannot say the cache held them.
    The PromQL twin: Fragments.kv_bound (mixin/promql.py)."""
    return (ctx.exhaustion is not None and usage_while_waiting is not None
            and usage_while_waiting >= ctx.t.eviction_usage_ratio)


def _queue_finding(ctx: EngineContext, evidence: dict[str, Any], headline: str, share_text: str,
                   confidence: str) -> Finding:
    t = ctx.t
    usage_while_waiting = _usage_while_waiting(ctx)
    queue_evidence = {**evidence, "kv_usage_max_while_waiting": usage_while_waiting,
                      "kv_usage_pressure_ratio": t.eviction_usage_ratio,
                      "kv_usage_threshold": t.exhaustion_usage_ratio,
                      "running_max": ctx.view.running_max, "preemptions": ctx.increase.counters.get("preemptions")}
    if kv_bound(ctx, usage_while_waiting):
        return ctx.finding(
            "slow_first_token", "queueing_kv_bound", confidence,
            f"{headline}; the queue is {share_text}, and the KV cache was exhausted while requests waited.",
            queue_evidence, NEXT_CHECK["queueing_kv_bound"])
    max_seqs, source = max_num_seqs(ctx)
    configured = t.max_num_seqs
    if configured is not None and (ctx.view.running_max or 0) >= configured:
        why = f"the batch was full at max_num_seqs={configured}"
    elif usage_while_waiting is None:
        why = "no poll saw a request waiting"
    else:
        why = f"KV usage at most {usage_while_waiting:.0%} while requests waited"
    # The cache may run out meanwhile (a long request preempted): the queue still waited with room.
    room = "had room while they waited" if ctx.exhaustion is not None else "was not exhausted"
    return ctx.finding(
        "slow_first_token", "queueing_compute_bound",
        confidence if usage_while_waiting is not None else "low",
        f"{headline}; the queue is {share_text} while the KV cache {room} ({why}): a bigger "
        "cache does not shorten this queue.",
        {**queue_evidence, "max_num_seqs": max_seqs, "max_num_seqs_source": source},
        NEXT_CHECK["queueing_compute_bound"])


def _prefill_finding(ctx: EngineContext, evidence: dict[str, Any], headline: str, share_text: str,
                     confidence: str) -> Finding:
    cached = ctx.value("kvwatch_prompt_tokens_cached_ratio")
    prompt_mean = ctx.value("kvwatch_prompt_tokens_per_request_mean")
    uncached = prompt_mean * (1 - cached) if prompt_mean is not None and cached is not None else None
    return ctx.finding(
        "slow_first_token", "prefill", confidence,
        f"{headline}; prefill is {share_text}"
        + (f", about {uncached:.0f} uncached prompt tokens per request." if uncached is not None else "."),
        {**evidence, "prompt_tokens_mean": prompt_mean, "prompt_tokens_cached_ratio": cached,
         "uncached_prompt_tokens_mean": uncached},
        NEXT_CHECK["prefill"])


def _residual_finding(ctx: EngineContext, evidence: dict[str, Any], headline: str, share_text: str,
                      confidence: str) -> Finding:
    """The time outside queue and prefill: preemption while the cache is exhausted, else the front end."""
    exhaustion = ctx.exhaustion
    if exhaustion is None:
        return ctx.finding(
            "slow_first_token", "front_end", confidence,
            f"{headline}; {share_text} is outside queue and prefill (front end, tokenization, scheduling).",
            evidence, NEXT_CHECK["front_end"])
    # A preempted request goes back to the queue and recomputes its KV:
    # neither vLLM's queue nor its prefill histogram counts that time, so the
    # residual grows exactly when the cache is the cause. While the exhaustion
    # detector holds (preemptions in the window, or the cache full while
    # requests waited) the residual is preemption, never the front end (the
    # alert rules split it the same way: mixin/alerts.py).
    return ctx.finding(
        "slow_first_token", "preemption", confidence,
        f"{headline}; {share_text} is outside queue and prefill while the KV cache was exhausted"
        + (f" ({count_text(exhaustion.preemptions)} preemptions in the window): preempted requests "
           "re-queued and recomputed, not the front end." if exhaustion.preemptions else
           " (full while requests waited, none preempted yet): requests held by the full cache, whose queue "
           "and prefill time vLLM counts only when they finish, not the front end."),
        {**evidence, "preemptions": exhaustion.preemptions,
         "kv_usage_max": ctx.value("kvwatch_kv_cache_usage_max_ratio")},
        NEXT_CHECK["preemption"])


check_judges("slow_first_token", JUDGES)
