"""The now span (diagnose/now.py): the rules over the last now_seconds read
the tail of the window's own per-engine polls, keep no track of their own,
and find what a window of the now span's length with its own track finds."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import kvwatch.diagnose.now as now_module
from kvwatch.diagnose.context import EngineContext, window_polls
from kvwatch.diagnose.exhaustion import clearly_over
from kvwatch.diagnose.thresholds import resolve_thresholds
from kvwatch.signals import evaluate_window
from kvwatch.window import Window
from sim_support import sim_monitor


def test_the_now_span_reads_the_windows_polls_and_finds_what_its_own_track_finds(monkeypatch):
    original = now_module.diagnose
    own: list[Window] = []
    found_any = []

    def checked(window, per_engine, events, thresholds, upstream, memory, lmcache, kv_events):
        if not own:
            own.append(Window(window.seconds, max_bytes=None))
        alone = own[0]
        alone.add(window.latest)  # every poll's snapshot, its steps its own
        before = copy.deepcopy(memory)
        found = original(window, per_engine, events, thresholds, upstream, memory, lmcache, kv_events)
        # No second per-engine track: the span's polls are the window's own Poll objects.
        assert "diagnosis_polls" not in window.kept
        assert [e.snapshot.time for e in window.entries] == [e.snapshot.time for e in alone.entries]
        tracks = window_polls(window.followed).engines
        for row in per_engine:
            polls = EngineContext(window, row, resolve_thresholds(thresholds)).polls
            mine = [p for p in tracks[(row.model, row.engine)].polls if p.time >= window.entries[0].snapshot.time]
            assert len(polls) == len(mine) and all(a is b for a, b in zip(polls, mine))
        rows, _ = evaluate_window(alone, lazy=True, models=False)
        assert found == original(alone, rows, events, thresholds, upstream, before, lmcache, kv_events)
        found_any.extend(found)
        return found

    monkeypatch.setattr(now_module, "diagnose", checked)
    monitor = sim_monitor("exhaustion", 420.0, every=5.0, window="2m")
    assert own and len(own[0].entries) == 7  # 30 s at 5 s, and the poll at its start
    assert {f.symptom for f in found_any} >= {"exhaustion"}
    assert monitor.judgment.window.followed is monitor.window


def test_an_exhaustion_that_ends_decisively_shows_ended_at_the_first_poll_the_now_span_misses_it(monkeypatch):
    """The simulated exhaustion's overload drains to an idle cache: at the
    first poll whose now span finds no exhaustion (nothing preempted or full
    over it) the cache is empty and nothing waits, so the finding reads
    "ended at" that poll at once, still critical, and is never active again;
    before, the quiet (35 s) hid the lapse and the critical stayed active
    after its condition ended. No max_num_seqs stated: no sizing advisory
    stands after it to make the lapse a pause of one episode (hold.py)."""
    original = now_module.diagnose
    found_now: list[bool] = []

    def spy(window, per_engine, *args):
        found = original(window, per_engine, *args)
        found_now.append(any(f.symptom == "exhaustion" for f in found))
        return found

    monkeypatch.setattr(now_module, "diagnose", spy)
    shown = []
    sim_monitor("exhaustion", 420.0, every=5.0, thresholds={},
                on_state=lambda state: shown.append((state.snapshot.time, [
                    f for f in state.findings if f.symptom == "exhaustion"])))
    assert len(found_now) == len(shown)
    first_found = found_now.index(True)
    lapse = found_now.index(False, first_found)
    at, findings = shown[lapse]
    before = shown[lapse - 1][1]
    assert [(f.severity, f.clearing_since) for f in before] == [("critical", None)], before
    assert [(f.cause, f.severity, f.clearing_since) for f in findings] == [
        (before[0].cause, "critical", at)], findings
    # Clearly over, so not hidden and never back: clearing until the hold ends it, then gone.
    assert not any(found_now[lapse:])
    assert all(f.clearing_since == at for _, later in shown[lapse:] for f in later)
    assert shown[-1][1] == []


def test_an_exhaustion_is_clearly_over_only_far_from_its_line_with_nothing_waiting():
    t = resolve_thresholds(None)
    below = t.eviction_usage_ratio - 0.01

    def over(usage, waiting, exhaustion=None):
        poll = SimpleNamespace(usage=usage, waiting=waiting)
        return clearly_over(SimpleNamespace(polls=[poll], exhaustion=exhaustion, t=t))

    assert over(below, 0.0)
    assert not over(t.eviction_usage_ratio, 0.0)  # between the two lines: a lapse near the threshold
    assert not over(below, 1.0)  # a queue: the cache may fill again as it drains
    assert not over(None, 0.0) and not over(below, None)  # unknown is not zero
    assert not over(below, 0.0, exhaustion=object())  # still found: preempted or full on the span
    assert not clearly_over(SimpleNamespace(polls=[], exhaustion=None, t=t))
