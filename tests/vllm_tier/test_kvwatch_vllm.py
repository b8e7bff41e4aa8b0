"""kvwatch against the real vLLM of the tier: what it exports and diagnoses, and
the alert the generated rules raise in a real Prometheus, under real load.

kvwatch runs as `kvwatch serve` does (background poll loop, HTTP app under
uvicorn) and every claim is read from its HTTP surface, never from its
internals; the reference values come straight from vLLM's own /metrics pages,
parsed by prometheus_client, not by kvwatch. Loads are bounded by their
duration and each wait by a deadline; the figures measured are printed with a
[vllm-tier] prefix.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests

from kvwatch.diagnose.thresholds import DEFAULT_THRESHOLDS
from promstack import prometheus, query, query_range, wait_until

from .harness import LoadStats, burst_load, shared_prefix_load, wait_until_idle
from .kvwatch_support import (
    PageRecorder,
    generate_rules,
    read_kvwatch_diagnosis,
    read_kvwatch_metrics,
    running_kvwatch,
    tier_reporter,
)

pytestmark = pytest.mark.vllm

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
ENGINE = {"model_name": "tiny-llama", "engine": "0"}
POLL_INTERVAL = "1s"  # a page vLLM answers late under the burst is kept (fetch deadline 15 s)

# The shared-prefix load outlasts kvwatch's window, so later comparisons use a
# window that starts inside the load and has moved with it.
PREFIX_WINDOW = "10s"
# 20 s: behind the page recorder's extra hop up to half of kvwatch's polls
# time out under this load (5 of 10 in one clean-clone run), and the test
# wants at least 4 good ones.
PREFIX_LOAD_SECONDS = 20.0
PREFIX_TOKENS, SUFFIX_TOKENS = 512, 64

# The documented burst (harness.burst_load: 24 distinct requests of 400 prompt
# + 400 generated tokens in flight, no shared prefix) runs ~3-6 s past its
# duration while its last requests drain; the findings clear one window after
# the last full or preempting poll. 15 s of load leave the alert (5 s `for:`)
# room to fire under load even when a busy machine delays the first full
# polls by a few seconds.
BURST_WINDOW_SECONDS = 20.0
BURST_SECONDS = 15.0
CLEAR_SLACK_SECONDS = 15.0
# A finding whose condition cleared is held (marked clearing, kvwatch_finding
# still 1) for finding_hold_seconds, as its alert keeps firing for as long.
FINDING_HOLD_SECONDS = DEFAULT_THRESHOLDS.finding_hold_seconds
# What kvwatch's exhaustion finding says about the hit ratio while the cache is
# exhausted and the prompts share nothing (kvwatch.diagnose).
NO_REUSE_NOTE = ("With the cache exhausted, a low hit rate from a workload without shared prefixes is not a "
                 "separate problem.")

EXHAUSTED_ALERT = "VllmKvCacheExhausted"
HIT_RATE_ALERT = "VllmPrefixCacheHitRateLow"
# A test copy of the generated rules: Prometheus selects kvwatch by the job
# promstack gives it, judges the same span as kvwatch's window, and holds the
# alerts 5 s instead of minutes.
MIXIN_TEST_CONFIG = {
    "selector": 'job="kvwatch"',
    "rate_window": f"{BURST_WINDOW_SECONDS:.0f}s",
    "for_durations": {EXHAUSTED_ALERT: "5s", HIT_RATE_ALERT: "5s"},
}


@pytest.fixture(scope="module")
def report(request):
    return tier_reporter(request.config)


# --------------------------------------------------------------- prefix hit ratio


@dataclass
class WindowComparison:
    kvwatch_ratio: float
    raw_ratio: float
    window_seconds: float
    first_queries: float  # vllm:prefix_cache_queries_total on the window's first page
    hits_delta: float
    queries_delta: float
    last_poll: float  # when the poll behind this ratio began (one comparison per poll)


@dataclass
class Unplaced:
    why: str


def compare_with_raw_pages(kvwatch_url: str, recorder: PageRecorder) -> WindowComparison | Unplaced | None:
    """kvwatch's exported hit ratio next to the ratio of the counter deltas
    between the two vLLM pages its window spans (None while kvwatch has no ratio).

    One read of kvwatch's /metrics shows one poll's state: the ratio, the time
    that poll began and the span of its window, so the window's first and last
    pages are the ones kvwatch requested at last - span and at last.
    """
    exported = read_kvwatch_metrics(kvwatch_url)
    if exported.value("kvwatch_up") != 1 or "kvwatch_prefix_cache_hit_ratio" not in exported:
        return None
    ratio = exported.value("kvwatch_prefix_cache_hit_ratio", **ENGINE)
    last_poll = exported.value("kvwatch_last_success_timestamp_seconds")
    span = exported.value("kvwatch_window_seconds")
    try:
        first = recorder.page_of_poll(last_poll - span).metrics()
        last = recorder.page_of_poll(last_poll).metrics()
    except AssertionError as unplaced:
        # In the full tier (after the KV-event modules' own servers, on a
        # loaded machine) a poll's stamp once lay more than 0.8 s from every
        # recorded page in three tries running; alone, and after those modules
        # alone, it never did, and the cause is not found. Such a read is not
        # compared (and counted): every read that is placed must agree exactly,
        # and at least four must be (the assertions below).
        return Unplaced(str(unplaced))
    # The right pages: kvwatch re-exports the last one's counters unchanged.
    assert exported.value("kvwatch_engine_prefix_cache_hits_total", **ENGINE) == last.value(HITS)
    assert exported.value("kvwatch_engine_prefix_cache_queries_total", **ENGINE) == last.value(QUERIES)
    hits = last.value(HITS) - first.value(HITS)
    queries = last.value(QUERIES) - first.value(QUERIES)
    return WindowComparison(ratio, hits / queries, span, first.value(QUERIES), hits, queries, last_poll)


def test_prefix_hit_ratio_equals_vllm_counter_deltas_over_the_polled_pages(real_vllm, report):
    before = wait_until_idle(real_vllm.metrics_url)
    with PageRecorder(real_vllm.base_url) as recorder, \
            running_kvwatch(recorder.url, poll_interval=POLL_INTERVAL, window=PREFIX_WINDOW) as kvwatch:
        wait_until(lambda: kvwatch.monitor.state.up, 10, "kvwatch's first poll")
        comparisons: list[WindowComparison] = []
        with shared_prefix_load(real_vllm.base_url, duration=PREFIX_LOAD_SECONDS,
                                prefix_tokens=PREFIX_TOKENS, suffix_tokens=SUFFIX_TOKENS) as run:
            # Read often and keep one comparison per poll: on a busy machine
            # many of kvwatch's polls time out against vLLM's slow /metrics,
            # and a sparse reader then saw only two or three good ones.
            polls_before, reads, unanswered = kvwatch.monitor.state.polls, 0, 0
            unplaced: list[str] = []
            while run.running:
                time.sleep(0.5)
                found = compare_with_raw_pages(kvwatch.url, recorder)
                reads += 1
                unanswered += found is None
                if isinstance(found, Unplaced):
                    unplaced.append(found.why)
                    continue
                if found is not None and (not comparisons or found.last_poll != comparisons[-1].last_poll):
                    comparisons.append(found)
            stats = run.wait()
            polls = kvwatch.monitor.state.polls - polls_before
            errors = dict(kvwatch.monitor.state.errors_by_reason)

    assert stats.failed == 0, stats.errors
    assert stats.completed > 16
    report(f"shared prefix: {stats.completed} requests in {stats.seconds:.1f} s; kvwatch's hit ratio "
           f"equal to vLLM's counter deltas in {len(comparisons)} windows: "
           + ", ".join(f"{c.kvwatch_ratio:.4f} ({c.hits_delta:.0f}/{c.queries_delta:.0f} over "
                       f"{c.window_seconds:.1f} s)" for c in comparisons)
           + f"; {reads} reads ({unanswered} without a ratio, {len(unplaced)} not placed: {unplaced[:2]}), "
           f"{polls} polls, poll errors {errors}")
    assert len(comparisons) >= 4
    for comparison in comparisons:
        assert comparison.kvwatch_ratio == pytest.approx(comparison.raw_ratio, rel=1e-12, abs=0)
        # Every request in the window queried its 576 tokens and hit the
        # 512-token prefix, except the load's first one, which ran alone to
        # cache it: it is in the window when the window began before the load.
        # (A floor on the ratio instead failed on a slow machine, where the
        # first windows held the first request and only a few others.)
        requests_in_window, rest = divmod(comparison.queries_delta, PREFIX_TOKENS + SUFFIX_TOKENS)
        assert rest == 0 and requests_in_window >= 1, comparison
        missed = 1 if comparison.first_queries == before.value(QUERIES) else 0
        assert comparison.hits_delta == (requests_in_window - missed) * PREFIX_TOKENS, comparison
    # Some windows began before the load, and some began inside it after the
    # window had moved on: the earliest page is picked right either way.
    assert any(c.first_queries == before.value(QUERIES) for c in comparisons)
    assert any(c.first_queries > before.value(QUERIES) for c in comparisons)


# --------------------------------------------------------------- burst


@dataclass
class Sample:
    at: float  # seconds since the burst started
    loaded: bool  # the load was still running
    findings: set[tuple[str, str, str]]  # (symptom, cause, severity) exported by kvwatch
    preemptions_per_second: float | None
    hit_ratio: float | None
    alerts: set[tuple[str, str, str]] | None  # (alertname, cause, alertstate); None if unanswered
    scraped: float | None = None  # Prometheus' `up` of its latest scrape of kvwatch
    exhaustion_evidence: dict = field(default_factory=dict)  # of the exhaustion finding, from /api/v1/diagnosis

    def has(self, symptom: str, cause: str | None = None) -> bool:
        return any(s == symptom and (cause is None or c == cause) for s, c, _ in self.findings)

    def alert(self, name: str, state: str = "firing") -> bool:
        return any(a == name and s == state for a, _, s in self.alerts or ())


@dataclass
class BurstObservation:
    before: Sample
    samples: list[Sample]  # while the load ran, then until kvwatch's findings cleared
    stats: LoadStats
    load_seconds: float
    cleared: Sample | None  # the first sample after the load without any finding
    alert_labels: list[dict] = field(default_factory=list)  # labels of the firing exhaustion alert
    prometheus_notes: str = ""  # rule health and log tail, for a failure message

    @property
    def during(self) -> list[Sample]:
        return [s for s in self.samples if s.loaded]

    @property
    def after(self) -> list[Sample]:
        return [s for s in self.samples if not s.loaded]

    def first(self, check) -> Sample | None:
        return next((s for s in self.samples if check(s)), None)


def _sample(kvwatch_url: str, prometheus_url: str, started: float, loaded: bool,
            alert_labels: list[dict]) -> Sample:
    exported = read_kvwatch_metrics(kvwatch_url)
    findings = {(labels["symptom"], labels["cause"], labels["severity"])
                for labels, value in exported.samples.get("kvwatch_finding", ()) if value == 1}

    def signal(name: str) -> float | None:
        try:
            return exported.value(name, **ENGINE)
        except KeyError:
            return None

    try:
        firing = query(prometheus_url, f'ALERTS{{alertname=~"{EXHAUSTED_ALERT}|{HIT_RATE_ALERT}"}}')
        alerts = {(a["metric"]["alertname"], a["metric"].get("cause", ""), a["metric"]["alertstate"])
                  for a in firing}
        alert_labels.extend(a["metric"] for a in firing if a["metric"]["alertname"] == EXHAUSTED_ALERT
                            and a["metric"]["alertstate"] == "firing")
        scraped = float(query(prometheus_url, 'up{job="kvwatch"}')[0]["value"][1])
    except Exception:  # a query that timed out under load is a gap, not a failure
        alerts, scraped = None, None
    evidence = {}
    if any(symptom == "exhaustion" for symptom, _, _ in findings):
        diagnosis = read_kvwatch_diagnosis(kvwatch_url)
        # The API keeps numbers under `evidence` and words (the note) under `notes`.
        evidence = next(({**f["evidence"], **f.get("notes", {})} for f in diagnosis["findings"]
                         if f["symptom"] == "exhaustion"
                         and f["cause"] != "capacity_below_max_num_seqs"), {})
    return Sample(time.monotonic() - started, loaded, findings, signal("kvwatch_preemptions_per_second"),
                  signal("kvwatch_prefix_cache_hit_ratio"), alerts, scraped, evidence)


@pytest.fixture(scope="module")
def burst(real_vllm, tmp_path_factory, report) -> BurstObservation:
    observation = observe_burst(real_vllm.base_url, tmp_path_factory.mktemp("mixin"))
    _report_burst(observation, report)
    return observation


def observe_burst(base_url: str, rules_dir: Path) -> BurstObservation:
    """One burst beyond the cache, watched by kvwatch and by a real Prometheus
    with the generated rules scraping that kvwatch, from before the load until
    kvwatch's findings cleared."""
    rules = generate_rules(rules_dir, MIXIN_TEST_CONFIG)
    metrics_url = base_url + "/metrics"
    wait_until_idle(metrics_url)
    with running_kvwatch(metrics_url, poll_interval=POLL_INTERVAL,
                         window=f"{BURST_WINDOW_SECONDS:g}s") as kvwatch, \
            prometheus([f"127.0.0.1:{kvwatch.port}"], rule_files=[rules], interval="1s") as prom:
        wait_until(lambda: query(prom.url, 'kvwatch_engine_kv_cache_usage_ratio{job="kvwatch"}'), 30,
                   "Prometheus to scrape kvwatch")
        loaded_rules = [rule["name"] for group in
                        wait_until(lambda: _rule_groups(prom.url), 10, "the generated rules to load")
                        for rule in group["rules"]]
        assert EXHAUSTED_ALERT in loaded_rules, loaded_rules
        alert_labels: list[dict] = []
        before = _sample(kvwatch.url, prom.url, time.monotonic(), False, alert_labels)

        samples: list[Sample] = []
        started, started_unix = time.monotonic(), time.time()
        with burst_load(base_url, duration=BURST_SECONDS) as run:
            while run.running:
                samples.append(_sample(kvwatch.url, prom.url, started, True, alert_labels))
                time.sleep(0.5)
            stats = run.wait()
        load_seconds = time.monotonic() - started

        cleared = None
        deadline = time.monotonic() + BURST_WINDOW_SECONDS + FINDING_HOLD_SECONDS + CLEAR_SLACK_SECONDS
        while time.monotonic() < deadline:
            sample = _sample(kvwatch.url, prom.url, started, False, alert_labels)
            samples.append(sample)
            if not sample.findings:
                cleared = sample
                break
            time.sleep(0.5)
        notes = "\n".join(f"rule {r['name']}/{r.get('labels', {}).get('cause')}: {r.get('health')} "
                          f"{r.get('lastError', '')}" for g in _rule_groups(prom.url) for r in g["rules"]
                          if r.get("type") == "alerting")
        notes += "\n" + _prometheus_view(prom.url, started_unix)
        notes += "\nPrometheus log:\n" + prom.log()[-1500:]
    return BurstObservation(before, samples, stats, load_seconds, cleared, alert_labels, notes)


