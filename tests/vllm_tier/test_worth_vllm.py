"""What the cache saved, checked against the engine (issue #51's 'Done
means'): the same seeded load, a round robin over 4 prefixes of 512 tokens
that the tier's cache holds, on a vLLM with prefix caching on (kvwatch
reading it, its window covering the run) and on one with it off. kvwatch's
saved prefill seconds from the on run, against the difference in vLLM's own
prefill time (vllm:request_prefill_time_seconds sum) between the two runs:
printed, and within 15 %.

Its own module: two vLLM start-ups, one after the other, on the tier's cores."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest

from .harness import read_metrics, vllm_server, wait_until_idle
from .kvwatch_support import running_kvwatch, tier_reporter
from .scenarios import prefix_rotation_load
from .test_kv_events_vllm import free_port

pytestmark = pytest.mark.vllm

PREFILL = "vllm:request_prefill_time_seconds_sum"
REQUESTS, SEED = 32, 51
STARTUP_S = 420.0


@pytest.fixture(scope="module")
def report(request):
    return tier_reporter(request.config)


def load(base_url):
    return prefix_rotation_load(base_url, duration=600.0, phases=((0.0, 4),), seed=SEED, max_requests=REQUESTS)


def prefill_seconds(server) -> float:
    """The run's prefill time, vLLM's own count, from an idle engine to idle again."""
    before = read_metrics(server.metrics_url).value(PREFILL)
    load(server.base_url).wait()
    return wait_until_idle(server.metrics_url).value(PREFILL) - before


@pytest.mark.timeout(1500)  # two vLLM start-ups (2-3 min each on the shared cores) and two loads
def test_saved_against_the_prefill_time_caching_saves(vllm_build, tmp_path_factory, report):
    venv, model = vllm_build
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-worth-on") / "server.log"
    with running_kvwatch(f"http://127.0.0.1:{port}/metrics", window="15m") as kvwatch:
        with vllm_server(port=port, model_dir=model, venv=venv, log_path=log, report=report,
                         startup_timeout_s=STARTUP_S) as server:
            time.sleep(2)  # kvwatch's first polls of the idle engine
            spent_on = prefill_seconds(server)
            time.sleep(2)
            with urllib.request.urlopen(kvwatch.url + "/api/v1/signals", timeout=5) as response:
                [worth] = json.loads(response.read())["worth"]
    log = tmp_path_factory.mktemp("vllm-worth-off") / "server.log"
    with vllm_server(model_dir=model, venv=venv, log_path=log, report=report, startup_timeout_s=STARTUP_S,
                     extra_args=("--no-enable-prefix-caching",)) as server:
        spent_off = prefill_seconds(server)
    truth = spent_off - spent_on
    saved = worth["saved_seconds"]
    report(f"worth: {REQUESTS} requests over 4 prefixes of 512 tokens; prefill time {spent_on:.3f} s with prefix "
           f"caching, {spent_off:.3f} s without: {truth:.3f} s saved by vLLM's count; kvwatch says {saved:.3f} s "
           f"({worth['saved_by_tier']}, at {worth['prefill_seconds_per_token']:.3g} s a token; "
           f"{100 * (saved - truth) / truth:+.1f} %)")
    assert truth > 0
    assert saved == pytest.approx(truth, rel=0.15)
