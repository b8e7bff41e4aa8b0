"""One window of one model's prefix reuse, split between the router and the
engines, and the causes of a low hit rate that lie in the router.

- predicted: what the router expected the replicas it chose to hold (llm-d:
  the predicted tokens' sum over the window; Dynamo, the legacy EPP: the mean
  of its per-request predicted ratios);
- available: what the best replica held, where the router says it (llm-d's
  best available tokens);
- delivered: what the engines counted as prefix-cache hits over the same
  window (vllm:prefix_cache_hits over vllm:prefix_cache_queries, summed over
  the model's replicas).

Causes (judge_routing):
- routing_miss: the router predicted reuse the engines did not deliver
  (delivered below routing_delivered_fraction of predicted): its index is
  stale, or the replicas evicted what it believes they hold;
- lost_prefix_affinity (the fleet cause, joined): the router chose replicas
  holding less than routing_affinity_fraction of what the best one held:
  its scoring ignores the prefix (round robin, load only);
- stale_router_metrics: the router's view of the replicas is older than its
  staleness bound (llm-d's stale endpoints above zero, or its poll interval
  configured longer than the bound), or its KV index applied no event while
  it routed (Dynamo).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvwatch.diagnose.vocabulary import NEXT_CHECK, Finding, severity_of
from kvwatch.routing.page import RouterReading

# The thresholds' defaults (the mixin's alert records read the same names).
ROUTING_THRESHOLDS: dict[str, float] = {
    # routing_miss: delivered below this share of predicted.
    "routing_delivered_fraction": 0.8,
    # ... and predicted at least this share of the prompt tokens (else nothing to miss).
    "routing_predicted_min_ratio": 0.1,
    # lost affinity: predicted below this share of the best available, which reuses at least hit_ratio_low.
    "routing_affinity_fraction": 0.6,
    "hit_ratio_low": 0.2,
    # The engines queried at least this many tokens in the window (as the hit-rate rules).
    "min_query_tokens": 1024,
}


@dataclass(frozen=True)
class RoutingWindow:
    """One model's window: the router's increases beside the engines'."""

    model: str
    dialect: str | None
    basis: str | None  # tokens | mean_ratio | requests
    role: str | None
    requests: float | None
    predicted_tokens: float | None
    available_tokens: float | None
    prompt_tokens: float | None
    predicted_ratio: float | None
    available_ratio: float | None
    delivered_tokens: float | None
    queried_tokens: float | None
    stale_endpoints: float | None = None
    events_applied: float | None = None
    poll_interval_s: float | None = None
    staleness_bound_s: float | None = None

    @property
    def delivered_ratio(self) -> float | None:
        if not self.queried_tokens or self.delivered_tokens is None:
            return None
        return self.delivered_tokens / self.queried_tokens

    def evidence(self) -> dict[str, Any]:
        return {"router": self.dialect, "basis": self.basis, "endpoint_role": self.role, "requests": self.requests,
                "predicted_tokens": self.predicted_tokens, "delivered_tokens": self.delivered_tokens,
                "available_tokens": self.available_tokens, "prompt_tokens": self.prompt_tokens,
                "queried_tokens": self.queried_tokens, "predicted_ratio": self.predicted_ratio,
                "delivered_ratio": self.delivered_ratio, "available_ratio": self.available_ratio}


def _increase(start: float | None, end: float | None) -> float | None:
    """A counter's increase with Prometheus' reset rule (a fall restarted from zero)."""
    if start is None or end is None:
        return None
    return end if end < start else end - start


def _ratio(part: float | None, whole: float | None) -> float | None:
    return part / whole if part is not None and whole else None


def attribute(model: str, start: RouterReading, end: RouterReading, delivered_tokens: float | None,
              queried_tokens: float | None, poll_interval_s: float | None = None,
              staleness_bound_s: float | None = None) -> RoutingWindow:
    """The window between two readings of one router page, beside the engines'
    prefix-cache hits and queries of `model` over the same window."""
    same = start.dialect == end.dialect
    requests = _increase(start.requests, end.requests) if same else None
    predicted = _increase(start.predicted_tokens, end.predicted_tokens) if same else None
    available = _increase(start.available_tokens, end.available_tokens) if same else None
    prompt = _increase(start.prompt_tokens, end.prompt_tokens) if same else None
    if end.basis == "tokens":
        predicted_ratio, available_ratio = _ratio(predicted, prompt), _ratio(available, prompt)
    elif end.basis == "mean_ratio":
        predicted_ratio, available_ratio = _ratio(_increase(start.ratio_sum, end.ratio_sum) if same else None,
                                                  requests), None
    else:
        predicted_ratio = available_ratio = None
    return RoutingWindow(
        model, end.dialect, end.basis, end.role, requests, predicted, available, prompt, predicted_ratio,
        available_ratio, delivered_tokens, queried_tokens, end.stale_endpoints,
        _increase(start.events_applied, end.events_applied) if same else None, poll_interval_s, staleness_bound_s)