# The parts of the exhaustion alert as Prometheus saw them through its scrapes
# of kvwatch (a failure message shows where they and kvwatch's finding part).
ALERT_PARTS = {
    "usage peak": "max_over_time(kvwatch_engine_kv_cache_usage_ratio{{job=\"kvwatch\"}}[{w}])",
    "waiting mean": "avg_over_time(kvwatch_engine_requests_waiting{{job=\"kvwatch\"}}[{w}])",
    "preemptions/s": "rate(kvwatch_engine_preemptions_total{{job=\"kvwatch\"}}[{w}])",
    "scrapes": "count_over_time(kvwatch_engine_kv_cache_usage_ratio{{job=\"kvwatch\"}}[{w}])",
}


def _prometheus_view(prometheus_url: str, started_unix: float) -> str:
    """The alert's parts every 2 s since the burst started, one line per instant."""
    columns: dict[str, dict[float, str]] = {}
    for name, template in ALERT_PARTS.items():
        expr = template.format(w=f"{BURST_WINDOW_SECONDS:.0f}s")
        try:
            series = query_range(prometheus_url, expr, started_unix, time.time(), step=2)
        except Exception as error:  # a note for a failure message must not fail the test
            return f"Prometheus's view unavailable: {error!r}"
        columns[name] = {float(t): v for t, v in series[0]["values"]} if series else {}
    instants = sorted({t for column in columns.values() for t in column})
    lines = [f"{t - started_unix:5.1f} s: " + ", ".join(f"{name} {columns[name].get(t, '-')}" for name in columns)
             for t in instants]
    return "Prometheus's view of the alert's parts:\n" + ("\n".join(lines) or "no data")


