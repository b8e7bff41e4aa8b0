"""Reading a range of history through the Prometheus HTTP query API (also
Thanos, Mimir, Cortex, VictoriaMetrics).

Every read is bounded: the step is chosen from the range (at least
`min_step`, and at most MAX_POINTS points per series and query, Prometheus'
own limit of 11,000 being above it), each family's range query is split into
time chunks so that series x points never exceeds `max_samples` (below
Prometheus' default --query.max-samples of 50,000,000), at most `concurrency`
queries run at once, each with a timeout. What was read is counted in `Cost`
(queries, samples, bytes, seconds) and reported with the diagnosis.

The HTTP session takes the sidecar's options: a bearer token file (re-read
on each query, as projected tokens rotate), a CA bundle or no verification,
no proxies from the environment, no redirects followed.
"""

from __future__ import annotations

import contextvars
import json
import math
import re
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import requests
import urllib3

from kvwatch import __version__
from kvwatch.history.matrix import decode, decode_listing, joined
from kvwatch.present import printable, public_host
from kvwatch.scrape import BearerToken, WatchedAdapter, Watchdog, connection_reason, read_body

MAX_POINTS = 10_000  # per series and query; Prometheus refuses more than 11,000
DEFAULT_MAX_SAMPLES = 5_000_000  # per query
DEFAULT_CONCURRENCY = 4
DEFAULT_TIMEOUT = 60.0
# The most bytes of one answer kvwatch holds (decompressed, counted as they
# are read): a hostile store's answers were read whole (4.8 GB; 2.7 GB in
# central mode against its 1024Mi limit). Central mode passes its own,
# smaller cap (CENTRAL_MAX_BYTES). The planner keeps a chunk's samples within
# the cap at BYTES_PER_SAMPLE each (a matrix point, `[1700000000.123,"1234.5"]`,
# is about 30 bytes with its separators).
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
CENTRAL_MAX_BYTES = 32 * 1024 * 1024
BYTES_PER_SAMPLE = 48
# The most of a store's own error text kept (in the log only; /readyz and the
# page say the status alone).
ERROR_TEXT_CHARS = 300
# Sent with every query. Thanos: refuse a partial answer (a failed store
# behind the querier fails the query instead of leaving its replicas out)
# and deduplicate HA pairs by the querier's replica labels (its default, said
# here). Prometheus, Mimir and VictoriaMetrics ignore both (tested against
# Prometheus and VictoriaMetrics).
STORE_PARAMETERS = {"partial_response": "false", "dedup": "true"}
# The series read_ranges keeps (its `keep`), seen by _get in the read's
# worker threads, so that an override of query_range keeps its signature.
_KEEP: contextvars.ContextVar = contextvars.ContextVar("kvwatch_keep", default=None)
# Steps the planner picks from, so that steps line up across runs.
NICE_STEPS = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600)


# A store that cannot be reached, in one sentence (the engine's own are in scrape.SENTENCES).
_STORE_SENTENCES = {
    "refused": "connection refused by {host}: nothing listens there (is it the query API's address and port?)",
    "timeout": "no answer from {host}",
    "dns": "cannot resolve the host name of {host}",
    "disconnected": "{host} closed the connection before answering",
    "connection": "cannot connect to {host}",
}


class QueryError(Exception):
    """The store refused or failed a query (the message says which and why;
    `reason` names a connection failure: refused, dns, disconnected,
    connection, tls; or what a store's refusal means: limit, throttled,
    partial)."""

    def __init__(self, message: str, reason: str | None = None, status: int | None = None):
        super().__init__(message)
        self.reason = reason
        self.status = status


# What a horizontally scaled store's refusal means, from its status and text
# (the text stays in the log): over one of its query limits (Prometheus'
# "would load too many samples", Mimir's err-mimir-max-series-per-query and
# kin, VictoriaMetrics' -search.max* flags, Thanos' store limits); throttled
# (HTTP 429: a tenant's query rate or concurrency); partial (a store behind
# a Thanos querier failed and partial responses are refused).
_LIMIT = re.compile(r"limit|exceed|too many|too large|max[-_.]?(samples|series|chunks|fetched|unique|points|query)",
                    re.IGNORECASE)
