"""The cache-tier panels of vLLM's offload tier return data from a real
Prometheus: a kvwatch polls a vLLM 0.32 page with the OffloadingConnector's
families, a real Prometheus with kvwatch's recording rules scrapes it, and
every dashboard query and recorded series that reads those families (the
tier's cost over the compute it saved, the bytes it moved per token served,
the lookup delays, the stores not made, the requests by fetch stage) holds
data, with the figures the sidecar computes.

No capture carries these families (tests/fixtures/README.md): the pages are
tests/fixtures/handwritten/vllm-0.32-offload-{a,b}.txt, WRITTEN FROM vLLM'S
SOURCE, carried forward by their difference one step a fetch (counters and
histograms grow by b - a each fetch, gauges stay at b's), so every rate and
ratio over any range is the one of a to b. The simulators the other
end-to-end tests run have no offload tier (tests/test_e2e_engines.py skips
these panels for them: its engines do not export the inputs)."""

from __future__ import annotations

import contextlib
import re
import threading
import time

import pytest

from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.sidecar.app import create_app
from kvwatch.signals import ENGINE_SERIES, SIGNALS_BY_NAME, worth
from mixin_support import GRAFANA_VARIABLES, RULES, dashboard_exprs, load_dashboards, load_rules, metric_names
from pageserver import Answer, LoopbackServer, serving
from promstack import prometheus, query, query_range, wait_until

MODEL = "llama-3.1-8b"
# The offload tier's signals, and the engine series only an offload tier (or a KV consumer) exports.
SIGNALS = ("kvwatch_cache_tier_cost_ratio", "kvwatch_cache_tier_moved_bytes_per_token",
           "kvwatch_kv_offload_lookup_delay_mean_seconds", "kvwatch_kv_offload_stores_dropped_per_second",
           "kvwatch_requests_kv_fetch")
SERIES = tuple(s.name for s in ENGINE_SERIES if s.key.startswith(("offload_", "kv_fetch_by_stage")))
GROWING = ("_total", "_bucket", "_sum", "_count")


def tier_names() -> set[str]:
    """The names a query must read to be one of the offload tier's: its signals, their recorded series and
    the engine series, with the suffixes Prometheus sees."""
    names: set[str] = set()
    for name in SIGNALS:
        names |= {name, "kvwatch_model_" + name[len("kvwatch_"):]}
        record = SIGNALS_BY_NAME[name].record[0]
        if record:
            names.add(record)
    for name in SERIES:
        names |= {name + suffix for suffix in ("",) + GROWING}
    return names


def reads_tier(expr: str, names: set[str]) -> bool:
    return any(name in names or any(part in names for part in name.split(":")) for name in metric_names(expr))


def carried_forward(a: str, b: str, step: int) -> str:
    """Page `step` of the series a, b, ...: counters and histograms at a + step x (b - a), gauges at b."""
    out = []
    for line_a, line_b in zip(a.splitlines(), b.splitlines(), strict=True):
        if line_b.startswith("#") or line_a == line_b:
            out.append(line_b)
            continue
        series, value_b = line_b.rsplit(" ", 1)
        value_a = float(line_a.rsplit(" ", 1)[1])
        name = series.split("{", 1)[0]
        if name.endswith(GROWING):
            out.append(f"{series} {value_a + step * (float(value_b) - value_a)!r}")
        else:
            out.append(line_b)
    return "\n".join(out) + "\n"


class CarriedForward(LoopbackServer):
    """Serves the next page of the series at every fetch."""

    def __init__(self, a: str, b: str):
        super().__init__(name="offload-pages")
        self.a, self.b, self.fetches = a, b, 0
        self.lock = threading.Lock()

    def respond(self, request):
        with self.lock:
            self.fetches += 1
            step = self.fetches
        return Answer(carried_forward(self.a, self.b, step))


@pytest.fixture
def offload_stack(fixtures_dir):
    folder = fixtures_dir / "handwritten"
    a, b = [(folder / f"vllm-0.32-offload-{x}.txt").read_text() for x in "ab"]
    with contextlib.ExitStack() as running:
        pages = running.enter_context(CarriedForward(a, b))
        settings = load_settings(overrides={"target": pages.base_url + "/metrics", "engine": "vllm", "port": 0,
                                            "poll_interval": "0.5s", "window": "5m"}, environ={})
        monitor = Monitor(settings)
        kvwatch = running.enter_context(serving(create_app(monitor, settings), start_timeout_s=10))
        monitor.start()
        running.callback(monitor.stop)
        prom = running.enter_context(prometheus([f"127.0.0.1:{kvwatch.port}"], rule_files=[RULES], interval="1s"))
        begin = float(int(time.time()))
        wait_until(lambda: query(prom.url, "kvwatch_up == 1"), 60, "Prometheus to scrape kvwatch")
        wait_until(lambda: query(prom.url, 'kvwatch_cache_tier_cost_ratio{tier="offload"}'), 60,
                   "the tier's cost to reach Prometheus")
        # Enough samples for the dashboards' 10 s rate ranges and the recording rules' evaluations.
        time.sleep(12)
        yield {"prometheus": prom.url, "started": begin, "monitor": monitor}


