"""The changes kvwatch names, provoked on a real vLLM of this test's own
(stopped and started again on one port while one kvwatch keeps polling it):
a restart whose cache is cold at first and warm again soon after, and a
restart that changes three things at once, each a finding of its own: the
cache configuration (prefix caching turned off, which is then
`caching_disabled`), the KV-cache dtype (`--kv-cache-dtype fp8`: vLLM's CPU
attention takes fp8 KV on x86 with AVX-512 or AMX only, so on a CPU without
either that part is left out and the test says why: cpu_support.py) and the served model
(another `--served-model-name`, which is what kvwatch's model change reads:
the set of `model_name` labels). The same start serves two LoRA adapters of
the tiny model (`--enable-lora`, harness.write_tiny_lora); requests for one,
then the other, are a LoRA change (a new name in `vllm:lora_requests_info`).
One start for all of them keeps the test at three server starts (about a
minute each, up to two on a busy machine).
"""

from __future__ import annotations

import time

import pytest

from promstack import wait_until

from .cpu_support import this_cpu_kv_cache_dtype_change
from .harness import MODEL_NAME, vllm_server, write_tiny_lora
from .kvwatch_support import read_kvwatch_diagnosis, running_kvwatch, tier_reporter
from .scenarios import distinct_load, prefix_rotation_load

pytestmark = pytest.mark.vllm

SEED = 19
PREFIXES = 6  # 6 x 17 blocks fit the 128: warm after one pass
OTHER_MODEL = MODEL_NAME + "-b"
ADAPTERS = ("lora-a", "lora-b")


def rotation(base_url: str, **kwargs):
    return prefix_rotation_load(base_url, phases=((0.0, PREFIXES),), concurrency=1, seed=SEED, **kwargs)


def findings(kvwatch) -> list[dict]:
    try:
        return read_kvwatch_diagnosis(kvwatch.url).get("findings", [])
    except OSError:
        return []


def watch(kvwatch, seconds: float, seen: list) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        seen.append(findings(kvwatch))
        time.sleep(0.5)


def causes(samples: list, symptom: str) -> set[str]:
    return {f["cause"] for found in samples for f in found if f["symptom"] == symptom}


