"""kvwatch polls a loopback server replaying real captures in sequence; a
real Prometheus scraping kvwatch returns the expected values through its
query API."""

import contextlib

import pytest

from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from pageserver import Answer, PageServer, serving
from promstack import free_port, prometheus, query, wait_until


@pytest.fixture
def kvwatch_server():
    with contextlib.ExitStack() as running:
        def start(settings):
            monitor = Monitor(settings)
            running.enter_context(serving(create_app(monitor, settings), port=settings.port, start_timeout_s=10))
            running.callback(monitor.stop)
            return monitor

        yield start


def test_prometheus_scraping_kvwatch_sees_the_replayed_engine(fixtures_dir, kvwatch_server):
    pages = [(fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text() for name in ("load", "long-load")]
    with PageServer([Answer(pages[0]), Answer(pages[1])]) as engine:
        port = free_port()
        settings = load_settings(overrides={"target": engine.url, "port": port, "poll_interval": "0.5s", "window": "1h"}, environ={})
        monitor = kvwatch_server(settings)
        monitor.start()  # the background loop: load, then long-load, which then repeats
        wait_until(lambda: monitor.state.polls >= 2, 10, "two polls")
        with prometheus([f"127.0.0.1:{port}"], interval="1s") as prom:
            selector = '{model_name="tiny-llama",engine="0"}'

            def scraped():
                return query(prom.url, f"kvwatch_engine_preemptions_total{selector}")

            result = wait_until(scraped, 30, "Prometheus to scrape kvwatch")
            assert float(result[0]["value"][1]) == 12
            assert float(query(prom.url, "kvwatch_up")[0]["value"][1]) == 1
            assert float(query(prom.url, f"kvwatch_engine_kv_cache_capacity_tokens{selector}")[0]["value"][1]) == 4096
            usage_max = float(query(prom.url, f"kvwatch_kv_cache_usage_max_ratio{selector}")[0]["value"][1])
            assert usage_max == pytest.approx(0.9921259842519685)
            hit = float(query(prom.url, f"kvwatch_prefix_cache_hit_ratio{selector}")[0]["value"][1])
            assert hit == 0.0
            # The re-exported histogram keeps vLLM's buckets: Prometheus can
            # take quantiles of it the usual way.
            buckets = query(prom.url, f"kvwatch_engine_time_to_first_token_seconds_bucket{selector}")
            assert {b["metric"]["le"] for b in buckets} >= {"0.001", "2.5", "2560.0", "+Inf"}
            quantile = query(prom.url, "histogram_quantile(0.5, sum by (le) (kvwatch_engine_time_to_first_token_seconds_bucket))")
            # lifetime p50 of 36 observations: rank 18 in (0.04, 0.06] holding 9 above 10
            assert float(quantile[0]["value"][1]) == pytest.approx(0.04 + 0.02 * (18 - 10) / 9)
