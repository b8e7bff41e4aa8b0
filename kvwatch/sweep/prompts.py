"""Prompts of a requested length in tokens, for `kvwatch sweep`.

Two ways to hit the length, chosen by what the server offers:

- `/tokenize` (vLLM has it): short words are tried until enough are found that
  cost exactly one token each after the first word of a prompt, and what the
  first word costs (it carries the BOS token and any special prefix). A prompt
  of L tokens is then a first word plus L - cost(first) words, checked against
  /tokenize for a few prompts of each length; a length whose check fails is
  fitted per prompt instead (tokenize, add or drop words, repeat).
- otherwise, a calibrated repetition of words: two one-token completions with
  prompts of n1 and n2 words give the server's prompt tokens for each (from the
  response's usage, else from its prompt_tokens counter), hence tokens per word
  and a fixed overhead; a prompt of L tokens has round((L - overhead) / slope)
  words. Exact for servers that count words (the simulator), close elsewhere.

Every prompt is drawn from its own random generator, so no two requests share
a first block and the prefix cache never serves one request from another's
blocks; the sweep reports the prompt tokens the server actually counted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

from kvwatch.sweep.client import Client, ServerError

# Short words that are one token in common tokenizers (after a space) and in
# small BPE vocabularies trained on syllables. Only those the server's own
# tokenizer confirms are used in /tokenize mode.
CANDIDATE_WORDS = (
    "to", "be", "go", "do", "so", "no", "me", "we", "he", "up", "us", "my", "by", "or", "on",
    "in", "at", "it", "is", "as", "an", "if", "of", "la", "pa", "ma", "ba", "da", "fa", "ga",
    "ka", "na", "ra", "sa", "ta", "va", "za", "bo", "mo", "lo", "ro", "ko", "mi", "ni", "ti",
    "pi", "bi", "di", "mu", "nu", "ku", "lu", "ne", "re", "se", "te", "de", "le", "pe", "ke",
)
# Enough distinct words that random prompts never share a first block.
WANTED_WORDS = 24
MIN_WORDS = 4
CHECKS_PER_LENGTH = 3
FIT_ATTEMPTS = 6
PROBE_WORDS = (16, 144)


class PromptError(RuntimeError):
    """Prompts of the requested lengths cannot be made for this server."""


@dataclass(slots=True)
class Prompt:
    text: str
    expected_tokens: int | None  # what the server's tokenizer says (or the calibration predicts)


@dataclass
class PromptMaker:
    method: str                        # "tokenize" or "calibrated-words"
    words: tuple[str, ...]
    first_cost: dict[str, int] = field(default_factory=dict)  # tokenize: tokens of a 1-word prompt
    slope: float = 1.0                 # calibrated-words: tokens per word
    overhead: float = 0.0              # calibrated-words: tokens of an empty prompt
    tokenize: Callable[[str], int] | None = None
    # Lengths whose sample check failed under /tokenize: fitted per prompt.
    fitted_lengths: set[int] = field(default_factory=set)
    checks: dict[int, list[int]] = field(default_factory=dict)

    def describe(self) -> str:
        if self.method == "tokenize":
            fitted = (f"; fitted per prompt for {', '.join(map(str, sorted(self.fitted_lengths)))}"
                      if self.fitted_lengths else "")
            return (f"/tokenize: {len(self.words)} one-token words, lengths checked against the "
                    f"server's tokenizer{fitted}")
        return (f"calibrated words: {self.slope:.3f} tokens per word + {self.overhead:.1f} "
                "(no /tokenize on the server)")

    def recipe(self) -> dict[str, Any]:
        """What a later sweep needs, with the same seed, to make the same prompts
        (`from_recipe`)."""
        return {"method": self.method, "words": list(self.words),
                "first_cost": dict(self.first_cost), "slope": self.slope,
                "overhead": self.overhead}

    @classmethod
    def from_recipe(cls, recipe: dict[str, Any],
                    tokenize: Callable[[str], int] | None) -> "PromptMaker":
        """The prompt maker of an earlier sweep. Under /tokenize, lengths are
        still checked (and fitted) with this server's tokenizer when it has one."""
        try:
            method = str(recipe["method"])
            words = tuple(str(word) for word in recipe["words"])
            first_cost = {str(k): int(v) for k, v in (recipe.get("first_cost") or {}).items()}
            slope, overhead = float(recipe.get("slope", 1.0)), float(recipe.get("overhead", 0.0))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PromptError(f"the recorded prompt recipe is unreadable: {error!r}") from None
        if method not in ("tokenize", "calibrated-words") or not words or slope <= 0 \
                or (method == "tokenize" and set(first_cost) != set(words)):
            raise PromptError("the recorded prompt recipe is incomplete")
        return cls(method, words, first_cost=first_cost, slope=slope, overhead=overhead,
                   tokenize=tokenize if method == "tokenize" else None)

    def min_tokens(self) -> int:
        if self.method == "tokenize":
            return min(self.first_cost.values())
        return max(1, round(self.overhead + self.slope))

    def make(self, tokens: int, rng: random.Random) -> Prompt:
        if self.method == "tokenize":
            prompt = self._by_word_cost(tokens, rng)
            if tokens in self.fitted_lengths and self.tokenize is not None:
                prompt = self._fit(tokens, prompt, rng, self.tokenize)
            return prompt
        count = max(1, round((tokens - self.overhead) / self.slope))
        text = " ".join(rng.choice(self.words) for _ in range(count))
        return Prompt(text, round(self.overhead + self.slope * count))

    def _by_word_cost(self, tokens: int, rng: random.Random) -> Prompt:
        first = rng.choice(self.words)
        rest = max(0, tokens - self.first_cost[first])
        text = " ".join([first] + [rng.choice(self.words) for _ in range(rest)])
        return Prompt(text, self.first_cost[first] + rest)

    def _fit(self, tokens: int, prompt: Prompt, rng: random.Random, tokenize: Callable[[str], int]) -> Prompt:
        words = prompt.text.split(" ")
        count = tokenize(prompt.text)
        for _ in range(FIT_ATTEMPTS):
            if count == tokens:
                break
            if count < tokens:
                words += [rng.choice(self.words) for _ in range(tokens - count)]
            else:
                # Each word costs at least one token, so dropping the excess never undershoots by more.
                words = words[: max(1, len(words) - (count - tokens))]
            count = tokenize(" ".join(words))
        return Prompt(" ".join(words), count)

    def check_length(self, tokens: int, seed: str) -> None:
        """Under /tokenize: tokenize a few prompts of this length; if any is off,
        fit prompts of this length one by one."""
        if self.method != "tokenize" or self.tokenize is None:
            return
        counts = []
        for index in range(CHECKS_PER_LENGTH):
            prompt = self._by_word_cost(tokens, random.Random(f"{seed}-check-{tokens}-{index}"))
            counts.append(self.tokenize(prompt.text))
        self.checks[tokens] = counts
        if any(count != tokens for count in counts):
            self.fitted_lengths.add(tokens)


