"""The sizing estimate where it is hard, against the simulator: each load
runs at a base cache, kvwatch predicts from the stream the hit ratio the
page would count with 1.25x, 1.5x, 2x and 3x the cache, and the same load
(same seed) runs at each of those sizes; the prediction is within 10 points
of the hit ratio counted there.

- a working set of 24 prefixes of 32 blocks (768) through 399 blocks, each
  picked at random: returns of every distance, a curve that rises steeply
  between 1x and 2x;
- a mix: half the requests one of 12 prefixes, half a distinct prompt of up
  to 600 tokens pushing blocks through;
- 60 prefixes of Zipf popularity: the popular ones hit (no event) and are
  refreshed in the engine's order, the rest evicted.

The first-order estimate errs low by up to 10.5 points on the first load
(at 2x): kept returns become hits, not stores, so fewer blocks pass between
an eviction and a return in the larger cache (the curve's second-order step,
kvwatch/kvevents/ledger.py)."""

from __future__ import annotations

import pytest

from test_kv_events_diagnose import Live

LOADS = {
    "working set 1.9x the cache": ("{share: 1.0, tokens: 512, count: 24}", "{dist: uniform, min: 16, max: 32}"),
    "mix of prefixes and distinct prompts": ("{share: 0.5, tokens: 512, count: 12}",
                                             "{dist: uniform, min: 16, max: 600}"),
    "zipf popularity": ("{share: 1.0, tokens: 512, count: 60, popularity: zipf, zipf_s: 1.1}",
                        "{dist: uniform, min: 16, max: 32}"),
}
BASE_BLOCKS = 400
FACTORS = (0.25, 0.5, 1.0, 2.0)  # extra cache: 1.25x, 1.5x, 2x and 3x


def scenario(prefix: str, prompt: str, blocks: int) -> str:
    return f"""
name: sizing
description: a load for the sizing check
engine: {{num_gpu_blocks: {blocks}, block_size: 16, max_num_seqs: 8, max_model_len: 4096}}
workload:
  rate: 4.0
  prompt_tokens: {prompt}
  output_tokens: {{dist: uniform, min: 4, max: 8}}
  max_tokens: 8
  prefix: {prefix}
phases:
  - {{name: run, duration: 30m}}
"""


def sizing(tmp_path, prefix: str, prompt: str, blocks: int) -> dict:
    live = Live(scenario(prefix, prompt, blocks), tmp_path)
    try:
        return live.run(240).kv_events["sizing"]
    finally:
        live.close()


@pytest.mark.parametrize("load", sorted(LOADS))
def test_the_sizing_estimate_is_within_ten_points_of_the_larger_caches_hit_ratio(tmp_path_factory, load):
    prefix, prompt = LOADS[load]
    base = sizing(tmp_path_factory.mktemp("base"), prefix, prompt, BASE_BLOCKS)
    predicted = {p["extra_cache"]: p["hit_ratio"] for p in base["points"]}
    usable = BASE_BLOCKS - 1  # the page's num_gpu_blocks - 1, the curve's base
    counted = {f: sizing(tmp_path_factory.mktemp(f"x{f}"), prefix, prompt, int(round(usable * (1 + f))) + 1)
               ["hit_ratio_now"] for f in FACTORS}
    errors = {f"{1 + f:g}x": round(predicted[f] - counted[f], 3) for f in FACTORS}
    print(f"{load}: now {base['hit_ratio_now']:.3f}; predicted/counted "
          + ", ".join(f"{1 + f:g}x {predicted[f]:.3f}/{counted[f]:.3f}" for f in FACTORS))
    assert all(abs(e) <= 0.10 for e in errors.values()), errors
    assert counted[2.0] > base["hit_ratio_now"]  # the load gains from more cache: the check means something
