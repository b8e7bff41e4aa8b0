"""The sizing estimate from vLLM's KV-cache events, checked against the
engine: the same 48 requests (a round robin over 12 prefixes of 512 tokens)
on the tier's cache, with kvwatch reading the stream and its window covering
the whole run, and on a vLLM given twice the --kv-cache-memory-bytes, whose
own counters give the hit ratio it then reaches. kvwatch's prediction for
`extra_cache` 1 (a cache twice as large) and vLLM's count are printed and
must agree within 10 percentage points.

Its own module, so that the other stream tests' server has stopped before
these two start (one after the other) on the tier's two cores.
"""

from __future__ import annotations

import time

import pytest

from .harness import read_metrics, vllm_server, wait_until_idle
from .kvwatch_support import read_kvwatch_diagnosis, running_kvwatch, tier_reporter
from .scenarios import prefix_rotation_load
from .test_kv_events_vllm import ROTATION_SEED, events_config, free_port

pytestmark = pytest.mark.vllm

KV_BYTES = 4194304  # the tier's cache: 128 blocks of 32 tokens
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
ROTATION_REQUESTS = 48
STARTUP_S = 420.0  # two cores shared with the load of the rest of the tier


@pytest.fixture(scope="module")
def report(request):
    return tier_reporter(request.config)


def rotation(base_url):
    return prefix_rotation_load(base_url, duration=600.0, seed=ROTATION_SEED, max_requests=ROTATION_REQUESTS)


@pytest.mark.timeout(1500)  # two vLLM start-ups (2-3 min each on the shared cores) and two loads
def test_the_sizing_estimate_against_a_vllm_with_twice_the_cache(vllm_build, tmp_path_factory, report):
    """The same 48 requests on the tier's cache (kvwatch reading the stream,
    its window covering the whole run) and on one twice as large (vLLM's own
    counters): the hit ratio kvwatch predicts for `extra_cache` 1 against the
    one vLLM counts."""
    venv, model = vllm_build
    endpoint, port = f"tcp://127.0.0.1:{free_port()}", free_port()
    log = tmp_path_factory.mktemp("vllm-kv-events-sizing") / "server.log"
    with running_kvwatch(f"http://127.0.0.1:{port}/metrics", window="5m", kv_events=endpoint) as kvwatch:
        with vllm_server(port=port, model_dir=model, venv=venv, log_path=log, report=report,
                         extra_args=events_config(endpoint), startup_timeout_s=STARTUP_S) as server:
            time.sleep(2)  # kvwatch's first polls of the engine
            load = rotation(server.base_url)
            load.wait()
            wait_until_idle(server.metrics_url)
            time.sleep(2)
            stream = read_kvwatch_diagnosis(kvwatch.url)["kv_events"]
    points = {p["extra_cache"]: p for p in stream["sizing"]["points"]}
    now, doubled = stream["sizing"]["hit_ratio_now"], points[1]
    report(f"kv events sizing: on 128 blocks, {stream['totals']['stored']} blocks stored, "
           f"{stream['totals']['stored_again']:.0f} stored again, hit ratio {now}; kvwatch predicts "
           f"{doubled['hit_ratio']} with {doubled['extra_blocks']} more blocks; curve "
           + ", ".join(f"x{p['extra_cache']:g}: {p['hit_ratio']}" for p in stream["sizing"]["points"]))
    log = tmp_path_factory.mktemp("vllm-twice") / "server.log"
    with vllm_server(model_dir=model, venv=venv, log_path=log, report=report,
                     kv_cache_memory_bytes=2 * KV_BYTES, startup_timeout_s=STARTUP_S) as bigger:
        before = read_metrics(bigger.metrics_url)
        rotation(bigger.base_url).wait()
        after = wait_until_idle(bigger.metrics_url)
    measured = (after.value(HITS) - before.value(HITS)) / (after.value(QUERIES) - before.value(QUERIES))
    report(f"kv events sizing: 48 requests over 12 prefixes of 512 tokens; hit ratio {now:.3f} on 128 blocks; "
           f"kvwatch predicts {doubled['hit_ratio']:.3f} with {doubled['extra_blocks']} more blocks "
           f"({doubled['extra_bytes'] / 2**20:.1f} MiB); vLLM with twice --kv-cache-memory-bytes counts "
           f"{measured:.3f} (difference {100 * (doubled['hit_ratio'] - measured):+.1f} pp)")
    assert stream["intake"]["missed"] == 0
    assert abs(doubled["hit_ratio"] - measured) <= 0.10