def _rule_groups(prometheus_url: str) -> list[dict]:
    return requests.get(f"{prometheus_url}/api/v1/rules", timeout=5).json()["data"]["groups"]


def _report_burst(o: BurstObservation, report) -> None:
    def at(sample: Sample | None) -> str:
        return f"{sample.at:.1f} s" if sample else "never"

    rates = [s.preemptions_per_second for s in o.during if s.preemptions_per_second]
    ratios = [s.hit_ratio for s in o.during if s.hit_ratio is not None]
    noted = [s for s in o.during if s.exhaustion_evidence.get("hit_ratio_note") == NO_REUSE_NOTE]
    report(f"burst: {o.stats.completed} requests, load ran {o.load_seconds:.1f} s; exhaustion finding from "
           f"{at(o.first(lambda s: s.has('exhaustion', 'concurrency_beyond_capacity')))}, preemption rate > 0 "
           f"from {at(o.first(lambda s: (s.preemptions_per_second or 0) > 0))} (peak "
           f"{max(rates, default=0):.2f}/s), hit ratio {min(ratios, default=0):.3f}-{max(ratios, default=0):.3f}; "
           f"the exhaustion finding's note on the hit ratio in {len(noted)} of the "
           f"{sum(1 for s in o.during if s.exhaustion_evidence)} samples under load with the finding "
           f"({len(o.during)} in all); "
           f"kvwatch's usage peak in the window {_peaks(o)}; "
           f"alert {EXHAUSTED_ALERT} pending at {at(o.first(lambda s: s.alert(EXHAUSTED_ALERT, 'pending')))}, "
           f"firing at {at(o.first(lambda s: s.alert(EXHAUSTED_ALERT)))}; findings cleared at {at(o.cleared)}"
           + (f" ({o.cleared.at - o.load_seconds:.1f} s after the load)" if o.cleared else "") + "; "
           f"causes seen: {sorted({f[:2] for s in o.samples for f in s.findings})}")


