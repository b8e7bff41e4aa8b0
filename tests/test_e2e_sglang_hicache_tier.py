"""SGLang's HiCache host tier on the cache-tier panels, from a real
Prometheus: a kvwatch polls the SGLang HiCache pages (WRITTEN FROM SGLang'S
SOURCE, tests/fixtures/README.md) carried forward by their difference one
step a fetch (tests/test_e2e_offload_tier.py), Prometheus with the generated
rules scrapes it, and the tier's cost and bytes moved per token read there,
through the signals' PromQL twins and their recorded series, equal the
sidecar's (0.2, and 3 x 147,456 bytes)."""

from __future__ import annotations

import contextlib
import time

import pytest
from pageserver import serving
from promstack import prometheus, query, query_range, wait_until
from mixin_support import RULES, load_rules
from test_e2e_offload_tier import CarriedForward

from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.sidecar.app import create_app
from kvwatch.signals import SIGNALS_BY_NAME

MODEL = "qwen3-8b"
COST = "kvwatch_cache_tier_cost_ratio"
BYTES = "kvwatch_cache_tier_moved_bytes_per_token"


@pytest.fixture
def hicache_stack(fixtures_dir):
    folder = fixtures_dir / "handwritten"
    a, b = [(folder / f"sglang-hicache-{x}.txt").read_text() for x in "ab"]
    with contextlib.ExitStack() as running:
        pages = running.enter_context(CarriedForward(a, b))
        settings = load_settings(overrides={"target": pages.base_url + "/metrics", "engine": "sglang", "port": 0,
                                            "poll_interval": "0.5s", "window": "5m"}, environ={})
        monitor = Monitor(settings)
        kvwatch = running.enter_context(serving(create_app(monitor, settings), start_timeout_s=10))
        monitor.start()
        running.callback(monitor.stop)
        prom = running.enter_context(prometheus([f"127.0.0.1:{kvwatch.port}"], rule_files=[RULES], interval="1s"))
        begin = float(int(time.time()))
        wait_until(lambda: query(prom.url, f'{COST}{{tier="host"}}'), 60, "the host tier's cost to reach Prometheus")
        time.sleep(12)
        yield {"prometheus": prom.url, "started": begin, "monitor": monitor}


def test_the_host_tier_reads_the_same_in_prometheus(hicache_stack):
    prom, start, now = hicache_stack["prometheus"], hicache_stack["started"], float(int(time.time()))
    args = dict(sel=f'model_name="{MODEL}"', w="10s", by="model_name, engine")
    cost = query(prom, SIGNALS_BY_NAME[COST].promql.format(**args))
    assert [(one["metric"]["tier"], round(float(one["value"][1]), 6)) for one in cost] == [("host", 0.2)]
    moved = query(prom, SIGNALS_BY_NAME[BYTES].promql.format(**args))
    assert [(one["metric"]["tier"], round(float(one["value"][1]))) for one in moved] == [("host", 3 * 147456)]
    recorded = [rule["record"] for rule in load_rules()
                if ":kvwatch_cache_tier_" in rule.get("record", "")]
    assert len(recorded) == 4, recorded
    empty = [name for name in recorded if not query_range(prom, f'{name}{{model_name="{MODEL}"}}', start, now, step=2)]
    assert not empty, empty
    [row] = hicache_stack["monitor"].state.per_engine
    assert row.values[COST] == pytest.approx({"host": 0.2})
