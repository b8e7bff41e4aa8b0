"""Helpers for tests of the simulator: read its rendered pages back as numbers,
and summarise a stretch of simulated time the way a scraper would see it."""

from __future__ import annotations

import re
import time
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
# A sidecar Monitor fed by the simulator on simulated time
# --------------------------------------------------------------------------

SIM_BASE = 1_700_000_000.0


def _sim_page(sims: list[Simulation]):
    """Stands in for the HTTP fetch: the simulated engines' page now."""
    from kvwatch.scrape import RenderedPage

    def render() -> str:
        engines = [engine for sim in sims for engine in sim.engines]
        return render_metrics(engines, sims[0].model_name, SIM_BASE, include_process=False)
    return RenderedPage(render)


class _SimClock:
    """The monitor's wall clock, read from the simulation (thread CPU time
    and everything else stay real)."""

    def __init__(self, sim: Simulation):
        import time

        self.sim, self._real = sim, time

    def time(self) -> float:
        return SIM_BASE + self.sim.now

    def monotonic(self) -> float:
        # The monitor stamps snapshots with its wall-clock offset plus the
        # monotonic clock: both follow the simulation.
        return self.sim.now

    def __getattr__(self, name):
        return getattr(self._real, name)


def sim_monitor(scenario: str | list[tuple[str, float]], until: float, engines: int | None = None, seed: int = 0,
                every: float = 5.0, thresholds: dict | None = None, window: str = "5m", on_state=None):
    """A Monitor that polled the simulated scenario every `every` simulated
    seconds up to `until`, as `kvwatch serve` would have (no wall-time waits).
    A list of (scenario, lead seconds) plays a fleet: one engine per scenario
    behind one page (engine labels 0, 1, ...), each `lead` seconds ahead in
    its own scenario. `on_state` is called with the State of every poll."""
    import kvwatch.pipeline.monitor as monitor_module
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings
    from kvwatch.sim.scenario import load_scenario

    fleet = [(scenario, 0.0)] if isinstance(scenario, str) else scenario
    sims = []
    for name, lead in fleet:
        sim = Simulation(load_scenario(name), seed=seed, created_unix=SIM_BASE,
                         engines=engines if isinstance(scenario, str) else 1)
        if lead:
            sim.advance_to(lead)
        sims.append(sim)
    index = 0
    for sim in sims:
        for engine in sim.engines:
            engine.index = index
            index += 1
    overrides = {"target": "http://127.0.0.1:9/metrics", "poll_interval": f"{every:g}s", "window": window}
    settings = load_settings(overrides=overrides, environ={})
    first = load_scenario(fleet[0][0])
    settings.diagnosis = thresholds if thresholds is not None else {"max_num_seqs": first.engine.max_num_seqs}
    clock_sim = sims[0]
    start = clock_sim.now
    real = monitor_module.time
    monitor_module.time = _SimClock(clock_sim)
    try:
        monitor = Monitor(settings)
        monitor.fetcher = _sim_page(sims)
        elapsed = 0.0
        while elapsed < until - 1e-9:
            step = min(until - elapsed, every)
            elapsed += step
            for sim, (_, lead) in zip(sims, fleet):
                sim.advance_to(lead + elapsed)
            state = monitor.poll_once()
            if on_state is not None:
                on_state(state)
    finally:
        monitor_module.time = real
    assert clock_sim.now == start + until
    # Stamped on the simulated clock (a monitor reading another clock would
    # put the whole run inside a few real milliseconds).
    assert monitor.state.snapshot.time == SIM_BASE + clock_sim.now, "the monitor no longer reads the patched clock"
    return monitor
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
            _add_page(series, page, start + t, target, lambda name: name.startswith("vllm:"))
            t += interval
    return _openmetrics(series)


def pages_openmetrics(pages, instance: str, job: str = "vllm") -> str:
    """Pages as a scraper stored them: (time, text) pairs (None for a failed
    fetch, which stores nothing), every sample under the target labels
    `instance` and `job`, as OpenMetrics text for a promtool backfill."""
    series: dict[tuple[str, str], list[str]] = {}
    target = f'instance="{instance}",job="{job}"'
    for at, text in pages:
        if text is not None:
            _add_page(series, text, at, target, lambda name: True)
    return _openmetrics(series)


def _add_page(series: dict, page: str, at: float, target: str, keep) -> None:
    stamp = f"{at:.3f}"
    for line in page.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _LINE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        if not keep(name):
            continue
        block = target + ("," + labels if labels else "")
        series.setdefault((name, block), []).append(f"{name}{{{block}}} {value} {stamp}")


def _openmetrics(series: dict) -> str:
    # Each series' samples together, in time order; one family per name.
    out = []
    for key in sorted(series):
        out.extend(series[key])
    out.append("# EOF")
    return "\n".join(out) + "\n"


def settle(server, source) -> None:
    """Wait until the KV-cache events a simulator server recorded reached
    kvwatch's ledger (`source`: its KVEventSource), so a poll then reads the
    stream as of the page."""
    publisher = server.kv_publisher

    def settled() -> bool:
        # Every message sent was read, none waits in the queue, none is in the accountant's hands.
        pending = any(e.pool.events.events for e in server.sim.engines) if publisher else False
        sent = publisher.sequences[0] if publisher else 0
        return (not pending and (source._expected or 0) >= sent and not source._queue
                and not source.accounting)

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if settled():
            time.sleep(0.02)  # twice in a row: the receiver numbers a message just before it queues it
            if settled():
                return
        time.sleep(0.02)
    raise AssertionError("the KV-cache event stream did not settle")
