"""Judges: one small function per cause, the evidence in, a verdict out,
registered for its symptom with the `judges` decorator its module makes
(`registrar`), asked in the order the symptom ranks its causes (causes.py).
`check_judges` refuses a ranked cause without a judge, or a judge for a cause
the symptom does not rank, at import.

What a verdict is, and whether the first one stands, is the symptom's own:
the low hit rate names one cause (hit_rate.py: the first verdict stands), the
exhaustion names its load shape and, beside it, the sizing advice
(exhaustion.py: every verdict kept)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

from kvwatch.diagnose.causes import SYMPTOMS, CatalogueError

J = TypeVar("J", bound=Callable[..., Any])


def registrar(registry: dict[str, J]) -> Callable[..., Callable[[J], J]]:
    """The `@judges("<cause>", ...)` decorator of one symptom's registry."""
    def judges(*causes: str) -> Callable[[J], J]:
        def register(judge: J) -> J:
            for cause in causes:
                registry[cause] = judge
            return judge
        return register
    return judges


def in_ranking(symptom: str, judged: Mapping[str, J]) -> Iterator[J]:
    """Each judge once, in the symptom's ranking: one that names several
    causes (told apart by one comparison) is asked at the first of them."""
    asked: list[J] = []
    for cause in SYMPTOMS[symptom].ranking:
        judge = judged[cause]
        if judge in asked:
            continue
        asked.append(judge)
        yield judge


def check_judges(symptom: str, judged: Mapping[str, Any], ranking: tuple[str, ...] | None = None) -> None:
    """Each cause the symptom ranks has its judge, and each judge names a
    ranked cause, or kvwatch does not import (a cause nobody judges would
    never be named, and the rule would fail at its turn)."""
    ranked = SYMPTOMS[symptom].ranking if ranking is None else ranking
    if set(ranked) != set(judged):
        raise CatalogueError(f"{symptom}: no judge for {sorted(set(ranked) - set(judged))} or no ranked cause "
                             f"for the judges of {sorted(set(judged) - set(ranked))} (its module's @judges)")
