"""Engine adapters: each maps one engine's metrics page onto the canonical
Snapshot (see base.py for the interface)."""

from __future__ import annotations

from kvwatch.engines.base import EngineAdapter
from kvwatch.engines.llamacpp import LlamacppAdapter
from kvwatch.engines.sglang import SglangAdapter
from kvwatch.engines.trtllm import TrtllmAdapter
from kvwatch.engines.vllm import VllmAdapter

# Every adapter, in the order pages are matched against them.
ENGINES: dict[str, type[EngineAdapter]] = {
    adapter.name: adapter for adapter in (VllmAdapter, SglangAdapter, LlamacppAdapter, TrtllmAdapter)
}
# The `engine` setting's values: a name above, or `auto` (from the first good page).
AUTO = "auto"


def make_adapter(engine: str = "vllm", max_series: int = 10_000) -> EngineAdapter:
    """The adapter named `engine`; a name kvwatch does not know is a ValueError
    listing those it does."""
    try:
        return ENGINES[engine](max_series=max_series)
    except KeyError:
        raise ValueError(f"unknown engine {engine!r} (known: {', '.join(ENGINES)})") from None


def recognize(text: str) -> str | None:
    """The name of the engine whose page this is, or None."""
    return next((name for name, adapter in ENGINES.items() if adapter.recognizes(text)), None)