_PARTIAL = re.compile(r"partial|receive series from|store ?api|storeapi", re.IGNORECASE)


def refusal(status: int | None, text: str) -> str | None:
    """limit, throttled, partial, or None for any other error answer."""
    if status == 429:
        return "throttled"
    if _PARTIAL.search(text):
        return "partial"
    # A deadline "exceeded" is a store too slow, not a limit reached.
    if status in (400, 413, 422, 500, 503) and _LIMIT.search(text) and "deadline" not in text.lower():
        return "limit"
    return None


def _is_labels(labels) -> bool:
    return isinstance(labels, dict) and all(type(k) is str and type(v) is str for k, v in labels.items())


def _printable(text: str, limit: int) -> str:
    """A store's own text as kvwatch repeats it: control characters (a
    terminal's escape sequences) written as escapes, cut to `limit`."""
    return printable(str(text)[:limit])


@dataclass
class Cost:
    queries: int = 0
    samples: int = 0
    series: int = 0
    bytes: int = 0
    seconds: float = 0.0  # wall time of the reads, from the first to the last
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, samples: int, series: int, size: int) -> None:
        with self._lock:
            self.queries += 1
            self.samples += samples
            self.series += series
            self.bytes += size

    def to_json(self) -> dict:
        return {"queries": self.queries, "samples": self.samples, "series_read": self.series,
                "bytes": self.bytes, "seconds": round(self.seconds, 3)}


def choose_step(start: float, end: float, min_step: float = 15.0, max_points: int = 2_880) -> float:
    """The smallest nice step >= min_step giving at most max_points steps over
    the range (24 h at 30 s is 2,880 points)."""
    span = max(0.0, end - start)
    for step in NICE_STEPS:
        if step >= min_step and span / step <= max_points:
            return float(step)
    return float(max(min_step, math.ceil(span / max_points)))


def merge_selector(selector: str | None, name_matcher: str) -> str:
    """`{a="b"}` and `__name__=~"..."` -> `{__name__=~"...",a="b"}`."""
    inner = (selector or "").strip()
    if inner.startswith("{") and inner.endswith("}"):
        inner = inner[1:-1].strip()
    return "{" + ",".join(part for part in (name_matcher, inner) if part) + "}"


_SELECTOR = re.compile(r'^\{\s*(?:[a-zA-Z_][a-zA-Z0-9_]*\s*(?:=~|!~|!=|=)\s*"(?:[^"\\]|\\.)*"\s*,?\s*)*\}$')


def check_selector(selector: str | None) -> str | None:
    """A problem with a `--selector`, or None."""
    if not selector:
        return None
    if not _SELECTOR.match(selector.strip()):
        return f"not a label selector: {selector!r} (expected e.g. '{{namespace=\"llm\"}}')"
    return None


