"""The second sources beside the engine (the upstream histogram, LMCache)
against hostile pages: bounded in what they keep, one sentence
for what they refuse, on the monitor's clock."""

from __future__ import annotations

import math

import pytest

from kvwatch.scrape import FetchResult
from kvwatch.pipeline.lmcache import LMCacheSource
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import Settings, load_settings
import kvwatch.pipeline.upstream as upstream
from kvwatch.pipeline.upstream import UpstreamSource


def upstream_page(bounds: list[str], counts: list[float], total: float) -> str:
    lines = ["# TYPE app_retrieval_seconds histogram"]
    lines += [f'app_retrieval_seconds_bucket{{le="{b}"}} {c}' for b, c in zip(bounds, counts)]
    lines += [f"app_retrieval_seconds_sum {total}", f"app_retrieval_seconds_count {counts[-1]}"]
    return "\n".join(lines) + "\n"


def test_an_upstream_histogram_of_absurdly_many_buckets_is_refused():
    """5,000 bucket bounds (a 7.6 MiB page of 160,000 took 1.3 GB, each
    poll's histogram kept twice in the window): not read past MAX_BUCKETS,
    reported down with one sentence; a page of 20 bounds reads as before."""
    source = UpstreamSource(Settings(upstream_target="http://127.0.0.1:9/metrics",
                                     upstream_histogram="app_retrieval_seconds", poll_interval=1.0), 60)
    bounds = [f"{n / 1000:g}" for n in range(1, 5000)] + ["+Inf"]
    report = source.ingest(upstream_page(bounds, [float(n) for n in range(5000)], 10.0), now=100.0)
    assert not report["up"] and report["reason"] == "too_many_buckets"
    assert report["detail"] == (f"app_retrieval_seconds: the histogram has more than {upstream.MAX_BUCKETS} bucket bounds, "
                                "more than kvwatch reads")
    assert not source._entries
    fine = [f"{n / 10:g}" for n in range(1, 20)] + ["+Inf"]
    assert source.ingest(upstream_page(fine, [0.0] * 20, 0.0), now=101.0)["up"]


def test_the_upstream_window_runs_on_the_monitors_clock(fixtures_dir):
    """Polls 30 s apart on the monitor's clock, the wall clock elsewhere (an
    NTP step back, here a clock the test holds): a slow step leaves the
    upstream's 60 s window with the monitor's (it read the wall clock: six
    minutes after a 1 h step back, a mean of 0.915 s against a true 0.01 s)."""
    engine_page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-idle.txt").read_text()
    settings = load_settings(overrides={
        "target": "http://127.0.0.1:9/metrics", "window": "60s", "poll_interval": "30s",
        "upstream_target": "http://127.0.0.1:9/upstream", "upstream_histogram": "app_retrieval_seconds"},
        environ={})
    now = [1_700_000_000.0]

    class Engine:
        def fetch(self):
            return FetchResult(engine_page, size=len(engine_page))

    monitor = Monitor(settings, fetcher=Engine(), clock=lambda: now[0])
    bounds = ["0.1", "1", "+Inf"]
    # No requests, then 10 slow ones (1 s each), then 10 fast ones (10 ms) a poll.
    steps = [([0, 0, 0], 0.0), ([0, 10, 10], 10.0)]
    for n in range(1, 6):
        steps.append(([10 * n, 10 + 10 * n, 10 + 10 * n], 10.0 + 0.1 * n))
    pages = iter(upstream_page(bounds, counts, total) for counts, total in steps)
    monitor.upstream.fetcher.fetch = lambda: FetchResult(next(pages), size=1)
    for _ in steps:
        state = monitor.poll_once()
        now[0] += 30
    report = state.upstream
    assert report["up"] and report["mean_seconds"] == pytest.approx(0.01)
    assert 0 < report["window_seconds"] <= 90


def lmcache_page(worker: str, value: str) -> str:
    labels = f'{{model_name="m",worker_id="{worker}",role="worker",served_model_name="m"}}'
    return (f"lmcache:num_hit_tokens_total{labels} {value}\n"
            f"lmcache:num_requested_tokens_total{labels} {value}\n")


@pytest.mark.parametrize("worker", ["²", "٣", "9" * 5000, "-1", ""])
def test_a_hostile_lmcache_worker_id_is_ranked_not_a_traceback(worker):
    """`worker_id="²"` (isdigit() but not int()) took the tier down with a
    traceback every poll; so would 5,000 digits (past int()'s limit)."""
    tier = LMCacheSource(Settings(target="http://127.0.0.1:9/metrics", lmcache_target="http://127.0.0.1:9/metrics"),
                         300.0)
    page = lmcache_page(worker, "10") + lmcache_page("1", "20")
    tier.ingest(page, 0.0)
    report = tier.ingest(page.replace(" 10\n", " 15\n").replace(" 20\n", " 30\n"), 60.0)
    # Worker 1 (a number) ranks before a worker_id that is not one.
    [row] = report["models"]
    assert report["up"] and row["latest"]["hit_tokens"] == 30


