"""What the engine's KV-cache event stream decides (kvwatch/kvevents).

The page cannot tell a working set evicted before its reuse from prompts that
share nothing or a prefix that changed: vLLM counts idle cached blocks as
free and its prefix counters read the same. The stream tells them apart
block by block, over the recent part of the window (`hit_recent_seconds`):

- blocks come back after their eviction (`stored_again_ratio_high` of the
  blocks stored or more): **eviction before reuse**, high confidence, with
  the blocks that returned and the extra cache that would have kept them;
- none comes back (at most `stored_again_ratio_none`) while blocks are
  stored: blocks that returned before and stopped returning, or a drop the
  page saw, is a **changed prefix**; otherwise **no shared prefix**, high
  confidence once the stream has been read longer than the judged part
  (a block evicted before kvwatch listened cannot be seen returning);
- in between, the page's cause stands and the stream's numbers ride along.

Fewer than `stream_min_blocks` stored in the judged part and the stream
decides nothing. The stream is one engine's (its publisher's endpoint); its
findings go to the engine the report was joined with.

The stream's own health is a symptom of its own, `kv_events`: configured
but no publisher ever reached kvwatch (`events_never_connected`), none for
`kv_events_silence_seconds` while the engine stored blocks by its page
(`events_stopped`, kvwatch/kvevents/join.py's `silence`), or messages lost
on the way (sequence gaps) or dropped by kvwatch's bounded intake in the
window (`events_missed`).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

from kvwatch.diagnose.thresholds import Thresholds
from kvwatch.stream_report import KVEventsPause, KVEventsReport
from kvwatch.diagnose.vocabulary import NEXT_CHECK, Finding, severity_of
from kvwatch.kvevents.source import extra_for_share

REFINED = ("prefix_changed", "eviction_before_reuse", "no_reuse")
_HAS_ALTERNATIVES = "alternatives" in {f.name for f in fields(Finding)}


def baseline_confidence(confidence: str, evidence: dict[str, Any], t: Thresholds) -> str:
    """A finding judged against a remembered healthy hit ratio is as sure as
    that baseline is fresh: high only within the first quarter of
    hit_baseline_max_age_seconds, medium to its half, then low (another
    stretch of traffic may have followed it)."""
    age = evidence.get("hit_ratio_last_healthy_seconds_ago")
    if not isinstance(age, (int, float)):
        return confidence
    limit = t.hit_baseline_max_age_seconds
    cap = "high" if age <= limit / 4 else "medium" if age <= limit / 2 else "low"
    order = ("high", "medium", "low")
    return order[max(order.index(confidence), order.index(cap))] if confidence in order else confidence


def stream_target(report: KVEventsReport, per_engine) -> tuple[str, str] | None:
    """The (model, engine) the stream is read for: the engine its report was
    joined with, or the page's only engine."""
    engine = report.get("page_engine")
    if engine and (name := engine["engine"]) is not None:
        return engine["model_name"], name
    rows = [row for row in per_engine if row.engine is not None]
    return (rows[0].model, rows[0].engine) if len(rows) == 1 else None


def stream_residency(ctx) -> tuple[bool, dict[str, Any], str] | None:
    """What the stream says in place of vLLM's residency histograms
    (residency.residency): (evicted before reuse, evidence, "high"), or None
    where it cannot tell (not read, too few blocks stored, a ratio between
    the two thresholds, or not read long enough to see blocks return)."""
    report = ctx.stream
    if not report or not report.get("up"):
        return None
    if ctx.exhaustion is not None and ctx.exhaustion.preemptions > 0:
        # A preempted request's blocks are evicted and stored again when it
        # is recomputed: the preemptions explain them, no working set does.
        return None
    t = ctx.t
    recent = report["recent"]
    if recent["stored"] < t.stream_min_blocks or report["window"].get("cleared"):
        return None  # too little, or a reset of the cache in the window (what returns after it is no eviction's)
    ratio = recent["stored_again_ratio"] or 0.0
    evidence = {**stream_evidence(report), "decided_by": "kv_events"}
    if ratio >= t.stored_again_ratio_high:
        return True, evidence, "high"
    if ratio <= t.stored_again_ratio_none:
        listened = report.get("listening_seconds") or 0.0
        if listened < 2 * recent["seconds"]:
            return None  # a block evicted before kvwatch listened cannot be seen returning
        return False, evidence, "high"
    return None


