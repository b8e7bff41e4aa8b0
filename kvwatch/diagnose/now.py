"""Now and the window, apart (issue #55): whether a finding is active is
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
"""

from __future__ import annotations

from typing import Iterable

from kvwatch.diagnose.vocabulary import Finding, is_actionable

# Findings judged on their own span, not the window: changes are events, the
# stream's findings are facts about kvwatch's source, and the stuck detector
# already asks that nothing moved for stuck_seconds.
PREFER_NOW = True
OWN_SPAN = frozenset({"change", "kv_events", "stuck", "fleet"})


def _where(finding: Finding) -> tuple[str, str, str]:
    return (finding.symptom, finding.model, finding.engine or "")


def judged_now(window: Iterable[Finding], now: Iterable[Finding]) -> list[Finding]:
    """The window's findings still true now, and the symptoms true now that
    the window does not show yet."""
    window, now = list(window), list(now)
    true_now = {_where(f): f for f in now if f.symptom not in OWN_SPAN}
    shown = {_where(f) for f in window}
    out = []
    for finding in window:
        fresh = true_now.get(_where(finding))
        if finding.symptom in OWN_SPAN:
            out.append(finding)
        elif fresh is None:
            continue  # ended: the hold shows it clearing
        elif is_actionable(finding) and not is_actionable(fresh):
            out.append(fresh)  # an advisory now (a latent risk) is not the harm the window shows, still going on
        else:
            out.append(finding if not PREFER_NOW or fresh.cause == finding.cause else fresh)
    out += [f for f in now if f.symptom not in OWN_SPAN and _where(f) not in shown]
    return out