@pytest.mark.parametrize("value", ["-1e308", "-1", "+Inf", "NaN", "1e309"])
def test_an_lmcache_counter_that_is_no_count_is_not_read(value):
    """A -1e308 counter was kept and exported; a counter is finite and never
    below 0, and the other counter of the model still reads."""
    tier = LMCacheSource(Settings(target="http://127.0.0.1:9/metrics", lmcache_target="http://127.0.0.1:9/metrics"),
                         300.0)
    labels = '{model_name="m",worker_id="0",role="worker",served_model_name="m"}'
    page = f"lmcache:num_hit_tokens_total{labels} {value}\nlmcache:num_requested_tokens_total{labels} 100\n"
    report = tier.ingest(page, 0.0)
    [row] = report["models"]
    assert "hit_tokens" not in row["latest"]
    assert row["latest"]["requested_tokens"] == 100
    assert all(math.isfinite(v) and v >= 0 for v in row["latest"].values())


def test_a_second_sources_page_is_read_up_to_its_own_cap():
    """An upstream page of 3 MiB (under the engine's 8 MiB): too large for a
    second source (SECOND_SOURCE_MAX_BYTES, 2 MiB), reported down, read no
    further; at the engine's cap each, beside the engine's page, kvwatch
    peaked at 541 MiB against its 384Mi limit."""
    from pageserver import Answer, PageServer

    bounds = ["0.1", "1", "+Inf"]
    page = upstream_page(bounds, [1.0, 2.0, 3.0], 1.0)
    padding = "".join(f"# padding {n:08d} {'x' * 80}\n" for n in range(3 * 1024 * 1024 // 100))
    with PageServer([Answer(padding + page)]) as server:
        settings = Settings(upstream_target=server.url, upstream_histogram="app_retrieval_seconds",
                            poll_interval=5.0)
        report = UpstreamSource(settings, 60).poll()
    assert not report["up"] and report["reason"] == "too_large"


def test_the_lmcache_tier_keeps_at_most_its_own_model_count():
    """500 served names on LMCache's page (a new name per request): the tier
    keeps MAX_MODELS (100) of them, the first in name order, even with the
    default max_series of 1,000 (it kept 1,000 a poll in its window)."""
    import kvwatch.pipeline.lmcache as lmcache

    labels = '{{model_name="m",worker_id="0",role="worker",served_model_name="name-{n:04d}"}}'
    page = "".join(f"lmcache:num_hit_tokens_total{labels.format(n=n)} 1\n"
                   f"lmcache:num_requested_tokens_total{labels.format(n=n)} 2\n" for n in range(500))
    tier = LMCacheSource(Settings(target="http://127.0.0.1:9/metrics", lmcache_target="http://127.0.0.1:9/metrics"),
                         300.0)
    report = tier.ingest(page, 0.0)
    assert [row["model_name"] for row in report["models"]] == [f"name-{n:04d}" for n in range(lmcache.MAX_MODELS)]


def test_a_kv_event_batch_of_an_unknown_layout_is_decoded_by_hand_only_up_to_its_cap():
    """A 4 MiB message (under the stream's 4 MiB message cap) of an event
    type no release sends, holding 4 M empty arrays: the typed decoders
    refuse it, and the generic decode built a list per byte (257 MB traced).
    It is now one sentence and a malformed count, decoding at most
    GENERIC_MAX_BYTES generically; a small batch of a newer event type still
    reads."""
    import tracemalloc

    import msgspec

    from kvwatch.kvevents import wire
    from kvwatch.kvevents.source import KVEventSource

    count = 4 * 1024 * 1024 - 64
    bomb = (b"\x92" + msgspec.msgpack.encode(1.0) + b"\x91\x92" + msgspec.msgpack.encode("BlockPinnedSoon")
            + b"\xdd" + count.to_bytes(4, "big") + b"\x90" * count)
    source = KVEventSource("tcp://127.0.0.1:1")
    tracemalloc.start()
    try:
        source.feed(0, bomb, now=1.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(bomb), peak
    assert source.malformed == 1
    assert source.last_malformed == (f"a batch of {len(bomb):,} bytes that is not in vLLM's known layouts "
                                        f"(kvwatch reads such batches only up to {wire.GENERIC_MAX_BYTES:,} bytes)")
    small = msgspec.msgpack.encode([2.0, [["BlockStored", [7], None, [], 16, None, "GPU"], ["BlockPinnedSoon", [7]]]])
    source.feed(1, small, now=2.0)
    assert source.ledger.totals.stored == 1 and source.skipped_events == 1
