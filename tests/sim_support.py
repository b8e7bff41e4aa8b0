"""Helpers for tests of the simulator: read its rendered pages back as numbers,
and summarise a stretch of simulated time the way a scraper would see it."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvwatch.sim.render import render_app_metrics, render_metrics
from kvwatch.sim.simulation import Simulation

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, frozenset of label pairs): value} of a text-format page."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        assert match, f"unparseable sample line: {line!r}"
        name, labels, value = match.groups()
        pairs = frozenset(_LABEL.findall(labels or ""))
        out[(name, pairs)] = float(value)
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of every series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(value for (sample, pairs), value in samples.items() if sample == name and want <= pairs)


def scrape(sim: Simulation) -> dict:
    """What a scraper of /metrics (plus /app/metrics) would read now."""
    page = render_metrics(sim.engines, sim.model_name, sim.created_unix, include_process=False)
    samples = parse_samples(page)
    samples.update(parse_samples(render_app_metrics(sim.app_retrieval, sim.created_unix)))
    return samples


@dataclass
class Window:
    """Counters as deltas between two scrapes, gauges sampled every `every` s."""

    start: dict
    end: dict
    usage: list[float]
    waiting: list[float]
    waiting_capacity: list[float]
    running: list[float]

    def delta(self, name: str, **labels: str) -> float:
        return total(self.end, name, **labels) - total(self.start, name, **labels)

    def hist_mean(self, name: str) -> float:
        count = self.delta(f"{name}_count")
        return self.delta(f"{name}_sum") / count if count else float("nan")

    @property
    def hit_ratio(self) -> float:
        queries = self.delta("vllm:prefix_cache_queries_total")
        return self.delta("vllm:prefix_cache_hits_total") / queries if queries else float("nan")

    @property
    def mean_usage(self) -> float:
        return sum(self.usage) / len(self.usage)


def observe(sim: Simulation, until: float, every: float = 2.0) -> Window:
    """Advance `sim` to simulated time `until`, scraping every `every` seconds."""
    start = scrape(sim)
    usage, waiting, capacity, running = [], [], [], []
    end = start
    while sim.now < until - 1e-9:
        sim.advance_to(min(until, sim.now + every))
        end = scrape(sim)
        usage.append(max(v for (name, _), v in end.items() if name == "vllm:kv_cache_usage_perc"))
        waiting.append(total(end, "vllm:num_requests_waiting"))
        capacity.append(total(end, "vllm:num_requests_waiting_by_reason", reason="capacity"))
        running.append(total(end, "vllm:num_requests_running"))
    return Window(start, end, usage, waiting, capacity, running)


# --------------------------------------------------------------------------
# A fleet of simulated replicas, as history for a Prometheus backfill
# --------------------------------------------------------------------------

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")


@dataclass
class Replica:
    """One simulated vLLM server: its target labels, and the simulations it
    runs one after another (a restart at each given simulated time)."""

    instance: str
    model: str
    scenario: object  # kvwatch.sim.scenario.Scenario
    seed: int = 0
    restarts: tuple[float, ...] = ()


def fleet_openmetrics(replicas: list[Replica], start: float, duration: float, interval: float,
                      job: str = "vllm") -> str:
    """The fleet's pages scraped every `interval` seconds from Unix time
    `start`, as OpenMetrics text with timestamps for `promtool tsdb
    create-blocks-from openmetrics`; each series' samples together, in time
    order."""
    series: dict[tuple[str, str], list[str]] = {}
    for replica in replicas:
        target = f'instance="{replica.instance}",job="{job}"'
        restarts = list(replica.restarts)
        created = start
        sim = Simulation(replica.scenario, seed=replica.seed, model_name=replica.model, created_unix=created)
        offset = 0.0  # simulated time of this process' start
        t = 0.0
        while t <= duration + 1e-9:
            if restarts and t >= restarts[0]:
                restarts.pop(0)
                offset = t
                sim = Simulation(replica.scenario, seed=replica.seed + 1000, model_name=replica.model,
                                 created_unix=start + t)
            sim.advance_to(t - offset)
            page = render_metrics(sim.engines, sim.model_name, sim.created_unix, include_process=False)
            stamp = f"{start + t:.3f}"
            for line in page.splitlines():
                if not line or line.startswith("#"):
                    continue
                match = _LINE.match(line)
                if not match:
                    continue
                name, labels, value = match.groups()
                if not name.startswith("vllm:"):
                    continue
                block = target + ("," + labels if labels else "")
                series.setdefault((name, block), []).append(f"{name}{{{block}}} {value} {stamp}")
            t += interval
    out = []
    for key in sorted(series):
        out.extend(series[key])
    out.append("# EOF")
    return "\n".join(out) + "\n"
