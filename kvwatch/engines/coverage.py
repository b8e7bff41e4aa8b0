"""Which canonical keys an engine's adapter provides, and so which of
kvwatch's signals stay dark on that engine.

A signal is dark on an engine when its derivation returns nothing from a
window in which every key the engine provides moved and nothing else exists:
the answer follows the catalogue (kvwatch/signals/catalogue.py) as it grows, with no
second list of each signal's inputs to keep in step.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from kvwatch.engines import ENGINES
from kvwatch.engines.base import EngineAdapter
from kvwatch.engines.table import TableAdapter
from kvwatch.signals import SIGNALS, View
from kvwatch.snapshot import EngineSnapshot, Histogram
from kvwatch.window import Increase

# canonical key -> kind, for keys whose kind the adapter's table does not carry.
KIND_BY_PREFIX = {"kv_usage": "gauge", "running": "gauge", "waiting": "gauge", "waiting_by_reason": "gauge",
                  "v0_prefix_hit_rate": "gauge"}


# Label values a labelled key ("key/*") is given in the window made up below;
# "awake" lights the sleep state, "external_kv_transfer" the tokens a KV connector served, "host"
# the tokens SGLang's HiCache host tier served.
LABEL_VALUES = ("stop", "abort", "capacity", "local_compute", "external_kv_transfer", "device", "host", "awake")


def provided(adapter: type[EngineAdapter], older_builds: bool = True) -> dict[str, str]:
    """canonical key -> kind (gauge, counter, histogram, config) the adapter can
    fill, as the adapter declares it (EngineAdapter.provides); without
    `older_builds`, only what the engine's current builds carry."""
    return adapter.provides(older_builds)


@lru_cache(maxsize=None)
def dark_signals(adapter: type[EngineAdapter], older_builds: bool = False) -> tuple[str, ...]:
    """Names of the catalogue's signals this engine's current builds cannot
    provide (with `older_builds`: that no build of it provides)."""
    keys = provided(adapter, older_builds)
    latest = EngineSnapshot("model", "0")
    increase = Increase(seconds=60.0, steps=2)
    for key, kind in keys.items():
        names = [key] if not key.endswith("/*") else [key[:-1] + value for value in LABEL_VALUES]
        for name in names:
            if kind == "gauge":
                latest.gauges[name] = 0.5
            elif kind == "counter":
                latest.counters[name] = 100.0
                increase.counters[name] = 50.0
            elif kind == "histogram":
                histogram = Histogram((1.0, float("inf")), (6.0, 10.0), 8.0, 10.0)
                latest.histograms[name] = histogram
                increase.histograms[name] = histogram
    capacity = 1000.0 if "capacity_tokens" in keys else None
    view_args: dict[str, Any] = dict(
        latest=latest, increase=increase,
        usage_max=0.5 if "kv_usage" in keys else None,
        running_max=1.0 if "running" in keys else None,
        capacity_tokens=capacity, block_size=16.0 if capacity else None,
        kv_used_bytes=500.0 if "config/kv_cache_memory_bytes" in keys and "kv_usage" in keys else None,
        # Derived by the window from usage alone (its trend and mean).
        usage_mean=0.5 if "kv_usage" in keys else None,
        exhaustion_eta=60.0 if "kv_usage" in keys else None,
    )
    if capacity and "kv_usage" in keys and {"config/num_gpu_blocks", "config/block_size"} <= keys.keys():
        # Whole-block arithmetic (signals/evaluation.py): 63 usable blocks of 16 tokens, half used.
        view_args.update(usable_blocks=63.0, used_blocks=32.0, block_tokens=512.0)
        if "config/kv_cache_memory_bytes" in keys:
            view_args.update(bytes_per_block=1024.0)
    dark = []
    for signal in SIGNALS:
        try:
            value = signal.derive(View(**view_args))
        except (ArithmeticError, ValueError):
            value = None
        if value is None or value == {}:
            dark.append(signal.name)
    return tuple(dark)


def engines_markdown() -> str:
    """docs/engines-signals.md: signals x engines, then each adapter's table
    (written by `kvwatch generate`, checked for staleness like the rest)."""
    engines = list(ENGINES)
    lines = ["| signal | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for signal in SIGNALS:
        cells = []
        for name in engines:
            if signal.name in dark_signals(ENGINES[name], older_builds=True):
                cells.append("–")
            elif signal.name in dark_signals(ENGINES[name]):
                cells.append("older builds")
            else:
                cells.append("yes")
        lines.append(f"| `{signal.name}` | " + " | ".join(cells) + " |")
    for name in engines:
        adapter = ENGINES[name]
        if not issubclass(adapter, TableAdapter):
            continue
        lines += ["", f"### {name}", "", "| canonical key | family | type | unit | note |", "|---|---|---|---|---|"]
        for row in adapter.table():
            family = f"`{row['family']}`" if row["family"] else ""
            lines.append(f"| `{row['key']}` | {family} | {row['type']} | {row['unit']} | {row['note']} |")
    return "\n".join(lines) + "\n"
