"""A stuck engine: requests or KV blocks held, nothing moving, no work done.

Users report it as "KV usage near 100 % for hours with no traffic until a
restart" and "Running 1, Waiting 14 for an hour". It is not exhaustion: a
full cache that serves requests counts tokens every step, and its running
and waiting requests come and go; a stuck engine counts none, and its
gauges stand still. The one detector (`stuck`), read by the rule and by the
exhaustion and first-token rules (which name nothing while the engine is
stuck: a frozen full cache is no concurrency problem), decides over the last
`stuck_seconds`:

- no progress: no prompt, generated or decoded token and no finished request
  counted in any step of the span (the counters must be on the page: unknown
  is not zero), and no restart;
- nothing moves: running requests and KV usage each hold one value in every
  poll of the span, and the waiting ones never fall (arrivals may join a
  queue nothing serves);
- something is held: requests running or waiting (`requests_stalled`), or,
  with none, KV usage above 0 (`kv_held_idle`: vLLM and SGLang count idle
  prefix-cached blocks as free, so an idle engine's usage is 0).

An engine asleep (vLLM's sleep mode) holds still by design and is never
stuck. The span needs a poll at or before its start: a window shorter than
`stuck_seconds` decides nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvwatch.diagnose.context import EngineContext, Poll
from kvwatch.diagnose.vocabulary import NEXT_CHECK, Finding

# Counters whose increase is work done. SGLang counts prompt and generated
# tokens when a request finishes; its realtime counters (prefix queries from
# realtime_tokens, decode_tokens) move every log interval.
PROGRESS = ("generation_tokens", "prompt_tokens", "prefix_queries", "decode_tokens")


@dataclass(frozen=True)
class Stuck:
    cause: str  # requests_stalled | kv_held_idle
    since: float  # the first poll of the span
    seconds: float  # how long it has held still, at least
    running: float | None
    waiting: float | None
    usage: float | None
    polls: int
    waiting_at_start: float | None = None


def stuck(ctx: EngineContext) -> Stuck | None:
    """The one detector, judged once per engine and poll."""
    found: Stuck | None | bool = getattr(ctx, "_stuck", False)
    if found is False or found is True:  # not judged yet (False is never a verdict)
        found = _judge(ctx)
        setattr(ctx, "_stuck", found)  # noqa: B010 - kept on the context, which declares no such field
    return found


def _judge(ctx: EngineContext) -> Stuck | None:
    polls = ctx.polls
    if len(polls) < 2:
        return None
    # The common cases end at the latest poll, without a walk (the same
    # answer the walk gives: it would stop at the same poll): an engine
    # that made progress in its latest step, or holds nothing.
    latest = polls[-1]
    if latest.step is None or any(value > 0 for key, value in latest.step.counters.items()
                                  if key in PROGRESS or key.startswith("finished/")):
        return None
    if not (latest.running or latest.waiting or latest.usage):
        return None
    limit = ctx.t.stuck_seconds
    now = polls[-1].time
    start_index = None
    for index in range(len(polls) - 1, -1, -1):
        if polls[index].time <= now - limit:
            start_index = index
            break
    if start_index is None:
        return None  # the window does not reach back that far
    span = polls[start_index:]
    latest = span[-1]
    if latest.gauge("sleep_state/awake") == 0:
        return None
    # Unknown is not zero: the engine must count its work on the page.
    counted = [key for key in PROGRESS if key in latest.engine.counters]
    if not counted:
        return None
    for poll in span[1:]:
        step = poll.step
        if step is None or step.restarted:
            return None
        counters = step.counters
        if any(counters.get(key, 0.0) > 0 for key in counted):
            return None
        if any(value > 0 for key, value in counters.items() if key.startswith("finished/")):
            return None
    running, usage = _still(span, "running"), _still(span, "usage")
    waiting = _rising(span)
    if running is False or waiting is False or usage is False:
        return None  # something moved
    held = (running or 0.0) + (waiting or 0.0)
    if held > 0:
        cause = "requests_stalled"
    elif usage is not None and usage > 0:
        cause = "kv_held_idle"
    else:
        return None  # idle: nothing held, nothing to do
    return Stuck(cause, span[0].time, now - span[0].time, running, waiting, usage, len(span), span[0].waiting)


def _still(span: list[Poll], attr: str):
    """The one value a gauge held over the span; None where the page lacks
    it; False where it moved."""
    values = {getattr(poll, attr) for poll in span}
    if values == {None}:
        return None
    if len(values) != 1:
        return False
    return values.pop()


def _rising(span: list[Poll]):
    """The waiting requests now, where they never fell over the span (new
    arrivals may join a queue nothing serves); None where the page lacks
    them; False where they fell (something was admitted or aborted)."""
    values = [poll.waiting for poll in span]
    if all(value is None for value in values):
        return None
    if any(value is None for value in values) or any(b < a for a, b in zip(values, values[1:])):  # type: ignore[operator]  # no None past the first test
        return False
    return values[-1]


def stuck_findings(ctx: EngineContext) -> list[Finding]:
    found = stuck(ctx)
    if found is None:
        return []
    minutes = found.seconds / 60
    evidence = {"stuck_seconds": found.seconds, "running": found.running, "waiting": found.waiting,
                "waiting_at_start": found.waiting_at_start, "kv_usage": found.usage, "polls": found.polls,
                "tokens_counted": 0}
    if found.cause == "requests_stalled":
        queue = (f"{_count(found.waiting)} waiting" if found.waiting == found.waiting_at_start else
                 f"{_count(found.waiting)} waiting (from {_count(found.waiting_at_start)}, none admitted)")
        summary = (f"{_count(found.running)} running and {queue} requests have not moved for {minutes:.1f} min while "
                   "the engine counted no token and finished no request: the engine is stuck, not exhausted"
                   + (f" (KV usage {found.usage:.0%}, frozen too)" if found.usage else "") + ".")
    else:
        summary = (f"KV usage stays at {found.usage:.0%} for {minutes:.1f} min with no request running or waiting and "
                   "no token counted: blocks held by nothing the engine reports.")
    return [ctx.finding("stuck", found.cause, "high", summary, evidence, NEXT_CHECK[found.cause])]


def _count(value: float | None) -> str:
    return "?" if value is None else f"{value:g}"
