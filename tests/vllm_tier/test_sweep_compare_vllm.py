"""`kvwatch sweep --baseline` on a real vLLM: the tiny model in float32 (the
tier's server), then in bfloat16 (a second server, ~25 s to start). On the
CPU build the cache's dtype is `auto` in both and follows the model's, so
the change is read from the KV bytes per token (1024 -> 512 at the same
4 MiB): the comparison names it first, the pool holds twice the tokens, and
the quality probe measures what bfloat16 did to the greedy answers."""

import json

import pytest

from kvwatch.cli import main
from kvwatch.sweep.compare import load_sweep

from .harness import vllm_server
from .kvwatch_support import tier_reporter

pytestmark = pytest.mark.vllm

# One length, two concurrency levels, 8 requests a cell: about 10 s a sweep.
GRID = ["--input-tokens", "128", "--output-tokens", "32", "--concurrency", "1,4",
        "--requests", "8", "--poll-interval", "0.1s", "--timeout", "120s", "--no-plots"]


@pytest.mark.timeout(480)
def test_float32_to_bfloat16_names_the_precision_first_and_measures_quality(
        real_vllm, vllm_build, tmp_path, capsys, request):
    venv, model = vllm_build
    before, after = tmp_path / "fp32", tmp_path / "bf16"
    code = main(["sweep", "--base-url", real_vllm.base_url, "--model", real_vllm.model_name,
                 *GRID, "--out", str(before)])
    err = capsys.readouterr().err
    print(err)
    assert code == 0, err
    # The tier's fixed flags, then --dtype again: vLLM's argument parser keeps the last.
    with vllm_server(model_dir=model, venv=venv, extra_args=("--dtype", "bfloat16"),
                     log_path=tmp_path / "bf16-server.log",
                     report=tier_reporter(request.config)) as bf16:
        code = main(["sweep", "--base-url", bf16.base_url, "--model", bf16.model_name, *GRID,
                     "--out", str(after), "--baseline", str(before)])
        err = capsys.readouterr().err
        print(err)
        assert code == 0, err

    first, second = load_sweep(before), load_sweep(after)
    for report in (first, second):
        assert report["quality_probe"]["status"] == "measured", report["quality_probe"]["note"]
        assert report["server"]["vllm_version"]  # vLLM's /version
        assert report["server"]["prompt_method"].startswith("/tokenize")
    assert second["config"]["seed"] == first["config"]["seed"]
    assert second["server"]["prompt_recipe"] == first["server"]["prompt_recipe"]

    result = json.loads((after / "compare.json").read_text())
    changes = result["changes"]
    assert changes["conditions"] == [] and changes["same_prompts"] is True
    assert changes["precision"].startswith(
        "the KV cache holds a token in 512 B instead of 1024 B under cache_dtype auto"), changes
    settings = {item["what"]: (item["before"], item["after"]) for item in changes["settings"]}
    assert settings["KV bytes per token"] == (1024.0, 512.0)
    assert settings["cache_config_info kv_cache_size_tokens"] == ("4096", "8192")

    # Capacity: the same 4 MiB holds twice the tokens, so about twice the requests.
    cells = result["cells"]
    assert cells["refused"] == [] and len(cells["compared"]) == 2
    for row in cells["compared"]:
        bound = row["metrics"]["capacity_bound"]
        # (4096 / 32 - 1) // 5 = 25 requests of 160 tokens; (8192 / 32 - 1) // 5 = 51.
        assert (bound["before"], bound["after"]) == (25, 51), row
        assert row["metrics"]["failed"]["after"] == 0

    # Quality, measured: a random-weight model's top tokens are close, and bfloat16's
    # 8-bit mantissa moves logprobs in every position both runs shared.
    quality = result["quality"]
    print(json.dumps({k: quality[k] for k in ("identical", "compared", "first_divergence_token",
                                              "logprob_mean_abs_diff", "logprob_max_abs_diff")}))
    assert quality["measured"] and quality["compared"] == 8
    assert quality["logprob_tokens_compared"] > 0
    assert quality["logprob_mean_abs_diff"] > 0
    assert quality["identical_share"] < 1.0, quality["per_prompt"]
    assert quality["first_divergence_token"] is not None

    text = (after / "compare.md").read_text()
    assert text.index("Capacity gains are only half the answer") < text.index("## What changed") \
        < text.index("## Quality probe") < text.index("## Cells")
