"""Diagnosis: symptom -> likely cause, with the evidence that decided it and
the next thing to check.

Symptoms and the causes told apart (these `symptom`/`cause` values are also the
labels of `kvwatch_finding` and of the generated alert rules; do not rename):

exhaustion        concurrency_beyond_capacity, long_requests,
                  capacity_below_max_num_seqs
low_hit_rate      caching_disabled, cold_cache, prefix_changed,
                  eviction_before_reuse, no_reuse
slow_first_token  queueing_kv_bound, queueing_compute_bound, prefill,
                  front_end, upstream, preemption
stuck             requests_stalled, kv_held_idle
change            model_changed, lora_changed, cache_dtype_changed,
                  cache_config_changed, engine_restarted
kv_events         events_stopped, events_missed

Rules run per (model, engine): the KV cache, its queue and its counters belong
to one engine core. Every rule reads only the window (so a finding starts when
its evidence is inside the window, like an alert over `rate(...[5m])`) plus the
change events the monitor recorded; the callers hold each finding until its
condition has been clear for `finding_hold_seconds` (hold.py), as the alerts'
keep_firing_for does. One detector
decides whether an engine's KV cache was exhausted, and the exhaustion rules,
the queueing split and the hit-rate rules all use it: exhaustion is never
called compute-bound queueing (nor the reverse), and while the cache is
exhausted a low hit rate is named only on evidence the exhaustion does not
explain (caching off, a restart, a change at the drop, a drop that showed
before the exhaustion, residency histograms). The exhaustion causes are
decided once per window from its means, as the generated alert rule decides
them over its rate window, so the two agree and exactly one of
concurrency_beyond_capacity and long_requests is named.

With the engine's KV-cache event stream (`kv_events`), the low-hit-rate
causes the page cannot tell apart are decided block by block
(diagnose/stream.py): blocks stored again after their eviction name eviction
before reuse, blocks that never return name no shared prefix or a changed
one; the stream's own silence and losses are the `kv_events` symptom.

With an LMCache tier beside the engine (`lmcache_target`), a low engine hit
ratio is not `no_reuse` while the tier supplies at least `hit_ratio_low` of the
model's prompt tokens, and the other low-hit-rate findings name the tier in
their evidence (hit_rate.with_external_tier).

Per engine and symptom one cause is primary (diagnose/arbitration.py: the
rule, written once); the other causes the rules found ride on it as
contributing factors, and causes the data cannot tell from it as
alternatives, both data. While the cache is exhausted, the first-token time
the queue and prefill histograms miss is `preemption`, never `front_end`.

Findings never claim more than their evidence. A prefix-cache hit means KV
computed for earlier tokens was reused; it proves neither that an answer is
current nor that the caller may see it, and no finding says otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from kvwatch.diagnose.arbitration import arbitrate
from kvwatch.diagnose.changes import Change, change_findings, changes_between, names_text, window_changes
from kvwatch.diagnose.context import EngineContext
from kvwatch.diagnose.exhaustion import exhaustion_findings
from kvwatch.diagnose.first_token import slow_first_token_findings
from kvwatch.diagnose.context import HitRateMemory
from kvwatch.diagnose.hit_rate import low_hit_rate_findings, with_external_tier
from kvwatch.diagnose.stream import stream_findings, stream_target
from kvwatch.diagnose.stuck import stuck, stuck_findings
from kvwatch.diagnose.thresholds import DEFAULT_THRESHOLDS, Thresholds, resolve_thresholds, validate_thresholds
from kvwatch.diagnose.vocabulary import CAUSES, CONFIDENCES, NEXT_CHECK, SEVERITIES, Finding, finding_order, is_actionable

log = logging.getLogger("kvwatch")

# Canonical snapshot keys no rule reads, directly or through the signals it
# reads: the latency histograms past the first token. `kvwatch diagnose
# --prometheus` does not ask the store for them (in vLLM 0.32 they are 116 of
# a replica's 256 series); central mode does, as it serves each replica's
# status page. tests/test_history_pages.py replays every real recording with
# and without them and requires the same findings, poll for poll.
NOT_DIAGNOSED_KEYS = frozenset({"decode_time", "inference_time", "e2e_latency", "inter_token_latency", "tpot"})

__all__ = ["CAUSES", "CONFIDENCES", "DEFAULT_THRESHOLDS", "Thresholds", "NEXT_CHECK", "NOT_DIAGNOSED_KEYS", "SEVERITIES", "Change",
           "Finding",
           "HitRateMemory",
           "changes_between", "diagnose", "is_actionable", "names_text", "resolve_thresholds", "validate_thresholds"]


# Evidence that reads a counter whose meaning the engine's version changed
# (Snapshot.counting): the note each finding citing it carries, and the
# counter it reads.
COUNTING_NOTES = (("hit_ratio", "prefix_queries", "hit_ratio_counting"),
                  ("preemptions", "preemptions", "preemptions_counting"))


def note_counting(findings: list[Finding], counting: dict[str, str]) -> None:
    """Adds to each finding whose evidence cites such a counter the sentence
    on how this version counts it (a string in the evidence is a note)."""
    if not counting:
        return
    for finding in findings:
        for part, key, note in COUNTING_NOTES:
            if key in counting and any(part in name and isinstance(value, (int, float)) and value is not None
                                       for name, value in finding.evidence.items()):
                finding.evidence[note] = counting[key]


def diagnose(window, per_engine, events, thresholds: Mapping[str, Any] | Thresholds | None, upstream=None,
             hit_memory: HitRateMemory | None = None, lmcache=None, kv_events=None,
             incumbents: frozenset | set = frozenset()) -> list[Finding]:
    """Findings for the window, most severe first. The rules judge each
    engine, whose cache and queue are its own. A rule that fails drops only
    its own findings. `hit_memory` (kept by the caller across polls) carries
    each engine's last healthy hit ratio beyond the window; `incumbents`
    (FindingHold.incumbents()) the previous poll's primary causes."""
    resolved = resolve_thresholds(thresholds)
    changes: list[Change] = []
    try:
        changes = window_changes(window, events)
    except Exception:  # pragma: no cover - defensive: one rule must not hide the rest
        log.exception("diagnosis: reading changes failed")
    findings: list[Finding] = []
    for row in per_engine:
        if row.engine is None:
            continue
        ctx = EngineContext(window, row, resolved, changes, hit_memory)
        if kv_events and stream_target(kv_events, per_engine) == (row.model, row.engine):
            ctx.stream = kv_events
        first = len(findings)
        try:
            held = stuck(ctx)
        except Exception:  # pragma: no cover - defensive: one rule must not hide the rest
            log.exception("diagnosis: the stuck detector failed for %s/%s", row.model, row.engine)
            held = None
        # A stuck engine is its own finding: its frozen full cache is no
        # exhaustion, and its first tokens are not slow but absent.
        rules = (lambda: stuck_findings(ctx), lambda: low_hit_rate_findings(ctx)) if held is not None else (
            lambda: exhaustion_findings(ctx),
            lambda: low_hit_rate_findings(ctx),
            lambda: slow_first_token_findings(ctx, upstream),
        )
        for rule in rules:
            try:
                findings.extend(rule())
            except Exception:
                log.exception("diagnosis rule failed for %s/%s", row.model, row.engine)
        note_counting(findings[first:], row.view.counting)
    if lmcache:
        prompt_tokens: dict[str, float] = {}
        for row in per_engine:
            if row.engine is not None:
                prompt_tokens[row.model] = (prompt_tokens.get(row.model, 0.0)
                                            + row.view.increase.counters.get("prompt_tokens", 0.0))
        try:
            findings = with_external_tier(findings, lmcache, prompt_tokens, resolved)
        except Exception:  # pragma: no cover - defensive
            log.exception("diagnosis: reading the LMCache tier failed")
    if kv_events:
        try:
            findings = stream_findings(findings, kv_events, per_engine, window, resolved)
        except Exception:  # pragma: no cover - defensive
            log.exception("diagnosis: reading the KV-cache event stream failed")
    try:
        findings.extend(change_findings(window, changes))
    except Exception:
        log.exception("diagnosis: change rule failed")
    # One story per engine and symptom: one primary cause, the rest carried
    # as its contributing factors (arbitration.py).
    return arbitrate(findings, incumbents)

