"""The optional second source for the slow-first-token diagnosis: a gateway's
or application's /metrics and one histogram there that measures time spent
before the engine sees a request (retrieval, routing, guardrails), named by
`upstream_histogram`, polled at `upstream_target`.

It keeps its own small window of that histogram (all its series summed, resets
handled like the engine's counters) and reports the window's mean and p95.
The engine's bearer token is never sent here: the upstream is another service.
"""

from __future__ import annotations

import math
import time
from collections import deque

from kvwatch.exposition import FamilySelector
from kvwatch.pipeline.reports import UpstreamReport
from kvwatch.present import public_url
from kvwatch.scrape import PageSource, SECOND_SOURCE_MAX_BYTES, Fetcher
from kvwatch.snapshot import Histogram

_SUFFIXES = ("_bucket", "_sum", "_count")
# The most bucket bounds kvwatch sums for the upstream histogram (classic
# histograms carry tens; client libraries' defaults 10 to 15): a page of
# 160,000 bounds (7.6 MiB) took 1.3 GB, each poll's histogram kept in the
# window twice.
MAX_BUCKETS = 1024


class TooManyBuckets(ValueError):
    pass


def histogram_base_name(name: str) -> str:
    """`app_retrieval_seconds_bucket` and `app_retrieval_seconds` name the same
    family."""
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def summed_histogram(page, name: str) -> Histogram | None:
    """The family's series summed across every label set but `le`
    (TooManyBuckets past MAX_BUCKETS bounds)."""
    family = page.families.get(name)
    if family is None:
        return None
    buckets: dict[float, float] = {}
    total = 0.0
    count = None
    for suffix, labels, value in family.samples:
        if math.isnan(value):
            continue
        if suffix == "_bucket":
            try:
                bound = float(labels.get("le", "nan"))
            except ValueError:
                continue
            if not math.isnan(bound):
                buckets[bound] = buckets.get(bound, 0.0) + value
                if len(buckets) > MAX_BUCKETS:
                    raise TooManyBuckets(f"the histogram has more than {MAX_BUCKETS} bucket bounds, more than "
                                         "kvwatch reads")
        elif suffix == "_sum":
            total += value
        elif suffix == "_count":
            count = (count or 0.0) + value
    if math.inf not in buckets:
        return None
    bounds = tuple(sorted(buckets))
    cumulative = tuple(buckets[b] for b in bounds)
    return Histogram(bounds, cumulative, total, cumulative[-1] if count is None else count)


class UpstreamSource:
    def __init__(self, settings, window_seconds: float, clock=time.time):
        self.name = histogram_base_name(settings.upstream_histogram)
        self.target = settings.upstream_target
        # Half the poll interval at most: the engine's fetch comes first in the
        # same poll, and both together should fit one interval.
        timeout = min(settings.fetch_timeout, max(0.2, 0.5 * settings.poll_interval))
        self.fetcher: PageSource = Fetcher(self.target, timeout, min(settings.max_body_bytes, SECOND_SOURCE_MAX_BYTES), None,
                               settings.ca_bundle, settings.tls_verify)
        self.selector = FamilySelector([self.name], ("",))
        self.window_seconds = window_seconds
        self.clock = clock
        # (time, histogram as scraped, increase since the previous poll)
        self._entries: deque[tuple[float, Histogram, Histogram | None]] = deque(maxlen=10_000)

    def poll(self) -> UpstreamReport:
        now = self.clock()
        result = self.fetcher.fetch()
        if not result.ok:
            return self._report(now, False, result.reason, result.detail)
        return self.ingest(result.page, now)

    def ingest(self, text: str, now: float) -> UpstreamReport:
        page = self.selector.parse(text)
        try:
            histogram = summed_histogram(page, self.name)
        except TooManyBuckets as exc:
            return self._report(now, False, "too_many_buckets", f"{self.name}: {exc}")
        if histogram is None:
            return self._report(now, False, "histogram_missing", f"no histogram {self.name!r} on the page")
        step = None
        if self._entries:
            previous = self._entries[-1][1]
            step = histogram.minus(previous)
            if step is None:
                # Restarted (or bounds changed): the increase is the new value.
                step = histogram
        self._entries.append((now, histogram, step))
        horizon = now - self.window_seconds
        while len(self._entries) > 2 and self._entries[1][0] <= horizon:
            self._entries.popleft()
        return self._report(now, True, None, "")

    def increase(self, since: float | None = None) -> Histogram | None:
        """The histogram's increase over the window (or its steps after `since`)."""
        total = None
        for at, _, step in list(self._entries)[1:]:
            if step is None or (since is not None and at <= since):
                continue
            merged = step if total is None else total.plus(step)
            total = merged if merged is not None else step
        return total

    def recent(self, report: UpstreamReport | None, seconds: float) -> UpstreamReport | None:
        """`report` (this poll's) over the last `seconds` only: what is true
        now (diagnose/now.py)."""
        if report is None or not report.get("up") or not self._entries:
            return report
        return self._report(report["time"], True, None, "", since=self._entries[-1][0] - seconds)

    def _report(self, now: float, up: bool, reason: str | None, detail: str,
                since: float | None = None) -> UpstreamReport:
        increase = self.increase(since)
        p95 = increase.reported_quantile(0.95) if increase is not None else None
        first = next((at for at, _, _ in self._entries if since is None or at >= since), now) if self._entries else now
        covered = self._entries[-1][0] - first if len(self._entries) > 1 else 0.0
        return UpstreamReport(
            histogram=self.name,
            target=public_url(self.target),
            up=up,
            reason=reason,
            detail=detail,
            count=increase.count if increase is not None else 0.0,
            mean_seconds=increase.mean() if increase is not None else None,
            p95_seconds=p95.value if p95 is not None else None,
            p95_pinned=p95.bound if p95 is not None else None,
            window_seconds=covered,
            time=now,
        )
