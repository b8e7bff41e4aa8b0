"""The story over time on the tier's real vLLM, scored as the simulated
demo is (kvwatch/sim/score.py): a scripted sequence of loads with known
boundaries (a warm shared working set, a rotation that evicts it, a burst
past the 4 MiB cache, prompts that share nothing, the warm set again), one
kvwatch at its default settings (5 s polls, 5 min window, the now span and
the hold) polling the engine the whole time, and every poll it made scored
against the story its phase states.

Bars: each phase's finding starts within START_BAR of its phase's start and
has ended (gone, or shown clearing) CLEAR_BAR after its condition ended; no
finding is born clearing; no critical finding is first shown after the
condition it is about ended, nor shown active past CLEAR_BAR after it. A
phase's condition ends when its load has drained (the next load starts
then). The banner and false findings are reported, not held to the
simulated bars: the real engine's prompts and timings are noisier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest

from kvwatch.sim.score import Phase, Poll, PollRecorder, Timeline, score
from kvwatch.sim.story import Story

from promstack import wait_until

from .harness import LoadRun, burst_load, wait_until_idle
from .kvwatch_support import running_kvwatch, tier_reporter
from .scenarios import distinct_load, prefix_rotation_load

pytestmark = pytest.mark.vllm

START_BAR = 45.0
CLEAR_BAR = 90.0
SEED = 31
WARM = 4  # prefixes of 17 blocks: 68 of the 128, warm after one pass


def warm_set(url: str, seconds: float) -> LoadRun:
    return prefix_rotation_load(url, duration=seconds, phases=((0.0, WARM),), seed=SEED)


@dataclass(frozen=True)
class Step:
    phase: Phase
    seconds: float  # of load; the phase lasts until its requests have drained
    load: Callable[[str, float], LoadRun]


STEPS = (
    Step(Phase("healthy", Story(None)), 50.0, warm_set),
    # 12 prefixes of 17 blocks in rotation need 204 of the 128: each is evicted before its turn.
    Step(Phase("eviction", Story("low_hit_rate")), 55.0,
         lambda url, seconds: prefix_rotation_load(url, duration=seconds, seed=SEED + 1)),
    # 24 requests of 400 + 400 tokens in flight against room for about 5: preempted and queued.
    # The banner leads with what users feel (causes.FELT_ORDER): the queue behind the full cache, where the
    # tiny model misses the default first-token objective; the story names the cache, which runs out on any machine.
    # 55 s of load: a phase scores its start only if a poll lands 45 s (START_BAR) into it, and at
    # 5 s polls a 45 s burst that drained in 49 s left its last poll at 44 s once in two runs.
    Step(Phase("burst", Story("exhaustion", ("slow_first_token", "low_hit_rate"))), 55.0,
         lambda url, seconds: burst_load(url, duration=seconds)),
    # As long as the clear bar and more: the burst's finding is looked for ending within the next phase,
    # and at the defaults an exhaustion ends up to the now span (30 s) and its quiet (35 s) after its
    # condition, so a shorter phase could not show it ending in time.
    Step(Phase("distinct", Story("low_hit_rate")), 100.0,
         lambda url, seconds: distinct_load(url, duration=seconds)),
    Step(Phase("healthy again", Story(None)), 95.0, warm_set),
)


def late_criticals(polls: list[Poll], timeline: Timeline) -> list[str]:
    """Critical findings shown active after the condition they are about
    ended (not allowed by the phase they are shown in): each one first shown
    then, or still active past CLEAR_BAR into that phase."""
    out = []
    before: set[tuple[str, str]] = set()
    for poll in polls:
        story = timeline.phases[poll.phase].story
        active = {(f.symptom, f.cause) for f in poll.findings if f.severity == "critical" and not f.clearing}
        for symptom, cause in sorted(active):
            if story is not None and not story.allows(symptom, cause):
                if (symptom, cause) not in before:
                    out.append(f"{symptom}/{cause} first shown {poll.into:.0f} s into {timeline.phases[poll.phase].name}")
                elif poll.into > CLEAR_BAR:
                    out.append(f"{symptom}/{cause} still active {poll.into:.0f} s into "
                               f"{timeline.phases[poll.phase].name}")
        before = active
    return out


# One server start (the tier's, shared) and about 6 minutes of loads and drains.
@pytest.mark.timeout(720)
def test_a_scripted_sequence_on_the_real_engine_scored_at_the_default_settings(real_vllm, request):
    report = tier_reporter(request.config)
    wait_until_idle(real_vllm.metrics_url)
    assert warm_set(real_vllm.base_url, 4.0).wait().failed == 0  # the first phase starts warm
    timeline = Timeline(tuple(step.phase for step in STEPS))
    recorder = PollRecorder()
    starts: list[float] = []
    with running_kvwatch(real_vllm.metrics_url, poll_interval=None, window=None) as kvwatch:
        kvwatch.monitor.after_poll.append(recorder)
        wait_until(lambda: kvwatch.monitor.state.up, 15, "kvwatch's first poll")
        for step in STEPS:
            starts.append(kvwatch.monitor.clock())
            stats = step.load(real_vllm.base_url, step.seconds).wait()
            assert stats.failed == 0, (step.phase.name, stats.errors[:3])
    polls = recorder.polls(starts)
    result = score(timeline, polls, settle=START_BAR)
    figures = {name: (dict(result.start_seconds).get(name), dict(result.clear_seconds).get(name),
                      f"{right}/{scored}") for name, (right, scored) in result.banner_by_phase.items()}
    report(f"scored real sequence: phases at {[round(s - starts[0]) for s in starts]} s, {len(polls)} polls; "
           f"per phase (start s, clear s, banner right): {figures}; {result.figures()}; "
           f"late criticals: {late_criticals(polls, timeline)}; wrong: {result.wrong_lines()[:12]}")
    assert len(polls) >= 0.8 * (polls[-1].at / kvwatch.monitor.settings.poll_interval), "kvwatch missed polls"
    missed = [(name, s) for name, s in result.start_seconds if s is None or s > START_BAR]
    assert len(result.start_seconds) == 3 and not missed, (result.start_seconds, result.wrong_lines())
    late = [(name, s) for name, s in result.clear_seconds if s is None or s > CLEAR_BAR]
    assert len(result.clear_seconds) == 2 and not late, (result.clear_seconds, result.wrong_lines())
    assert result.born_clearing == 0, result.wrong_lines()
    assert not late_criticals(polls, timeline), late_criticals(polls, timeline)
