"""Capacity arithmetic for a paged KV cache: KV bytes per token from a model's
attention structure, bytes per request at given lengths, and how many such
requests a KV budget holds, before and after block rounding. Every step is kept
as a number and as a written line, so an operator can check it by hand.

Pure arithmetic on values already parsed: no files, no network. The
`kvwatch capacity` command (kvwatch/commands/capacity.py) does the reading.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

from kvwatch import units
from kvwatch.capacity.estimate import RequestEstimate, human_bytes, request_estimate  # noqa: F401 (re-exported)

KV_DTYPE_CHOICES = ("auto", "fp16", "bf16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp32")

# Bytes per element of a KV cache dtype, under the names vLLM's --kv-cache-dtype
# and a config's torch_dtype use.
DTYPE_BYTES = {
    "fp32": 4, "float32": 4, "float": 4,
    "fp16": 2, "float16": 2, "half": 2,
    "bf16": 2, "bfloat16": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1,
}


# What the bound leaves out. Printed with every answer: the number is a bound
# from arithmetic, never a promise about a running server.
IGNORED = (
    "Prefix sharing: requests that share a prompt prefix share its full blocks when "
    "prefix caching is on, so more requests can fit than this bound says.",
    "Reserves: the budget is taken to be the KV pool itself. Weights, activation memory "
    "(vLLM profiles a forward pass at start-up and gives the KV cache what is left), "
    "CUDA graphs, the sampler and the gpu_memory_utilization headroom must already be "
    "out of it; if the budget was a GPU's total memory, the bound is far too high.",
    "Fragmentation and allocator behaviour: blocks are allocated as a request grows and "
    "freed when it ends; vLLM V1 keeps one block aside (the null block, counted in the "
    "pool bound); chunked prefill, preemption and recomputation change who holds what "
    "at any moment.",
    "Unequal lengths: the bound assumes every request has the same length. A mix fits "
    "somewhere between the bounds of its shortest and longest requests, and the "
    "quantiles of input and output are added as if long prompts had long answers.",
    "Final length: each request is counted at input + output tokens. Mid-generation "
    "requests hold fewer blocks, so more can be running than the bound at any instant.",
    "Scheduler limits: max_num_seqs, max_num_batched_tokens and max_model_len can cap "
    "concurrency below this bound whatever the memory.",
    "Parallelism: with tensor parallelism each GPU holds num_kv_heads / TP heads, so give "
    "the pool of all ranks of one replica; when there are fewer KV heads than ranks "
    "(MQA, MLA) every rank holds a full copy and the per-GPU budget is what counts.",
    "Speculative decoding: a draft model or MTP layers hold KV of their own, not counted.",
)


class CapacityInputError(ValueError):
    """An input the arithmetic cannot use; the message says which and why."""


# ---------------------------------------------------------------------------
# Parsing of the small text forms the command accepts (sizes, token lengths).


def parse_size(text: str) -> int:
    """Bytes, in the one size grammar of kvwatch.units."""
    try:
        return units.parse_size(text)
    except ValueError as error:
        raise CapacityInputError(str(error)) from None


def parse_token_lengths(text: str) -> int | dict[str, int]:
    """One length ('2048') or a distribution by quantile ('p50=512,p95=2048')."""
    text = str(text).strip()
    if re.fullmatch(r"[0-9]+", text):
        return int(text)
    lengths: dict[str, int] = {}
    for part in text.split(","):
        match = re.fullmatch(r"\s*(p[0-9]+(?:\.[0-9]+)?|mean|max)\s*=\s*([0-9]+)\s*", part)
        if not match:
            raise CapacityInputError(
                f"cannot read {text!r} as token lengths: give one integer (2048) or "
                "quantiles such as p50=512,p95=2048 (keys p<number>, mean or max)")
        key = match.group(1)
        if key in lengths:
            raise CapacityInputError(f"{key} is given twice in {text!r}")
        lengths[key] = int(match.group(2))
    return lengths


def combine_lengths(input_tokens: int | Mapping[str, int],
                    output_tokens: int | Mapping[str, int]) -> list[tuple[str, int, int]]:
    """(label, input, output) for each quantile; a single value applies to all of
    them. Labels 'request' when both are single values."""
    in_map = input_tokens if isinstance(input_tokens, Mapping) else None
    out_map = output_tokens if isinstance(output_tokens, Mapping) else None
    if not isinstance(input_tokens, Mapping) and not isinstance(output_tokens, Mapping):
        rows = [("request", int(input_tokens), int(output_tokens))]
    elif in_map is not None and out_map is not None:
        if list(in_map) != list(out_map):
            raise CapacityInputError(
                f"input and output distributions name different quantiles "
                f"({', '.join(in_map)} vs {', '.join(out_map)}); give the same keys in "
                "the same order, or one plain number for either")
        rows = [(key, int(in_map[key]), int(out_map[key])) for key in in_map]
    elif isinstance(input_tokens, Mapping) and not isinstance(output_tokens, Mapping):
        rows = [(key, int(value), int(output_tokens)) for key, value in input_tokens.items()]
    elif isinstance(output_tokens, Mapping) and not isinstance(input_tokens, Mapping):
        rows = [(key, int(input_tokens), int(value)) for key, value in output_tokens.items()]
    else:  # both maps: above
        rows = []
    for label, inp, out in rows:
        if inp < 0 or out < 0:
            raise CapacityInputError(f"token counts cannot be negative ({label}: {inp}+{out})")
        if inp + out == 0:
            raise CapacityInputError(f"a request needs at least one token ({label}: 0+0)")
    return rows


# ---------------------------------------------------------------------------
# The model's attention structure.

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv")
_NESTED_KEYS = ("text_config", "llm_config", "language_config")

# Layer type names used by layer_types / layers_block_type lists, mapped to what
# they keep per request. "attention" alone is resolved by the sliding-window keys.
_LAYER_KIND_NAMES = {
    "full_attention": "full", "global_attention": "full", "global": "full", "full": "full",
    "attention": "attention",
    "sliding_attention": "sliding", "sliding_window": "sliding", "sliding": "sliding",
    "local_attention": "sliding", "local": "sliding",
    "mamba": "mamba", "mamba2": "mamba", "ssm": "mamba",
    "linear_attention": "linear_attention", "linear": "linear_attention",
    "conv": "conv", "short_conv": "conv",
    "mlp": "mlp", "moe": "mlp",
}
# Nemotron-H style hybrid_override_pattern characters.
_PATTERN_KINDS = {"*": "attention", "M": "mamba", "-": "mlp", "E": "mlp"}
_NO_KV_KINDS = ("mamba", "linear_attention", "conv", "mlp")


@dataclass
class KVStructure:
    """How a model's layers hold KV, and the bytes one token costs."""

    config_section: str            # "" for the top level, else e.g. "text_config"
    model_type: str | None
    attention: str                 # MHA, GQA, MQA or MLA
    num_layers: int
    layer_kinds: list[str]         # per layer: full, sliding, mamba, linear_attention, conv, mlp
    full_layers: int
    sliding_layers: int
    no_kv_layers: int
    sliding_window: int | None
    num_attention_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    kv_lora_rank: int | None
    qk_rope_head_dim: int | None
    kv_dtype: str
    kv_dtype_bytes: int
    elements_per_token_per_layer: int
    bytes_per_token_per_layer: int
    bytes_per_token: int           # all KV layers, as if each kept every token
    full_bytes_per_token: int      # full-attention layers only
    sliding_bytes_per_token: int   # sliding-window layers only (kept up to the window)
    state_bytes_per_request: int | None  # mamba state, fixed per request, when sizable
    steps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _positive_int(cfg: Mapping[str, Any], key: str) -> int:
    value = cfg[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 \
            or int(value) != value:
        raise CapacityInputError(f"config field {key} must be a positive integer, got {value!r}")
    return int(value)


def _first(cfg: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str, int] | None:
    for key in keys:
        if cfg.get(key) is not None:
            return key, _positive_int(cfg, key)
    return None


def _require(cfg: Mapping[str, Any], keys: tuple[str, ...], what: str) -> tuple[str, int]:
    found = _first(cfg, keys)
    if found is None:
        raise CapacityInputError(
            f"the model config has no {keys[0]}"
            + (f" (nor {', '.join(keys[1:])})" if len(keys) > 1 else "")
            + f", needed for {what}")
    return found


def _language_section(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """Multimodal configs nest the language model; its layers are the ones with KV."""
    for key in _NESTED_KEYS:
        sub = config.get(key)
        if isinstance(sub, Mapping) and _first(sub, _LAYER_KEYS) is not None:
            return sub, key
    return config, ""


def _model_dtype(config: Mapping[str, Any], section: Mapping[str, Any]) -> str | None:
    for cfg in (config, section):
        for key in ("torch_dtype", "dtype"):
            value = cfg.get(key)
            if isinstance(value, str):
                return value.removeprefix("torch.")
    return None


def _dtype_bytes(name: str, what: str) -> int:
    try:
        return DTYPE_BYTES[name.lower()]
    except KeyError:
        raise CapacityInputError(
            f"unknown {what} {name!r}: use one of {', '.join(KV_DTYPE_CHOICES[1:])}") from None


def _raw_layer_kinds(cfg: Mapping[str, Any], num_layers: int) -> tuple[list[str], str]:
    """Per-layer kinds before the sliding-window keys are applied, and the key
    they came from."""
    for key in ("layer_types", "layers_block_type"):
        names = cfg.get(key)
        if isinstance(names, list):
            kinds = []
            for name in names:
                kind = _LAYER_KIND_NAMES.get(str(name).lower())
                if kind is None:
                    raise CapacityInputError(
                        f"config {key} names an unknown layer type {name!r}; known: "
                        + ", ".join(sorted(_LAYER_KIND_NAMES)))
                kinds.append(kind)
            if len(kinds) != num_layers:
                raise CapacityInputError(
                    f"config {key} lists {len(kinds)} layers but the model has {num_layers}")
            return kinds, key
    pattern = cfg.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern:
        unknown = sorted(set(pattern) - set(_PATTERN_KINDS))
        if unknown:
            raise CapacityInputError(
                f"config hybrid_override_pattern has unknown characters {''.join(unknown)!r}")
        if len(pattern) != num_layers:
            raise CapacityInputError(
                f"config hybrid_override_pattern has {len(pattern)} layers, the model {num_layers}")
        return [_PATTERN_KINDS[c] for c in pattern], "hybrid_override_pattern"
    if cfg.get("attn_layer_period") is not None:
        period = _positive_int(cfg, "attn_layer_period")
        offset = int(cfg.get("attn_layer_offset") or 0)
        # Jamba: layer i is attention when i % period == offset, else Mamba.
        return (["attention" if i % period == offset else "mamba" for i in range(num_layers)],
                "attn_layer_period/attn_layer_offset")
    return ["attention"] * num_layers, ""


def _sliding_window(cfg: Mapping[str, Any]) -> int | None:
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        # Qwen2-style configs carry a sliding_window they do not use.
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise CapacityInputError(f"config sliding_window must be a positive integer, got {window!r}")
    return window


def _resolve_attention(cfg: Mapping[str, Any], kinds: list[str], window: int | None,
                       model_type: str | None) -> tuple[list[str], str]:
    """Turn generic 'attention' layers into full or sliding, per the config's
    conventions; returns the kinds and a line saying which rule applied."""
    if "attention" not in kinds:
        return kinds, ""
    if window is None:
        return ["full" if k == "attention" else k for k in kinds], ""
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        # Gemma 3 / Cohere 2: every pattern-th layer is global, the others slide.
        rule = f"sliding_window_pattern {pattern}: layer i slides unless (i+1) % {pattern} == 0"
        sliding = [(i + 1) % pattern != 0 for i in range(len(kinds))]
    elif model_type == "gemma2":
        rule = "gemma2: even layers slide, odd layers are global"
        sliding = [i % 2 == 0 for i in range(len(kinds))]
    elif cfg.get("use_sliding_window") is True and cfg.get("max_window_layers") is not None:
        first = int(cfg["max_window_layers"])
        rule = f"max_window_layers {first}: layers from {first} on slide"
        sliding = [i >= first for i in range(len(kinds))]
    else:
        rule = "sliding_window set and no per-layer pattern: every attention layer slides"
        sliding = [True] * len(kinds)
    resolved = [("sliding" if slide else "full") if kind == "attention" else kind
                for kind, slide in zip(kinds, sliding)]
    return resolved, rule


def kv_structure(config: Mapping[str, Any], kv_dtype: str = "auto") -> KVStructure:
    """Bytes of KV one token costs in this model, from its attention structure
    (never from the parameter count). Raises CapacityInputError naming the
    missing or odd field."""
    if not isinstance(config, Mapping):
        raise CapacityInputError("the model config must be a JSON object")
    cfg, section = _language_section(config)
    model_type = cfg.get("model_type") or config.get("model_type")
    steps: list[str] = []
    notes: list[str] = []
    where = f" (from {section})" if section else ""
    if section:
        steps.append(f"language model fields read from {section}")
    dtype_bytes, dtype_label = _kv_dtype_bytes(config, cfg, kv_dtype)
    layers_key, num_layers = _require(cfg, _LAYER_KEYS, "the layer count")
    kinds, kinds_source = _raw_layer_kinds(cfg, num_layers)
    window = _sliding_window(cfg)
    if "sliding" in kinds and window is None:
        raise CapacityInputError(
            "the config's layer list names sliding-window layers but sliding_window is not set")
    kinds, window_rule = _resolve_attention(cfg, kinds, window, model_type)
    if cfg.get("kv_lora_rank") is not None:
        shape = _mla_shape(cfg, where, dtype_bytes, steps, notes)
    else:
        shape = _heads_shape(cfg, where, steps)
    elements = shape["elements"]
    per_layer = elements * dtype_bytes
    steps.append(f"bytes per token per layer = {elements} x {dtype_bytes} B ({dtype_label}) "
                 f"= {per_layer} B")
    full, sliding = kinds.count("full"), kinds.count("sliding")
    steps.append(_layers_line(kinds, num_layers, layers_key, window, kinds_source))
    if window_rule and sliding:
        steps.append(window_rule)
    if full + sliding == 0:
        raise CapacityInputError(
            "the config describes no attention layer, so there is no KV cache to size")
    bytes_per_token = per_layer * (full + sliding)
    steps.append(f"bytes per token = {per_layer} B x {full + sliding} KV layers = "
                 f"{bytes_per_token} B ({human_bytes(bytes_per_token)})"
                 + (f"; the {sliding} sliding-window layers stop growing at the window"
                    if sliding else ""))
    state_bytes = _mamba_state_bytes(config, cfg, kinds, steps, notes)
    _structure_notes(cfg, kinds, notes)
    return KVStructure(
        config_section=section, model_type=model_type, attention=shape["attention"],
        num_layers=num_layers, layer_kinds=kinds, full_layers=full, sliding_layers=sliding,
        no_kv_layers=num_layers - full - sliding, sliding_window=window if sliding else None,
        num_attention_heads=shape.get("heads"), num_kv_heads=shape.get("kv_heads"), head_dim=shape.get("head_dim"),
        kv_lora_rank=shape.get("kv_lora_rank"), qk_rope_head_dim=shape.get("rope_dim"), kv_dtype=dtype_label,
        kv_dtype_bytes=dtype_bytes, elements_per_token_per_layer=elements,
        bytes_per_token_per_layer=per_layer, bytes_per_token=bytes_per_token,
        full_bytes_per_token=per_layer * full, sliding_bytes_per_token=per_layer * sliding,
        state_bytes_per_request=state_bytes, steps=steps, notes=notes)


def _kv_dtype_bytes(config: Mapping[str, Any], cfg: Mapping[str, Any], kv_dtype: str) -> tuple[int, str]:
    """Bytes of one KV element and how the dtype was chosen ('auto' follows the model's torch_dtype)."""
    kv_dtype = (kv_dtype or "auto").lower()
    if kv_dtype != "auto":
        return _dtype_bytes(kv_dtype, "KV cache dtype"), kv_dtype
    model_dtype = _model_dtype(config, cfg)
    if model_dtype is None:
        raise CapacityInputError(
            "--kv-dtype auto uses the model's torch_dtype, and the config has none; "
            "pass --kv-dtype fp16, bf16, fp8 or fp32")
    return _dtype_bytes(model_dtype, "torch_dtype"), f"auto = torch_dtype {model_dtype}"


def _mla_shape(cfg: Mapping[str, Any], where: str, dtype_bytes: int, steps: list[str],
               notes: list[str]) -> dict[str, Any]:
    """Multi-head latent attention caches one compressed latent (kv_lora_rank)
    plus the shared rotary key part per token and layer; K and V are rebuilt
    from it, so there is no factor 2 and no head count."""
    kv_lora_rank = _positive_int(cfg, "kv_lora_rank")
    if cfg.get("qk_rope_head_dim") is None:
        raise CapacityInputError(
            "the model config has kv_lora_rank (MLA) but no qk_rope_head_dim, "
            "needed for the rotary part of the cached latent")
    rope_dim = _positive_int(cfg, "qk_rope_head_dim")
    elements = kv_lora_rank + rope_dim
    steps.append(f"attention: MLA (kv_lora_rank{where}), one latent vector per layer and "
                 "token, no separate K and V")
    steps.append(f"KV elements per token per layer = kv_lora_rank {kv_lora_rank} + "
                 f"qk_rope_head_dim {rope_dim} = {elements}")
    if dtype_bytes == 1:
        notes.append("MLA with an fp8 cache: some vLLM backends (fp8_ds_mla) store the "
                     "rotary part in bf16 plus scales (656 B per token and layer for "
                     "DeepSeek V3), more than the 1 byte per element counted here.")
    return {"attention": "MLA", "kv_lora_rank": kv_lora_rank, "rope_dim": rope_dim, "elements": elements}


def _kv_heads_line(cfg: Mapping[str, Any], heads: int, heads_key: str) -> tuple[int, str]:
    """The KV head count and where it came from."""
    found_kv = _first(cfg, _KV_HEAD_KEYS)
    if found_kv is not None:
        kv_key, kv_heads = found_kv
        return kv_heads, f"{kv_key} = {kv_heads}"
    if cfg.get("multi_query_attention") and cfg.get("multi_query_group_num") is not None:
        kv_heads = _positive_int(cfg, "multi_query_group_num")
        return kv_heads, f"multi_query_group_num = {kv_heads}"
    if cfg.get("multi_query") is True:
        return 1, "multi_query = true, so 1"
    return heads, f"no num_key_value_heads, so {heads_key} = {heads}"


def _head_dim_line(cfg: Mapping[str, Any], heads: int, heads_key: str) -> tuple[int, str]:
    """head_dim from the config, else hidden size over heads, and how."""
    if cfg.get("head_dim") is not None:
        head_dim = _positive_int(cfg, "head_dim")
        return head_dim, f"head_dim = {head_dim} (config)"
    hidden_key, hidden = _require(cfg, _HIDDEN_KEYS, "head_dim (hidden_size / heads)")
    if hidden % heads:
        raise CapacityInputError(
            f"{hidden_key} {hidden} is not a multiple of {heads_key} {heads} and the "
            "config gives no head_dim")
    head_dim = hidden // heads
    return head_dim, f"head_dim = {hidden_key} {hidden} / {heads_key} {heads} = {head_dim}"


def _heads_shape(cfg: Mapping[str, Any], where: str, steps: list[str]) -> dict[str, Any]:
    """Multi-head, grouped-query or multi-query attention: K and V per KV head."""
    heads_key, heads = _require(cfg, _HEAD_KEYS, "the head count")
    kv_heads, kv_line = _kv_heads_line(cfg, heads, heads_key)
    head_dim, dim_line = _head_dim_line(cfg, heads, heads_key)
    if kv_heads == heads:
        attention = "MHA"
    elif kv_heads == 1:
        attention = "MQA"
    else:
        attention = "GQA"
    elements = 2 * kv_heads * head_dim
    steps.append(f"attention: {attention}{where}, KV heads: {kv_line} "
                 f"(of {heads} query heads)")
    steps.append(dim_line)
    steps.append(f"KV elements per token per layer = 2 (K and V) x {kv_heads} KV heads x "
                 f"head_dim {head_dim} = {elements}")
    return {"attention": attention, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "elements": elements}


def _layers_line(kinds: list[str], num_layers: int, layers_key: str, window: int | None,
                 kinds_source: str | None) -> str:
    full, sliding = kinds.count("full"), kinds.count("sliding")
    no_kv = num_layers - full - sliding
    layer_line = (f"layers: {num_layers} ({layers_key}): {full} full attention, "
                  f"{sliding} sliding window" + (f" of {window} tokens" if sliding else "")
                  + f", {no_kv} without KV")
    if no_kv:
        counts = {kind: kinds.count(kind) for kind in _NO_KV_KINDS if kind in kinds}
        layer_line += " (" + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ")"
    if kinds_source:
        layer_line += f"; layer types from {kinds_source}"
    return layer_line


def _mamba_state_bytes(config: Mapping[str, Any], cfg: Mapping[str, Any], kinds: list[str],
                       steps: list[str], notes: list[str]) -> int | None:
    """Fixed per-request state of Mamba-1 layers (Jamba's field names), in the model
    dtype (vLLM's mamba_cache_dtype 'auto'). Other recurrent layers are named as
    ignored."""
    mamba = kinds.count("mamba")
    state = None
    keys = ("mamba_d_state", "mamba_d_conv", "mamba_expand", "hidden_size")
    if mamba and all(cfg.get(key) is not None for key in keys):
        d_state, d_conv, expand, hidden = (_positive_int(cfg, key) for key in keys)
        d_inner = expand * hidden
        model_dtype = _model_dtype(config, cfg)
        if model_dtype is None:
            raise CapacityInputError("sizing the Mamba state needs the config's torch_dtype")
        dtype_bytes = _dtype_bytes(model_dtype, "torch_dtype")
        elements = d_inner * (d_conv - 1) + d_inner * d_state
        per_layer = elements * dtype_bytes
        state = per_layer * mamba
        steps.append(
            f"Mamba state per request: d_inner = mamba_expand {expand} x hidden_size {hidden} "
            f"= {d_inner}; conv {d_inner} x (mamba_d_conv {d_conv} - 1) + ssm {d_inner} x "
            f"mamba_d_state {d_state} = {elements} elements x {dtype_bytes} B ({model_dtype}) "
            f"= {per_layer} B per layer x {mamba} Mamba layers = {state} B "
            f"({human_bytes(state)}), whatever the length")
        notes.append("Mamba state is sized in the model dtype (vLLM's mamba_cache_dtype auto); "
                     "vLLM pads Mamba and attention pages to one size, which can raise the real "
                     "attention block size above --block-size.")
    elif mamba:
        notes.append(f"The state of the {mamba} Mamba layers is a fixed per-request cost that "
                     "this config does not describe in fields kvwatch knows (mamba_d_state, "
                     "mamba_d_conv, mamba_expand); it is ignored, so the bound is too high.")
    for kind in ("linear_attention", "conv"):
        count = kinds.count(kind)
        if count:
            notes.append(f"The state of the {count} {kind} layers is a fixed per-request cost "
                         "kvwatch does not size; it is ignored, so the bound is too high.")
    return state


def _structure_notes(cfg: Mapping[str, Any], kinds: list[str], notes: list[str]) -> None:
    if cfg.get("attention_chunk_size"):
        notes.append("attention_chunk_size is set (chunked local attention): those layers are "
                     "counted as full attention, so the bound is on the low side.")
    if cfg.get("num_kv_shared_layers"):
        notes.append("num_kv_shared_layers is set: layers that reuse another layer's KV are "
                     "counted as holding their own, so the bound is on the low side.")
    if cfg.get("num_nextn_predict_layers"):
        notes.append(f"{cfg['num_nextn_predict_layers']} MTP layer(s) are not counted; with "
                     "speculative decoding they hold KV too.")
    if cfg.get("cross_attention_layers"):
        notes.append("cross_attention_layers hold encoder (image) KV per request, not per "
                     "token; they are counted as ordinary layers here.")
    if "sliding" in kinds:
        notes.append("Sliding-window layers are counted at their steady state; while a long "
                     "prompt is prefilled they hold up to window + one prefill chunk.")


# ---------------------------------------------------------------------------
# Requests and the budget.


@dataclass
class CapacityResult:
    """Every number of the derivation; `bound` fields are upper bounds from
    arithmetic, see `ignores`."""

    kv_budget_bytes: int
    block_size: int | None
    structure: KVStructure | None
    bytes_per_token: int | None
    block_bytes: int | None             # one block of block_size tokens across every KV layer
    pool_blocks: int | None             # budget // block_bytes
    pool_tokens: int | None             # pool_blocks x block_size
    usable_blocks: int | None           # pool_blocks - 1 (vLLM V1's null block)
    requests: list[RequestEstimate]
    steps: list[str]
    notes: list[str]
    ignores: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_budget(kv_budget_bytes: int) -> int:
    if isinstance(kv_budget_bytes, bool) or not isinstance(kv_budget_bytes, int) \
            or kv_budget_bytes <= 0:
        raise CapacityInputError(f"the KV budget must be a positive number of bytes, got "
                                 f"{kv_budget_bytes!r}")
    return kv_budget_bytes


def compute_capacity(config: Mapping[str, Any], kv_dtype: str, block_size: int,
                     kv_budget_bytes: int, input_tokens: int | Mapping[str, int],
                     output_tokens: int | Mapping[str, int]) -> CapacityResult:
    """How many requests of the given lengths a KV budget holds for this model.

    `input_tokens` and `output_tokens` are each one length or a mapping from a
    quantile label ('p50') to a length; a request is counted at input + output.
    """
    budget = _check_budget(kv_budget_bytes)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size <= 0:
        raise CapacityInputError(f"the block size must be a positive integer, got {block_size!r}")
    structure = kv_structure(config, kv_dtype)
    rows = combine_lengths(input_tokens, output_tokens)
    _check_positions(config, rows)
    bpt = structure.bytes_per_token
    block_bytes = block_size * bpt
    pool_blocks = budget // block_bytes
    if pool_blocks < 2:
        # vLLM keeps one null block, so a pool needs two blocks to hold a token.
        raise CapacityInputError(
            f"a KV budget of {budget} B ({human_bytes(budget)}) holds {pool_blocks} block"
            f"{'' if pool_blocks == 1 else 's'} of {block_bytes} B ({block_size} tokens x {bpt} B), and vLLM "
            f"needs two (one null block and one to use), {2 * block_bytes} B at least; a size without a "
            f"unit is bytes (for {budget} GiB write {budget}GiB)")
    usable_blocks = max(pool_blocks - 1, 0)
    pool_tokens = pool_blocks * block_size
    steps = list(structure.steps)
    steps.append(f"one block = {block_size} tokens x {bpt} B = {block_bytes} B "
                 f"({human_bytes(block_bytes)})")
    steps.append(f"pool = budget {budget} B // {block_bytes} B = {pool_blocks} blocks = "
                 f"{pool_tokens} tokens"
                 + (" if every layer kept every token (vLLM groups sliding and full layers "
                    "differently, so its num_gpu_blocks is not comparable)"
                    if structure.sliding_layers else ""))
    steps.append(f"usable blocks = {pool_blocks} - 1 (vLLM V1 keeps one null block) = "
                 f"{usable_blocks}")

    requests = [request_estimate(structure, label, inp, out, block_size, budget) for label, inp, out in rows]
    for request in requests:
        steps.extend(request.steps)
    if len(rows) > 1:
        steps.append("each quantile's bound assumes every request had that quantile's length")

    return CapacityResult(
        kv_budget_bytes=budget, block_size=block_size, structure=structure,
        bytes_per_token=bpt, block_bytes=block_bytes, pool_blocks=pool_blocks,
        pool_tokens=pool_tokens, usable_blocks=usable_blocks, requests=requests, steps=steps,
        notes=list(structure.notes) + _block_size_notes(structure, block_size), ignores=list(IGNORED))


# vLLM's MLA attention backends that fix the block size whatever --block-size
# says (vllm/platforms/cuda.py: "Forcing kv cache block size to ...").
MLA_BACKEND_BLOCK_SIZES = {"FlashMLA": 64, "CUTLASS MLA": 128}
VLLM_DEFAULT_BLOCK_SIZE = 16


def _block_size_notes(structure: KVStructure, block_size: int) -> list[str]:
    if structure.attention != "MLA" or block_size != VLLM_DEFAULT_BLOCK_SIZE:
        return []
    return [f"MLA with block size {block_size}: vLLM's FlashMLA backend (the default for MLA on Hopper GPUs) "
            f"uses blocks of {MLA_BACKEND_BLOCK_SIZES['FlashMLA']} tokens whatever --block-size says, and CUTLASS MLA "
            f"(Blackwell) {MLA_BACKEND_BLOCK_SIZES['CUTLASS MLA']}; give --block-size "
            f"{MLA_BACKEND_BLOCK_SIZES['FlashMLA']} to count the blocks that engine allocates."]


def _check_positions(config: Mapping[str, Any], rows) -> None:
    """A request longer than the model's positions is refused by vLLM
    (max_model_len defaults to max_position_embeddings and may not exceed it
    without rope scaling): it has no capacity to count."""
    section, _ = _language_section(config)
    limit = section.get("max_position_embeddings", config.get("max_position_embeddings"))
    if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
        return
    scaling = section.get("rope_scaling") or config.get("rope_scaling")
    if isinstance(scaling, Mapping):
        kind = scaling.get("rope_type", scaling.get("type"))
        factor = scaling.get("factor")
        # As vLLM derives max_model_len: these rope types scale the positions.
        if kind not in ("llama3", "longrope", "su", "mrope", "default", None) and isinstance(factor, (int, float)):
            limit = int(limit * max(1.0, float(factor)))
    too_long = [(label, inp + out) for label, inp, out in rows if inp + out > limit]
    if too_long:
        shown = ", ".join(f"{tokens} tokens ({label})" for label, tokens in too_long)
        raise CapacityInputError(
            f"a request of {shown} is longer than the model's max_position_embeddings {limit}: vLLM refuses it "
            "(its max_model_len defaults to that and cannot exceed it without rope scaling)")


def capacity_from_request_bytes(kv_budget_bytes: int, per_request_bytes: int) -> CapacityResult:
    """The bound when bytes per request are known directly: budget // bytes.
    No model, so no block rounding."""
    budget = _check_budget(kv_budget_bytes)
    if isinstance(per_request_bytes, bool) or not isinstance(per_request_bytes, int) \
            or per_request_bytes <= 0:
        raise CapacityInputError("bytes per request must be a positive number of bytes")
    bound = budget // per_request_bytes
    line = (f"simple bound = budget {budget} B ({human_bytes(budget)}) // {per_request_bytes} B "
            f"({human_bytes(per_request_bytes)}) per request = {bound}")
    request = RequestEstimate(
        label="given", input_tokens=None, output_tokens=None, tokens=None, sliding_tokens=None,
        bytes_per_request=per_request_bytes, simple_bound=bound, full_layer_blocks=None,
        sliding_layer_blocks=None, rounded_bytes_per_request=None, rounded_bound=None,
        pool_bound=None, state_bytes_per_request=None, bound_with_state=None, steps=[line])
    return CapacityResult(
        kv_budget_bytes=budget, block_size=None, structure=None, bytes_per_token=None,
        block_bytes=None, pool_blocks=None, pool_tokens=None, usable_blocks=None,
        requests=[request], steps=[line],
        notes=["bytes per request were given directly: no block rounding is applied; if they "
               "came from a token count, round it up to whole blocks first"],
        ignores=list(IGNORED))


# ---------------------------------------------------------------------------
# Against what a live engine reports.


def live_bounds(capacity_tokens: int, block_size: int, input_tokens: int | Mapping[str, int],
                output_tokens: int | Mapping[str, int]) -> list[dict[str, Any]]:
    """Requests that fit in a pool a live engine reports, counting each request at
    ceil(tokens / block_size) blocks and keeping one null block aside. Assumes
    every layer keeps every token (true of full-attention models)."""
    if block_size <= 0:
        raise CapacityInputError(f"reported block_size {block_size} is not positive")
    blocks = capacity_tokens // block_size
    usable = max(blocks - 1, 0)
    rows = []
    for label, inp, out in combine_lengths(input_tokens, output_tokens):
        tokens = inp + out
        per_request = math.ceil(tokens / block_size)
        rows.append({
            "label": label, "tokens": tokens, "blocks": blocks, "usable_blocks": usable,
            "blocks_per_request": per_request, "bound": usable // per_request,
            "step": (f"[{label}] {capacity_tokens} tokens / {block_size} = {blocks} blocks, "
                     f"{usable} usable; ceil({tokens} / {block_size}) = {per_request} blocks per "
                     f"request; {usable} // {per_request} = {usable // per_request}"),
        })
    return rows


def observed_occupancy(running: float | None, usage: float | None, capacity_tokens: int,
                       block_size: int) -> dict[str, Any] | None:
    """What one scrape shows: requests running at a KV usage. vLLM V1 measures usage
    against num_gpu_blocks - 1 (the null block is never free), so blocks in use
    = usage x (blocks - 1). One observation: not a peak, not a limit."""
    if running is None or usage is None:
        return None
    usable = max(capacity_tokens // block_size - 1, 0)
    blocks_in_use = round(usage * usable)
    tokens_in_use = blocks_in_use * block_size
    per_request = tokens_in_use / running if running else None
    return {
        "num_requests_running": running, "kv_cache_usage": usage,
        "blocks_in_use": blocks_in_use, "usable_blocks": usable, "tokens_in_use": tokens_in_use,
        "tokens_per_running_request": per_request,
        "step": (f"{running:g} running at KV usage {usage:.3f} x {usable} usable blocks = "
                 f"{blocks_in_use} blocks = {tokens_in_use} tokens"
                 + (f", {per_request:.0f} tokens per running request" if per_request else "")),
        "caveat": ("a single observation from one scrape: requests mid-generation hold fewer "
                   "blocks than at their end, and it is not the peak"),
    }


def compare_pools(computed_blocks: int, computed_tokens: int, reported_blocks: int | None,
                  reported_tokens: int) -> dict[str, Any]:
    """Computed pool against the one the engine reports."""
    diff = computed_tokens - reported_tokens
    ratio = computed_tokens / reported_tokens if reported_tokens else None
    if diff == 0:
        verdict = "matches"
    elif ratio is not None and 0.98 <= ratio <= 1.02:
        verdict = "within 2%"
    else:
        verdict = "differs"
    return {"computed_blocks": computed_blocks, "computed_tokens": computed_tokens,
            "reported_blocks": reported_blocks, "reported_tokens": reported_tokens,
            "difference_tokens": diff, "ratio": ratio, "verdict": verdict}
