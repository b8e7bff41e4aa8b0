"""`kvwatch capacity --prometheus`: an objective (first-token p95 under X)
inverted over history into the replicas, or the KV cache per replica, the
observed peak needs. The arithmetic by hand on a few steps; the store's
reading against a real Prometheus backfilled with the simulator's
exhaustion scenario (as tests/test_history_backfill.py records it), the
same figures as the arithmetic over the pages themselves."""

from __future__ import annotations

import json
import re
import time

import pytest

from kvwatch.capacity.needed import CacheShape, Step, needed
from kvwatch.capture.bundle import Capture, CaptureWriter
from kvwatch.capture.record import manifest_for, record
from kvwatch.cli import main
from kvwatch.scrape import Fetcher
from kvwatch.sim.server import start_background
from promstack import backfilled_prometheus
from sim_support import pages_openmetrics

SHAPE = CacheShape(usable_blocks=511, block_size=16, bytes_per_block=2 * 1024 * 1024, source="a test")


def test_the_peak_s_requests_at_their_footprint_give_the_replicas_and_the_cache():
    steps = [Step(0, 4, 0, 2, 0.2, 0.5),  # quiet: 4 running in 0.2 x 511 blocks, first token 0.5 s
             Step(10, 20, 10, 2, 1.6, 9.0),  # near the peak (30 >= 0.9 x 30): 1.6 x 511 / 20 = 40.88 blocks each
             Step(20, 20, 8, 2, 1.8, 7.0)]  # near too (28): 1.8 x 511 / 20 = 45.99 blocks each
    result = needed("m", steps, 2.0, SHAPE)
    mid = result["estimate"]
    # Median footprint (40.88 + 45.99) / 2 = 43.435 blocks: one replica's 511 blocks hold 11 requests,
    # so 30 requests need 3 replicas; at 2 replicas, 15 requests each need 652 blocks + the null block.
    assert mid["footprint_blocks"] == pytest.approx(43.435)
    assert (mid["requests_per_replica"], mid["replicas"]) == (11, 3)
    assert mid["blocks_per_replica"] == 653 and mid["gib_per_replica"] == pytest.approx(653 * 2 / 1024)
    assert (result["low"]["replicas"], result["high"]["replicas"]) == (3, 3)
    assert result["answer"].startswith("To hold first-token p95 under 2 s at the observed peak (30 requests "
                                       "in the system), m needs 3 replicas or 1.28 GiB of KV cache per replica")
    assert "prefill alone" not in result["answer"]  # with nothing waiting the first token took 0.5 s


def test_a_first_token_slow_without_a_queue_is_said_to_be_beyond_any_cache():
    steps = [Step(0, 4, 0, 1, 0.2, 3.0), Step(10, 10, 5, 1, 0.9, 9.0)]
    result = needed("m", steps, 2.0, SHAPE)
    assert "reached 3 s with nothing waiting: prefill alone misses the objective" in result["answer"]


def test_no_requests_is_nothing_to_size():
    assert needed("m", [Step(0, 0, 0, 1, 0.0, None)], 2.0, SHAPE)["found"] is False


INTERVAL, DURATION = 5.0, 540.0
INSTANCE = "10.0.9.2:8000"


def _gauge(page: str, name: str) -> float:
    return float(re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", page, re.M).group(1))


@pytest.mark.slow  # a simulator, promtool and Prometheus
def test_the_store_s_history_gives_the_arithmetic_of_its_pages(tmp_path, capsys):
    base = float((int(time.time()) // 3600 - 3) * 3600)
    path = tmp_path / "sim.tar.gz"
    with start_background("exhaustion", speed=0) as sim:
        now = [base]

        def sleep(seconds):
            sim.advance(seconds)
            now[0] += seconds

        writer = CaptureWriter(path, manifest_for(sim.metrics_url, INTERVAL, DURATION))
        record(Fetcher(sim.metrics_url, 5.0, 16 << 20), writer, INTERVAL, DURATION,
               clock=lambda: now[0], monotonic=lambda: now[0] - base, sleep=sleep)
        writer.close(ended_at=now[0], interrupted=False)
    pages = [(entry.time, text) for entry, text in Capture(path).pages()]
    first = pages[0][1]
    blocks = int(re.search(r'num_gpu_blocks="(\d+)"', first).group(1))
    memory = float(re.search(r'kv_cache_memory_bytes="(\d+)"', first).group(1))
    steps = [Step(at, _gauge(text, "vllm:num_requests_running"), _gauge(text, "vllm:num_requests_waiting"), 1,
                  _gauge(text, "vllm:kv_cache_usage_perc"), None) for at, text in pages]
    expected = needed("x", steps, 2.0, CacheShape(blocks - 1, 16, memory / blocks, "the pages"))
    assert expected["found"] and expected["peak"]["waiting"] > 0  # the overload queued

    with backfilled_prometheus(pages_openmetrics(pages, INSTANCE)) as prom:
        code = main(["capacity", "--prometheus", prom.url, "--from", str(base), "--to", str(base + DURATION),
                     "--step", f"{INTERVAL:g}s", "--ttft-p95", "2s", "--json"])
        assert code == 0
        report = json.loads(capsys.readouterr().out)
        main(["capacity", "--prometheus", prom.url, "--from", str(base), "--to", str(base + DURATION),
              "--step", f"{INTERVAL:g}s", "--ttft-p95", "2s"])
        text = capsys.readouterr().out
    [result] = report["models"]
    assert result["peak"]["requests"] == expected["peak"]["requests"]
    assert result["peak"]["at"] == pytest.approx(expected["peak"]["at"])
    for part in ("estimate", "low", "high"):
        assert result[part]["replicas"] == expected[part]["replicas"]
        assert result[part]["blocks_per_replica"] == expected[part]["blocks_per_replica"]
        assert result[part]["footprint_blocks"] == pytest.approx(expected[part]["footprint_blocks"])
    assert result["cache"]["usable_blocks"] == blocks - 1
    assert f"needs {expected['estimate']['replicas']} replicas or " in text
    assert "Error: the footprint ranged" in text and "Assumptions:" in text
    assert "arithmetic, not a guarantee" in text


def test_a_store_without_the_cache_s_shape_or_an_objective_is_one_sentence(capsys):
    assert main(["capacity", "--prometheus", "http://127.0.0.1:9", "--since", "1h"]) == 2
    assert "--prometheus needs the objective: --ttft-p95 SECONDS" in capsys.readouterr().err
    assert main(["capacity", "--prometheus", "http://127.0.0.1:9", "--ttft-p95", "soon"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--ttft-p95" in err
