"""The KV budget from the hardware: what one GPU of a replica leaves for the KV
cache once vLLM has taken its share of the card, loaded its slice of the weights
and set aside its activation and runtime memory.

    usable per GPU   = gpu_memory x gpu_memory_utilization
    weights per GPU  = parameters of the config's shapes x dtype bytes, split by
                       tensor parallel size where vLLM shards them, whole where
                       it replicates them
    KV per GPU       = usable - weights per GPU - runtime reserve

Pure arithmetic on a parsed config.json, like kvwatch/capacity/arithmetic.py,
whose bounds the budget then flows into. Every term is kept as a number and as
a written line.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any, Mapping

from kvwatch.capacity import arithmetic as cap
from kvwatch.capacity.arithmetic import CapacityInputError, human_bytes

# A round figure for what vLLM keeps out of the KV pool besides the weights: the
# activation peak of its start-up profile run (a forward pass of
# max_num_batched_tokens tokens, plus the sampler over max_num_seqs), memory
# outside PyTorch's allocator (CUDA context, NCCL buffers with tensor
# parallelism) and the CUDA graph pool. vLLM measures these at start-up instead
# of computing them, so no formula here can; one to a few GiB per GPU is what
# its start-up logs show for 7-70B models at default settings. Larger
# max_num_batched_tokens, long vocabularies and multimodal encoders raise it.
DEFAULT_RUNTIME_RESERVE = "2GiB"
DEFAULT_GPU_MEMORY_UTILIZATION = "0.9"  # vLLM's default

# Families whose MLP is up -> activation -> down (two matrices); every other
# family is taken to gate it (gate, up, down: three matrices, as Llama does).
_UNGATED_MLP = frozenset({
    "gpt2", "gpt_bigcode", "gpt_neox", "gptj", "opt", "falcon", "bloom", "phi", "starcoder2",
    "mpt", "gpt_neo", "codegen",
})
# Families whose config class ties the output head to the embeddings when
# config.json does not say (transformers' per-class default).
_TIED_BY_DEFAULT = frozenset({
    "gemma", "gemma2", "gemma3", "gemma3_text", "gpt2", "gpt_bigcode", "opt", "gpt_neo",
})
# Families whose q, k and v projections carry a bias without an attention_bias key.
_QKV_BIAS = frozenset({"qwen2", "qwen2_moe", "qwen2_vl", "qwen2_5_vl"})
# vLLM pads the vocabulary of its parallel embedding and head to a multiple of this.
_VOCAB_PADDING = 64


@dataclass
class WeightTerm:
    """One group of parameters, counted over the whole model and on one GPU."""

    name: str
    parameters: int
    per_gpu_parameters: int
    split: str                      # "sharded", "replicated" or a mix, in words
    formula: str


@dataclass
class WeightCount:
    """Parameters of the config's shapes and the bytes one GPU holds."""

    model_type: str | None
    dtype: str
    dtype_bytes: int
    tensor_parallel_size: int
    terms: list[WeightTerm]
    parameters: int
    per_gpu_parameters: int
    bytes_per_gpu: int
    steps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


@dataclass
class HardwareBudget:
    """The KV budget of one replica from its GPUs, each term kept."""

    gpu_memory_bytes: int
    gpu_memory_utilization: str
    tensor_parallel_size: int
    usable_bytes_per_gpu: int          # gpu_memory x utilization
    weights_bytes_per_gpu: int
    weights_source: str
    runtime_reserve_bytes: int
    runtime_reserve_source: str
    kv_budget_per_gpu: int             # usable - weights - reserve
    kv_shards: int                     # ranks that hold a different part of each token's KV
    kv_budget_bytes: int               # kv_budget_per_gpu x kv_shards: the replica's pool
    weights: WeightCount | None
    steps: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_utilization(text: str | float) -> Fraction:
    """The share of each GPU vLLM may use: above 0, at most 1, kept exact."""
    try:
        value = Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError):
        raise CapacityInputError(
            f"--gpu-memory-utilization {text!r} is not a number (vLLM's default is 0.9)") from None
    if not 0 < value <= 1:
        raise CapacityInputError(
            f"--gpu-memory-utilization {text} must be above 0 and at most 1 (a share of the GPU)")
    return value


