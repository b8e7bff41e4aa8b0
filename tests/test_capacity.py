"""Capacity arithmetic against values computed by hand (the computation is in the
comments), the live reader against the real captures, and `kvwatch capacity`
end to end through kvwatch.cli.main."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwatch.capacity import arithmetic as cap
from kvwatch.capacity.arithmetic import CapacityInputError
from kvwatch.capacity.live import read_live_capacity
from kvwatch.cli import main
from pageserver import Answer, PageServer

GiB, MiB = 2**30, 2**20

# Llama-3-8B-like: GQA with 8 KV heads of 32 query heads.
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "num_key_value_heads": 8, "torch_dtype": "bfloat16"}
# Llama-2-7B-like: no num_key_value_heads, so MHA.
LLAMA2_7B = {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
             "num_attention_heads": 32, "torch_dtype": "float16"}
# StarCoder-like (GPT-BigCode field names): multi_query means one KV head.
STARCODER = {"model_type": "gpt_bigcode", "n_embd": 6144, "n_layer": 40, "n_head": 48,
             "multi_query": True, "torch_dtype": "float32"}
# DeepSeek-V3-like MLA. The head counts are there to prove they are not used.
DEEPSEEK_V3 = {"model_type": "deepseek_v3", "hidden_size": 7168, "num_hidden_layers": 61,
               "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512,
               "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
               "v_head_dim": 128, "num_nextn_predict_layers": 1, "torch_dtype": "bfloat16"}
# Mistral-7B-v0.1-like: every layer slides over 4096 tokens.
MISTRAL_7B = {"model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096,
              "torch_dtype": "bfloat16"}
# Gemma-3-4B-like multimodal config: language model nested in text_config, five of
# six layers slide over 1024 tokens; torch_dtype only at the top.
GEMMA3_4B = {"model_type": "gemma3", "torch_dtype": "bfloat16",
             "vision_config": {"hidden_size": 1152, "num_hidden_layers": 27},
             "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                             "num_hidden_layers": 34, "num_attention_heads": 8,
                             "num_key_value_heads": 4, "head_dim": 256,
                             "sliding_window": 1024, "sliding_window_pattern": 6}}
# Jamba-like hybrid: one attention layer in eight (i % 8 == 4), the rest Mamba.
JAMBA = {"model_type": "jamba", "hidden_size": 4096, "num_hidden_layers": 32,
         "num_attention_heads": 32, "num_key_value_heads": 8, "attn_layer_period": 8,
         "attn_layer_offset": 4, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2,
         "torch_dtype": "bfloat16"}
# The tiny Llama of the real captures (tests/fixtures/vllm-0.32-cpu).
TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 256, "vocab_size": 2048, "max_position_embeddings": 2048,
              "torch_dtype": "float32"}


def only(result: cap.CapacityResult) -> cap.RequestEstimate:
    assert len(result.requests) == 1
    return result.requests[0]


# ---------------------------------------------------------------------------
# Sizes and lengths


@pytest.mark.parametrize("text, expected", [
    ("3GiB", 3 * 2**30), ("3 GiB", 3 * 2**30), ("3GB", 3 * 10**9), ("3gb", 3 * 10**9),
    ("384MiB", 384 * 2**20), ("384MB", 384 * 10**6), ("1KiB", 1024), ("1KB", 1000),
    ("2TiB", 2 * 2**40), ("1TB", 10**12), ("1.5GiB", 1610612736), ("4194304", 4194304),
    ("4194304B", 4194304),
])
def test_parse_size_tells_decimal_from_binary(text, expected):
    assert cap.parse_size(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("3G", "unknown size unit"), ("3 gigs", "unknown size unit"), ("", "cannot read"),
    ("-1GiB", "cannot read"), ("0GiB", "more than zero"), ("1.3B", "whole number"),
    ("GiB", "cannot read"),
])
def test_parse_size_refuses_what_it_cannot_read(text, fragment):
    with pytest.raises(CapacityInputError, match=fragment):
        cap.parse_size(text)


def test_token_lengths_one_value_or_quantiles():
    assert cap.parse_token_lengths("2048") == 2048
    assert cap.parse_token_lengths("p50=512, p95=2048") == {"p50": 512, "p95": 2048}
    assert cap.combine_lengths({"p50": 512, "p95": 2048}, 256) == [
        ("p50", 512, 256), ("p95", 2048, 256)]
    assert cap.combine_lengths(100, {"p50": 1, "p99": 9}) == [("p50", 100, 1), ("p99", 100, 9)]
    with pytest.raises(CapacityInputError, match="different quantiles"):
        cap.combine_lengths({"p50": 1}, {"p95": 2})
    with pytest.raises(CapacityInputError, match="cannot read"):
        cap.parse_token_lengths("median=5")
    with pytest.raises(CapacityInputError, match="at least one token"):
        cap.combine_lengths(0, 0)


# ---------------------------------------------------------------------------
# Bytes per token from the attention structure


def test_gqa_llama3_8b_fp16():
    # head_dim = 4096 / 32 = 128
    # per layer per token: 2 (K,V) x 8 KV heads x 128 x 2 B = 4096 B
    # per token: 4096 x 32 layers = 131072 B
    # 3 GiB, 2048 + 1024 = 3072 tokens: 3072 x 131072 = 402653184 B = 384 MiB
    #   simple bound 3221225472 // 402653184 = 8
    #   block 16: ceil(3072/16) = 192 blocks, no rounding loss -> rounded bound 8
    #   pool: 3221225472 // (16 x 131072 = 2097152) = 1536 blocks; minus the null block
    #   1535 // 192 = 7 (the eighth request's last block is the null block)
    result = cap.compute_capacity(LLAMA3_8B, "fp16", 16, 3 * GiB, 2048, 1024)
    structure = result.structure
    assert (structure.attention, structure.num_kv_heads, structure.head_dim) == ("GQA", 8, 128)
    assert structure.bytes_per_token_per_layer == 4096
    assert result.bytes_per_token == 131072
    request = only(result)
    assert request.bytes_per_request == 402653184 == 384 * MiB
    assert request.simple_bound == 8
    assert request.full_layer_blocks == 192
    assert request.rounded_bytes_per_request == 402653184
    assert request.rounded_bound == 8
    assert (result.pool_blocks, result.usable_blocks, request.pool_bound) == (1536, 1535, 7)


def test_kv_dtype_auto_reads_torch_dtype_and_fp8_halves_it():
    # auto -> bfloat16 (2 B): same 131072 B/token as fp16; fp8 (1 B): 65536; fp32: 262144
    assert cap.kv_structure(LLAMA3_8B, "auto").bytes_per_token == 131072
    assert cap.kv_structure(LLAMA3_8B, "fp8").bytes_per_token == 65536
    assert cap.kv_structure(LLAMA3_8B, "fp8_e5m2").bytes_per_token == 65536
    assert cap.kv_structure(LLAMA3_8B, "fp32").bytes_per_token == 262144


def test_mha_llama2_7b():
    # no num_key_value_heads: KV heads = 32 = query heads (MHA); head_dim 4096/32 = 128
    # per token: 2 x 32 x 128 x 2 B x 32 layers = 524288 B (512 KiB)
    # 1000 + 500 = 1500 tokens: 1500 x 524288 = 786432000 B; 3 GiB // that = 4
    # ceil(1500/16) = 94 blocks = 1504 tokens: 1504 x 524288 = 788529152 B -> 4
    # pool: 3 GiB // (16 x 524288) = 384 blocks; (3 GiB - 8388608) // 788529152 = 4
    result = cap.compute_capacity(LLAMA2_7B, "auto", 16, 3 * GiB, 1000, 500)
    assert result.structure.attention == "MHA"
    assert result.structure.num_kv_heads == 32
    assert result.bytes_per_token == 524288
    request = only(result)
    assert (request.bytes_per_request, request.simple_bound) == (786432000, 4)
    assert (request.full_layer_blocks, request.rounded_bytes_per_request) == (94, 788529152)
    assert (request.rounded_bound, result.pool_blocks, request.pool_bound) == (4, 384, 4)


@pytest.mark.parametrize("config", [
    STARCODER,
    # the same model spelled the Llama way
    {"hidden_size": 6144, "num_hidden_layers": 40, "num_attention_heads": 48,
     "num_key_value_heads": 1},
])
def test_mqa_one_kv_head(config):
    # head_dim 6144 / 48 = 128; per token: 2 x 1 x 128 x 2 B (fp16) x 40 layers = 20480 B
    # 1 GiB, 4096 + 4096 = 8192 tokens: 8192 x 20480 = 167772160 B (160 MiB)
    # 1073741824 // 167772160 = 6; 8192 is 512 whole blocks, so rounding changes nothing
    result = cap.compute_capacity(config, "fp16", 16, GiB, 4096, 4096)
    assert result.structure.attention == "MQA"
    assert result.bytes_per_token == 20480
    request = only(result)
    assert (request.bytes_per_request, request.simple_bound) == (167772160, 6)
    assert (request.rounded_bound, request.pool_bound) == (6, 6)


def test_mla_deepseek_v3():
    # one latent per layer: kv_lora_rank 512 + qk_rope_head_dim 64 = 576 elements, no K/V x2
    # bf16: 576 x 2 B = 1152 B per layer; x 61 layers = 70272 B per token
    # (an MHA reading of the heads would give 2 x 128 x 56 x 2 x 61: far more)
    # 3 GiB, 2048 + 1024 = 3072 tokens: 3072 x 70272 = 215875584 B
    # 3221225472 // 215875584 = 14 (14 x = 3022258176, 15 x = 3238133760)
    # block 64: 3072 / 64 = 48 whole blocks; pool 3221225472 // (64 x 70272 = 4497408) = 716
    # (716 - 1) // 48 = 14
    result = cap.compute_capacity(DEEPSEEK_V3, "auto", 64, 3 * GiB, 2048, 1024)
    structure = result.structure
    assert structure.attention == "MLA"
    assert structure.elements_per_token_per_layer == 576
    assert result.bytes_per_token == (512 + 64) * 61 * 2 == 70272
    request = only(result)
    assert (request.bytes_per_request, request.simple_bound) == (215875584, 14)
    assert (result.pool_blocks, request.pool_bound) == (716, 14)
    assert any("MTP" in note for note in result.notes)
    # fp8: 576 x 1 x 61 = 35136 B/token; 3221225472 // (3072 x 35136 = 107937792) = 29
    fp8 = cap.compute_capacity(DEEPSEEK_V3, "fp8", 64, 3 * GiB, 2048, 1024)
    assert fp8.bytes_per_token == 35136
    assert only(fp8).simple_bound == 29
    assert any("fp8_ds_mla" in note for note in fp8.notes)


def test_mla_without_rope_dim_is_refused():
    config = dict(DEEPSEEK_V3)
    del config["qk_rope_head_dim"]
    with pytest.raises(CapacityInputError, match="qk_rope_head_dim"):
        cap.kv_structure(config)


def test_sliding_window_mistral_capped_at_the_window():
    # per layer per token: 2 x 8 x 128 x 2 B = 4096 B; 32 layers, all sliding over 4096
    # 8000 + 2000 = 10000 tokens, but each layer keeps min(10000, 4096) = 4096
    # simple: 4096 tokens x 4096 B x 32 = 536870912 B (512 MiB); 3 GiB // that = 6
    # blocks: min(ceil(10000/16) = 625, ceil(4096/16) + 1 = 257) = 257 = 4112 tokens
    # rounded: 4112 x 131072 = 538968064 B; 3221225472 // 538968064 = 5 (6 x = 3233808384)
    # pool: (3221225472 - 2097152) // 538968064 = 5
    result = cap.compute_capacity(MISTRAL_7B, "auto", 16, 3 * GiB, 8000, 2000)
    structure = result.structure
    assert (structure.sliding_layers, structure.full_layers) == (32, 0)
    assert result.bytes_per_token == 131072
    request = only(result)
    assert request.sliding_tokens == 4096
    assert (request.bytes_per_request, request.simple_bound) == (536870912, 6)
    assert (request.full_layer_blocks, request.sliding_layer_blocks) == (625, 257)
    assert (request.rounded_bytes_per_request, request.rounded_bound) == (538968064, 5)
    assert request.pool_bound == 5
    # A short request is not capped: 1000 tokens keep ceil(1000/16) = 63 blocks, not 257.
    short = only(cap.compute_capacity(MISTRAL_7B, "auto", 16, 3 * GiB, 1000, 0))
    assert short.sliding_layer_blocks == 63
    assert short.bytes_per_request == 1000 * 131072


GEMMA3_LAYER_TYPES = {**GEMMA3_4B, "text_config": {
    **{k: v for k, v in GEMMA3_4B["text_config"].items() if k != "sliding_window_pattern"},
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                    for i in range(34)]}}


@pytest.mark.parametrize("config", [GEMMA3_4B, GEMMA3_LAYER_TYPES],
                         ids=["sliding_window_pattern", "layer_types"])
def test_alternating_sliding_gemma3_nested_text_config(config):
    # layers i with (i+1) % 6 == 0 are global: i = 5, 11, 17, 23, 29 -> 5 full, 29 sliding
    # per layer per token: 2 x 4 x 256 x 2 B = 4096 B; bytes/token (all 34) = 139264
    # 3000 + 1000 = 4000 tokens:
    #   simple: 4096 x (5 x 4000 + 29 x min(4000, 1024)) = 4096 x 49696 = 203554816 B
    #   blocks: full ceil(4000/16) = 250; sliding min(250, 1024/16 + 1 = 65) = 65
    #   rounded: 4096 x 16 x (5 x 250 + 29 x 65) = 4096 x 16 x 3135 = 205455360 B
    #   1 GiB: 1073741824 // 203554816 = 5; // 205455360 = 5
    result = cap.compute_capacity(config, "auto", 16, GiB, 3000, 1000)
    structure = result.structure
    assert structure.config_section == "text_config"
    assert (structure.full_layers, structure.sliding_layers) == (5, 29)
    assert [i for i, kind in enumerate(structure.layer_kinds) if kind == "full"] == [
        5, 11, 17, 23, 29]
    assert result.bytes_per_token == 139264
    request = only(result)
    assert (request.bytes_per_request, request.simple_bound) == (203554816, 5)
    assert (request.full_layer_blocks, request.sliding_layer_blocks) == (250, 65)
    assert (request.rounded_bytes_per_request, request.rounded_bound) == (205455360, 5)


def test_gemma2_slides_on_even_layers():
    # gemma2 without layer_types: layer 0 slides, layer 1 is global, ...
    # 42 layers -> 21 sliding, 21 full; per layer: 2 x 8 x 256 x 2 B = 8192 B
    # 10000 tokens, window 4096: 8192 x (21 x 10000 + 21 x 4096) = 2424963072 B
    # 16 GiB: 17179869184 // 2424963072 = 7
    config = {"model_type": "gemma2", "hidden_size": 3584, "num_hidden_layers": 42,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256,
              "sliding_window": 4096, "torch_dtype": "bfloat16"}
    result = cap.compute_capacity(config, "auto", 16, 16 * GiB, 9000, 1000)
    assert result.structure.layer_kinds[:4] == ["sliding", "full", "sliding", "full"]
    request = only(result)
    assert request.bytes_per_request == 2424963072
    assert request.simple_bound == 7


def test_unused_sliding_window_is_ignored():
    # Qwen2-style: sliding_window present but use_sliding_window false -> all full
    config = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28,
              "num_attention_heads": 28, "num_key_value_heads": 4, "sliding_window": 131072,
              "use_sliding_window": False, "max_window_layers": 28, "torch_dtype": "bfloat16"}
    structure = cap.kv_structure(config)
    # 2 x 4 x 128 x 2 B x 28 = 57344 B/token, every layer full
    assert (structure.full_layers, structure.sliding_layers) == (28, 0)
    assert structure.bytes_per_token == 57344


def test_hybrid_jamba_attention_layers_only_and_mamba_state():
    # attention layers: i % 8 == 4 -> 4, 12, 20, 28: 4 of 32 layers; 28 Mamba layers
    # KV per token: 2 x 8 x 128 x 2 B x 4 layers = 16384 B
    # Mamba state per request (bf16): d_inner = 2 x 4096 = 8192;
    #   conv 8192 x (4 - 1) + ssm 8192 x 16 = 155648 elements x 2 B = 311296 B per layer
    #   x 28 layers = 8716288 B
    # 3 GiB, 2048 + 1024 = 3072 tokens: 3072 x 16384 = 50331648 B; 3 GiB // that = 64
    # pool: (3221225472 - 16 x 16384) // 50331648 = 3220963328 // 50331648 = 63
    # with state: 3220963328 // (50331648 + 8716288 = 59047936) = 54
    result = cap.compute_capacity(JAMBA, "auto", 16, 3 * GiB, 2048, 1024)
    structure = result.structure
    assert [i for i, kind in enumerate(structure.layer_kinds) if kind == "full"] == [
        4, 12, 20, 28]
    assert (structure.full_layers, structure.no_kv_layers) == (4, 28)
    assert result.bytes_per_token == 16384
    assert structure.state_bytes_per_request == 8716288
    request = only(result)
    assert (request.bytes_per_request, request.simple_bound) == (50331648, 64)
    assert (request.pool_bound, request.bound_with_state) == (63, 54)


def test_hybrid_from_a_layer_list_without_state_fields_says_state_is_ignored():
    # Qwen3-Next-like: 3 of 4 layers linear attention (no KV). 48 layers -> 12 attention
    # per token: 2 x 2 KV heads x 256 x 2 B x 12 = 24576 B
    config = {"model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
              "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
              "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                              for i in range(48)], "torch_dtype": "bfloat16"}
    result = cap.compute_capacity(config, "auto", 16, GiB, 1000, 24)
    assert (result.structure.full_layers, result.structure.no_kv_layers) == (12, 36)
    assert result.bytes_per_token == 24576
    assert result.structure.state_bytes_per_request is None
    assert any("linear_attention" in note and "ignored" in note for note in result.notes)
    # 1024 tokens x 24576 = 25165824 B; 1 GiB // that = 42
    assert only(result).simple_bound == 42


def test_hybrid_layers_block_type_and_override_pattern():
    # Jamba spelled as an explicit list, and a Nemotron-H style pattern:
    # "M*M-" x 2: attention at 1 and 5; per token 2 x 8 x 128 x 2 B x 2 = 8192 B
    listed = {**{k: v for k, v in JAMBA.items() if not k.startswith("attn_layer")},
              "layers_block_type": ["attention" if i % 8 == 4 else "mamba" for i in range(32)]}
    assert cap.kv_structure(listed).bytes_per_token == 16384
    pattern = {"hidden_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 32,
               "num_key_value_heads": 8, "hybrid_override_pattern": "M*M-M*M-",
               "torch_dtype": "bfloat16"}
    structure = cap.kv_structure(pattern)
    assert structure.full_layers == 2
    assert structure.bytes_per_token == 8192
    assert any("Mamba" in note and "ignored" in note for note in structure.notes)


def test_tiny_llama_of_the_real_captures(fixtures_dir: Path):
    # head_dim 128 / 4 = 32; per token: 2 x 2 KV heads x 32 x 4 B (fp32) x 2 layers = 1024 B
    # budget 4194304 (--kv-cache-memory-bytes), block 32: one block = 32 x 1024 = 32768 B
    # pool: 4194304 // 32768 = 128 blocks = 4096 tokens -- what vLLM reported
    result = cap.compute_capacity(TINY_LLAMA, "auto", 32, 4194304, 400, 400)
    assert result.bytes_per_token == 1024
    assert (result.block_bytes, result.pool_blocks, result.pool_tokens) == (32768, 128, 4096)
    for capture in sorted((fixtures_dir / "vllm-0.32-cpu").glob("*.txt")):
        live = read_live_capacity(capture.read_text())
        (engine,) = live["engines"]
        assert (engine["num_gpu_blocks"], engine["block_size"]) == (128, 32), capture.name
        assert engine["kv_cache_size_tokens"] == result.pool_tokens, capture.name
        assert engine["kv_cache_memory_bytes"] == result.kv_budget_bytes, capture.name
    # 800 tokens = 25 blocks; (128 - 1) // 25 = 5
    assert only(result).pool_bound == 5
    # 400 + 401 = 801 tokens: simple 801 x 1024 = 820224 B, 4194304 // 820224 = 5;
    # ceil(801/32) = 26 blocks = 851968 B, 4194304 // 851968 = 4 -- rounding costs one
    odd = only(cap.compute_capacity(TINY_LLAMA, "auto", 32, 4194304, 400, 401))
    assert (odd.simple_bound, odd.full_layer_blocks, odd.rounded_bound) == (5, 26, 4)


def test_worked_example_budget_over_bytes_per_request():
    # 3 GiB = 3072 MiB; 3072 / 384 = 8; 3072 / 768 = 4
    assert only(cap.capacity_from_request_bytes(3 * GiB, 384 * MiB)).simple_bound == 8
    assert only(cap.capacity_from_request_bytes(3 * GiB, 768 * MiB)).simple_bound == 4
    # one byte more per request and the eighth no longer fits
    assert only(cap.capacity_from_request_bytes(3 * GiB, 384 * MiB + 1)).simple_bound == 7


def test_distribution_gives_one_row_per_quantile():
    # Llama-3-8B fp16: p50 512 + 128 = 640 tokens x 131072 = 83886080 B -> 3 GiB // = 38
    #                  p95 2048 + 512 = 2560 tokens x 131072 = 335544320 B -> 3 GiB // = 9
    result = cap.compute_capacity(LLAMA3_8B, "fp16", 16, 3 * GiB,
                                  {"p50": 512, "p95": 2048}, {"p50": 128, "p95": 512})
    assert [(r.label, r.tokens, r.simple_bound) for r in result.requests] == [
        ("p50", 640, 38), ("p95", 2560, 9)]


@pytest.mark.parametrize("config, fragment", [
    ({"model_type": "llama"}, "num_hidden_layers"),
    ({"num_hidden_layers": 2, "hidden_size": 128}, "num_attention_heads"),
    ({"num_hidden_layers": 2, "num_attention_heads": 4}, "hidden_size"),
    ({"num_hidden_layers": 2, "num_attention_heads": 3, "hidden_size": 128}, "not a multiple"),
    ({**TINY_LLAMA, "num_key_value_heads": "two"}, "positive integer"),
    ({**TINY_LLAMA, "layer_types": ["full_attention"]}, "lists 1 layers"),
    ({**TINY_LLAMA, "layer_types": ["banana", "full_attention"]}, "unknown layer type"),
    ({**TINY_LLAMA, "layer_types": ["mamba", "mamba"]}, "no attention layer"),
    ({**TINY_LLAMA, "layer_types": ["sliding_attention"] * 2}, "sliding_window is not set"),
])
def test_config_without_needed_fields(config, fragment):
    with pytest.raises(CapacityInputError, match=fragment):
        cap.kv_structure(config, "fp16")


def test_auto_dtype_reads_transformers_v5_dtype_key():
    # transformers 5 writes "dtype" where 4.x wrote "torch_dtype" (the real tiny model does)
    config = {k: v for k, v in TINY_LLAMA.items() if k != "torch_dtype"}
    assert cap.kv_structure({**config, "dtype": "float32"}).bytes_per_token == 1024
    assert cap.kv_structure({**config, "dtype": "bfloat16"}).bytes_per_token == 512


def test_auto_dtype_needs_torch_dtype():
    config = {k: v for k, v in TINY_LLAMA.items() if k != "torch_dtype"}
    with pytest.raises(CapacityInputError, match="--kv-dtype"):
        cap.kv_structure(config, "auto")
    assert cap.kv_structure(config, "fp16").bytes_per_token == 512


@settings(max_examples=200, deadline=None)
@given(layers=st.integers(1, 128), kv_heads=st.integers(1, 64), head_dim=st.integers(1, 512),
       dtype=st.sampled_from(["fp8", "fp16", "bf16", "fp32"]), block=st.integers(1, 256),
       budget=st.integers(1, 2**42), inp=st.integers(0, 200_000), out=st.integers(1, 50_000))
def test_bounds_are_ordered(layers, kv_heads, head_dim, dtype, block, budget, inp, out):
    config = {"num_hidden_layers": layers, "num_attention_heads": kv_heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim}
    # Below two blocks (the null block and one to use) the budget is refused: `budget` is beyond them.
    budget += 2 * block * 2 * kv_heads * head_dim * cap.DTYPE_BYTES[dtype] * layers
    result = cap.compute_capacity(config, dtype, block, budget, inp, out)
    request = only(result)
    assert result.bytes_per_token == 2 * kv_heads * head_dim * cap.DTYPE_BYTES[dtype] * layers
    assert request.bytes_per_request <= request.rounded_bytes_per_request
    assert request.rounded_bytes_per_request - request.bytes_per_request < result.block_bytes
    assert request.pool_bound <= request.rounded_bound <= request.simple_bound
    # the pool bound is what whole blocks allow, one block kept aside
    assert request.pool_bound == result.usable_blocks // request.full_layer_blocks


# ---------------------------------------------------------------------------
# The live reader on the other real captures


def test_read_live_capacity_across_versions(fixtures_dir: Path):
    public = fixtures_dir / "public"
    v0 = read_live_capacity((public / "vllm-v0-0.5.txt").read_text())["engines"][0]
    # V0: no engine label, gpu_cache_usage_perc, no kv_cache_size_tokens: 7281 x 16
    assert (v0["engine"], v0["capacity_tokens"], v0["usage_metric"]) == (
        "0", 7281 * 16, "vllm:gpu_cache_usage_perc")
    v011 = read_live_capacity((public / "vllm-0.11.0.txt").read_text())["engines"][0]
    assert (v011["capacity_tokens"], v011["kv_cache_memory_bytes"]) == (2452 * 16, None)
    deepseek = read_live_capacity(
        (public / "vllm-0.25-deepseek-specdecode.txt").read_text())["engines"][0]
    # vLLM's group-aware kv_cache_size_tokens wins over blocks x block_size (15998 x 4)
    assert deepseek["capacity_tokens"] == 1428520
    assert deepseek["capacity_source"] == "kv_cache_size_tokens"
    assert deepseek["kv_cache_max_concurrency"] == pytest.approx(1.3623435238014137)
    # SGLang states its pool in tokens (max_total_num_tokens), with no block size on this build.
    (sglang,) = read_live_capacity((public / "sglang-0.5.10-trimmed.txt").read_text())["engines"]
    assert (sglang["capacity_tokens"], sglang["block_size"], sglang["usage_metric"], sglang["kv_cache_usage"]) == (
        430839, None, "sglang:token_usage", 0.25)


def test_read_live_capacity_underscore_spelling_and_engines(fixtures_dir: Path):
    text = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    underscored = text.replace("vllm:", "vllm_")
    (engine,) = read_live_capacity(underscored)["engines"]
    assert (engine["capacity_tokens"], engine["num_requests_running"]) == (4096, 6.0)
    two = text + "\n".join(line.replace('engine="0"', 'engine="1"')
                           for line in text.splitlines() if line.startswith("vllm:"))
    assert [e["engine"] for e in read_live_capacity(two)["engines"]] == ["0", "1"]


def test_observed_occupancy_uses_usable_blocks():
    # vLLM V1 reports usage over num_gpu_blocks - 1: 0.99212598 = 126 / 127
    # 126 blocks x 32 tokens = 4032 tokens over 6 running = 672 tokens each
    observed = cap.observed_occupancy(6.0, 0.9921259842519685, 4096, 32)
    assert (observed["blocks_in_use"], observed["tokens_in_use"]) == (126, 4032)
    assert observed["tokens_per_running_request"] == 672
    assert "single observation" in observed["caveat"]


# ---------------------------------------------------------------------------
# The command


@pytest.fixture
def write_config(tmp_path: Path):
    def write(config, name="config.json") -> str:
        path = tmp_path / name
        path.write_text(json.dumps(config) if not isinstance(config, str) else config)
        return str(path)
    return write


def run_json(capsys, *argv) -> dict:
    assert main(["capacity", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_gqa_json(capsys, write_config):
    report = run_json(capsys, "--model-config", write_config(LLAMA3_8B), "--kv-dtype", "fp16",
                      "--kv-budget", "3GiB", "--input-tokens", "2048", "--output-tokens", "1024")
    result = report["result"]
    assert result["bytes_per_token"] == 131072
    assert result["structure"]["attention"] == "GQA"
    request = result["requests"][0]
    assert (request["bytes_per_request"], request["simple_bound"], request["rounded_bound"]) == (
        384 * MiB, 8, 8)
    assert len(result["ignores"]) >= 6
    assert any("Prefix sharing" in item for item in result["ignores"])


def test_a_budget_below_two_blocks_is_refused_saying_a_bare_size_is_bytes(capsys, write_config):
    """`--kv-budget 20` is 20 bytes: it holds no block, and used to answer 0
    requests without a word."""
    code = main(["capacity", "--model-config", write_config(LLAMA3_8B), "--kv-dtype", "fp16",
                 "--kv-budget", "20", "--input-tokens", "512", "--output-tokens", "128"])
    err = capsys.readouterr().err
    assert code != 0
    assert "20 B" in err and "holds 0 blocks" in err and "a size without a unit is bytes" in err and "20GiB" in err
    # Two blocks of 16 tokens x 131072 B: the smallest budget that holds a token.
    assert cap.compute_capacity(LLAMA3_8B, "fp16", 16, 2 * 16 * 131072, 1, 1).usable_blocks == 1
    with pytest.raises(CapacityInputError, match="holds 1 block of"):
        cap.compute_capacity(LLAMA3_8B, "fp16", 16, 2 * 16 * 131072 - 1, 1, 1)


def test_a_request_longer_than_the_models_positions_is_refused(capsys, write_config):
    config = {**LLAMA3_8B, "max_position_embeddings": 8192}
    code = main(["capacity", "--model-config", write_config(config), "--kv-dtype", "fp16",
                 "--kv-budget", "3GiB", "--input-tokens", "p50=512,p95=8000", "--output-tokens", "1024"])
    err = capsys.readouterr().err
    assert code != 0 and "9024 tokens (p95)" in err and "max_position_embeddings 8192" in err
    assert "(p50)" not in err
    # Exactly at the limit is fine; yarn rope scaling stretches it as vLLM does.
    assert only(cap.compute_capacity(config, "fp16", 16, 3 * GiB, 8000, 192)).tokens == 8192
    yarn = {**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    assert only(cap.compute_capacity(yarn, "fp16", 16, 3 * GiB, 30000, 2000)).tokens == 32000


def test_mla_at_the_default_block_size_says_flashmla_uses_64(capsys, write_config):
    code = main(["capacity", "--model-config", write_config(DEEPSEEK_V3), "--kv-budget", "40GiB",
                 "--input-tokens", "1024", "--output-tokens", "256"])
    out = capsys.readouterr().out
    assert code == 0 and "FlashMLA" in out and "--block-size 64" in out
    assert not any("FlashMLA" in note for note in cap.compute_capacity(DEEPSEEK_V3, "auto", 64, 40 * GiB, 1024, 256).notes)
    assert not any("FlashMLA" in note for note in cap.compute_capacity(LLAMA3_8B, "fp16", 16, 3 * GiB, 1024, 256).notes)


def test_cli_table_shows_the_arithmetic(capsys, write_config):
    code = main(["capacity", "--model-config", write_config(LLAMA3_8B), "--kv-dtype", "fp16",
                 "--kv-budget", "3GiB", "--input-tokens", "p50=512,p95=2048",
                 "--output-tokens", "p50=128,p95=512"])
    out = capsys.readouterr().out
    assert code == 0
    assert "bytes per token = 4096 B x 32 KV layers = 131072 B" in out
    assert "[p95] simple bound = 3221225472 // 335544320 = 9" in out
    assert "What the bound ignores" in out
    assert "never a guarantee" in out


def test_cli_directory_holding_config_json(capsys, write_config, tmp_path):
    write_config(TINY_LLAMA)
    report = run_json(capsys, "--model-config", str(tmp_path), "--kv-budget", "4MiB",
                      "--block-size", "32", "--input-tokens", "400", "--output-tokens", "400")
    assert report["result"]["pool_tokens"] == 4096


@pytest.mark.parametrize("per_request, bound", [("384MiB", 8), ("768MiB", 4)])
def test_cli_worked_example(capsys, per_request, bound):
    report = run_json(capsys, "--kv-budget", "3GiB", "--per-request-bytes", per_request)
    assert report["result"]["requests"][0]["simple_bound"] == bound
    assert main(["capacity", "--kv-budget", "3GiB", "--per-request-bytes", per_request]) == 0
    assert f"= {bound}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, fragment", [
    (["--model-config", "{missing}", "--kv-budget", "3GiB", "--input-tokens", "1",
      "--output-tokens", "1"], "model config not found"),
    (["--model-config", "{llama}", "--kv-budget", "3 gigs", "--input-tokens", "1",
      "--output-tokens", "1"], "unknown size unit"),
    (["--model-config", "{llama}", "--kv-budget", "3G", "--input-tokens", "1",
      "--output-tokens", "1"], "KiB, MiB, GiB"),
    (["--model-config", "{empty}", "--kv-budget", "3GiB", "--input-tokens", "1",
      "--output-tokens", "1", "--kv-dtype", "fp16"], "no num_hidden_layers"),
    (["--model-config", "{broken}", "--kv-budget", "3GiB", "--input-tokens", "1",
      "--output-tokens", "1"], "not valid JSON"),
    (["--model-config", "{llama}", "--kv-budget", "3GiB", "--input-tokens", "1"],
     "--output-tokens"),
    (["--model-config", "{llama}", "--kv-budget", "3GiB", "--input-tokens", "p50=1",
      "--output-tokens", "p90=1"], "different quantiles"),
    (["--model-config", "{llama}", "--kv-budget", "3GiB", "--input-tokens", "1",
      "--output-tokens", "1", "--kv-dtype", "int4"], "--kv-dtype"),
    (["--model-config", "{llama}", "--input-tokens", "1", "--output-tokens", "1"],
     "needs --kv-budget"),
    (["--model-config", "{llama}", "--kv-budget", "3GiB", "--input-tokens", "1",
      "--output-tokens", "1", "--block-size", "0"], "--block-size"),
    (["--kv-budget", "3GiB", "--per-request-bytes", "384MiB", "--model-config", "{llama}"],
     "drop --model-config"),
    (["--per-request-bytes", "384MiB"], "needs --kv-budget"),
    (["--kv-budget", "3GiB"], "give --model-config"),
])
def test_cli_bad_inputs_fail_clearly(capsys, write_config, tmp_path, argv, fragment):
    paths = {"{missing}": str(tmp_path / "absent.json"), "{llama}": write_config(LLAMA3_8B),
             "{empty}": write_config({"model_type": "llama"}, "empty.json"),
             "{broken}": write_config("{not json", "broken.json")}
    argv = [paths.get(arg, arg) for arg in argv]
    assert main(["capacity", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvwatch capacity: error: ")
    assert fragment in captured.err


def _metrics_server(body: str) -> PageServer:
    """Serves one text body on 127.0.0.1 at /metrics (404 elsewhere)."""
    return PageServer([Answer(body)], path="/metrics")


def test_cli_target_compares_computed_with_reported(capsys, write_config, fixtures_dir):
    body = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with _metrics_server(body) as server:
        report = run_json(capsys, "--target", server.base_url, "--model-config",
                          write_config(TINY_LLAMA), "--input-tokens", "400",
                          "--output-tokens", "400")
        code = main(["capacity", "--target", server.url, "--model-config",
                     write_config(TINY_LLAMA), "--input-tokens", "400", "--output-tokens", "400"])
        table = capsys.readouterr().out
    (engine,) = report["engines"]
    assert engine["reported"]["capacity_tokens"] == 4096
    # the budget comes from the target's kv_cache_memory_bytes (4194304), so the
    # computed pool is independent of the reported one -- and they agree
    assert engine["computed"]["budget_bytes"] == 4194304
    assert engine["comparison"]["verdict"] == "matches"
    assert engine["comparison"]["computed_tokens"] == engine["comparison"]["reported_tokens"]
    # 800 tokens = 25 blocks of 32; (128 - 1) // 25 = 5
    assert engine["bounds_from_reported"][0]["bound"] == 5
    assert engine["observed"]["num_requests_running"] == 6.0
    assert engine["observed"]["tokens_in_use"] == 4032
    assert code == 0
    assert "computed vs reported: 4,096 vs 4,096 tokens (matches" in table
    assert "single observation" in table
    assert "kv_cache_max_concurrency: 4" in table


def test_cli_target_alone_and_a_budget_that_disagrees(capsys, write_config, fixtures_dir):
    body = (fixtures_dir / "vllm-0.32-cpu" / "metrics-idle.txt").read_text()
    with _metrics_server(body) as server:
        alone = run_json(capsys, "--target", server.base_url, "--input-tokens", "p50=100,p95=900",
                         "--output-tokens", "100")
        # a budget of 8 MiB computes 256 blocks where the target holds 128
        wrong = run_json(capsys, "--target", server.base_url, "--model-config",
                         write_config(TINY_LLAMA), "--kv-budget", "8MiB",
                         "--input-tokens", "100", "--output-tokens", "100")
    # p50: 200 tokens = ceil(200/32) = 7 blocks -> 127 // 7 = 18
    # p95: 1000 tokens = 32 blocks -> 127 // 32 = 3
    assert [row["bound"] for row in alone["engines"][0]["bounds_from_reported"]] == [18, 3]
    comparison = wrong["engines"][0]["comparison"]
    assert (comparison["computed_blocks"], comparison["verdict"]) == (256, "differs")
    assert comparison["difference_tokens"] == 4096


def test_cli_target_names_a_hybrid_models_mamba_cache(capsys, fixtures_dir):
    """cache_config_info of a hybrid model as vLLM 0.32 writes it (mamba_*
    labels set by MambaModelConfig): WRITTEN FROM vLLM'S SOURCE on the real
    capture, whose tiny model has no Mamba layers."""
    body = (fixtures_dir / "vllm-0.32-cpu" / "metrics-idle.txt").read_text()
    hybrid = body.replace('mamba_block_size="None"', 'mamba_block_size="32"').replace(
        'mamba_cache_mode="none"', 'mamba_cache_mode="align"')
    with _metrics_server(hybrid) as server:
        assert main(["capacity", "--target", server.base_url, "--input-tokens", "100", "--output-tokens", "100"]) == 0
        table = capsys.readouterr().out
    assert "hybrid model (Mamba layers): mamba_block_size 32, mamba_cache_mode align" in table
    with _metrics_server(body) as server:
        assert main(["capacity", "--target", server.base_url, "--input-tokens", "100", "--output-tokens", "100"]) == 0
        assert "hybrid" not in capsys.readouterr().out


def test_cli_target_errors(capsys, fixtures_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed_port = sock.getsockname()[1]
    assert main(["capacity", "--target", f"http://127.0.0.1:{closed_port}",
                 "--input-tokens", "1", "--output-tokens", "1"]) == 2
    assert "cannot fetch" in capsys.readouterr().err
    body = (fixtures_dir / "vllm-0.32-cpu" / "metrics-idle.txt").read_text()
    body = "\n".join(line for line in body.splitlines() if "cache_config_info" not in line) + "\n"
    with _metrics_server(body) as server:
        assert main(["capacity", "--target", server.base_url, "--input-tokens", "1",
                     "--output-tokens", "1"]) == 2
        assert "no vllm:cache_config_info" in capsys.readouterr().err
    # Another engine's page without a capacity: the error names the engine and what it cannot provide.
    with _metrics_server("# TYPE llamacpp:requests_processing gauge\nllamacpp:requests_processing 1\n") as server:
        assert main(["capacity", "--target", server.base_url, "--input-tokens", "1",
                     "--output-tokens", "1"]) == 2
        err = capsys.readouterr().err
        assert "llamacpp's page and states no KV capacity" in err and "time_to_first_token_seconds" in err
    with _metrics_server(body) as server:
        assert main(["capacity", "--target", server.base_url + "/other", "--input-tokens", "1",
                     "--output-tokens", "1"]) == 2
        assert "refused the request (wrong path" in capsys.readouterr().err
    assert main(["capacity", "--target", "ftp://x", "--input-tokens", "1",
                 "--output-tokens", "1"]) == 2
    assert "not an http(s) URL" in capsys.readouterr().err


def test_the_answer_comes_first_in_one_line(capsys, write_config):
    # It printed 68 lines with the answer near the end.
    argv = ["capacity", "--model-config", write_config(LLAMA3_8B), "--kv-dtype", "fp16", "--kv-budget", "125GiB",
            "--input-tokens", "2048", "--output-tokens", "1024"]
    assert main(argv) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert main([*argv, "--json"]) == 0
    pool_bound = json.loads(capsys.readouterr().out)["result"]["requests"][0]["pool_bound"]
    assert first == (f"Answer: {pool_bound:,} requests of 3,072 tokens fit at once in a KV budget of 125.0 GiB; "
                     "the working follows.")
    assert main(["capacity", "--model-config", write_config(LLAMA3_8B), "--kv-dtype", "fp16", "--kv-budget", "3GiB",
                 "--input-tokens", "p50=512,p95=2048", "--output-tokens", "p50=128,p95=1024"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("Answer: p50: ") and "; p95: " in first
    assert main(["capacity", "--kv-budget", "3GiB", "--per-request-bytes", "100MiB"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("Answer: 30 requests of 100.0 MiB fit at once")
