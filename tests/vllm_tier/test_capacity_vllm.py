"""`kvwatch capacity --target` against a real vLLM: the pool computed from the
served model's own config.json and the budget vLLM was given must equal the
pool vLLM reports."""

import json

import pytest

from kvwatch.cli import main

pytestmark = pytest.mark.vllm


def test_computed_capacity_matches_the_real_server(real_vllm, capsys):
    code = main(["capacity", "--target", real_vllm.base_url,
                 "--model-config", str(real_vllm.model_dir / "config.json"),
                 "--input-tokens", "400", "--output-tokens", "400", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    (engine,) = report["engines"]
    # 2 layers x 2 KV heads x head_dim 32 x 2 (K, V) x 4 B = 1024 B per token;
    # --kv-cache-memory-bytes 4194304 // (32 x 1024) = 128 blocks = 4096 tokens
    assert engine["computed"]["result"]["bytes_per_token"] == 1024
    assert engine["computed"]["budget_source"].startswith("kv_cache_memory_bytes")
    assert engine["comparison"]["verdict"] == "matches"
    assert engine["comparison"]["reported_tokens"] == 4096
    assert engine["bounds_from_reported"][0]["bound"] == 5