def _stale(window: RoutingWindow) -> Finding | None:
    poll, bound = window.poll_interval_s, window.staleness_bound_s
    stale_share = 1 - bound / poll if poll is not None and bound is not None and poll > bound else None
    slow_poll = stale_share is not None
    no_events = window.events_applied == 0 and bool(window.requests)
    if not (slow_poll or (window.stale_endpoints or 0) > 0 or no_events):
        return None
    if stale_share is not None:
        why = (f"it polls the replicas every {poll:g} s against a staleness bound of {bound:g} s, so its view is "
               f"stale {stale_share:.1%} of each cycle")
    elif no_events:
        why = f"its KV index applied no event while it routed {window.requests:.0f} requests"
    else:
        why = f"{window.stale_endpoints:.0f} endpoints' metrics are missing or older than its staleness bound"
    evidence = {"router": window.dialect, "stale_endpoints": window.stale_endpoints, "poll_interval_s": poll,
                "staleness_bound_s": bound, "stale_share": stale_share,
                "events_applied": window.events_applied, "requests": window.requests}
    return Finding("routing", "stale_router_metrics", severity_of("stale_router_metrics"), "high", window.model,
                   None, f"The router of {window.model} decides on stale metrics: {why}.", evidence,
                   NEXT_CHECK["stale_router_metrics"])


def _miss(window: RoutingWindow, t: dict[str, float]) -> Finding | None:
    predicted, delivered = window.predicted_ratio, window.delivered_ratio
    if predicted is None or delivered is None or predicted < t["routing_predicted_min_ratio"]:
        return None
    if delivered >= t["routing_delivered_fraction"] * predicted:
        return None
    tokens = window.basis == "tokens"
    if tokens and window.predicted_tokens and window.delivered_tokens is not None:
        fraction = window.delivered_tokens / window.predicted_tokens
        said = (f"the router predicted {window.predicted_tokens:.0f} cached prompt tokens, the engines delivered "
                f"{window.delivered_tokens:.0f} ({fraction:.0%})")
    else:
        fraction = delivered / predicted
        said = (f"the router predicted a mean hit ratio of {predicted:.0%}, the engines delivered {delivered:.0%}")
    evidence = {**window.evidence(), "delivered_fraction": fraction}
    alternatives: tuple[dict[str, Any], ...] = ()
    if window.role == "prefill":
        alternatives = ({"cause": "prefill_decode_split", "decided_by": ["engines"],
                         "how": "the prediction is for prefill pods: compare with the prefill pods' hits only"},)
    return Finding("routing", "routing_miss", severity_of("routing_miss"), "high" if tokens else "medium",
                   window.model, None, f"Requests of {window.model} miss the prefixes their router routed them "
                   f"for: {said}.", evidence, NEXT_CHECK["routing_miss"], alternatives=alternatives)


def _affinity(window: RoutingWindow, t: dict[str, float]) -> Finding | None:
    predicted, available = window.predicted_ratio, window.available_ratio
    if predicted is None or available is None or available < t["hit_ratio_low"]:
        return None
    if predicted >= t["routing_affinity_fraction"] * available:
        return None
    evidence = {**window.evidence(), "replica": "*", "peers_hit_ratio": available, "hit_ratio": predicted}
    return Finding("fleet", "lost_prefix_affinity", severity_of("lost_prefix_affinity"), "high", window.model, None,
                   f"The router of {window.model} sends requests to replicas holding {predicted:.0%} of their "
                   f"prompts while the best replica held {available:.0%}: it routes without the prefix.",
                   evidence, NEXT_CHECK["lost_prefix_affinity"])


def decides_affinity(window: RoutingWindow, thresholds: dict[str, float] | None = None) -> bool:
    """Whether the window tells whether the router keeps prefix affinity: it
    says what its chosen replicas and the best one held, over enough queried
    tokens. Such a window decides lost_prefix_affinity for its model, in place
    of the fleet's peer comparison (which sees hits, not where each prompt's
    prefix was held)."""
    t = {**ROUTING_THRESHOLDS, **(thresholds or {})}
    return (window.predicted_ratio is not None and window.available_ratio is not None and bool(window.requests)
            and (window.queried_tokens or 0.0) >= t["min_query_tokens"])


def judge_routing(window: RoutingWindow, thresholds: dict[str, float] | None = None) -> list[Finding]:
    """The routing findings of one model's window (none while too little was queried)."""
    t = {**ROUTING_THRESHOLDS, **(thresholds or {})}
    findings = [f for f in (_stale(window),) if f is not None]
    if (window.queried_tokens or 0.0) < t["min_query_tokens"] or not window.requests:
        return findings
    miss = _miss(window, t)
    if miss is not None:
        return findings + [miss]
    affinity = _affinity(window, t)
    return findings + ([affinity] if affinity is not None else [])