def _get(cfg: Mapping[str, Any], *keys: str) -> int | None:
    found = cap._first(cfg, keys)
    return found[1] if found else None


def _split(n: int, tp: int) -> int:
    return -(-n // tp)


@dataclass(frozen=True)
class _Shapes:
    """The config's shapes the weight count reads, and the tensor parallel size."""

    config: Mapping[str, Any]
    cfg: Mapping[str, Any]  # the language model's section (the config itself unless nested)
    model_type: str | None
    layers: int
    hidden: int
    vocab: int
    heads: int
    tp: int


def _term(name: str, total: int, per_gpu: int, split: str, formula: str) -> list[WeightTerm]:
    """The term, or none when it counts no parameter."""
    return [WeightTerm(name, total, per_gpu, split, formula)] if total else []


def count_weights(config: Mapping[str, Any], tensor_parallel_size: int = 1) -> WeightCount:
    """Parameters from the config's shapes: embeddings, attention (MHA, GQA, MQA,
    MLA), MLP (plain, gated, MoE experts with shared experts and router), norms,
    and the output head unless tied. On one GPU: sharded terms split over the
    tensor parallel ranks as vLLM splits them, replicated terms whole."""
    if not isinstance(config, Mapping):
        raise CapacityInputError("the model config must be a JSON object")
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise CapacityInputError(f"--tensor-parallel-size must be a positive integer, got {tp!r}")
    cfg, section = cap._language_section(config)
    dtype = cap._model_dtype(config, cfg)
    if dtype is None:
        raise CapacityInputError("counting the weights needs the config's torch_dtype (or "
                                 "dtype); or give --weights-bytes per GPU")
    dtype_bytes = cap._dtype_bytes(dtype, "torch_dtype")
    shapes = _read_shapes(config, cfg, tp)
    steps: list[str] = []
    terms = _embedding_terms(shapes, steps)
    terms += _mla_attention_term(shapes) if cfg.get("kv_lora_rank") is not None else _attention_term(shapes)
    terms += _mlp_terms(shapes)
    norms = (2 * shapes.layers + 1) * shapes.hidden
    terms += _term("norms", norms, norms, "replicated", f"(2 per layer x {shapes.layers} + final 1) x {shapes.hidden}")
    total = sum(t.parameters for t in terms)
    per_gpu = sum(t.per_gpu_parameters for t in terms)
    nbytes = per_gpu * dtype_bytes
    for term in terms:
        steps.append(f"{term.name} = {term.formula} = {term.parameters:,}; on one GPU "
                     f"{term.per_gpu_parameters:,} ({term.split})")
    steps.append(f"parameters = {total:,} ({total / 1e9:.2f} B); on one GPU of {tp}: "
                 f"{per_gpu:,} x {dtype_bytes} B ({dtype}) = {nbytes:,} B ({human_bytes(nbytes)})")
    return WeightCount(model_type=shapes.model_type, dtype=dtype, dtype_bytes=dtype_bytes,
                       tensor_parallel_size=tp, terms=terms, parameters=total,
                       per_gpu_parameters=per_gpu, bytes_per_gpu=nbytes, steps=steps,
                       notes=_weight_notes(config, cfg, section, dtype))


def _read_shapes(config: Mapping[str, Any], cfg: Mapping[str, Any], tp: int) -> _Shapes:
    _, layers = cap._require(cfg, cap._LAYER_KEYS, "the layer count")
    _, hidden = cap._require(cfg, cap._HIDDEN_KEYS, "the weight shapes")
    _, vocab = cap._require(cfg, ("vocab_size",), "the embedding size")
    _, heads = cap._require(cfg, cap._HEAD_KEYS, "the attention shapes")
    kinds, _ = cap._raw_layer_kinds(cfg, layers)
    odd = sorted({k for k in kinds if k != "attention"})
    if odd:
        raise CapacityInputError(
            f"the config has {', '.join(odd)} layers, whose weights kvwatch does not count; "
            "give --weights-bytes (the checkpoint's bytes per GPU) instead")
    return _Shapes(config, cfg, cfg.get("model_type") or config.get("model_type"), layers, hidden, vocab, heads, tp)


def _embedding_terms(shapes: _Shapes, steps: list[str]) -> list[WeightTerm]:
    """Embeddings and head: vLLM's VocabParallelEmbedding / ParallelLMHead pad the
    vocabulary to a multiple of 64 and give each rank a slice of the rows. A
    tied head adds nothing, said in `steps`."""
    cfg, config, vocab, hidden = shapes.cfg, shapes.config, shapes.vocab, shapes.hidden
    padded = _split(vocab, _VOCAB_PADDING) * _VOCAB_PADDING
    rows_per_gpu = _split(padded, shapes.tp)
    terms = _term("embeddings", vocab * hidden, rows_per_gpu * hidden, "sharded (vocabulary rows)",
                  f"vocab_size {vocab} x hidden_size {hidden}")
    if "tie_word_embeddings" in cfg or "tie_word_embeddings" in config:
        tied = bool(cfg.get("tie_word_embeddings", config.get("tie_word_embeddings")))
        tie_line = f"tie_word_embeddings = {str(tied).lower()}"
    else:
        tied = shapes.model_type in _TIED_BY_DEFAULT
        tie_line = (f"tie_word_embeddings absent: {shapes.model_type}'s default, "
                    f"{'tied' if tied else 'untied'}")
    if tied:
        steps.append(f"lm_head: {tie_line}, it shares the embedding matrix and adds nothing")
        return terms
    return terms + _term("lm_head", vocab * hidden, rows_per_gpu * hidden, "sharded (vocabulary rows)",
                         f"hidden_size {hidden} x vocab_size {vocab} ({tie_line})")


def _mla_attention_term(shapes: _Shapes) -> list[WeightTerm]:
    """Multi-head latent attention (kv_lora_rank), per layer."""
    cfg, hidden, heads, layers = shapes.cfg, shapes.hidden, shapes.heads, shapes.layers
    kv_rank = cap._positive_int(cfg, "kv_lora_rank")
    rope = _get(cfg, "qk_rope_head_dim")
    nope = _get(cfg, "qk_nope_head_dim")
    v_dim = _get(cfg, "v_head_dim")
    if rope is None or nope is None or v_dim is None:
        raise CapacityInputError("an MLA config (kv_lora_rank) needs qk_rope_head_dim, "
                                 "qk_nope_head_dim and v_head_dim to count its weights")
    q_rank = _get(cfg, "q_lora_rank")
    qk = nope + rope
    sharded = heads * (nope + v_dim) * kv_rank + heads * v_dim * hidden
    replicated = hidden * (kv_rank + rope) + kv_rank
    if q_rank:
        sharded += q_rank * heads * qk
        replicated += hidden * q_rank + q_rank
        q_line = (f"q_a {hidden} x q_lora_rank {q_rank} + norm + q_b {q_rank} x {heads} "
                  f"heads x {qk}")
    else:
        sharded += hidden * heads * qk
        q_line = f"q {hidden} x {heads} heads x (nope {nope} + rope {rope})"
    return _term("attention", layers * (sharded + replicated),
                 layers * (_split(sharded, shapes.tp) + replicated),
                 "q, kv_b, o sharded; kv_a and its norm replicated",
                 f"MLA, {layers} layers x ({q_line} + kv_a {hidden} x (kv_lora_rank {kv_rank} + "
                 f"rope {rope}) + norm {kv_rank} + kv_b {kv_rank} x {heads} x (nope {nope} + v "
                 f"{v_dim}) + o {heads} x {v_dim} x {hidden})")


def _kv_heads(cfg: Mapping[str, Any], heads: int) -> int:
    kv_heads = _get(cfg, *cap._KV_HEAD_KEYS)
    if kv_heads is not None:
        return kv_heads
    if cfg.get("multi_query_attention") and cfg.get("multi_query_group_num"):
        return cap._positive_int(cfg, "multi_query_group_num")
    if cfg.get("multi_query") is True:
        return 1
    return heads


def _attention_term(shapes: _Shapes) -> list[WeightTerm]:
    """Multi-head, grouped-query or multi-query attention, per layer, with its biases."""
    cfg, hidden, heads, layers, tp, model_type = (shapes.cfg, shapes.hidden, shapes.heads, shapes.layers,
                                                   shapes.tp, shapes.model_type)
    kv_heads = _kv_heads(cfg, heads)
    head_dim = _get(cfg, "head_dim") or hidden // heads
    q = hidden * heads * head_dim
    o = heads * head_dim * hidden
    kv = 2 * hidden * kv_heads * head_dim
    # With more ranks than KV heads, vLLM gives each rank one whole KV head.
    kv_heads_per_gpu = max(1, _split(kv_heads, tp))
    kv_per_gpu = 2 * hidden * kv_heads_per_gpu * head_dim
    bias = bias_per_gpu = 0
    bias_line = ""
    if cfg.get("attention_bias") is True or cfg.get("bias") is True:
        bias = heads * head_dim + 2 * kv_heads * head_dim + hidden
        bias_per_gpu = _split(heads * head_dim, tp) + 2 * kv_heads_per_gpu * head_dim + hidden
        bias_line = " + q, k, v, o biases"
    elif model_type in _QKV_BIAS:
        bias = heads * head_dim + 2 * kv_heads * head_dim
        bias_per_gpu = _split(heads * head_dim, tp) + 2 * kv_heads_per_gpu * head_dim
        bias_line = f" + q, k, v biases ({model_type})"
    return _term("attention", layers * (q + o + kv + bias),
                 layers * (_split(q + o, tp) + kv_per_gpu + bias_per_gpu),
                 "sharded by heads" + (f"; {kv_heads} KV heads over {tp} ranks: each holds "
                                       f"{kv_heads_per_gpu}" if tp > 1 else ""),
                 f"{layers} layers x (q {hidden} x {heads} x {head_dim} + k, v 2 x {hidden} x "
                 f"{kv_heads} x {head_dim} + o {heads} x {head_dim} x {hidden}{bias_line})")


def _moe_layer_rule(cfg: Mapping[str, Any], layers: int) -> tuple[list[bool], str]:
    """Which layers hold experts, and the config's rule for it in words."""
    if cfg.get("n_routed_experts") is not None:
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        freq = int(cfg.get("moe_layer_freq") or 1)
        return ([i >= first_dense and i % freq == 0 for i in range(layers)],
                f"layers from first_k_dense_replace {first_dense} on, every moe_layer_freq {freq}")
    if cfg.get("decoder_sparse_step") is not None or cfg.get("mlp_only_layers"):
        step = int(cfg.get("decoder_sparse_step") or 1)
        only = set(cfg.get("mlp_only_layers") or [])
        return ([i not in only and (i + 1) % step == 0 for i in range(layers)],
                f"every decoder_sparse_step {step} layer, not mlp_only_layers")
    return [True] * layers, "every layer"


def _mlp_terms(shapes: _Shapes) -> list[WeightTerm]:
    """MLP, per layer: dense, or routed experts + shared experts + router."""
    cfg, hidden, layers, tp = shapes.cfg, shapes.hidden, shapes.layers, shapes.tp
    gated = shapes.model_type not in _UNGATED_MLP
    matrices = 3 if gated else 2
    mlp_kind = "gated: gate, up, down" if gated else "up, down"
    dense_inter = _get(cfg, "intermediate_size", "ffn_dim", "n_inner")
    if dense_inter is None and not gated:
        dense_inter = 4 * hidden
    experts = _get(cfg, "num_local_experts", "n_routed_experts", "num_experts")
    terms: list[WeightTerm] = []
    moe_layers = 0
    if experts:
        moe_layers, terms = _expert_terms(shapes, experts, matrices, dense_inter)
    dense_layers = layers - moe_layers
    if dense_layers:
        if dense_inter is None:
            raise CapacityInputError("the config has no intermediate_size, needed for the MLP")
        dense = matrices * hidden * dense_inter
        terms += _term("mlp", dense_layers * dense, dense_layers * _split(dense, tp), "sharded",
                       f"{dense_layers} dense layers x {matrices} ({mlp_kind}) x {hidden} x "
                       f"intermediate_size {dense_inter}")
    return terms


def _expert_terms(shapes: _Shapes, experts: int, matrices: int,
                  dense_inter: int | None) -> tuple[int, list[WeightTerm]]:
    """The MoE layers' count, and their routed experts, shared experts and router."""
    cfg, hidden, tp = shapes.cfg, shapes.hidden, shapes.tp
    expert_inter = _get(cfg, "moe_intermediate_size") or dense_inter
    if expert_inter is None:
        raise CapacityInputError("an MoE config needs moe_intermediate_size or "
                                 "intermediate_size to count its experts")
    is_moe, rule = _moe_layer_rule(cfg, shapes.layers)
    moe_layers = sum(is_moe)
    routed = experts * matrices * hidden * expert_inter
    terms = _term("experts", moe_layers * routed, moe_layers * _split(routed, tp),
                  "sharded (each expert's intermediate split)",
                  f"{moe_layers} MoE layers ({rule}) x {experts} experts x {matrices} x {hidden} x "
                  f"{expert_inter}")
    shared_inter = 0
    if cfg.get("n_shared_experts"):
        shared_inter = cap._positive_int(cfg, "n_shared_experts") * expert_inter
        shared_line = f"n_shared_experts {cfg['n_shared_experts']} x {expert_inter}"
    elif cfg.get("shared_expert_intermediate_size"):
        shared_inter = cap._positive_int(cfg, "shared_expert_intermediate_size")
        shared_line = f"shared_expert_intermediate_size {shared_inter} (+ its gate)"
    if shared_inter:
        shared = matrices * hidden * shared_inter
        gate = hidden if cfg.get("shared_expert_intermediate_size") else 0
        terms += _term("shared experts", moe_layers * (shared + gate),
                       moe_layers * (_split(shared, tp) + gate), "sharded",
                       f"{moe_layers} MoE layers x {matrices} x {hidden} x {shared_line}")
    terms += _term("router", moe_layers * hidden * experts, moe_layers * hidden * experts, "replicated",
                   f"{moe_layers} MoE layers x {hidden} x {experts} experts")
    return moe_layers, terms


def _weight_notes(config: Mapping[str, Any], cfg: Mapping[str, Any], section: str | None, dtype: str) -> list[str]:
    """What the count leaves out or overstates, each with the way to the real figure."""
    notes = []
    if section:
        notes.append(f"Only the language model ({section}) is counted: a vision or audio "
                     "encoder's weights are not, so the KV budget is too high; give "
                     "--weights-bytes for the real figure.")
    if isinstance(config.get("quantization_config") or cfg.get("quantization_config"), Mapping):
        notes.append(f"The config has a quantization_config: weights are counted at {dtype}, "
                     "larger than a quantized checkpoint, so the KV budget is too low; give "
                     "--weights-bytes (the checkpoint's size / tensor parallel size).")
    if cfg.get("num_nextn_predict_layers"):
        notes.append(f"{cfg['num_nextn_predict_layers']} MTP layer(s) are not counted; vLLM "
                     "loads them only for speculative decoding.")
    return notes


def kv_shards(config: Mapping[str, Any], tensor_parallel_size: int) -> tuple[int, str]:
    """Ranks of one replica that hold different parts of a token's KV: KV heads
    are split over ranks (min(TP, KV heads)); MLA's one latent is copied whole
    onto every rank (1)."""
    structure = cap.kv_structure(config, "fp16")  # the dtype plays no part in the heads
    tp = tensor_parallel_size
    if structure.attention == "MLA":
        return 1, f"MLA: every one of the {tp} ranks holds the whole latent, so 1"
    kv_heads = structure.num_kv_heads or 1
    shards = min(tp, kv_heads)
    if tp <= kv_heads:
        return shards, f"{kv_heads} KV heads over {tp} ranks: each holds 1/{tp} of a token's KV"
    return shards, (f"{kv_heads} KV heads over {tp} ranks: each rank holds one whole head, "
                    f"so only {shards} hold different parts")


def hardware_budget(config: Mapping[str, Any], gpu_memory_bytes: int,
                    gpu_memory_utilization: str | float = DEFAULT_GPU_MEMORY_UTILIZATION,
                    tensor_parallel_size: int = 1,
                    runtime_reserve_bytes: int | None = None,
                    weights_bytes_per_gpu: int | None = None) -> HardwareBudget:
    """KV budget of one replica: per GPU, gpu_memory x utilization - weights per
    GPU - runtime reserve; for the replica, that times the ranks that hold
    different parts of the KV, in the terms compute_capacity's bytes per token
    (all KV heads) use."""
    cap._check_budget(gpu_memory_bytes)
    tp = tensor_parallel_size
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise CapacityInputError(f"--tensor-parallel-size must be a positive integer, got {tp!r}")
    util = parse_utilization(gpu_memory_utilization)
    usable = math.floor(gpu_memory_bytes * util)
    steps = [f"usable per GPU = gpu_memory {gpu_memory_bytes:,} B ({human_bytes(gpu_memory_bytes)})"
             f" x gpu_memory_utilization {gpu_memory_utilization} = {usable:,} B "
             f"({human_bytes(usable)})"]
    notes: list[str] = []

    weights = None
    if weights_bytes_per_gpu is not None:
        cap._check_budget(weights_bytes_per_gpu)
        weights_bytes, weights_source = weights_bytes_per_gpu, "--weights-bytes"
        steps.append(f"weights per GPU = {weights_bytes:,} B ({human_bytes(weights_bytes)}), "
                     "as given")
    else:
        weights = count_weights(config, tp)
        weights_bytes, weights_source = weights.bytes_per_gpu, "counted from the config's shapes"
        steps += [f"weights: {line}" for line in weights.steps]
        notes += weights.notes

    if runtime_reserve_bytes is None:
        reserve = cap.parse_size(DEFAULT_RUNTIME_RESERVE)
        reserve_source = (f"default {DEFAULT_RUNTIME_RESERVE}: activation peak, CUDA context, "
                          "NCCL and CUDA graphs, which vLLM measures at start-up")
    else:
        cap._check_budget(runtime_reserve_bytes)
        reserve, reserve_source = runtime_reserve_bytes, "--runtime-reserve"
    steps.append(f"runtime reserve per GPU = {reserve:,} B ({human_bytes(reserve)}), "
                 f"{reserve_source}")

    per_gpu = usable - weights_bytes - reserve
    steps.append(f"KV per GPU = {usable:,} - {weights_bytes:,} - {reserve:,} = {per_gpu:,} B"
                 + (f" ({human_bytes(per_gpu)})" if per_gpu > 0 else ""))
    if per_gpu <= 0:
        raise CapacityInputError(
            f"nothing is left for the KV cache: {human_bytes(usable)} usable per GPU - "
            f"{human_bytes(weights_bytes)} of weights - {human_bytes(reserve)} reserve = "
            f"{per_gpu:,} B; more GPUs (--tensor-parallel-size), a higher "
            "--gpu-memory-utilization or smaller weights")
    shards, shard_line = kv_shards(config, tp)
    budget = per_gpu * shards
    steps.append(f"KV ranks: {shard_line}")
    steps.append(f"KV budget of the replica = {per_gpu:,} B x {shards} = {budget:,} B "
                 f"({human_bytes(budget)}), in bytes of every KV head")
    return HardwareBudget(
        gpu_memory_bytes=gpu_memory_bytes, gpu_memory_utilization=str(gpu_memory_utilization),
        tensor_parallel_size=tp, usable_bytes_per_gpu=usable, weights_bytes_per_gpu=weights_bytes,
        weights_source=weights_source, runtime_reserve_bytes=reserve,
        runtime_reserve_source=reserve_source, kv_budget_per_gpu=per_gpu, kv_shards=shards,
        kv_budget_bytes=budget, weights=weights, steps=steps, notes=notes)


# What the budget from the hardware leaves out; printed with it.
IGNORED = (
    "GPU memory: give what the card reports (nvidia-smi's total, torch.cuda.mem_get_info), "
    "not its name: an 80 GB H100 reports about 79.6 GiB. vLLM takes utilization x total "
    "as a ceiling for its whole process, so memory other processes hold on the GPU is "
    "not subtracted here and is not there for vLLM either.",
    "Runtime reserve: a flat figure per GPU, not a measurement. vLLM profiles the "
    "activation peak, non-PyTorch memory and CUDA graphs at start-up and logs the "
    "result ('Available KV cache memory: ... GiB', per GPU); once you have it, give it as "
    "--kv-budget (times the ranks that hold different KV, with tensor parallelism).",
    "Weights: counted from the shapes in config.json at its torch_dtype; quantized "
    "checkpoints, vision and audio encoders, learned position embeddings, LoRA adapters, "
    "MTP layers, LayerNorm biases and extra per-layer norms are not counted; vLLM pads the "
    "vocabulary to a multiple of 64 on each rank (counted on one GPU, not in the total).",
    "Pipeline, expert and data parallelism: the weights are split by tensor parallelism "
    "only. Pipeline and expert parallelism split them differently, and data parallel "
    "replicas each have their own pool.",
)
