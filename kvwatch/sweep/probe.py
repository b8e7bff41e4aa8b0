"""The quality probe of `kvwatch sweep`: a small fixed set of prompts sent one
at a time with greedy decoding (temperature 0, a fixed max_tokens, logprobs
where the server gives them) before the first cell, and recorded with the
results, so that `kvwatch sweep --compare` can tell whether a change to the
server (a lower-precision KV cache above all) changed its answers.

The prompts never change between kvwatch versions without a new PROBE_VERSION:
two sweeps are compared prompt by prompt, by text. One at a time, on an idle
server, so batching cannot change what greedy decoding picks; after the cells,
so the probe cannot touch their figures.

The record says what was measured and what was not: `status` is `measured`
(every prompt answered, with logprobs), `no-logprobs` (answered, the server
gave none), `partial` (some prompts failed), `failed` (none answered) or
`not-run` (the sweep was stopped first).
"""

from __future__ import annotations

from typing import Any

from kvwatch.sweep.client import Client, ServerError, error_message

PROBE_VERSION = 1
PROBE_MAX_TOKENS = 32
PROBE_PROMPTS = (
    "The capital of France is",
    "Water boils at a temperature of",
    "def fibonacci(n):\n    ",
    "Translate to German: The weather is nice today.\n",
    "A list of the first ten prime numbers: 2, 3, 5,",
    "Once upon a time, in a small village by the sea,",
    "The three laws of thermodynamics state that",
    "Q: What is 17 times 23?\nA:",
)

MEASURED, NO_LOGPROBS, PARTIAL, FAILED, NOT_RUN = (
    "measured", "no-logprobs", "partial", "failed", "not-run")
# Statuses whose outputs can be compared (some or all prompts answered).
ANSWERED = (MEASURED, NO_LOGPROBS, PARTIAL)


def _request(model: str, prompt: str, logprobs: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": PROBE_MAX_TOKENS,
                            "temperature": 0, "stream": False}
    if logprobs:
        body["logprobs"] = 1
    return body


def _parse(answer: Any) -> dict[str, Any]:
    """The output of one completion: text, tokens and their logprobs (None when
    the server sent none), finish reason."""
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError("the answer has no choices")
    choice = choices[0]
    text = choice.get("text")
    if not isinstance(text, str):
        raise ValueError("the answer's choice has no text")
    tokens = logprobs = None
    block = choice.get("logprobs")
    if isinstance(block, dict) and isinstance(block.get("tokens"), list) \
            and isinstance(block.get("token_logprobs"), list) \
            and len(block["tokens"]) == len(block["token_logprobs"]):
        tokens = [str(token) for token in block["tokens"]]
        logprobs = [float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None
                    for v in block["token_logprobs"]]
    return {"text": text, "tokens": tokens, "token_logprobs": logprobs,
            "finish_reason": choice.get("finish_reason")}


def run_probe(client: Client, model: str, timeout: float) -> dict[str, Any]:
    """Send the probe prompts one by one; never raises: failures are in the record."""
    results: list[dict[str, Any]] = []
    ask_logprobs = True
    refused: str | None = None
    unreachable: str | None = None
    for prompt in PROBE_PROMPTS:
        entry: dict[str, Any] = {"prompt": prompt, "text": None, "tokens": None,
                                 "token_logprobs": None, "finish_reason": None, "error": None}
        if unreachable:
            entry["error"] = f"not sent after: {unreachable}"
            results.append(entry)
            continue
        try:
            status, answer = client.post_json("/v1/completions", _request(model, prompt, ask_logprobs),
                                              timeout=timeout)
            if status == 400 and ask_logprobs:
                # A server that refuses logprobs (vLLM with --max-logprobs 0) still
                # answers without them: its outputs can be compared, its logprobs not.
                refused = error_message(answer) or "HTTP 400"
                ask_logprobs = False
                status, answer = client.post_json("/v1/completions",
                                                  _request(model, prompt, False), timeout=timeout)
            if status != 200:
                detail = error_message(answer)
                entry["error"] = f"HTTP {status}" + (f": {detail}" if detail else "")
            else:
                entry.update(_parse(answer))
        except ServerError as error:
            # A timeout or a lost connection: the rest would only wait as long
            # and pile requests on the server.
            entry["error"] = unreachable = str(error)
        except (ValueError, TypeError) as error:
            entry["error"] = f"unreadable answer: {error}"
        results.append(entry)
    answered = [entry for entry in results if entry["error"] is None]
    with_logprobs = [entry for entry in answered if entry["token_logprobs"] is not None]
    if not answered:
        status_text, note = FAILED, f"no probe prompt was answered: {results[0]['error']}"
    elif len(answered) < len(results):
        status_text = PARTIAL
        note = (f"{len(results) - len(answered)} of {len(results)} probe prompts failed, the first: "
                + next(entry["error"] for entry in results if entry["error"]))
    elif len(with_logprobs) < len(answered):
        status_text = NO_LOGPROBS
        note = ("the server refused logprobs (" + refused + "); outputs recorded without them"
                if refused else "the server sent no logprobs; outputs recorded without them")
    else:
        status_text, note = MEASURED, None
    return {"version": PROBE_VERSION, "status": status_text, "note": note,
            "max_tokens": PROBE_MAX_TOKENS, "temperature": 0,
            "logprobs_requested": ask_logprobs, "results": results}


def not_run(why: str) -> dict[str, Any]:
    return {"version": PROBE_VERSION, "status": NOT_RUN, "note": why,
            "max_tokens": PROBE_MAX_TOKENS, "temperature": 0, "logprobs_requested": False,
            "results": []}
