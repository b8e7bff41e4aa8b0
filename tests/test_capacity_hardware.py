"""The KV budget from the hardware (kvwatch/capacity/hardware.py): the weight
count against published parameter counts, the split over tensor parallel
ranks by hand, and `kvwatch capacity --gpu-memory` end to end.

The model configs below are the shape fields of the published config.json of
each checkpoint (Hugging Face), copied as facts; the published parameter
counts are those of the model cards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvwatch.capacity import arithmetic as cap
from kvwatch.capacity import hardware as hw
from kvwatch.capacity.arithmetic import CapacityInputError
from kvwatch.cli import main

from pageserver import Answer, PageServer
from test_capacity import TINY_LLAMA

GiB = 2**30

# meta-llama/Meta-Llama-3-8B: 8.03 B parameters.
LLAMA3_8B = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "attention_bias": False, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}
# meta-llama/Llama-3.2-1B: 1.23 B parameters, output head tied to the embeddings.
LLAMA32_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
              "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 64, "vocab_size": 128256, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16"}
# Qwen/Qwen2-7B: 7.62 B parameters; q, k, v carry biases (no attention_bias key).
QWEN2_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
            "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "vocab_size": 152064, "sliding_window": 131072, "use_sliding_window": False,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# mistralai/Mixtral-8x7B-v0.1: 46.7 B parameters, 8 experts in every layer.
MIXTRAL_8X7B = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
                "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
# deepseek-ai/DeepSeek-V2-Lite: 15.7 B parameters; MLA without a q low rank,
# 64 routed + 2 shared experts from layer 1 on, layer 0 dense.
DEEPSEEK_V2_LITE = {"model_type": "deepseek_v2", "hidden_size": 2048,
                    "intermediate_size": 10944, "moe_intermediate_size": 1408,
                    "num_hidden_layers": 27, "num_attention_heads": 16,
                    "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
                    "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                    "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
                    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("config, published", [
    (LLAMA3_8B, 8.03e9), (LLAMA32_1B, 1.23e9), (QWEN2_7B, 7.62e9), (MIXTRAL_8X7B, 46.7e9),
    (DEEPSEEK_V2_LITE, 15.7e9),
    # the tiny Llama of the captures (tests/fixtures/README.md): 0.82 M
    (TINY_LLAMA, 0.82e6),
], ids=["llama3-8b", "llama3.2-1b-tied", "qwen2-7b", "mixtral-8x7b", "deepseek-v2-lite",
        "tiny-llama"])
def test_weight_count_within_one_percent_of_published(config, published):
    count = hw.count_weights(config)
    assert abs(count.parameters - published) / published < 0.01, count.steps


def test_tiny_llama_count_by_hand():
    # embeddings 2048 x 128 = 262,144 and an untied head as much (LlamaConfig's default);
    # per layer: q 128x128 + k, v 2 x 128x64 + o 128x128 = 49,152, MLP 3 x 128 x 256 =
    # 98,304, norms 256; x 2 layers = 295,424; final norm 128
    count = hw.count_weights(TINY_LLAMA)
    assert count.parameters == 262_144 * 2 + 295_424 + 128 == 819_840
    assert count.bytes_per_gpu == 819_840 * 4  # float32


def test_llama3_8b_split_over_two_ranks():
    count = hw.count_weights(LLAMA3_8B, 2)
    terms = {t.name: t for t in count.terms}
    assert set(terms) == {"embeddings", "lm_head", "attention", "mlp", "norms"}
    # sharded terms halve, the norms stay whole on every rank
    assert terms["embeddings"].per_gpu_parameters == 128256 * 4096 // 2
    assert terms["attention"].per_gpu_parameters == 1_342_177_280 // 2
    assert terms["mlp"].per_gpu_parameters == 5_637_144_576 // 2
    assert terms["norms"].per_gpu_parameters == terms["norms"].parameters == 65 * 4096
    assert count.per_gpu_parameters == 4_015_263_744
    assert count.bytes_per_gpu == 8_030_527_488


def test_more_ranks_than_kv_heads_replicate_kv_projections():
    # 16 ranks, 8 KV heads: each rank keeps one whole KV head (k and v: 2 x 4096 x 128
    # per layer), not half of one
    terms = {t.name: t for t in hw.count_weights(LLAMA3_8B, 16).terms}
    q_and_o = 2 * 4096 * 4096 // 16
    assert terms["attention"].per_gpu_parameters == 32 * (q_and_o + 2 * 4096 * 128)
    assert hw.kv_shards(LLAMA3_8B, 16)[0] == 8


def test_mla_replicates_the_latent_projection_and_its_kv():
    count = hw.count_weights(DEEPSEEK_V2_LITE, 2)
    attention = {t.name: t for t in count.terms}["attention"]
    # sharded: q 2048x16x192 + kv_b 512x16x256 + o 16x128x2048 = 12,582,912 per layer;
    # replicated: kv_a 2048 x 576 + its norm 512 = 1,180,160
    assert attention.parameters == 27 * (12_582_912 + 1_180_160)
    assert attention.per_gpu_parameters == 27 * (12_582_912 // 2 + 1_180_160)
    experts = {t.name: t for t in count.terms}
    assert experts["experts"].parameters == 26 * 64 * 3 * 2048 * 1408
    assert experts["shared experts"].parameters == 26 * 3 * 2048 * 2816
    assert experts["router"].per_gpu_parameters == experts["router"].parameters == 26 * 2048 * 64
    assert experts["mlp"].parameters == 3 * 2048 * 10944  # layer 0 only
    # every rank holds the whole latent: the replica's pool is one GPU's
    assert hw.kv_shards(DEEPSEEK_V2_LITE, 2)[0] == 1


def test_budget_terms_and_their_flow_into_the_bounds():
    budget = hw.hardware_budget(LLAMA3_8B, 80 * GiB, "0.9", 2)
    # 80 GiB x 0.9 = 77,309,411,328; - 8,030,527,488 weights - 2 GiB reserve
    assert budget.usable_bytes_per_gpu == 77_309_411_328
    assert budget.weights_bytes_per_gpu == 8_030_527_488
    assert budget.runtime_reserve_bytes == 2 * GiB
    assert budget.kv_budget_per_gpu == 67_131_400_192
    # 8 KV heads over 2 ranks: each holds half of every token's KV, so the replica's
    # pool in bytes of all heads is twice one GPU's
    assert (budget.kv_shards, budget.kv_budget_bytes) == (2, 134_262_800_384)
    result = cap.compute_capacity(LLAMA3_8B, "auto", 16, budget.kv_budget_bytes, 2048, 1024)
    # 131,072 B per token x 16 = 2 MiB blocks: 134,262,800,384 // 2,097,152 = 64,021 blocks;
    # (64,021 - 1) // 192 = 333 requests of 3,072 tokens
    assert (result.pool_blocks, result.requests[0].pool_bound) == (64_021, 333)


def test_budget_with_given_weights_and_reserve_skips_the_count():
    # Mamba layers' weights are not counted, so a hybrid needs its weights given
    hybrid = {**LLAMA3_8B, "layer_types": ["mamba", "full_attention"] * 16}
    with pytest.raises(CapacityInputError, match="--weights-bytes"):
        hw.hardware_budget(hybrid, 24 * GiB)
    budget = hw.hardware_budget(hybrid, 24 * GiB, "1", 1, runtime_reserve_bytes=GiB,
                                weights_bytes_per_gpu=16 * GiB)
    assert budget.weights is None
    assert budget.kv_budget_per_gpu == 7 * GiB


@pytest.mark.parametrize("kwargs, fragment", [
    ({"gpu_memory_bytes": 8 * GiB}, "nothing is left"),
    ({"gpu_memory_utilization": "1.5"}, "at most 1"),
    ({"gpu_memory_utilization": "most"}, "not a number"),
    ({"tensor_parallel_size": 0}, "positive integer"),
    ({"config": {k: v for k, v in LLAMA3_8B.items() if k != "torch_dtype"}}, "torch_dtype"),
])
def test_budget_refuses_what_it_cannot_count(kwargs, fragment):
    args = {"config": LLAMA3_8B, "gpu_memory_bytes": 80 * GiB, **kwargs}
    with pytest.raises(CapacityInputError, match=fragment):
        hw.hardware_budget(**args)


def test_quantized_and_multimodal_configs_say_what_the_count_misses():
    quantized = hw.count_weights({**LLAMA3_8B, "quantization_config": {"quant_method": "fp8"}})
    assert any("quantization_config" in note for note in quantized.notes)
    nested = hw.count_weights({"model_type": "llava", "torch_dtype": "float16",
                               "text_config": LLAMA3_8B})
    assert any("text_config" in note for note in nested.notes)


# ---------------------------------------------------------------------------
# The command


@pytest.fixture
def config_path(tmp_path: Path):
    def write(config) -> str:
        path = tmp_path / "config.json"
        path.write_text(json.dumps(config))
        return str(path)
    return write


def test_cli_gpu_memory_shows_each_term(capsys, config_path):
    argv = ["capacity", "--model-config", config_path(LLAMA3_8B), "--gpu-memory", "80GiB",
            "--gpu-memory-utilization", "0.9", "--tensor-parallel-size", "2",
            "--input-tokens", "2048", "--output-tokens", "1024"]
    assert main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    terms = report["hardware"]
    assert (terms["usable_bytes_per_gpu"], terms["weights_bytes_per_gpu"],
            terms["runtime_reserve_bytes"], terms["kv_budget_bytes"]) == (
        77_309_411_328, 8_030_527_488, 2 * GiB, 134_262_800_384)
    assert terms["weights"]["parameters"] == 8_030_261_248
    assert report["result"]["kv_budget_bytes"] == 134_262_800_384
    assert report["result"]["requests"][0]["pool_bound"] == 333
    assert any(item.startswith("Runtime reserve") for item in report["result"]["ignores"])
    assert not any(item.startswith("Reserves:") for item in report["result"]["ignores"])
    # Each caveat once under its own heading: two bullets both began "Parallelism:".
    headings = [item.split(":")[0] for item in report["result"]["ignores"]]
    assert len(headings) == len(set(headings)), headings

    assert main(argv) == 0
    table = capsys.readouterr().out
    for line in ("x utilization              77,309,411,328", "- weights",
                 "- runtime reserve", "= KV per GPU               67,131,400,192",
                 "8.03 B parameters", "KV budget: 134,262,800,384 B"):
        assert line in table
    # Every column of the terms table is labelled (the GiB column had no heading).
    heading, rule = table.splitlines()[5:7]  # after the answer line, a blank, the title and a blank
    assert heading.split() == ["term", "bytes", "binary", "units", "from"], heading
    assert len(rule.split()) == 4


def test_cli_gpu_memory_against_a_live_target(capsys, config_path, fixtures_dir):
    # the tiny Llama's weights are 819,840 x 4 B = 3,279,360 B; with a 1 MiB reserve,
    # 8,522,240 B of GPU leave 4,194,304 B: the pool of 128 blocks the capture reports
    body = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(body)]) as server:
        assert main(["capacity", "--target", server.url, "--model-config",
                     config_path(TINY_LLAMA), "--gpu-memory", "8522240",
                     "--gpu-memory-utilization", "1", "--runtime-reserve", "1MiB",
                     "--input-tokens", "400", "--output-tokens", "400", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    (engine,) = report["engines"]
    assert engine["computed"]["budget_bytes"] == 4_194_304
    assert engine["computed"]["budget_source"].startswith("--gpu-memory")
    assert engine["comparison"]["verdict"] == "matches"


@pytest.mark.parametrize("flags, fragment", [
    (["--gpu-memory", "80GiB", "--kv-budget", "3GiB"], "not both"),
    (["--tensor-parallel-size", "2"], "needs --gpu-memory"),
    (["--gpu-memory", "80GiB", "--gpu-memory-utilization", "0"], "above 0"),
    (["--gpu-memory", "80G"], "KiB, MiB, GiB"),
])
def test_cli_hardware_flags_fail_clearly(capsys, config_path, flags, fragment):
    assert main(["capacity", "--model-config", config_path(LLAMA3_8B), "--input-tokens", "1",
                 "--output-tokens", "1", *flags]) == 2
    assert fragment in capsys.readouterr().err


def test_cli_gpu_memory_needs_a_model_config(capsys):
    assert main(["capacity", "--gpu-memory", "80GiB", "--per-request-bytes", "1GiB"]) == 2
    assert "--per-request-bytes" in capsys.readouterr().err
