"""Writes the llama.cpp tier's tiny random Llama as a GGUF file.

Usage: python make_tiny_gguf.py OUT.gguf WORDS.json SUMMARY.json
(with llama.cpp's gguf-py on PYTHONPATH and numpy installed).

The model has the vLLM tier's shape (2 layers, 2 heads of 32, fp32, random
weights) and a SentencePiece-style vocabulary built so that llama.cpp's SPM
tokenizer makes each of the tier's prompt words (harness.prompt_words(), four
letters consonant-vowel-consonant-vowel) exactly one token: the pieces
"▁c", "▁cv", "▁cvc" and "▁cvcv" are in the vocabulary and no piece inside a
word, so the merges run left to right into the whole word. A prompt of n
words is then n + 1 tokens (<s> first), as in the vLLM tier. Bytes have
fallback tokens, so any text tokenizes.

Written with gguf-py directly rather than convert_hf_to_gguf.py: that
converter recognises tokenizers by a hash of known pre-tokenizers and has no
entry for the tier's word-level tokenizer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import gguf

N_EMBD = 64
N_HEAD = 2
N_HEAD_KV = 2
N_LAYER = 2
N_FF = 128
N_CTX_TRAIN = 2048
SEED = 7
SPACE = "\u2581"


def vocabulary(words: list[str]) -> tuple[list[str], list[float], list[int]]:
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    pieces: list[str] = [SPACE] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    seen = set(pieces)
    # Every prefix of "▁word", shortest first; longer pieces score higher so
    # that a merge into a longer piece always wins.
    for length in range(2, 6):
        for word in words:
            piece = SPACE + word[:length - 1]
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
    tokens += pieces
    types += [gguf.TokenType.NORMAL] * len(pieces)
    scores = [0.0] * (3 + 256) + [float(len(p)) for p in pieces]
    return tokens, scores, [int(t) for t in types]


def main(out: Path, words_path: Path, summary_path: Path) -> None:
    words = json.loads(words_path.read_text())
    tokens, scores, types = vocabulary(words)
    rng = np.random.default_rng(SEED)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    writer = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    writer.add_name("tiny-llama")
    writer.add_context_length(N_CTX_TRAIN)
    writer.add_embedding_length(N_EMBD)
    writer.add_block_count(N_LAYER)
    writer.add_feed_forward_length(N_FF)
    writer.add_head_count(N_HEAD)
    writer.add_head_count_kv(N_HEAD_KV)
    writer.add_rope_dimension_count(N_EMBD // N_HEAD)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(True)

    parameters = 0

    def add(name: str, array: np.ndarray) -> None:
        nonlocal parameters
        parameters += array.size
        writer.add_tensor(name, array)

    add("token_embd.weight", weight(len(tokens), N_EMBD))
    for layer in range(N_LAYER):
        add(f"blk.{layer}.attn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        add(f"blk.{layer}.attn_q.weight", weight(N_EMBD, N_EMBD))
        add(f"blk.{layer}.attn_k.weight", weight(N_EMBD // N_HEAD * N_HEAD_KV, N_EMBD))
        add(f"blk.{layer}.attn_v.weight", weight(N_EMBD // N_HEAD * N_HEAD_KV, N_EMBD))
        add(f"blk.{layer}.attn_output.weight", weight(N_EMBD, N_EMBD))
        add(f"blk.{layer}.ffn_norm.weight", np.ones(N_EMBD, dtype=np.float32))
        add(f"blk.{layer}.ffn_gate.weight", weight(N_FF, N_EMBD))
        add(f"blk.{layer}.ffn_up.weight", weight(N_FF, N_EMBD))
        add(f"blk.{layer}.ffn_down.weight", weight(N_EMBD, N_FF))
    add("output_norm.weight", np.ones(N_EMBD, dtype=np.float32))
    add("output.weight", weight(len(tokens), N_EMBD))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    summary_path.write_text(json.dumps({"parameters": int(parameters), "vocab": len(tokens),
                                        "words": len(words), "gguf_bytes": out.stat().st_size}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]))