def test_the_offload_tier_panels_and_records_return_data(offload_stack):
    prom, start, now = offload_stack["prometheus"], offload_stack["started"], float(int(time.time()))
    names = tier_names()
    variables = dict(GRAFANA_VARIABLES, **{"$model": MODEL, "$__rate_interval": "10s", "$__range": "20s"})
    checked, empty = [], []
    for dashboard in load_dashboards().values():
        for where, expr in dashboard_exprs(dashboard):
            if not reads_tier(expr, names):
                continue
            for variable in sorted(variables, key=len, reverse=True):
                expr = expr.replace(variable, variables[variable])
            checked.append(where)
            if not query_range(prom, expr, start, now, step=2):
                empty.append(where)
    for rule in load_rules():
        if "record" in rule and reads_tier(rule["expr"], names):
            checked.append(f"recorded {rule['record']}")
            if not query_range(prom, f'{rule["record"]}{{model_name="{MODEL}"}}', start, now, step=2):
                empty.append(f"recorded {rule['record']}")
    assert not empty, f"offload-tier queries without data: {empty}"
    titles = " ".join(checked)
    # The prefix-cache board's three new panels, and each signal's recorded series.
    for title in ("Does the cache tier pay for itself", "Bytes a cache tier moved per token it served",
                  "KV offload lookup delay, mean"):
        assert title in titles, checked
    assert sum(where.startswith("recorded ") for where in checked) >= len(SIGNALS), checked
    # The figures Prometheus derives from the re-exported series are the sidecar's own: the tier added 0.3 of
    # the compute its tokens saved, and moved three tokens' KV bytes (131,072 each) per token served.
    cost = query(prom, SIGNALS_BY_NAME["kvwatch_cache_tier_cost_ratio"].promql.format(
        sel=f'model_name="{MODEL}"', w="10s", by="model_name, engine"))
    assert [round(float(one["value"][1]), 6) for one in cost] == [0.3]
    assert cost[0]["metric"]["tier"] == "offload"
    moved = query(prom, SIGNALS_BY_NAME["kvwatch_cache_tier_moved_bytes_per_token"].promql.format(
        sel=f'model_name="{MODEL}"', w="10s", by="model_name, engine"))
    assert [round(float(one["value"][1])) for one in moved] == [3 * 131072]
    [row] = offload_stack["monitor"].state.per_engine
    assert row.values["kvwatch_cache_tier_cost_ratio"]["offload"] == pytest.approx(0.3)
    # What the cache saved, as the sidecar counts it: per step of the pages the device tier's 30,000 tokens
    # at 0.0005 s (15 s) and the host (offload) tier's less its 4.5 s of loads and lookups (10.5 s); over any
    # range both are the same multiple of a step, so Prometheus' twin keeps their ratio and the per-token rate.
    scope = {"sel": f'model_name="{MODEL}"', "w": "10s", "by": "model_name, engine"}
    saved = {one["metric"]["tier"]: float(one["value"][1]) for one in query(
        prom, SIGNALS_BY_NAME["kvwatch_cache_saved_prefill_seconds"].promql.format(**scope))}
    assert saved["host"] / saved["device"] == pytest.approx(10.5 / 15.0) and saved["disk"] == 0
    mine = row.values["kvwatch_cache_saved_prefill_seconds"]
    assert mine["host"] / mine["device"] == pytest.approx(10.5 / 15.0)
    per_token = query(prom, worth.PER_TOKEN_PROMQL.format(**scope))
    assert [round(float(one["value"][1]), 9) for one in per_token] == [0.0005]


def test_the_pages_carry_forward_as_a_to_b(fixtures_dir):
    folder = fixtures_dir / "handwritten"
    a, b = [(folder / f"vllm-0.32-offload-{x}.txt").read_text() for x in "ab"]
    assert carried_forward(a, b, 1) == b
    third = carried_forward(a, b, 3)
    load = re.search(r'^vllm:kv_offload_load_time_total\{[^}]*\} (\S+)$', third, re.M).group(1)
    assert float(load) == 27.0 + 3 * 3.0
    usage = re.search(r'^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$', third, re.M).group(1)
    assert float(usage) == 0.64  # a gauge stays at b's
