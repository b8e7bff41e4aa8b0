"""A stand-in for a Prometheus query API, in process: the series of an
OpenMetrics text with timestamps (what tests/sim_support.py writes for a
promtool backfill) answered through PrometheusClient's own chunking and cost
counting, with `/api/v1/series` and `/api/v1/query_range` over plain label
matchers (=, !=, =~, !~) and Prometheus' 5-minute lookback. `down` makes
every query fail as a store that does not answer; `latest` hides samples
after a time (the store has not scraped them yet)."""

from __future__ import annotations

import bisect
import re

from kvwatch.history.query import PrometheusClient, QueryError

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
LOOKBACK = 300.0


class StubClient(PrometheusClient):
    def __init__(self, openmetrics: str, **options):
        super().__init__("http://store.invalid:9090", **options)
        self.down = False
        self.latest: float | None = None
        self.paths: list[str] = []
        self.ranges: list[tuple[float, float]] = []
        self.store: dict[tuple, tuple[list[float], list[str]]] = {}
        for line in openmetrics.splitlines():
            match = _LINE.match(line)
            if not match:
                continue
            name, labels, value, at = match.groups()
            key = tuple(sorted([("__name__", name)] + [(k, v.replace('\\"', '"').replace("\\\\", "\\"))
                                                       for k, v in _LABEL.findall(labels or "")]))
            times, values = self.store.setdefault(key, ([], []))
            times.append(float(at))
            values.append(value)

    def drop(self, **labels: str) -> None:
        """Forget every series with these labels (a replica scaled away)."""
        for key in [k for k in self.store if set(labels.items()) <= set(k)]:
            del self.store[key]

    def _matching(self, selector: str) -> list[tuple]:
        matchers = _MATCHER.findall(selector)
        found = []
        for key in self.store:
            labels = dict(key)
            ok = True
            for name, op, value in matchers:
                have = labels.get(name, "")
                if op == "=":
                    ok = have == value
                elif op == "!=":
                    ok = have != value
                elif op == "=~":
                    ok = re.fullmatch(value.replace("\\\\", "\\"), have) is not None
                else:
                    ok = re.fullmatch(value.replace("\\\\", "\\"), have) is None
                if not ok:
                    break
            if ok:
                found.append(key)
        return found

    def _get(self, path: str, params, labels=None):
        self.paths.append(path)
        if self.down:
            raise QueryError(f"{path}: no answer within {self.timeout:g}s")
        start, end = float(params["start"]), float(params["end"])
        if self.latest is not None:
            end = min(end, self.latest)
        if path == "/api/v1/series":
            out = []
            for key in self._matching(params["match[]"]):
                times = self.store[key][0]
                if bisect.bisect_left(times, start) < bisect.bisect_right(times, end):
                    out.append(dict(key) if labels is None else {k: v for k, v in key if k in labels})
            self.cost.count(len(out), 0, 0)
            return out
        step = float(params["step"])
        self.ranges.append((start, end))
        result = []
        for key in self._matching(params["query"]):
            times, values = self.store[key]
            points = []
            at = start
            while at <= end + 1e-9:
                index = bisect.bisect_right(times, at) - 1
                if index >= 0 and at - times[index] <= LOOKBACK:
                    points.append([at, values[index]])
                at += step
            if points:
                result.append({"metric": dict(key), "values": points})
        self.cost.count(sum(len(s["values"]) for s in result), len(result), 0)
        return {"resultType": "matrix", "result": result}