class PrometheusClient:
    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, bearer_token_file: str | None = None,
                 ca_bundle: str | None = None, tls_verify: bool = True, concurrency: int = DEFAULT_CONCURRENCY,
                 max_samples: int = DEFAULT_MAX_SAMPLES, max_bytes: int = DEFAULT_MAX_BYTES):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.max_bytes = max(1024, int(max_bytes))
        self.bearer_token_file = bearer_token_file
        self.concurrency = max(1, concurrency)
        self.max_samples = max(1, min(max_samples, self.max_bytes // BYTES_PER_SAMPLE))
        self.cost = Cost()
        self.session = requests.Session()
        self.session.trust_env = False
        self.session.verify = ca_bundle if ca_bundle else tls_verify
        self.session.headers.update({"User-Agent": f"kvwatch/{__version__}", "Accept-Encoding": "gzip"})
        # The fetcher's watchdog over these sockets too: the deadline holds
        # however slowly a store trickles its answer.
        adapter = WatchedAdapter(pool_connections=1, pool_maxsize=self.concurrency)
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        if not tls_verify:
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        self._token = BearerToken(bearer_token_file)
        # Answers are read `concurrency` at a time but decoded one at a time:
        # decoding holds the GIL anyway, and a decoded answer is many times
        # its bytes (14 per byte for small series), so what a read holds at
        # once is at most `concurrency` answers' bytes and one answer decoded.
        self._decoding = threading.Lock()

    def _get(self, path: str, params, labels: tuple[str, ...] | None = None) -> Any:
        """One query's answer, within the client's timeout for the whole of
        it (connect, headers and body: a trickling store is cut off at the
        deadline) and within max_bytes (decompressed). `labels`: a series
        list's label sets cut to these (matrix.decode_listing)."""
        started = time.monotonic()
        watchdog = Watchdog(self.timeout)
        try:
            with watchdog:
                status, content_type, content = self._post(path, params, started)
        except QueryError:
            if watchdog.fired:
                raise QueryError(f"{path}: no answer within {self.timeout:g}s", "timeout") from None
            raise
        if watchdog.fired:
            raise QueryError(f"{path}: no answer within {self.timeout:g}s", "timeout")
        size = len(content)
        refused = [0, 0]
        with self._decoding:
            try:
                text = content.decode("utf-8")
                del content
                if labels is not None:
                    body = decode_listing(text, labels)
                else:
                    body = decode(text, _KEEP.get() if path == "/api/v1/query_range" else None, refused)
            except (ValueError, RecursionError):  # UnicodeDecodeError included
                raise QueryError(f"{path}: HTTP {status}, not JSON ({_printable(content_type, 80)})") from None
            finally:
                text = ""
        if not isinstance(body, dict):
            raise QueryError(f"{path}: HTTP {status}, JSON but not an object")
        if status != 200 or body.get("status") != "success":
            text = f"{body.get('errorType', '')} {body.get('error', '')}".strip()
            # An answer without its error's text still says what failed, not a bare "HTTP 404:".
            said = (f": {_printable(text, ERROR_TEXT_CHARS)}" if text
                    else ", an error answer that gives no reason (is this a Prometheus query API?)")
            raise QueryError(f"{path}: HTTP {status}{said}", refusal(status, text[:ERROR_TEXT_CHARS * 4]),
                             status=status)
        data = body.get("data")
        # Thanos answers a query some of its stores failed with success and
        # warnings (a partial response) where partial responses are on: part
        # of a fleet read as all of it would show the rest as gone.
        warnings = body.get("warnings") or (data.get("warnings") if isinstance(data, dict) else None)
        if warnings:
            said = _printable(json.dumps(warnings)[:ERROR_TEXT_CHARS], ERROR_TEXT_CHARS)
            raise QueryError(f"{path}: a partial answer, with warnings: {said}", "partial")
        if isinstance(data, dict) and isinstance(data.get("result"), list):
            result = data["result"]
            if not all(isinstance(s, dict) and _is_labels(s.get("metric")) for s in result):
                raise QueryError(f"{path}: HTTP {status}, a result that is not a list of series with labels")
            samples = sum(len(s.get("values", ())) or 1 for s in result) + refused[1]
            self.cost.count(samples, len(result) + refused[0], size)
        elif isinstance(data, list) and all(map(_is_labels, data)):
            self.cost.count(len(data), 0, size)
        else:
            raise QueryError(f"{path}: HTTP {status}, an answer whose data is neither series nor a result")
        return data

    def _post(self, path: str, params, started: float) -> tuple[int, str, bytes]:
        try:
            response = self.session.post(f"{self.url}{path}", data=params, headers=self._token.headers(),
                                         timeout=(self.timeout, self.timeout), allow_redirects=False, stream=True)
        except requests.Timeout:
            raise QueryError(f"{path}: no answer within {self.timeout:g}s", "timeout") from None
        except requests.exceptions.SSLError:
            raise QueryError(f"{path}: TLS handshake with {public_host(self.url)} failed (certificate or protocol)",
                             "tls") from None
        except requests.ConnectionError as exc:
            reason = connection_reason(exc)
            raise QueryError(f"{path}: {_STORE_SENTENCES[reason].format(host=public_host(self.url))}", reason) from None
        except requests.RequestException as exc:
            raise QueryError(f"{path}: {type(exc).__name__}: {_printable(str(exc), ERROR_TEXT_CHARS)}") from None
        with response:
            content, failure = read_body(response, self.max_bytes, started + self.timeout, self.timeout)
            status, content_type = response.status_code, response.headers.get("content-type", "")
        if failure is not None:
            reason, _detail = failure
            if reason == "timeout":
                raise QueryError(f"{path}: no answer within {self.timeout:g}s", "timeout")
            if reason == "too_large":
                raise QueryError(f"{path}: the answer is larger than the {self.max_bytes:,} bytes kvwatch reads of "
                                 "one answer (narrow the selector or the range)", "too_large")
            raise QueryError(f"{path}: {_STORE_SENTENCES['disconnected'].format(host=public_host(self.url))} "
                             "in the middle of its answer", "disconnected")
        return status, content_type, content

    def series(self, match: str, start: float, end: float,
               labels: tuple[str, ...] | None = None) -> list[dict[str, str]]:
        """The label sets of every series matching over the range; with
        `labels`, each cut to those labels and equal ones shared (read them,
        never change them): what a listing holds is then what its reader
        reads, not every label of every series."""
        found = self._get("/api/v1/series", {"match[]": match, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                             **STORE_PARAMETERS}, labels)
        return found

    def query_range(self, query: str, start: float, end: float, step: float) -> list[dict]:
        data = self._get("/api/v1/query_range", {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                                 "step": f"{step:g}", **STORE_PARAMETERS})
        return data["result"]

    def plan(self, start: float, end: float, step: float, series: int) -> list[tuple[float, float]]:
        """Time chunks of [start, end] on the step grid, each within
        MAX_POINTS points and max_samples samples for `series` series."""
        points = int(round((end - start) / step)) + 1
        per_chunk = max(1, min(MAX_POINTS, self.max_samples // max(1, series)))
        chunks = []
        first = 0
        while first < points:
            last = min(points - 1, first + per_chunk - 1)
            chunks.append((start + first * step, start + last * step))
            first = last + 1
        return chunks

    def read_ranges(self, queries: list[tuple[str, int]], start: float, end: float, step: float,
                    keep: Callable[[dict], bool] | None = None) -> list[list[dict]]:
        """Each (query, expected series) over [start, end] at `step`, chunked,
        at most `concurrency` at a time; per query, its series with the
        chunks' values joined in time order. With `keep(labels) -> bool`,
        only the series it keeps: the others are left out as each answer is
        decoded (matrix.decode), never held past their labels.

        Each answer is joined in as soon as it and those before it are in,
        and at most `concurrency` answers are asked ahead of the one being
        joined, so a read holds what it joined and at most `concurrency`
        answers more, however many chunks it takes (holding every answer
        until the last, a refresh of 22 chunks at central mode's 32 MiB cap
        peaked at 9.8 GiB)."""
        jobs: deque = deque()
        for index, (query, series) in enumerate(queries):
            for chunk_start, chunk_end in self.plan(start, end, step, series):
                jobs.append((index, query, chunk_start, chunk_end))
        started = time.monotonic()
        by_query: list[dict[tuple, dict]] = [dict() for _ in queries]
        pool = ThreadPoolExecutor(max_workers=self.concurrency)
        asked: deque = deque()
        try:
            while jobs or asked:
                while jobs and len(asked) < self.concurrency:
                    index, query, chunk_start, chunk_end = jobs.popleft()
                    context = contextvars.copy_context()
                    context.run(_KEEP.set, keep)
                    asked.append((index, pool.submit(context.run, self.query_range, query, chunk_start, chunk_end,
                                                     step)))
                index, future = asked.popleft()
                result = future.result()
                del future
                target = by_query[index]
                for series in result:
                    # Again here: a client whose answers do not come
                    # through _get (a stand-in) is held to `keep` too.
                    if keep is not None and not keep(series["metric"]):
                        continue
                    key = tuple(sorted(series["metric"].items()))
                    found = target.get(key)
                    if found is None:
                        target[key] = {"metric": series["metric"], "values": series["values"]}
                    else:
                        found["values"] = joined(found["values"], series["values"])
                del result
        finally:
            # The first failure ends the read: queries not yet started are
            # dropped, not each waited out to its own deadline.
            pool.shutdown(wait=True, cancel_futures=True)
        self.cost.seconds += time.monotonic() - started
        return [list(found.values()) for found in by_query]
