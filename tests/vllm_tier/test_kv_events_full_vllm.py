"""vLLM's full report mode on the tier's real vLLM 0.32: requests that send
`vllm_xargs: {"kv_cache_report_mode": "full"}` make vLLM announce their
reused (hit) blocks with a BlockStored too. kvwatch reads those as hits, so

- the rotation, distinct and changed-prefix loads with every request in full
  mode are named as in incremental mode (test_kv_events_vllm.py), and the
  rotation with half of them in full mode (one stream, mixed) as well;
- a warm shared prefix in full mode reads as hits: none stored again, the
  blocks stored about one a request, the stream's hit tokens the page's.

The engine is the tier's shared events engine (conftest.py's `events_vllm`):
the full mode is asked per request, so the engine's flags are those of
test_kv_events_vllm.py. The module's tests read it with one kvwatch, so the
distinct prompts are judged after the rotations' quiet, as a kvwatch that
read them would."""

from __future__ import annotations

import time

import pytest

from .harness import wait_until_idle
from .kvwatch_support import tier_reporter
from .scenarios import changed_prefix_load, distinct_load, prefix_rotation_load
from .test_kv_events_vllm import ROTATION_SEED, _named, _watch

pytestmark = pytest.mark.vllm

FULL = {"vllm_xargs": {"kv_cache_report_mode": "full"}}


def every(index: int) -> dict:
    return FULL


def half(index: int) -> dict:
    return FULL if index % 2 == 0 else {}


@pytest.fixture(scope="module")
def report(request):
    return tier_reporter(request.config)


def _quiet(server):
    wait_until_idle(server.metrics_url)
    time.sleep(31)  # the last load's blocks leave the 30 s window


@pytest.mark.parametrize("which, extra", [("every request", every), ("half of them", half)])
def test_a_rotation_in_full_mode_is_eviction_before_reuse(stream, report, which, extra):
    server, kvwatch = stream
    _quiet(server)
    seen = _watch(kvwatch, prefix_rotation_load(server.base_url, duration=30.0, seed=ROTATION_SEED,
                                                extra_body=extra))
    last = seen[-1]["kv_events"]
    named = _named(seen, "eviction_before_reuse")
    window = last["window"]
    report(f"kv events, rotation, full mode for {which}: {window['stored']} blocks stored in the window, "
           f"{window['stored_again']:.0f} stored again ({window['stored_again_ratio'] or 0:.0%}), "
           f"{window['reused']:.0f} announced hits; eviction_before_reuse (high, stream) in {len(named)} of "
           f"{len(seen)} samples")
    assert last["intake"]["malformed"] == 0
    assert named, [(f["cause"], f["confidence"]) for d in seen for f in d["findings"]]


def test_distinct_prompts_in_full_mode_are_no_shared_prefix(stream, report):
    server, kvwatch = stream
    _quiet(server)
    seen = _watch(kvwatch, distinct_load(server.base_url, duration=30.0, extra_body=every))
    named = _named(seen, "no_reuse")
    window = seen[-1]["kv_events"]["window"]
    report(f"kv events, distinct, full mode: {window['stored']} stored, {window['stored_again']:.0f} stored again, "
           f"{window['reused']:.0f} hits; no_reuse (high, stream) in {len(named)} of {len(seen)} samples")
    assert named, [(f["cause"], f["confidence"], f["summary"]) for d in seen[-2:] for f in d["findings"]]


def test_a_prefix_change_in_full_mode_is_a_changed_prefix(stream, report):
    server, kvwatch = stream
    _quiet(server)
    seen = _watch(kvwatch, changed_prefix_load(server.base_url, duration=35.0, switch_after=15.0,
                                               extra_body=every))
    named = _named(seen, "prefix_changed")
    report(f"kv events, prefix change, full mode: prefix_changed (high, stream) in {len(named)} of {len(seen)} "
           "samples")
    assert named, [(f["cause"], f["confidence"]) for d in seen for f in d["findings"]]


def test_a_warm_shared_prefix_in_full_mode_reads_as_hits(stream, report):
    server, kvwatch = stream
    _quiet(server)
    # One prefix of 512 tokens (16 blocks) kept warm, 32 tokens of each request's own after it.
    seen = _watch(kvwatch, prefix_rotation_load(server.base_url, duration=20.0, phases=((0.0, 1),), seed=5,
                                                extra_body=every))
    last = seen[-1]["kv_events"]
    window, hits = last["window"], last["hits"]
    report(f"kv events, warm prefix, full mode: {window['stored']} blocks stored, {window['reused']:.0f} announced "
           f"hits, {window['stored_again']:.0f} stored again; the stream's hit tokens {hits['stream_tokens']} "
           f"beside the page's {hits['page_tokens']}")
    assert window["stored_again"] == 0
    assert window["reused"] > 5 * window["stored"]  # hits, not new work
    assert hits["stream_share_of_page"] == pytest.approx(1.0, abs=0.1)