def _peaks(o: BurstObservation) -> str:
    peaks = [s.exhaustion_evidence["kv_usage_max"] for s in o.samples if "kv_usage_max" in s.exhaustion_evidence]
    return f"{min(peaks):.3f}-{max(peaks):.3f}" if peaks else "unknown"


def test_burst_reports_exhaustion_and_preemptions_and_no_low_hit_rate(burst):
    assert burst.stats.failed == 0, burst.stats.errors
    assert not burst.before.has("exhaustion")
    exhausted = [s for s in burst.during if s.has("exhaustion", "concurrency_beyond_capacity")]
    assert exhausted, [s.findings for s in burst.during]
    # Preemptions in the window make the finding critical.
    assert any(s.preemptions_per_second and s.preemptions_per_second > 0
               and ("exhaustion", "concurrency_beyond_capacity", "critical") in s.findings for s in exhausted)
    # No prompt shares a prefix, so nothing hits; the cache is full and
    # preempting. That is exhaustion, not a hit-rate problem: no low-hit-rate
    # finding under the load nor after it ...
    ratios = [s.hit_ratio for s in burst.during if s.hit_ratio is not None]
    assert ratios and max(ratios) == 0, ratios
    assert not [s for s in burst.samples if s.has("low_hit_rate")], [s.findings for s in burst.samples]
    # ... and the exhaustion finding carries the ratio and says why.
    noted = [s for s in burst.during if s.exhaustion_evidence.get("hit_ratio_note") == NO_REUSE_NOTE]
    assert noted, [s.exhaustion_evidence for s in burst.during]
    assert all(s.exhaustion_evidence["prefix_cache_hit_ratio"] == 0 for s in noted)


