"""The timeline scorer (kvwatch/sim/score.py) and the stories scenario phases
state (kvwatch/sim/story.py): each measure counts what it names on
hand-built polls, and the demo loop states a story for every phase."""

import pytest

from kvwatch.sim.scenario import ScenarioError, load_scenario, parse_scenario
from kvwatch.sim.score import Poll, Seen, score

BASE = {"name": "t", "engine": {"num_gpu_blocks": 1024, "block_size": 16, "max_num_seqs": 4},
        "workload": {"rate": 1.0, "prompt_tokens": {"dist": "uniform", "min": 10, "max": 20},
                     "output_tokens": {"dist": "uniform", "min": 10, "max": 20}}}


def scenario(*stories, duration=100):
    phases = [{"name": f"p{i}", "duration": duration, **({"story": s} if s is not None else {})}
              for i, s in enumerate(stories)]
    return parse_scenario({**BASE, "phases": phases}, "t.yaml")


def seen(name, clearing=False, confidence="medium", severity="warning"):
    symptom, cause = name.split("/")
    return Seen(symptom, cause, severity, confidence, clearing, f"{name} summary")


def polls(phases, every=10.0, duration=100):
    """One poll each `every` s; phases: a list (per phase) of functions of seconds-into-phase -> findings."""
    out = []
    for index, findings_at in enumerate(phases):
        into = every
        while into <= duration + 1e-9:
            out.append(Poll(index * duration + into, index, 0, into if into < duration else 0.0,
                            tuple(findings_at(into))))
            into += every
    # The last poll of a phase is the next one's start in the simulator's reckoning; keep it simple: in phase.
    return [Poll(p.at, p.phase, p.cycle, p.into if p.into else duration, p.findings) for p in out]


def test_a_story_names_symptoms_and_causes_of_the_catalogue():
    loaded = scenario({"lead": "low_hit_rate/prefix_changed", "fair": ["exhaustion"]}, {"lead": "nothing"})
    first, second = (phase.story for phase in loaded.phases)
    assert first.leads("low_hit_rate", "prefix_changed") and not first.leads("low_hit_rate", "no_reuse")
    assert first.allows("exhaustion", "long_requests") and not first.allows("slow_first_token", "prefill")
    assert first.allows("change", "engine_restarted")  # events are never scored
    assert second.lead is None


@pytest.mark.parametrize("story, said", [
    ({"lead": "low_hit_rate/prefix_moved"}, "'prefix_moved' is not a cause of low_hit_rate"),
    ({"lead": "slow"}, "'slow' is not a symptom"),
    ({"fair": ["exhaustion"]}, "lead: missing"),
    ({"lead": "exhaustion", "banner": "x"}, "unknown story key"),
    ("exhaustion", "expected a mapping"),
])
def test_a_wrong_story_is_one_sentence_naming_its_place(story, said):
    with pytest.raises(ScenarioError) as caught:
        scenario(story)
    assert any(said in problem and problem.startswith("phases[0] (p0).story") for problem in caught.value.problems), \
        caught.value.problems


def test_every_phase_of_the_demo_states_its_story():
    demo = load_scenario("demo")
    assert all(phase.story is not None for phase in demo.phases), [p.name for p in demo.phases if p.story is None]


def test_the_banner_and_false_findings_are_scored_after_the_settle():
    loaded = scenario({"lead": "low_hit_rate/prefix_changed"})
    run = polls([lambda t: [seen("low_hit_rate/prefix_changed")] if t >= 80 else
                 [seen("exhaustion/long_requests", confidence="high")]])
    result = score(loaded, run, settle=75)
    # Scored: 80, 90, 100 (not 10..70): all right, nothing false.
    assert (result.scored, result.banner_right, result.false_seconds) == (3, 3, 0.0)
    run = polls([lambda t: [seen("slow_first_token/prefill"), seen("low_hit_rate/prefix_changed"),
                            seen("exhaustion/long_requests", confidence="high")]])
    result = score(loaded, run, settle=75)
    assert result.banner_right == 0 and result.scored == 3  # the banner leads with the first active finding
    assert result.false_seconds == 60.0 and result.false_high_seconds == 30.0


def test_nothing_is_right_only_when_nothing_false_is_active():
    loaded = scenario({"lead": "nothing", "fair": ["low_hit_rate/no_reuse"]})
    quiet = score(loaded, polls([lambda t: [seen("low_hit_rate/no_reuse"), seen("exhaustion/long_requests",
                                                                                clearing=True)]]), settle=75)
    assert quiet.banner_right_share == 1.0 and quiet.false_seconds == 0.0
    loud = score(loaded, polls([lambda t: [seen("exhaustion/long_requests")]]), settle=75)
    assert loud.banner_right_share == 0.0


def test_toggles_born_clearing_and_cause_changes_are_counted():
    loaded = scenario({"lead": "low_hit_rate"})
    timeline = {10: ["prefix_changed"], 20: ["prefix_changed"], 30: ["eviction_before_reuse"],
                40: ["prefix_changed"], 50: ["prefix_changed"], 60: ["prefix_changed"],
                70: ["prefix_changed"], 80: ["prefix_changed~", "no_reuse~"], 90: ["prefix_changed"],
                100: ["prefix_changed~"]}

    def at(t):
        return [seen("low_hit_rate/" + name.rstrip("~"), clearing=name.endswith("~")) for name in timeline[t]]

    result = score(loaded, polls([at]), settle=75)
    assert result.toggles == 1  # clearing at 80, active at 90 (before the settle, not counted)
    assert result.born_clearing == 1  # no_reuse, first seen held at 80
    assert result.cause_changes_max == 2  # prefix -> eviction -> prefix


def test_start_and_clearing_delays_are_measured_from_the_phase_boundaries():
    loaded = scenario({"lead": "slow_first_token"}, {"lead": "nothing"}, {"lead": "nothing"})
    run = polls([lambda t: [seen("slow_first_token/prefill")] if t >= 40 else [],
                 lambda t: [seen("slow_first_token/prefill", clearing=True)] if t <= 30 else [],
                 lambda t: []])
    result = score(loaded, run, settle=75)
    assert result.start_seconds == [("p0 (cycle 0)", 40.0)]
    assert result.clear_seconds == [("p0 (cycle 0)", 10.0)]  # shown clearing ("ended at") at the first poll after
    run = polls([lambda t: [seen("slow_first_token/prefill")] if t >= 40 else [],
                 lambda t: [seen("slow_first_token/prefill", clearing=t > 30)] if t <= 50 else [],
                 lambda t: []])
    assert score(loaded, run, settle=75).clear_seconds == [("p0 (cycle 0)", 40.0)]
    stuck = score(loaded, polls([lambda t: [seen("slow_first_token/prefill")]] * 3), settle=75)
    assert stuck.clear_seconds == [("p0 (cycle 0)", None)]
    assert "p0 (cycle 0): its finding never cleared" in " ".join(stuck.failures())
