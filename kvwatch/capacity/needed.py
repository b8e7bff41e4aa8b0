"""What capacity an objective needs, inverted from history (no I/O): "to
hold first-token p95 under X at the observed peak, this model needs N
replicas or G GiB of KV cache per replica", with the assumptions, the error
and the caveat that arithmetic is not a guarantee. The store is read by
kvwatch/history/needed.py.

The arithmetic: a request waits for its first token past the objective when
it cannot be admitted, that is when the cache cannot hold every request in
the system at once. So the cache must hold the peak's requests (running +
waiting) at their footprint in blocks (KV blocks used / requests running, at
the steps near the peak). Where the first token is over the objective even
without a queue, prefill itself is slow: no cache or replica count fixes it,
and the answer says so."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

GIB = float(1 << 30)
# The steps whose demand is within this share of the peak's price the footprint (and give its spread).
NEAR_PEAK = 0.9
CAVEAT = ("arithmetic, not a guarantee: it assumes the peak repeats with the same lengths and that the cache is "
          "what holds the first token back; check it with a run at the setting")


@dataclass(frozen=True)
class Step:
    at: float
    running: float
    waiting: float
    replicas: float
    usage_sum: float | None  # KV usage summed over the replicas (0..1 each)
    ttft_p95: float | None  # seconds, over the store's rate window ending here


@dataclass(frozen=True)
class CacheShape:
    usable_blocks: int  # num_gpu_blocks - 1 per replica
    block_size: int
    bytes_per_block: float | None
    source: str  # the series it was read from


def _footprints(steps: list[Step], peak: float, usable_blocks: int) -> list[float]:
    """Blocks per running request at the steps near the peak."""
    return [s.usage_sum * usable_blocks / s.running for s in steps
            if s.running > 0 and s.usage_sum and s.running + s.waiting >= NEAR_PEAK * peak]


def _for_footprint(footprint: float, demand: float, replicas: float, shape: CacheShape) -> dict[str, Any]:
    holds = max(1, math.floor(shape.usable_blocks / footprint))  # requests one replica's cache holds
    per_replica = math.ceil(demand / max(1.0, replicas))
    blocks = math.ceil(per_replica * footprint) + 1  # vLLM's null block is never allocated
    return {"footprint_blocks": footprint, "requests_per_replica": holds,
            "replicas": max(1, math.ceil(demand / holds)), "blocks_per_replica": blocks,
            "gib_per_replica": None if shape.bytes_per_block is None else blocks * shape.bytes_per_block / GIB}


def needed(model: str, steps: list[Step], objective_seconds: float, shape: CacheShape) -> dict[str, Any]:
    """The capacity the objective needs at the observed peak, for one model."""
    if not steps or max(s.running + s.waiting for s in steps) <= 0:
        return {"model_name": model, "answer": f"{model}: no request in the range; nothing to size", "found": False}
    peak_step = max(steps, key=lambda s: (s.running + s.waiting, -s.at))
    demand = peak_step.running + peak_step.waiting
    footprints = _footprints(steps, demand, shape.usable_blocks)
    queue_free = [s.ttft_p95 for s in steps if s.waiting == 0 and s.running > 0 and s.ttft_p95 is not None]
    slow_alone = max(queue_free) if queue_free else None
    out: dict[str, Any] = {
        "model_name": model, "found": bool(footprints), "objective_seconds": objective_seconds,
        "peak": {"at": peak_step.at, "requests": demand, "running": peak_step.running,
                 "waiting": peak_step.waiting, "replicas": peak_step.replicas, "ttft_p95": peak_step.ttft_p95},
        "queue_free_ttft_p95_max": slow_alone, "cache": vars(shape).copy(), "caveat": CAVEAT,
        "assumptions": [
            "the first token waits past the objective only while requests wait for KV blocks (queueing for "
            "the cache); the other waits are taken as they were",
            f"a request holds the footprint of the running ones at the steps within {NEAR_PEAK:.0%} of the "
            "peak's demand (KV blocks used / requests running)",
            "every replica of the model has the cache of " + shape.source,
            "the load spreads evenly over the replicas, and the engine's max_num_seqs admits what the cache holds"],
    }
    if not footprints:
        out["answer"] = f"{model}: no step near the peak with requests running and KV usage; nothing to size"
        return out
    middle = _for_footprint(statistics.median(footprints), demand, peak_step.replicas, shape)
    low, high = (_for_footprint(f, demand, peak_step.replicas, shape) for f in (min(footprints), max(footprints)))
    out.update(estimate=middle, low=low, high=high,
               error=(f"the footprint ranged {min(footprints):.1f}-{max(footprints):.1f} blocks a request over "
                      f"{len(footprints)} steps near the peak: {low['replicas']}-{high['replicas']} replicas, "
                      f"{low['blocks_per_replica']:,}-{high['blocks_per_replica']:,} blocks a replica"))
    out["answer"] = answer(out)
    return out


def answer(result: dict[str, Any]) -> str:
    """The one sentence, with its bound where prefill alone misses the objective."""
    model, objective, peak, mid = (result["model_name"], result["objective_seconds"], result["peak"],
                                   result["estimate"])
    gib = (f" or {mid['gib_per_replica']:.2f} GiB of KV cache per replica at {peak['replicas']:g} replicas"
           if mid["gib_per_replica"] is not None else
           f" or {mid['blocks_per_replica']:,} KV blocks per replica at {peak['replicas']:g} replicas")
    text = (f"To hold first-token p95 under {objective:g} s at the observed peak ({peak['requests']:g} requests "
            f"in the system), {model} needs {mid['replicas']} replicas{gib}.")
    slow = result.get("queue_free_ttft_p95_max")
    if slow is not None and slow > objective:
        text += (f" But its first-token p95 reached {slow:.3g} s with nothing waiting: prefill alone misses the "
                 "objective, which no cache size or replica count fixes.")
    return text


def lines(result: dict[str, Any]) -> list[str]:
    """The report as text: the answer, the peak, the error, the assumptions and the caveat."""
    out = [result["answer"]]
    if not result.get("found"):
        return out
    peak = result["peak"]
    ttft = "unknown" if peak["ttft_p95"] is None else f"{peak['ttft_p95']:.3g} s"
    out += ["", f"Observed peak: {peak['running']:g} running + {peak['waiting']:g} waiting on {peak['replicas']:g} "
            f"replicas; first-token p95 then {ttft}.", f"Error: {result['error']}.", "Assumptions:"]
    out += [f"  - {item}" for item in result["assumptions"]]
    out += ["", f"This is {result['caveat']}."]
    return out