def stream_findings(findings: list[Finding], report: KVEventsReport | None, per_engine, window,
                    t: Thresholds) -> list[Finding]:
    """`findings` with the stream's own health findings added (its decisions
    of hit-rate causes are the hit-rate rule's: stated_by_stream)."""
    if not report:
        return findings
    target = stream_target(report, per_engine)
    return findings + _health(report, target, window, t) if target is not None else findings


def stated_by_stream(finding: Finding, report: KVEventsReport | None, t: Thresholds) -> Finding:
    """A low-hit-rate finding of the stream's engine (`report`, None where the
    engine has no stream) in the stream's words where it decided the cause;
    its numbers and why not where it did not. The hit-rate rule calls it on
    the finding it judged, so its cause is decided in one place."""
    if not report or finding.symptom != "low_hit_rate" or finding.cause not in REFINED:
        return finding
    return _state(finding, report, t)


def cleared_seconds_ago(report: KVEventsReport | None) -> float | None:
    """How long ago the engine last cleared its whole prefix cache
    (AllBlocksCleared in its events: a reset, after which the cache refills
    from nothing), or None where the stream is not up or saw no clear."""
    if not report or not report.get("up"):
        return None
    cleared = [c for c in report.get("changes") or () if c.get("kind") == "kv_cache_cleared"]
    if not cleared:
        return None
    return (report.get("time") or cleared[-1]["time"]) - cleared[-1]["time"]


def stream_evidence(report: KVEventsReport) -> dict[str, Any]:
    """The stream's numbers a low-hit-rate finding of its engine carries."""
    recent, earlier, window = report["recent"], report["earlier"], report["window"]
    sizing = report.get("sizing") or {}
    half = extra_for_share(window.get("distance") or [], window.get("stored_again") or 0.0, 0.5)
    every = extra_for_share(window.get("distance") or [], window.get("stored_again") or 0.0, 1.0)
    evidence = {
        "kv_events_judged_seconds": recent["seconds"],
        "kv_events_blocks_stored": recent["stored"],
        "kv_events_blocks_evicted": recent["evicted"],
        "kv_events_blocks_stored_again": recent["stored_again"],
        "kv_events_stored_again_ratio": recent["stored_again_ratio"],
        "kv_events_stored_again_ratio_before": earlier["stored_again_ratio"],
        "kv_events_blocks_stored_before": earlier["stored"],
        "kv_events_return_seconds_median": window.get("return_seconds_median"),
        "kv_events_extra_blocks_to_keep_half": half,
        "kv_events_extra_blocks_to_keep_all": every,
        "kv_events_sampling_ratio": (report.get("table") or {}).get("sampling_rate"),
    }
    bytes_per_block = None
    for point in sizing.get("points") or []:
        if point.get("extra_blocks") and point.get("extra_bytes") is not None:
            bytes_per_block = point["extra_bytes"] / point["extra_blocks"]
            break
    if bytes_per_block is not None and half is not None:
        evidence["kv_events_extra_bytes_to_keep_half"] = half * bytes_per_block
    return evidence


def _state(finding: Finding, report: KVEventsReport, t: Thresholds) -> Finding:
    """A low-hit-rate finding of the stream's engine, in the stream's words
    where it decided; its numbers and why not where it did not."""
    if not report.get("up"):
        return finding
    recent = report["recent"]
    evidence = {**finding.evidence, **stream_evidence(report)}
    seconds = recent["seconds"]
    ratio = recent["stored_again_ratio"] or 0.0
    if finding.evidence.get("decided_by") != "kv_events":
        if recent["stored"] < t.stream_min_blocks:
            why = (f"the stream saw {recent['stored']:g} blocks stored in the last {seconds:.0f}s, fewer than "
                   f"stream_min_blocks ({t.stream_min_blocks:g}): it decides nothing yet")
        elif t.stored_again_ratio_none < ratio < t.stored_again_ratio_high:
            why = (f"{ratio:.0%} of the blocks stored in the last {seconds:.0f}s came back after their eviction: "
                   "between stored_again_ratio_none and stored_again_ratio_high, the stream does not decide")
        else:
            why = (f"none of the blocks stored came back, but the stream has been read for "
                   f"{report.get('listening_seconds') or 0:.0f}s, less than twice the judged part: a block "
                   "evicted before kvwatch listened cannot be seen returning")
        return replace(finding, evidence={**evidence, "kv_events": why})
    return _decided(finding, report, t, evidence)


