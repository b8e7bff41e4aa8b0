"""The real engine's scripted sequence is scored by the simulator's scorer
(kvwatch/sim/score.py): PollRecorder takes a live Monitor's polls and places
them in the sequence's phases; a Timeline gives the phases' stories."""

from __future__ import annotations

from fuzz.pages import Engine, page
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sim.score import Phase, PollRecorder, Timeline, score
from kvwatch.sim.story import Story
from kvwatch.settings import load_settings
from page_support import Pages


def test_polls_fall_in_the_phase_they_follow_and_a_preemption_is_the_cache_running_out():
    pages = [page(Engine(prompt_tokens=100 * n, finished_stop=n, preemptions=3 if n >= 5 else 0, usage=0.5))
             for n in range(1, 9)]
    times = iter(1000.0 + 5 * i for i in range(len(pages)))
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics"}, environ={})
    monitor = Monitor(settings, fetcher=Pages(pages), clock=lambda: next(times))
    recorder = PollRecorder()
    for _ in pages:
        recorder(monitor.poll_once())
    polls = recorder.polls([1007.0, 1018.0])
    assert [(p.at, p.phase, p.into) for p in polls] == [
        (3.0, 0, 3.0), (8.0, 0, 8.0), (13.0, 1, 2.0), (18.0, 1, 7.0), (23.0, 1, 12.0), (28.0, 1, 17.0)]
    assert [p.full for p in polls] == [False, False, True, False, False, False]  # the poll after the preemptions


def test_a_timeline_is_scored_as_a_scenario_is():
    recorder = PollRecorder()
    recorder.records = [(100.0 + 10 * i, (), False) for i in range(12)]
    timeline = Timeline((Phase("quiet", Story(None)), Phase("evicting", Story("low_hit_rate"))))
    result = score(timeline, recorder.polls([100.0, 150.0]), settle=20)
    assert result.start_seconds == [("evicting (cycle 0)", None)]  # no finding ever came
    assert result.banner_by_phase == {"quiet (cycle 0)": [3, 3], "evicting (cycle 0)": [0, 5]}  # from 20 s in
