"""Central mode's routers (kvwatch/central/routers.py) without a store: a
router's samples written back as its page read as the page itself reads, and
a store's hostile answer for the router families costs nothing but its samples."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from kvwatch.central.routers import MAX_ROUTERS, StoreRouters, page_text
from kvwatch.routing import read_router_page
from kvwatch.settings import load_settings
from kvwatch.sim.scenario import load_scenario
from kvwatch.sim.simulation import Simulation

LABELS = ("job", "instance", "namespace", "pod")


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    return [(s.name, dict(s.labels), s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.endswith(("_sum", "_count", "_total"))]


def test_a_routers_samples_written_back_read_as_its_page():
    sim = Simulation(load_scenario("routing"), seed=1, router="round_robin")
    sim.advance(60)
    text = sim.router.render(sim.model_name)
    direct, back = read_router_page(text), read_router_page(page_text(_samples(text)))
    assert direct.dialect == back.dialect == "llm-d"
    assert direct.requests == back.requests > 0
    assert (back.predicted_tokens, back.available_tokens, back.prompt_tokens) == (
        direct.predicted_tokens, direct.available_tokens, direct.prompt_tokens)
    assert back.models == direct.models == [sim.model_name]


class _Store:
    """Answers the router query with what it is given."""

    def __init__(self, series):
        self.series = series

    def read_ranges(self, queries, start, end, step, keep=None):
        assert len(queries) == 1 and "llm_d_epp_" in queries[0][0]
        return [self.series]


def _series(name: str, instance: str, values, **labels):
    return {"metric": {"__name__": name, "job": "router", "instance": instance, **labels}, "values": values}


def _routers() -> StoreRouters:
    return StoreRouters(load_settings(overrides={}, environ={}), 120.0, LABELS)


def test_a_hostile_answer_costs_only_its_samples():
    routers = _routers()
    good = "llm_d_epp_prefix_predicted_cached_tokens"
    routers.read(_Store([
        _series(good + "_sum", "r:1", [[100, "50"], [101, "abc"], ["x", "1"], [102, "NaN"], [103, "60"]]),
        _series(good + "_count", "r:1", [[100, "5"], [103, "6"]], **{'bad"label': "x", "ok": 'a"b\nc'}),
        _series('evil{x="1"} 3\nllm_d_epp_prefix_predicted_cached_tokens_sum', "r:1", [[100, "1e9"]]),
    ]), "", 100, 103, 1)
    [(key, kept)] = routers.readings.items()
    assert key == ("router", "r:1", "", "")
    assert [(at, reading.predicted_tokens, reading.requests) for at, reading in kept] == [
        (100.0, 50.0, 5.0), (103.0, 60.0, 6.0)]


def test_at_most_max_routers_are_kept_and_a_silent_one_is_forgotten():
    routers = _routers()
    series = [_series("llm_d_epp_prefix_predicted_cached_tokens_sum", f"r:{i}", [[100, "1"]])
              for i in range(MAX_ROUTERS + 5)]
    routers.read(_Store(series), "", 100, 100, 1)
    assert len(routers.readings) == MAX_ROUTERS
    routers.read(_Store([]), "", 101, 221, 1)  # nothing for a window span
    assert routers.readings == {}


def test_a_router_window_decides_affinity_only_with_what_it_needs():
    from kvwatch.routing import RouterReading, attribute
    from kvwatch.routing.attribution import decides_affinity

    def reading(scale: float, available: float | None = 800.0) -> RouterReading:
        return RouterReading(dialect="llm-d", requests=10 * scale, predicted_tokens=100 * scale,
                             available_tokens=None if available is None else available * scale,
                             prompt_tokens=1000 * scale)

    assert decides_affinity(attribute("m", reading(1), reading(2), 500.0, 2000.0))
    assert not decides_affinity(attribute("m", reading(1), reading(2), 5.0, 20.0))  # too little queried
    # No best available on the page (Dynamo, older llm-d): the peers' comparison stands.
    assert not decides_affinity(attribute("m", reading(1, None), reading(2, None), 500.0, 2000.0))
