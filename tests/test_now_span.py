"""The now span (diagnose/now.py): the rules over the last now_seconds read
the tail of the window's own per-engine polls, keep no track of their own,
and find what a window of the now span's length with its own track finds."""

from __future__ import annotations

import copy

import kvwatch.diagnose.now as now_module
from kvwatch.diagnose.context import EngineContext, window_polls
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