def tokenize_counter(client: Client, model: str) -> Callable[[str], int] | None:
    """A function counting a prompt's tokens with the server's /tokenize, or
    None when the server has no such endpoint (or it does not answer as vLLM's)."""

    def count(text: str) -> int:
        status, body = client.post_json("/tokenize", {"model": model, "prompt": text})
        if status != 200 or not isinstance(body, dict):
            raise PromptError(f"/tokenize answered HTTP {status}")
        if isinstance(body.get("count"), int):
            return body["count"]
        if isinstance(body.get("tokens"), list):
            return len(body["tokens"])
        raise PromptError("/tokenize answered without a count or tokens")

    try:
        count("to be")
    except (PromptError, ServerError):
        return None
    return count


def calibrate_with_tokenize(count: Callable[[str], int]) -> PromptMaker | None:
    """Find one-token words with the server's tokenizer; None if too few."""
    first_cost: dict[str, int] = {}
    for word in CANDIDATE_WORDS:
        one = count(word)
        nine = count(" ".join([word] * 9))
        if nine - one == 8 and one >= 1:
            first_cost[word] = one
        if len(first_cost) >= WANTED_WORDS:
            break
    if len(first_cost) < MIN_WORDS:
        return None
    return PromptMaker("tokenize", tuple(first_cost), first_cost=first_cost, tokenize=count)


def calibrate_with_probes(probe: Callable[[str], int], max_model_len: int | None,
                          seed: str) -> PromptMaker:
    """Fit tokens = overhead + slope x words from two prompts of known word
    counts; `probe(text)` returns the prompt tokens the server counted."""
    low, high = PROBE_WORDS
    if max_model_len is not None:
        high = max(low + 8, min(high, max_model_len // 2))
    rng = random.Random(f"{seed}-probe")
    counts = []
    for words in (low, high):
        counts.append(probe(" ".join(rng.choice(CANDIDATE_WORDS) for _ in range(words))))
    slope = (counts[1] - counts[0]) / (high - low)
    if slope <= 0:
        raise PromptError(
            f"prompts of {low} and {high} words counted {counts[0]} and {counts[1]} prompt tokens; "
            "cannot calibrate prompt lengths on this server")
    overhead = counts[0] - slope * low
    return PromptMaker("calibrated-words", CANDIDATE_WORDS, slope=slope, overhead=overhead)