# Three server starts of 56-123 s each on the shared 2 cores (the slowest
# while other tests ran beside the tier) and about 80 s of loads: past the
# default 300 s once, so this test has its own limit.
@pytest.mark.timeout(720)
def test_restart_cold_then_warm_and_a_restart_that_changes_config_dtype_model_and_lora(vllm_build, tmp_path,
                                                                                          request):
    report = tier_reporter(request.config)
    venv, model = vllm_build
    log = tmp_path / "server.log"
    with vllm_server(model_dir=model, venv=venv, log_path=log, report=report) as first:
        port = first.port
        kvwatch_context = running_kvwatch(first.metrics_url, poll_interval="1s", window="40s")
        kvwatch = kvwatch_context.__enter__()
        try:
            wait_until(lambda: kvwatch.monitor.state.up, 10, "kvwatch's first poll")
            warm = rotation(first.base_url, duration=10.0)
            assert warm.wait().failed == 0
        except BaseException:
            kvwatch_context.__exit__(None, None, None)
            raise
    try:
        # 1. The same server again: counters restart and the cache is empty.
        with vllm_server(port=port, model_dir=model, venv=venv, log_path=log, report=report) as second:
            wait_until(lambda: kvwatch.monitor.state.up, 30, "kvwatch to poll the restarted engine")
            cold: list = []
            first_pass = rotation(second.base_url, duration=30.0, max_requests=PREFIXES)  # each prefix once: all miss
            while first_pass.running:
                cold.append(findings(kvwatch))
                time.sleep(0.5)
            assert first_pass.wait().failed == 0
            watch(kvwatch, 4.0, cold)
            warm_again: list = []
            # Warm for longer than the now span (now_seconds, 30 s: whether a finding is active is
            # judged there), then past its symptom's quiet (15 s) before reading the end.
            again = rotation(second.base_url, duration=36.0)
            while again.running:
                warm_again.append(findings(kvwatch))
                time.sleep(0.5)
            assert again.wait().failed == 0
            watch(kvwatch, 18.0, warm_again)
        restarted = [f for found in cold + warm_again for f in found if f["cause"] == "engine_restarted"]
        report(f"restart: cold pass said {sorted(causes(cold, 'low_hit_rate'))}, then "
               f"{sorted(causes(warm_again[-3:], 'low_hit_rate'))}; last restart summary: "
               f"{restarted[-1]['summary'] if restarted else None}")
        assert restarted
        assert causes(cold, "low_hit_rate") == {"cold_cache"}, cold[-3:]
        # Active ones: a finding that ended is held, shown clearing, for finding_hold_seconds.
        assert not causes([[f for f in found if not f.get("clearing_since")] for found in warm_again[-3:]],
                          "low_hit_rate"), warm_again[-3:]
        # The restart's finding as last shown (it leaves with the restart's change, before the end).
        last = next(([f for f in found if f["cause"] == "engine_restarted"] for found in reversed(warm_again)
                     if any(f["cause"] == "engine_restarted" for f in found)), [])
        assert last and "warm again" in last[0]["summary"] and "cold" not in last[0]["summary"], warm_again[-1]

        # 2. Started again with prefix caching off, an fp8 KV cache (where the
        # CPU takes one) and another served model name: a configuration change,
        # a dtype change and a model change; then every prompt is computed in full.
        dtype_change = this_cpu_kv_cache_dtype_change()
        report(f"KV-cache dtype change: {dtype_change.dtype or 'none'} ({dtype_change.reason})")
        adapter = write_tiny_lora(tmp_path / "lora")
        lora_flags = ("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
                      "--lora-modules", *(f"{name}={adapter}" for name in ADAPTERS))
        with vllm_server(port=port, model_dir=model, venv=venv, log_path=log, report=report,
                         served_model_name=OTHER_MODEL,
                         extra_args=("--no-enable-prefix-caching", *dtype_change.flags, *lora_flags)) as third:
            wait_until(lambda: kvwatch.monitor.state.up, 30, "kvwatch to poll the reconfigured engine")
            off: list = []
            for model_name, seconds in ((OTHER_MODEL, 10.0), *((name, 4.0) for name in ADAPTERS)):
                load = distinct_load(third.base_url, duration=seconds, model=model_name)
                while load.running:
                    off.append(findings(kvwatch))
                    time.sleep(0.5)
                assert load.wait().failed == 0, model_name
            watch(kvwatch, 2.0, off)
        changed = [f for found in off for f in found if f["cause"] == "cache_config_changed"]
        dtype = [f for found in off for f in found if f["cause"] == "cache_dtype_changed"]
        models = [f for found in off for f in found if f["cause"] == "model_changed"]
        report(f"caching off, {dtype_change.dtype or 'same dtype'}, {OTHER_MODEL}: kvwatch said {sorted(causes(off, 'low_hit_rate'))} and changes "
               f"{sorted(causes(off, 'change'))}; {changed[-1]['summary'] if changed else None}; "
               f"{dtype[-1]['summary'] if dtype else None}; {models[-1]['summary'] if models else None}")
        assert changed and "enable_prefix_caching" in changed[-1]["notes"]["changed_keys"], off[-1]
        assert "cache_dtype" not in changed[-1]["notes"]["changed_keys"], changed[-1]
        if dtype_change.dtype:
            assert dtype and dtype[-1]["notes"]["changed_keys"] == "cache_dtype", off[-1]
            assert dtype_change.dtype in dtype[-1]["summary"], dtype[-1]
        else:
            assert not dtype, dtype[-1]
        assert models and {f["model_name"] for f in models} == {OTHER_MODEL}, models[-1:]
        assert OTHER_MODEL in models[-1]["notes"]["models_after"], models[-1]
        lora = [f for found in off for f in found if f["cause"] == "lora_changed"]
        report(f"LoRA: {lora[-1]['summary'] if lora else 'no lora_changed'}")
        assert lora and "lora-b" in lora[-1]["summary"] and "lora-a" not in lora[-1]["summary"], off[-1]
        assert causes(off, "low_hit_rate") == {"caching_disabled"}, off[-3:]
        assert all(f["model_name"] == OTHER_MODEL for found in off for f in found
                   if f["symptom"] == "low_hit_rate"), off[-3:]
    finally:
        kvwatch_context.__exit__(None, None, None)