def _new_load(finding: Finding, report: KVEventsReport) -> KVEventsPause | None:
    """The pause in the engine's stores (as long as the judged part or more)
    that began the load judged now, where what the page or the stream's
    earlier part compares it with came before that pause: then that was
    another load's reuse, not this load's prefix that changed."""
    pause = report.get("pause")
    if not pause or finding.evidence.get("changes_at_drop"):
        return None
    ago = finding.evidence.get("hit_ratio_last_healthy_seconds_ago")
    # A remembered healthy ratio is that old; a drop's baseline and the stream's earlier part end where the recent part starts.
    baseline_ended = ago if isinstance(ago, (int, float)) else report["recent"]["seconds"]
    return pause if baseline_ended >= pause["ended_seconds_ago"] else None


def _decided(finding: Finding, report: KVEventsReport, t: Thresholds, evidence: dict[str, Any]) -> Finding:
    """A low-hit-rate finding the stream decided, in the stream's words."""
    recent, earlier = report["recent"], report["earlier"]
    seconds = recent["seconds"]
    ratio = recent["stored_again_ratio"] or 0.0
    cause = finding.cause
    before = earlier["stored_again_ratio"]
    new_load = _new_load(finding, report) if cause in ("no_reuse", "prefix_changed") else None
    if new_load is not None:
        cause = "no_reuse"  # what was shared before the pause was another load's
        evidence.update(kv_events_quiet_seconds=new_load["seconds"],
                        kv_events_load_began_seconds_ago=new_load["ended_seconds_ago"])
    elif (cause == "no_reuse" and earlier["stored"] >= t.stream_min_blocks and before is not None
            and before >= t.stored_again_ratio_high and not finding.evidence.get("kv_cache_exhausted")
            and not report.get("window_exhausted")):
        # (Blocks stored again while the cache ran out are preempted requests recomputed, no shared prefix.)
        cause = "prefix_changed"  # blocks returned, and stopped returning while stores go on
    if cause == "eviction_before_reuse":
        extra = evidence.get("kv_events_extra_blocks_to_keep_half")
        in_bytes = evidence.get("kv_events_extra_bytes_to_keep_half")
        median = evidence.get("kv_events_return_seconds_median")
        summary = (f"Blocks are evicted before their reuse (the engine's KV-cache events decide it): "
                   f"{recent['stored_again']:.0f} of the {recent['stored']:.0f} blocks stored in the last "
                   f"{seconds:.0f}s ({ratio:.0%}) were stored again after their eviction, recomputed"
                   + (f", a median {median:.3g}s after it" if median is not None else "")
                   + (f"; about {extra:.0f} more blocks" + (f" ({in_bytes / 2**20:.0f} MiB)" if in_bytes else "")
                      + " would have kept half of them (estimate)" if extra else "") + "."
                   + _evictor(report, evidence))
    elif cause == "prefix_changed" and before is not None and before >= t.stored_again_ratio_high:
        summary = (f"The prefix changed (the engine's KV-cache events decide it): before the last {seconds:.0f}s, "
                   f"{before:.0%} of the stored blocks came back after their eviction; since, none of the "
                   f"{recent['stored']:.0f} blocks stored has: the requests stopped sharing what they shared.")
    elif cause == "prefix_changed":
        summary = (f"The prefix changed: {finding.summary.rstrip('.')}; the engine's KV-cache events rule out "
                   f"eviction: none of the {recent['stored']:.0f} blocks stored in the last {seconds:.0f}s came "
                   "back after an eviction, so the new prompts' blocks are new content.")
    else:
        summary = ("The prompts share no prefix the cache could keep (the engine's KV-cache events decide it): "
                   + (f"the engine stored nothing for {new_load['seconds']:.0f}s before this load began "
                      f"{new_load['ended_seconds_ago']:.0f}s ago, so the reuse before that pause was another "
                      "load's; " if new_load is not None else "")
                   + f"none of the {recent['stored']:.0f} blocks stored in the last {seconds:.0f}s came back "
                   "after an eviction, so a larger cache would not raise the hit ratio.")
    # Judged against no remembered baseline when the load is new: its age does not lower the confidence.
    confidence = "high" if new_load is not None else baseline_confidence("high", evidence, t)
    changes: dict[str, Any] = dict(cause=cause, severity=severity_of(cause), confidence=confidence,
                   summary=summary, evidence=evidence, next_check=NEXT_CHECK[cause])
    if _HAS_ALTERNATIVES:
        changes["alternatives"] = ()  # the stream told the causes apart
    return replace(finding, **changes)