def test_findings_clear_once_the_window_has_moved_past_the_burst(burst):
    # Right after the load the window still holds it ...
    assert burst.after[0].has("exhaustion", "concurrency_beyond_capacity"), burst.after[0].findings
    # ... and once it has moved past and the finding hold has run out, kvwatch
    # reports nothing.
    assert burst.cleared is not None, (
        f"kvwatch still reported {burst.samples[-1].findings} "
        f"{BURST_WINDOW_SECONDS + FINDING_HOLD_SECONDS + CLEAR_SLACK_SECONDS:.0f} s after the load")
    assert burst.cleared.preemptions_per_second == 0


def test_prometheus_fires_the_exhaustion_alert_during_the_burst(burst):
    # Fired while the burst was in its rate window: under the load or after
    # it, until kvwatch's findings cleared. Prometheus sees the burst through
    # its scrapes of kvwatch, which a saturated 2-core machine delays by
    # seconds, so `for:` can run out just after the load stops (pending at
    # 16 s, firing at 21.1 s of a 21.0 s load, in one run).
    until = burst.cleared.at if burst.cleared else math.inf
    firing = [s for s in burst.samples if s.alert(EXHAUSTED_ALERT) and s.at <= until]
    assert firing, "\n".join([f"{s.at:.1f} s: up {s.scraped}, alerts {s.alerts}, findings {s.findings}"
                               for s in burst.samples] + [burst.prometheus_notes])
    assert burst.before.alerts == set()
    labels = burst.alert_labels[0]
    assert labels["symptom"] == "exhaustion"
    assert labels["cause"] == "concurrency_beyond_capacity"
    assert (labels["model_name"], labels["engine"]) == ("tiny-llama", "0")
    # The same burst is not a hit-rate alert either, pending or firing.
    assert not [s for s in burst.samples if any(a == HIT_RATE_ALERT for a, _, _ in s.alerts or ())]
