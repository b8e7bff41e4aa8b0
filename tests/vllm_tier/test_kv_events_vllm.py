"""vLLM's KV-cache event stream, read live by kvwatch on the tier's real
vLLM (128 blocks x 32 tokens, --max-num-seqs 8): vLLM runs with
--kv-events-config pointing at a loopback endpoint kvwatch binds (vLLM's
publisher connects to any endpoint that is not a wildcard).

- A round robin over 12 prefixes of 512 tokens (192 blocks through 127) is
  named eviction before reuse with high confidence, decided by the stream,
  with the blocks that came back.
- Prompts that share nothing are named no shared prefix, decided by the stream.
- A prefix that stops being shared mid-run is named a changed prefix.

The engine is the tier's events engine (conftest.py's `events_vllm`), shared
with test_kv_events_full_vllm.py and the sizing test; the module's tests read
it with one kvwatch (conftest.py's `stream`), which remembers what one test's
load left across the next one's quiet. The sizing estimate against vLLMs with
more cache is test_kv_events_sizing_vllm.py.
"""

from __future__ import annotations

import time

import pytest

from .harness import _free_port, events_config, wait_until_idle
from .kvwatch_support import read_kvwatch_diagnosis, tier_reporter
from .scenarios import changed_prefix_load, distinct_load, prefix_rotation_load

pytestmark = pytest.mark.vllm

ROTATION_SEED = 34
# test_worth_vllm.py imports these two from here.
free_port = _free_port
__all__ = ["events_config", "free_port"]


@pytest.fixture(scope="module")
def report(request):
    return tier_reporter(request.config)


def _watch(kvwatch, load, symptom="low_hit_rate", settle_s=3.0):
    """Findings and the stream's report every 0.5 s while `load` runs and a little after."""
    seen = []
    while load.running:
        seen.append(read_kvwatch_diagnosis(kvwatch.url))
        time.sleep(0.5)
    load.wait()
    end = time.monotonic() + settle_s
    while time.monotonic() < end:
        seen.append(read_kvwatch_diagnosis(kvwatch.url))
        time.sleep(0.5)
    return seen


def _named(seen, cause):
    return [f for d in seen for f in d["findings"] if f["symptom"] == "low_hit_rate" and f["cause"] == cause
            and f["confidence"] == "high" and f["notes"].get("decided_by") == "kv_events"]


def test_events_arrive_and_a_rotation_is_eviction_before_reuse(stream, report):
    server, kvwatch = stream
    wait_until_idle(server.metrics_url)
    load = prefix_rotation_load(server.base_url, duration=30.0, seed=ROTATION_SEED)
    seen = _watch(kvwatch, load)
    last = seen[-1]["kv_events"]
    assert last["up"], last
    assert last["intake"]["malformed"] == 0 and last["intake"]["missed"] == 0
    named = _named(seen, "eviction_before_reuse")
    report(f"kv events, rotation: {last['totals']['stored']} blocks stored, {last['totals']['stored_again']:.0f} "
           f"stored again after eviction; eviction_before_reuse (high, stream) in {len(named)} of {len(seen)} samples")
    assert named, [(f["cause"], f["confidence"]) for d in seen for f in d["findings"]]
    assert named[-1]["evidence"]["kv_events_blocks_stored_again"] > 0
    assert last["totals"]["stored_again"] > 0


def test_distinct_prompts_are_no_shared_prefix(stream, report):
    server, kvwatch = stream
    wait_until_idle(server.metrics_url)
    time.sleep(31)  # the rotation's returns leave the 30 s window
    load = distinct_load(server.base_url, duration=30.0)
    seen = _watch(kvwatch, load)
    named = _named(seen, "no_reuse")
    window = seen[-1]["kv_events"]["window"]
    report(f"kv events, distinct prompts: {window['stored']} blocks stored in the window, "
           f"{window['stored_again']:.0f} stored again; no_reuse (high, stream) in {len(named)} of {len(seen)} samples")
    assert named, [(f["cause"], f["confidence"]) for d in seen for f in d["findings"]]
    assert not _named(seen[len(seen) // 2:], "eviction_before_reuse")


def test_a_prefix_change_mid_run_is_a_changed_prefix(stream, report):
    server, kvwatch = stream
    wait_until_idle(server.metrics_url)
    time.sleep(31)
    load = changed_prefix_load(server.base_url, duration=35.0, switch_after=15.0)
    seen = _watch(kvwatch, load)
    named = _named(seen, "prefix_changed")
    report(f"kv events, prefix change: prefix_changed (high, stream) in {len(named)} of {len(seen)} samples")
    assert named, [(f["cause"], f["confidence"]) for d in seen for f in d["findings"]]
