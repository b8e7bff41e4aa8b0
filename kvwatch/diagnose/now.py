"""Now and the window, apart: whether a finding is active is
judged on what is true now, the rules run over the last `now_seconds` (the
gauges as they stand, counters over the last few polls, the event stream's
recent blocks), while the window's finding stays the evidence and the
charts. The rules are the same code run over two spans, so there is one
definition of each condition.

A window finding whose symptom the rules no longer find now on its engine
has ended: it is left out here, and the hold (hold.py) reports it as
clearing, then gone. A symptom found now that the window does not show yet
(the window's quantiles lag: vLLM observes its queue and prefill histograms
when a request finishes) starts from the now finding.

Every mode judges so, through one NowJudgment: the sidecar and a replay,
the history (`kvwatch diagnose --prometheus`, backfill) and central mode.
The now span keeps no per-engine polls of its own: its rules read the tail
of the window's (context.EngineContext).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterable

from kvwatch.diagnose import NOT_DIAGNOSED_KEYS, diagnose
from kvwatch.diagnose.context import EngineContext, HitRateMemory
from kvwatch.diagnose.exhaustion import clearly_over
from kvwatch.diagnose.hold import FindingHold, where
from kvwatch.diagnose.thresholds import Thresholds, resolve_thresholds
from kvwatch.diagnose.vocabulary import Finding, is_actionable
from kvwatch.signals import evaluate_window
from kvwatch.window import Window

# Findings judged on their own span, not the window: changes are events, the
# stream's findings are facts about kvwatch's source, and the stuck detector
# already asks that nothing moved for stuck_seconds.
PREFER_NOW = True
OWN_SPAN = frozenset({"change", "kv_events", "stuck", "fleet"})


# Per symptom, whether its condition is clearly over on the now span of one engine (not merely
# unfound there): the hold then shows its lapse ended at once instead of hiding it for the quiet.
CLEARLY_OVER = {"exhaustion": clearly_over}


def judged_now(window: Iterable[Finding], now: Iterable[Finding]) -> list[Finding]:
    """The window's findings still true now, and the symptoms true now that
    the window does not show yet."""
    window, now = list(window), list(now)
    true_now = {where(f): f for f in now if f.symptom not in OWN_SPAN}
    shown = {where(f) for f in window}
    out = []
    for finding in window:
        fresh = true_now.get(where(finding))
        if finding.symptom in OWN_SPAN:
            out.append(finding)
        elif fresh is None:
            continue  # ended: the hold shows it clearing
        elif is_actionable(finding) and not is_actionable(fresh):
            out.append(fresh)  # an advisory now (a latent risk) is not the harm the window shows, still going on
        else:
            out.append(finding if not PREFER_NOW or fresh.cause == finding.cause else fresh)
    out += [f for f in now if f.symptom not in OWN_SPAN and where(f) not in shown]
    return out


class NowJudgment:
    """The one step every mode takes after its window's diagnosis: the
    sidecar (Monitor, and so a replay), the history and central mode
    (run._replica_step, one per replica). The rules run again over the last
    `now_seconds`, a span that follows the window on its own entries
    (Window.follow), and their findings decide which of the window's are
    still active (judged_now); the hold and its hysteresis (hold.py) then
    say what is shown. `thresholds` as given to diagnose (the settings'
    diagnosis section)."""

    def __init__(self, window_seconds: float, thresholds: Mapping[str, Any] | Thresholds | None = None):
        self.thresholds = resolved = resolve_thresholds(thresholds)
        # The latency histograms past the first token, which no rule reads, are not summed over it.
        self.window = Window(min(resolved.now_seconds, window_seconds), max_bytes=None,
                             left_out=NOT_DIAGNOSED_KEYS)
        # The hit-rate rule's memory of each engine's healthy ratio, as the now span saw it.
        self.memory = HitRateMemory()
        self.hold = FindingHold(resolved.finding_hold_seconds)

    def incumbents(self) -> set[tuple]:
        """The previous step's primary causes, for the window's diagnosis (diagnose's `incumbents`)."""
        return self.hold.incumbents()

    def judge(self, at: float, window: Window, window_findings: list[Finding], events, upstream=None,
              lmcache=None, kv_events=None, others: Iterable[Finding] = ()) -> list[Finding]:
        """The findings shown at `at`: the window's (diagnosed over `window`)
        judged now, plus `others` (findings judged on their own span, the
        router's), held. `upstream` is the upstream's report over the now
        span; `lmcache` and `kv_events` the poll's reports."""
        self.window.follow(window)
        if kv_events:
            # The stream's report spans the window: the now span's rules must know the window's cache ran out.
            kv_events = {**kv_events, "window_exhausted": any(f.symptom == "exhaustion" for f in window_findings)}
        per_engine, _ = evaluate_window(self.window, lazy=True, models=False)
        now = diagnose(self.window, per_engine, events, self.thresholds, upstream, self.memory, lmcache, kv_events)
        return self.hold.apply(at, judged_now(window_findings, now) + list(others), self._over(per_engine))

    def _over(self, per_engine) -> set[tuple[str, str, str]]:
        """The held findings' (symptom, model, engine) whose condition the now span finds clearly over."""
        wanted = {place for place in self.hold.held_where() if place[0] in CLEARLY_OVER}
        over = set()
        for row in per_engine:
            symptoms = [s for s, model, engine in wanted if (model, engine) == (row.model, row.engine or "")]
            if row.engine is None or not symptoms:
                continue
            ctx = EngineContext(self.window, row, self.thresholds)
            over |= {(s, row.model, row.engine) for s in symptoms if CLEARLY_OVER[s](ctx)}
        return over
