"""Builds the tiny randomly initialised Llama and its tokenizer that the real-vLLM tier serves.

Runs under the vLLM virtual environment's Python (transformers, tokenizers and torch
live there, not in kvwatch's), started by harness.build_tiny_model:

    python make_tiny_model.py <out-dir> <words.json>

words.json lists the words prompts are made of. The tokenizer is trained on text made
of exactly those words so that each " word" becomes one token; load drivers rely on
that to send prompts of a known token count, and this script refuses to finish if any
word does not encode to a single token.
"""

import json
import random
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
UNK_ID, BOS_ID, EOS_ID, PAD_ID = range(4)
VOCAB_SIZE = 2048
SUMMARY_FILE = "kvwatch-build.json"  # written last: its presence means the build finished

# Plain enough for vLLM's chat endpoint to render; the output is noise either way.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def training_corpus(words: list[str], lines: int, words_per_line: int, seed: int):
    rng = random.Random(seed)
    for _ in range(lines):
        yield " ".join(rng.choice(words) for _ in range(words_per_line))


def build_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    # add_prefix_space makes the first word of a prompt the same token as every other.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus(words, 4000, 64, seed=1), trainer=trainer)
    # Like Llama's tokenizer: every encoded prompt starts with <s>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    not_single = [w for w in words if len(tokenizer.encode(w, add_special_tokens=False).ids) != 1]
    if not_single:
        raise SystemExit(f"{len(not_single)} words are not single tokens, e.g. {not_single[:5]}")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(out: Path) -> int:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    out, words_file = Path(sys.argv[1]), Path(sys.argv[2])
    words = json.loads(words_file.read_text())
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(words)
    tokenizer.save_pretrained(out)
    parameters = build_model(out)
    (out / "kvwatch-words.json").write_text(json.dumps(words))
    summary = {"parameters": parameters, "tokenizer_vocab": tokenizer.vocab_size}
    (out / SUMMARY_FILE).write_text(json.dumps(summary))
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