def _evictor(report: KVEventsReport, evidence: dict[str, Any]) -> str:
    """The tenant (LoRA adapter) whose stores evicted other tenants' reusable
    blocks most over the stream's window, into the evidence, and its sentence."""
    found = report.get("evictor")
    if not found:
        return ""
    victims = ", ".join(found["victims"])
    evidence.update(evictor_tenant=found["evictor"], evictor_share=found["share"],
                    evictor_evicted_blocks=found["evicted_blocks"], evictor_victims=found["victims"],
                    reusable_evictions=found["reusable_evictions"])
    return (f" Tenant {found['evictor']} (its LoRA adapter on the events) evicted {found['share']:.0%} of the "
            f"{found['reusable_evictions']:.0f} reusable blocks evicted in the window, of {victims}.")


def _health(report: KVEventsReport, target: tuple[str, str], window, t: Thresholds) -> list[Finding]:
    model, engine = target
    found: list[Finding] = []
    silence = t.kv_events_silence_seconds
    age = report.get("last_message_age_seconds")
    quiet = report.get("silence") or {}
    intake = report.get("intake") or {}
    evidence = {"endpoint": report.get("endpoint"), "mode": report.get("mode"), "last_message_age_seconds": age,
                "kv_events_silence_seconds": silence, "reason": report.get("reason"), "detail": report.get("detail")}
    if never_connected(report, silence):
        found.append(Finding(
            "kv_events", "events_never_connected", severity_of("events_never_connected"), "high", model, engine,
            f"No publisher has reached kvwatch's KV-cache event endpoint {report.get('endpoint')} in the "
            f"{report.get('configured_seconds') or 0:.0f}s it has been configured, and no event arrived: the engine "
            "does not publish there (or kvwatch cannot listen), so the stream decides nothing.",
            {**evidence, "configured_seconds": report.get("configured_seconds"),
             "connections": intake.get("connections", 0)},
            NEXT_CHECK["events_never_connected"]))
    elif quiet.get("blocks", 0) >= 1:
        what = "no KV-cache event has arrived" if age is None else f"the last KV-cache event came {age:.0f}s ago"
        found.append(Finding(
            "kv_events", "events_stopped", severity_of("events_stopped"), "high", model, engine,
            f"The engine's KV-cache events stopped reaching kvwatch at {report.get('endpoint')}: {what}, while "
            f"by its page the engine stored at least {quiet['blocks']:.0f} blocks since ({quiet['prompt_tokens']:.0f} "
            f"prompt tokens, {quiet['cached_tokens']:.0f} of them cached); the stream's decisions are off.",
            {**evidence, "prompt_tokens_since": quiet["prompt_tokens"], "cached_tokens_since": quiet["cached_tokens"],
             "blocks_unseen": quiet["blocks"]},
            NEXT_CHECK["events_stopped"]))
    lost = report["window"].get("missed", 0) + report["window"].get("dropped", 0)
    if lost > 0:
        found.append(Finding(
            "kv_events", "events_missed", severity_of("events_missed"), "high", model, engine,
            f"{lost:g} KV-cache event messages were lost in the window ({report['window'].get('missed', 0):g} never "
            f"arrived, {report['window'].get('dropped', 0):g} dropped by kvwatch's bounded intake): the stream's "
            "counts are low by what they held.",
            {"missed_messages": report["window"].get("missed"), "dropped_messages": report["window"].get("dropped"),
             "messages": report["window"].get("messages"), "window_seconds": report["window"].get("seconds")},
            NEXT_CHECK["events_missed"]))
    return found


def never_connected(report: KVEventsReport, silence_seconds: float) -> bool:
    """Configured for `silence_seconds` or more, and neither a publisher's
    handshake nor a message reached kvwatch (or it cannot listen at all)."""
    connected = (report.get("intake") or {}).get("connections")
    return ((report.get("reason") == "listen" or (report.get("reason") == "no_events" and not connected))
            and (report.get("configured_seconds") or 0.0) >= silence_seconds)
