"""One request length against a KV budget: its bytes with and without block
rounding (sliding-window layers keep at most their window), and how many such
requests the budget holds, each step kept as a written line."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestEstimate:
    """One request length and how many of it fit."""

    label: str
    input_tokens: int | None
    output_tokens: int | None
    tokens: int | None
    sliding_tokens: int | None          # tokens a sliding layer keeps: min(tokens, window)
    bytes_per_request: int              # without block rounding
    simple_bound: int                   # budget // bytes_per_request
    full_layer_blocks: int | None       # ceil(tokens / block_size)
    sliding_layer_blocks: int | None    # min(full_layer_blocks, ceil(window / block_size) + 1)
    rounded_bytes_per_request: int | None
    rounded_bound: int | None           # budget // rounded_bytes_per_request
    pool_bound: int | None              # (budget - one null block) // rounded bytes
    state_bytes_per_request: int | None
    bound_with_state: int | None        # pool bound with the fixed state added per request
    steps: list[str] = field(default_factory=list)


def human_bytes(value: int | float) -> str:
    """'384.0 MiB': binary units, for reading beside the exact byte count."""
    amount = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(amount) < 1024 or unit == "TiB":
            return f"{int(amount)} B" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def request_estimate(structure: Any, label: str, inp: int, out: int, block_size: int,
                     budget: int) -> RequestEstimate:
    """How many requests of `inp` + `out` tokens a budget holds, for a model's
    KV structure (arithmetic.KVStructure)."""
    tokens = inp + out
    lines = [f"[{label}] tokens = {inp} input + {out} output = {tokens}"]
    full_blocks = math.ceil(tokens / block_size)
    sliding_tokens: int | None
    sliding_blocks: int | None
    if structure.sliding_window is not None:
        sliding_tokens, sliding_blocks, simple, rounded = _windowed_bytes(structure, label, tokens, full_blocks,
                                                                          block_size, lines)
    else:
        bpt = structure.bytes_per_token
        sliding_tokens = sliding_blocks = None
        simple = bpt * tokens
        rounded = full_blocks * block_size * bpt
        lines.append(f"[{label}] bytes = {tokens} x {bpt} B = {simple} B "
                     f"({human_bytes(simple)})")
        lines.append(f"[{label}] blocks = ceil({tokens} / {block_size}) = {full_blocks}; "
                     f"rounded bytes = {full_blocks} x {block_size * bpt} B = {rounded} B "
                     f"({human_bytes(rounded)})")
    block_bytes = block_size * structure.bytes_per_token
    simple_bound = budget // simple
    rounded_bound = budget // rounded
    pool_budget = max(budget - block_bytes, 0)
    pool_bound = pool_budget // rounded
    lines.append(f"[{label}] simple bound = {budget} // {simple} = {simple_bound}")
    lines.append(f"[{label}] bound after block rounding = {budget} // {rounded} = "
                 f"{rounded_bound}")
    lines.append(f"[{label}] pool bound = ({budget} - one null block {block_bytes}) // "
                 f"{rounded} = {pool_bound}")
    state = structure.state_bytes_per_request
    with_state = None
    if state is not None:
        with_state = pool_budget // (rounded + state)
        lines.append(f"[{label}] with Mamba state = {pool_budget} // ({rounded} + {state}) "
                     f"= {with_state}")
    return RequestEstimate(
        label=label, input_tokens=inp, output_tokens=out, tokens=tokens,
        sliding_tokens=sliding_tokens, bytes_per_request=simple, simple_bound=simple_bound,
        full_layer_blocks=full_blocks, sliding_layer_blocks=sliding_blocks,
        rounded_bytes_per_request=rounded, rounded_bound=rounded_bound,
        pool_bound=pool_bound, state_bytes_per_request=state, bound_with_state=with_state,
        steps=lines)


def _windowed_bytes(structure: Any, label: str, tokens: int, full_blocks: int, block_size: int,
                    lines: list[str]) -> tuple[int, int, int, int]:
    """Sliding layers keep at most the window's tokens (and its blocks, plus one
    the window straddles): (tokens kept, blocks kept, bytes, rounded bytes)."""
    window = structure.sliding_window
    full_bpt, sliding_bpt = structure.full_bytes_per_token, structure.sliding_bytes_per_token
    sliding_tokens = min(tokens, window)
    simple = full_bpt * tokens + sliding_bpt * sliding_tokens
    lines.append(f"[{label}] bytes = {full_bpt} B x {tokens} "
                 f"(full layers) + {sliding_bpt} B x min({tokens}, "
                 f"window {window}) = {sliding_tokens} (sliding layers) = {simple} B "
                 f"({human_bytes(simple)})")
    sliding_blocks = min(full_blocks, math.ceil(window / block_size) + 1)
    rounded = (full_bpt * full_blocks + sliding_bpt * sliding_blocks) * block_size
    lines.append(f"[{label}] blocks: full layers ceil({tokens} / {block_size}) = "
                 f"{full_blocks}; sliding layers min({full_blocks}, ceil({window} / "
                 f"{block_size}) + 1) = {sliding_blocks}")
    lines.append(f"[{label}] rounded bytes = ({full_bpt} B x "
                 f"{full_blocks} + {sliding_bpt} B x "
                 f"{sliding_blocks}) x {block_size} = {rounded} B ({human_bytes(rounded)})")
    return sliding_tokens, sliding_blocks, simple, rounded
