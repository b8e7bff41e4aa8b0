"""One rule for every string that reaches a label value, whatever its source
(an engine's page, the KV-cache event stream, a capture, a store's answer).

- `bounded_label`: a value is bounded in bytes. One longer than
  LABEL_VALUE_MAX_BYTES is kept as its start and a digest of the whole, so
  the same long value always gives the same label and two long values that
  differ anywhere give two.
- `LabelBudget`: the distinct values one source may introduce, counted in
  values and bytes. Past either bound a new value is folded into "other",
  and the fold is said once (the log and `sentence`), never once a value.
"""

from __future__ import annotations

import hashlib
import logging

log = logging.getLogger("kvwatch")

# A label value longer than this (UTF-8 bytes) is kept as its start and a
# digest: vLLM's model names, engine ids, media and LoRA names are far shorter.
LABEL_VALUE_MAX_BYTES = 256
LABEL_VALUE_START_BYTES = 64
OTHER = "other"
DEFAULT_BUDGET_VALUES = 64
DEFAULT_BUDGET_BYTES = 64 * 1024


def bounded_label(value: str) -> str:
    """The value, or for one over LABEL_VALUE_MAX_BYTES its start and a
    blake2b digest of the whole (at most about 140 bytes)."""
    if len(value) * 4 <= LABEL_VALUE_MAX_BYTES:  # no UTF-8 character takes more than 4 bytes
        return value
    encoded = value.encode("utf-8", "surrogatepass")
    if len(encoded) <= LABEL_VALUE_MAX_BYTES:
        return value
    digest = hashlib.blake2b(encoded, digest_size=16).hexdigest()
    start = encoded[:LABEL_VALUE_START_BYTES].decode("utf-8", "ignore")  # a character cut in two is left out
    return f"{start}...({len(encoded)} bytes, blake2b {digest})"


def bounded_labels(labels: dict[str, str]) -> dict[str, str]:
    """A label set with every value bounded (the same dict when none is long)."""
    if all(len(value) * 4 <= LABEL_VALUE_MAX_BYTES for value in labels.values()):
        return labels
    return {name: bounded_label(value) for name, value in labels.items()}


class LabelBudget:
    """The distinct label values one source may introduce: at most
    `max_values` of them and `max_bytes` in all (after `bounded_label`);
    past either, a new value reads as OTHER."""

    def __init__(self, source: str, max_values: int = DEFAULT_BUDGET_VALUES,
                 max_bytes: int = DEFAULT_BUDGET_BYTES):
        self.source = source
        self.max_values = max_values
        self.max_bytes = max_bytes
        self.values: set[str] = set()
        self.bytes = 0
        self.folded = 0  # values read as OTHER
        self.sentence: str | None = None

    def admit(self, value: str) -> str:
        """The label to use for `value`: itself bounded, or OTHER past the budget."""
        value = bounded_label(value)
        if value in self.values or value == OTHER:
            return value
        size = len(value.encode("utf-8", "surrogatepass"))
        if len(self.values) < self.max_values and self.bytes + size <= self.max_bytes:
            self.values.add(value)
            self.bytes += size
            return value
        self.folded += 1
        if self.sentence is None:
            self.sentence = (f"{self.source} named more than {len(self.values)} distinct label values "
                             f"({self.bytes:,} bytes); every new one is counted under \"{OTHER}\"")
            log.warning("%s", self.sentence)
        return OTHER
