"""Central mode's routers: a router's page (llm-d's endpoint picker, Dynamo's
KV router, SGLang's router) scraped by the store like the engines, read back
from it at each step and judged as the sidecar judges its router target.

Each refresh reads the router families' series over the new steps (one range
query; the store's client holds it to its timeout and sample budget), writes
each router's samples at each step back as the text of its page and reads it
with the sidecar's reader (kvwatch/routing/page.py). A router is one value of
the replica labels (its scrape target); at most MAX_ROUTERS are kept, each
with its readings over one window span. At the refresh's last step, each
router's window is attributed against the prefix-cache counters of every
replica's window (kvwatch/pipeline/router.py's model_windows, the sidecar's
own function) and judged by judge_routing: the router's findings are the
fleet's (they are about the model, not one replica). Where a router's window
says what its chosen replicas and the best one held (decides_affinity), it
decides lost_prefix_affinity for its model: the fleet's peer comparison of
hit ratios for that model gives way to it.
"""

from __future__ import annotations

import re
from collections import deque
from typing import Any

from kvwatch.diagnose.vocabulary import Finding
from kvwatch.history.matrix import pairs_of
from kvwatch.history.query import PrometheusClient, merge_selector
from kvwatch.pipeline.router import MAX_READINGS, model_windows
from kvwatch.routing import RouterReading, judge_routing, read_router_page
from kvwatch.routing.attribution import decides_affinity
from kvwatch.routing.page import LLM_D_PREFIXES
from kvwatch.units import finite_number
from kvwatch.window import Window

MAX_ROUTERS = 16
# The series one router's page is expected to hold (the read's chunks are
# planned for it; a store answering more is held to the client's budget).
EXPECTED_SERIES = 64
_LLM_D = ("prefix_(predicted|best_predicted|best_available)_cached_tokens_(sum|count)", "prefix_prompt_tokens_(sum|count)",
          "request_total", "flow_control_stale_endpoints", "request_(input|cached)_tokens_sum")
_OTHERS = ("inference_extension_prefix_indexer_hit_ratio_(sum|count)", "dynamo_component_router_kv_hit_rate_(sum|count)",
           "dynamo_component_kv_cache_events_applied(_total)?", "smg_router_cache_(hits|misses)_total")
NAME_MATCHER = '__name__=~"(({prefixes})({llm_d}))|{others}"'.format(
    prefixes="|".join(LLM_D_PREFIXES), llm_d="|".join(_LLM_D), others="|".join(_OTHERS))


_NAME = re.compile(NAME_MATCHER[len('__name__=~"'):-1])
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _family(name: str) -> tuple[str, str]:
    """(the family a sample name belongs to, its kind) as the page declares them."""
    for suffix in ("_sum", "_count"):
        if name.endswith(suffix):
            return name[: -len(suffix)], "histogram"
    if name.endswith("_total"):
        return name[: -len("_total")], "counter"
    return name, "gauge"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def page_text(samples: list[tuple[str, dict[str, str], float]]) -> str:
    """The text of a router's page from its samples at one step, each family's
    samples together under its TYPE line."""
    families: dict[str, tuple[str, list[str]]] = {}
    for name, labels, value in samples:
        family, kind = _family(name)
        inner = ",".join(f'{key}="{_escape(str(val))}"' for key, val in sorted(labels.items())
                         if _LABEL.fullmatch(str(key)))
        families.setdefault(family, (kind, []))[1].append(f"{name}{{{inner}}} {value!r}")
    lines: list[str] = []
    for family, (kind, rows) in families.items():
        lines.append(f"# TYPE {family} {kind}")
        lines.extend(rows)
    return "\n".join(lines) + "\n"


class StoreRouters:
    """Every router the store holds for the selector, its readings over the window."""

    def __init__(self, settings: Any, window_seconds: float, replica_labels: tuple[str, ...]):
        self.model: str | None = settings.router_model
        self.refresh_interval: float | None = settings.router_refresh_interval
        self.bound: float | None = settings.router_staleness_bound
        self.window_seconds = window_seconds
        self.replica_labels = replica_labels
        self.readings: dict[tuple, deque[tuple[float, RouterReading]]] = {}

    def read(self, client: PrometheusClient, selector: str, start: float, end: float, step: float) -> None:
        """The routers' readings at each step of [start, end]; routers with no
        reading for a window span are forgotten."""
        admitted = set(self.readings)

        def keep(metric: dict) -> bool:
            """Only the families asked for (a store's answer is not trusted to hold only those), of
            at most MAX_ROUTERS routers: the rest is left out as the answer is decoded."""
            if not isinstance(metric.get("__name__"), str) or not _NAME.fullmatch(metric["__name__"]):
                return False
            key = tuple(metric.get(label, "") for label in self.replica_labels)
            if key not in admitted and len(admitted) < MAX_ROUTERS:
                admitted.add(key)
            return key in admitted

        [found] = client.read_ranges([(merge_selector(selector, NAME_MATCHER), EXPECTED_SERIES)], start, end, step,
                                     keep=keep)
        steps: dict[tuple, dict[float, list]] = {}
        for series in found:
            metric = dict(series["metric"])
            name = metric.pop("__name__", "")
            key = tuple(metric.pop(label, "") for label in self.replica_labels)
            if not keep({"__name__": name, **dict(zip(self.replica_labels, key))}):
                continue  # a stand-in client may not apply keep itself
            at_steps = steps.setdefault(key, {})
            for at, value in pairs_of(series["values"]):
                sample = finite_number(at), finite_number(value)
                if sample[0] is not None and sample[1] is not None:
                    at_steps.setdefault(sample[0], []).append((name, metric, sample[1]))
        for key, by_time in sorted(steps.items()):
            kept = self.readings.setdefault(key, deque(maxlen=MAX_READINGS))
            for at in sorted(by_time):
                reading = read_router_page(page_text(by_time[at]))
                if reading.dialect is not None or reading.stale_endpoints is not None:
                    kept.append((at, reading))
        for key in list(self.readings):
            kept = self.readings[key]
            while kept and kept[0][0] < end - self.window_seconds:
                kept.popleft()
            if not kept:
                del self.readings[key]

    def findings(self, engines: list[Window]) -> tuple[list[Finding], set[str]]:
        """Each router's findings over its readings' span, beside every replica's
        window; and the models whose prefix affinity a router's window decided."""
        out: list[Finding] = []
        decided: set[str] = set()
        for _key, kept in sorted(self.readings.items()):
            if len(kept) < 2:
                continue
            for window in model_windows(kept[0][1], kept[-1][1], engines, self.model, self.refresh_interval,
                                        self.bound):
                out.extend(judge_routing(window))
                if decides_affinity(window):
                    decided.add(window.model)
        return out, decided
