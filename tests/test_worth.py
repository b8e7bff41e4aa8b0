"""What the cache is worth in the engine's own prefill seconds: saved by its
hits (by tier, less what lower tiers cost to load back), lost to
recomputation (the page's upper bound, the stream's count) and bought by
more memory (the sizing curve's steps, the point of diminishing returns).
Figures worked out by hand from the real vLLM 0.32 captures and the
handwritten offload and HiCache pages."""

from __future__ import annotations

import re

import pytest
from page_support import polled, with_value
from test_kv_events import feed_all, rotation

from kvwatch.kvevents.source import KVEventSource
from kvwatch.sidecar.collector import make_registry
from kvwatch.signals import SIGNALS_BY_NAME, worth

SAVED = "kvwatch_cache_saved_prefill_seconds"
# idle -> load of the real vLLM 0.32 capture: 8 requests' prefill time 0.04006 s, less one mean inter-token
# latency each (4.5299 s / 1,840 = 0.002462 s): 0.020366 s over the 3,840 tokens computed.
LOAD_PER_TOKEN = (0.04006170100012696 - 8 * 4.529917940999553 / 1840) / 3840
LOST = "kvwatch_cache_lost_prefill_seconds"


def pages(fixtures_dir, folder, names):
    return [(fixtures_dir / folder / f"metrics-{name}.txt").read_text() for name in names]


def handwritten(fixtures_dir, names):
    return [(fixtures_dir / "handwritten" / f"{name}.txt").read_text() for name in names]


def test_saved_is_the_tokens_each_tier_served_at_the_engines_prefill_seconds_per_token(fixtures_dir):
    monitor = polled(pages(fixtures_dir, "vllm-0.32-cpu", ("idle", "load")), engine="vllm")
    [row] = monitor.state.per_engine
    # idle -> load: 3,584 tokens from the device tier, at LOAD_PER_TOKEN (5.3 us a token).
    per_token = LOAD_PER_TOKEN
    assert per_token == pytest.approx(5.3038e-06, rel=1e-4)
    assert worth.prefill_seconds_per_token(row.view) == pytest.approx(per_token)
    assert row.values[SAVED]["device"] == pytest.approx(3584 * per_token)
    assert row.values[SAVED]["host"] == 0.0
    registry = make_registry(monitor)
    identity = {"model_name": "tiny-llama", "engine": "0", "tier": "device"}
    assert registry.get_sample_value(SAVED, identity) == pytest.approx(3584 * per_token)


def test_a_lower_tier_is_charged_what_it_took_to_load_back(fixtures_dir):
    [row] = polled(handwritten(fixtures_dir, ("vllm-0.32-offload-a", "vllm-0.32-offload-b")),
                   engine="vllm").state.per_engine
    # 40,000 computed in 20 s: 0.0005 s a token. Device 30,000 tokens: 15 s. Host (the offload tier)
    # 30,000 tokens, 15 s, less its loads (3 s) and lookups (0.3 + 1.2 s): 10.5 s.
    assert row.values[SAVED]["device"] == pytest.approx(15.0)
    assert row.values[SAVED]["host"] == pytest.approx(10.5)


def test_sglang_prices_at_its_extend_passes_and_counts_what_it_recomputed(fixtures_dir):
    [row] = polled(handwritten(fixtures_dir, ("sglang-hicache-a", "sglang-hicache-b"))).state.per_engine
    # 30,000 computed (mode=input) in 15 s of extend passes: 0.0005 s a token.
    assert row.values[SAVED]["device"] == pytest.approx(15.0)
    assert row.values[SAVED]["host"] == pytest.approx(15.0 - 3.0)  # 30,000 host hits, 3 s loading them back
    assert row.values[SAVED]["storage"] == pytest.approx(5.0)  # L3 exports no time: nothing to charge
    # 3,000 retracted input tokens, a count: 1.5 s.
    assert worth.recomputed_prompt_tokens(row.view) == (3000.0, True)
    assert row.values[LOST] == pytest.approx(1.5)


def test_lost_on_vllm_is_an_upper_bound_from_preemptions_and_the_mean_prompt(fixtures_dir):
    [row] = polled(pages(fixtures_dir, "vllm-0.32-cpu", ("load", "long-load")), engine="vllm").state.per_engine
    # 12 preemptions x a 400-token mean prompt (9,600 / 24) = 4,800 tokens, an upper bound;
    # 10,000 computed in 0.6166 - 0.0401 prefill seconds of 24 requests, less one mean inter-token latency
    # each ((25.7417 - 4.5299) s / (9,940 - 1,840)).
    itl = (25.741712759999132 - 4.529917940999553) / (9940 - 1840)
    per_token = (0.6166234520007947 - 0.04006170100012696 - 24 * itl) / 10000
    assert worth.recomputed_prompt_tokens(row.view) == (pytest.approx(4800.0), False)
    assert row.values[LOST] == pytest.approx(4800 * per_token)
    assert "UPPER BOUND" in SIGNALS_BY_NAME[LOST].doc


def test_no_preemption_loses_nothing_and_no_prefill_time_prices_nothing(fixtures_dir):
    [row] = polled(pages(fixtures_dir, "vllm-0.32-cpu", ("idle", "load")), engine="vllm").state.per_engine
    assert row.values[LOST] == 0.0
    [row] = polled(pages(fixtures_dir, "vllm-0.32-cpu", ("idle", "idle")), engine="vllm").state.per_engine
    assert row.values[SAVED] is None and row.values[LOST] is None


def test_an_engine_the_window_cannot_price_says_why_instead_of_dropping_out(fixtures_dir):
    from kvwatch.settings import load_settings
    from kvwatch.sidecar.report import signals_json
    from kvwatch.sidecar.statuspage import render_status_page

    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics"}, environ={})
    cases = (("vllm-0.32-cpu", ("idle", "idle"), "vllm", "no request finished its prefill in it"),
             ("llamacpp-b11434-cpu", ("idle", "full"), "llamacpp",
              "the engine reports no prefill time and computed tokens to price a token at"))
    for folder, names, engine, why in cases:
        monitor = polled(pages(fixtures_dir, folder, names), engine=engine)
        [item] = signals_json(monitor.state, settings)["worth"]
        assert item["lines"] == [f"Not priced over 60 s: {why}."]
        assert item["saved_seconds"] is None and item["lost_seconds"] is None  # unknown, not zero
        assert f"Not priced over 60 s: {why}." in render_status_page(monitor.state, settings)


def stream_report():
    # 12 prefixes of 15 blocks of 16 tokens through a 100-block cache, 4 rounds: 540 blocks
    # stored again; 80 more blocks would have kept them all.
    source = KVEventSource("tcp://127.0.0.1:1")
    end = feed_all(source, rotation(prefixes=12, blocks=15, cache=100, rounds=4))
    return source.report(now=end, bytes_per_block=2 * 1024 * 1024)


def test_the_stream_counts_what_eviction_before_reuse_cost_and_what_more_cache_buys(fixtures_dir):
    [row] = polled(pages(fixtures_dir, "vllm-0.32-cpu", ("idle", "load")), engine="vllm").state.per_engine
    per_token = worth.prefill_seconds_per_token(row.view)
    report = stream_report()
    seconds = report["window"]["seconds"]
    out = worth.with_worth(report, row.view)
    assert out["window"]["lost_prefill_seconds"] == pytest.approx(540 * 16 * per_token)
    points = out["sizing"]["points"]
    for point in points:
        assert point["extra_gib"] == pytest.approx(point["extra_blocks"] * 2 / 1024)
        assert point["saved_prefill_seconds_per_hour"] == pytest.approx(
            point["blocks_kept"] * 16 * per_token * 3600 / seconds)
    # Past the size that keeps every return, more cache buys nothing more: the knee is the first
    # step that keeps them all (100 blocks, x1: the largest step's saving, 540 blocks kept).
    knee = out["sizing"]["diminishing_returns"]
    assert knee["extra_cache"] == 1.0
    assert knee["saved_prefill_seconds_per_hour"] == pytest.approx(540 * 16 * per_token * 3600 / seconds)
    assert report["sizing"].get("diminishing_returns") is None  # the stream's own report is left as it was


def test_a_curve_still_rising_at_its_largest_step_has_no_point_of_diminishing_returns():
    # Kept blocks growing with every step: only the largest reaches 90 % of its own saving, which is no knee
    # (the sentence had read "diminishing returns past x8 ... 90 % of what the largest step would").
    points = [{"extra_cache": x, "extra_bytes": x * (1 << 30), "blocks_kept": kept}
              for x, kept in ((1, 100), (2, 200), (4, 400), (8, 800))]
    rows, knee = worth.bought({"points": points}, 60.0, 16, 1e-5)
    assert knee is None and rows[-1]["saved_prefill_seconds_per_hour"] == pytest.approx(800 * 16 * 1e-5 * 60)
    text = worth.lines({"window_seconds": 60.0, "saved_seconds": None, "lost_seconds": None, "bought": rows,
                        "diminishing_returns": knee})
    assert "No point of diminishing returns up to x8 more cache" in " ".join(text)
    assert not any("Diminishing returns past" in line for line in text)
    # Flat past x2: the knee is x2, and the sentence says so.
    points[2]["blocks_kept"] = points[3]["blocks_kept"] = 200
    rows, knee = worth.bought({"points": points}, 60.0, 16, 1e-5)
    assert knee["extra_cache"] == 2


def test_money_keeps_its_figures_below_a_cent_and_prices_what_more_cache_buys_an_hour():
    # 1.35 s at 2.5 an hour is 0.00094: it printed as 0.00.
    assert worth._money(worth.currency(1.35, 2.5)) == " (0.000937 at the price per GPU-hour)"
    assert worth._money(worth.currency(7200.0, 2.5)) == " (5.00 at the price per GPU-hour)"
    line = worth.lines({"window_seconds": 60.0, "saved_seconds": None, "lost_seconds": None, "diminishing_returns": None,
                        "bought": [{"extra_cache": 1, "extra_gib": 0.5, "saved_prefill_seconds_per_hour": 1800.0,
                                    "saved_money_per_hour": worth.currency(1800.0, 2.0)}]})[0]
    assert line == "Bought by more cache (estimate): x1 (+0.5 GiB) 1,800 s/h (1.00/h at the price per GPU-hour)."


def test_without_a_rate_to_price_at_the_stream_says_nothing_priced():
    out = worth.with_worth(stream_report(), None)
    assert out["window"]["lost_prefill_seconds"] is None
    assert out["sizing"]["diminishing_returns"] is None
    assert all(p["saved_prefill_seconds_per_hour"] is None for p in out["sizing"]["points"])


def test_a_price_per_gpu_hour_turns_seconds_into_currency():
    assert worth.currency(7200.0, 2.5) == pytest.approx(5.0)
    assert worth.currency(7200.0, None) is None and worth.currency(None, 2.5) is None


def test_the_status_page_and_the_api_say_what_the_cache_is_worth_at_the_price(fixtures_dir):
    from kvwatch.settings import load_settings
    from kvwatch.sidecar.report import signals_json
    from kvwatch.sidecar.statuspage import render_status_page

    monitor = polled(handwritten(fixtures_dir, ("vllm-0.32-offload-a", "vllm-0.32-offload-b")), engine="vllm")
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "gpu_hour_price": "3.6"}, environ={})
    [item] = signals_json(monitor.state, settings)["worth"]
    assert item["saved_seconds"] == pytest.approx(25.5) and item["saved_money"] == pytest.approx(25.5 / 1000)
    assert item["lost_basis"] == "page_count" and item["lost_seconds"] == 0.0  # no preemption in the window
    html = render_status_page(monitor.state, settings)
    assert 'id="worth"' in html and "What the cache is worth" in html
    assert "Saved: 25.5 s of prefill over 60 s (device 15 s, host 10.5 s) (0.0255 at the price per GPU-hour)." in html
    assert "not wall time; at a price per GPU-hour, the cost of that work, not a bill" in html


def test_a_price_that_is_not_a_positive_number_is_one_sentence():
    from kvwatch.settings import SettingsError, load_settings

    with pytest.raises(SettingsError) as raised:
        load_settings(overrides={"gpu_hour_price": "cheap"}, environ={})
    assert raised.value.problems == ["--gpu-hour-price: 'cheap' is not a number (a price per GPU-hour, e.g. 2.5)"]
    with pytest.raises(SettingsError) as raised:
        load_settings(overrides={"gpu_hour_price": "-1"}, environ={})
    assert raised.value.problems == ["--gpu-hour-price: '-1' must be a positive price per GPU-hour"]


def test_kvwatch_diagnose_prints_and_serves_the_worth(fixtures_dir, capsys):
    import json

    from pageserver import Answer, PageServer

    from kvwatch.cli import main

    texts = pages(fixtures_dir, "vllm-0.32-cpu", ("idle", "load"))
    for extra in ((), ("--json",)):
        with PageServer([Answer(text) for text in texts]) as server:
            main(["diagnose", "--target", server.url, "--duration", "0.3s", "--interval", "0.1s",
                  "--gpu-hour-price", "2", *extra])
        out = capsys.readouterr().out
        if extra:
            [item] = json.loads(out)["worth"]
            assert item["saved_by_tier"]["device"] == pytest.approx(3584 * LOAD_PER_TOKEN)
            assert item["gpu_hour_price"] == 2.0
        else:
            assert "WHAT THE CACHE IS WORTH [tiny-llama/0]" in out
            assert "Saved: 0.019 s of prefill" in out and "Lost to recomputation: 0 s" in out


def test_with_the_stream_lost_is_counted_and_kvwatch_capacity_prints_what_more_cache_buys(fixtures_dir):
    import argparse
    import json

    from pageserver import Answer, PageServer
    from test_kv_events import stream_fed

    from kvwatch.commands import capacity

    texts = pages(fixtures_dir, "vllm-0.32-cpu", ("idle", "load"))
    with stream_fed(texts, rotation(prefixes=12, blocks=15, cache=100, rounds=4)) as (_, _, client):
        diagnosis = client.get("/api/v1/diagnosis").json()
        signals = client.get("/api/v1/signals").json()
    per_token = LOAD_PER_TOKEN
    stream = diagnosis["kv_events"]
    # 540 blocks of 16 tokens stored again after their eviction, at the page's prefill seconds per token.
    assert stream["window"]["lost_prefill_seconds"] == pytest.approx(540 * 16 * per_token)
    [item] = signals["worth"]
    assert item["lost_basis"] == "stream" and item["lost_seconds"] == pytest.approx(540 * 16 * per_token)
    assert any("counted from the event stream" in line for line in item["lines"])
    # The page's own figure stays beside the stream's count, named by its basis: two numbers, told apart.
    lost_line = next(line for line in item["lines"] if line.startswith("Lost to recomputation"))
    assert item["lost_page_basis"] in ("page_count", "page_upper_bound")
    [engine] = signals["engines"]
    page_lost = engine["signals"]["kvwatch_cache_lost_prefill_seconds"]
    assert page_lost is not None and item["lost_page_seconds"] == pytest.approx(page_lost)
    assert f"the page's own figure, from the page's counts (the engine's recomputed prompt tokens, or no " \
           f"preemption), says {worth._seconds(page_lost)}." in lost_line
    assert stream["sizing"]["diminishing_returns"]["extra_cache"] == 1
    with PageServer([Answer(json.dumps(diagnosis), headers={"Content-Type": "application/json"})]) as served:
        report = capacity.build_report(argparse.Namespace(kvwatch=served.base_url, json=False))
    text = capacity.render_table(report)
    assert "prefill s/h bought" in text and "Diminishing returns past x1 more cache" in text
    assert "Lost to recomputation:" in text and "counted from the event stream" in text
    # A hostile answer's knee is refused in one sentence, not printed.
    stream["sizing"]["diminishing_returns"] = {"extra_cache": 1, "extra_gib": "lots"}
    with PageServer([Answer(json.dumps(diagnosis), headers={"Content-Type": "application/json"})]) as served:
        with pytest.raises(capacity.CapacityInputError, match="diminishing_returns is not a point"):
            capacity.build_report(argparse.Namespace(kvwatch=served.base_url, json=False))


@pytest.mark.slow  # promtool and Prometheus
def test_the_twins_over_kvwatch_s_own_series_give_the_sidecar_s_figures(fixtures_dir):
    from page_support import Pages
    from prometheus_client import generate_latest
    from promstack import backfilled_prometheus, query
    from sim_support import pages_openmetrics

    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings

    base = float((int(__import__("time").time()) // 3600 - 3) * 3600)
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "engine": "vllm",
                                        "poll_interval": "1s", "window": "5m"}, environ={})
    times = iter([base, base + 60.0])
    monitor = Monitor(settings, fetcher=Pages(pages(fixtures_dir, "vllm-0.32-cpu", ("idle", "load"))),
                      clock=lambda: next(times))
    exported = []
    for at in (base, base + 60.0):
        monitor.poll_once()
        exported.append((at, generate_latest(make_registry(monitor)).decode()))
    [row] = monitor.state.per_engine
    scope = {"sel": 'model_name="tiny-llama"', "w": "2m", "by": "model_name, engine"}
    with backfilled_prometheus(pages_openmetrics(exported, "10.0.9.3:9400", job="kvwatch")) as prom:
        # Every increase over the range is the same multiple of the pages' difference, so the rate is exact.
        [rate] = query(prom.url, worth.PER_TOKEN_PROMQL.format(**scope), at=base + 60.0)
        saved = {one["metric"]["tier"]: float(one["value"][1])
                 for one in query(prom.url, worth.SAVED_PROMQL.format(**scope), at=base + 60.0)}
    assert float(rate["value"][1]) == pytest.approx(LOAD_PER_TOKEN)
    mine = row.values[SAVED]
    # The counters start at 0 on the idle page: increase() does not extrapolate below zero, so it is the difference.
    assert saved["device"] == pytest.approx(mine["device"]) and saved["host"] == 0


def _prefill_page(idle: str, requests: int, computed: int, cached: int, seconds: float, itl: tuple[int, float],
                  prompts: int | None = None) -> str:
    """The idle capture with these lifetime totals: every prefill under 0.3 s and 1,000 tokens, each request
    one inter-token latency step (itl: count, sum); with `prompts`, the requests' prompt tokens observed too."""
    def histogram(page: str, family: str, from_le: float, count: int, total: float) -> str:
        def bucket(match: re.Match) -> str:
            le = match.group(2)
            return f"{match.group(1)} {count if le == '+Inf' or float(le) >= from_le else 0}.0"
        page = re.sub(rf'^({re.escape(family)}_bucket\{{[^}}]*le="([^"]+)"[^}}]*\}}) \S+$', bucket, page, flags=re.M)
        page = with_value(page, family + "_count", f"{count}.0")
        return with_value(page, family + "_sum", repr(float(total)))

    page = histogram(idle, "vllm:request_prefill_time_seconds", 0.3, requests, seconds)
    page = histogram(page, "vllm:request_prefill_kv_computed_tokens", 1000.0, requests, computed)
    page = with_value(page, 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-llama",'
                      'source="local_compute"}', f"{computed}.0")
    page = with_value(page, 'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny-llama",'
                      'source="local_cache_hit"}', f"{cached}.0")
    page = with_value(page, 'vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="tiny-llama",'
                      'source="device"}', f"{cached}.0")
    if prompts is not None:
        page = histogram(page, "vllm:request_prompt_tokens", 1e9, requests, prompts)
    page = with_value(page, "vllm:inter_token_latency_seconds_count", f"{itl[0]}.0")
    return with_value(page, "vllm:inter_token_latency_seconds_sum", repr(itl[1]))


# The CPU tier's engine (tests/vllm_tier/test_worth_vllm.py): a request's prefill holds 5.8 ms whatever its
# prompt, and 23 us a token; one inter-token latency is 2.5 ms.
FIXED, PER_TOKEN, ITL = 0.0058, 23e-6, 0.0025


def _rotation_pages(fixtures_dir, steps):
    """Pages after each step of (requests, computed tokens a request, cached tokens a request)."""
    [idle] = pages(fixtures_dir, "vllm-0.32-cpu", ("idle",))
    out, totals = [idle], [0, 0, 0, 0.0]
    for requests, computed, cached in steps:
        totals = [totals[0] + requests, totals[1] + requests * computed, totals[2] + requests * cached,
                  totals[3] + requests * (FIXED + computed * PER_TOKEN)]
        out.append(_prefill_page(idle, totals[0], totals[1], totals[2], totals[3], (totals[0], totals[0] * ITL)))
    return out


def test_a_hit_is_priced_at_the_fitted_cost_of_a_token_not_at_the_requests_fixed_cost(fixtures_dir):
    # 4 prefixes of 512 tokens and a 32-token suffix: 4 cold requests (544 computed), then 8 and 8 warm (32
    # computed, 512 cached). The fit of the three polls' steps finds the fixed 5.8 ms and the 23 us exactly;
    # 8,192 cached tokens saved 8,192 x 23 us = 0.1884 s, what turning the cache off would add. The mean less
    # one inter-token latency a request said (0.1778 - 20 x 0.0025) / 2,688 = 47.6 us a token: 0.390 s, +107 %.
    steps = ((4, 544, 0), (8, 32, 512), (8, 32, 512))
    [row] = polled(_rotation_pages(fixtures_dir, steps), engine="vllm").state.per_engine
    fixed, per_token = worth.fitted_prefill_cost(row.view)
    assert (fixed, per_token) == (pytest.approx(FIXED), pytest.approx(PER_TOKEN))
    assert worth.prefill_seconds_per_token(row.view) == pytest.approx(PER_TOKEN)
    assert row.values[SAVED]["device"] == pytest.approx(8192 * PER_TOKEN)


def test_polls_of_one_shape_of_request_cannot_tell_the_fixed_cost_apart(fixtures_dir):
    # Every step the same mix: the fit's two columns are one; the mean less one inter-token latency a request.
    steps = ((4, 100, 400), (8, 100, 400), (2, 100, 400))
    [row] = polled(_rotation_pages(fixtures_dir, steps), engine="vllm").state.per_engine
    assert worth.fitted_prefill_cost(row.view) is None
    assert worth.prefill_seconds_per_token(row.view) == pytest.approx((FIXED - ITL + 100 * PER_TOKEN) / 100)


# An engine whose token costs more the further into the context it sits (attention over every earlier
# position): a token at position p costs PER_TOKEN + PER_POSITION x p, so a request of P prompt tokens, K of
# them cached, costs FIXED + PER_TOKEN x (P - K) + PER_POSITION x (K + ... + P - 1), and its cache spared it
# PER_TOKEN x K + PER_POSITION x (0 + ... + K - 1).
PER_POSITION = 20e-9


def _positions(start: int, end: int) -> float:
    """start + ... + end - 1."""
    return (end - start) * (start + end - 1) / 2


def _position_pages(fixtures_dir, polls, per_position=PER_POSITION):
    """Pages after each poll, a poll a list of its requests' (prompt tokens, cached tokens), the prompts seen."""
    [idle] = pages(fixtures_dir, "vllm-0.32-cpu", ("idle",))
    out, totals = [idle], [0, 0, 0, 0.0, 0]
    for requests in polls:
        for prompt, cached in requests:
            cost = FIXED + PER_TOKEN * (prompt - cached) + per_position * _positions(cached, prompt)
            totals = [totals[0] + 1, totals[1] + prompt - cached, totals[2] + cached, totals[3] + cost,
                      totals[4] + prompt]
        out.append(_prefill_page(idle, totals[0], totals[1], totals[2], totals[3], (totals[0], totals[0] * ITL),
                                 prompts=totals[4]))
    return out


# The CPU tier's saved check, one request a poll: cold prompts of 128 to 1,984 tokens, then 16 requests of a
# 1,920-token prefix cached and 64 computed.
COLD = [[(size, 0)] for size in (128, 512, 1024, 1536, 1984)]
WARM = [[(1984, 1920)]] * 16


def test_a_hit_is_priced_at_the_position_it_sat_at_where_a_token_costs_more_deeper_into_the_context(fixtures_dir):
    # Turning the cache off would add, a hit, what its 1,920 tokens cost at their positions: 1,920 x 23 us +
    # 20 ns x (0 + ... + 1,919) = 81.0 ms, 42.2 us a cached token. The linear fit's slope is a mean over the
    # cold prompts' positions and reads the warm ones' deep suffixes as fixed cost: 39.2 us, 7.1 % under.
    [row] = polled(_position_pages(fixtures_dir, COLD + WARM), engine="vllm", every=5.0).state.per_engine
    fixed, per_token, per_position = worth.fitted_position_cost(row.view)
    assert (fixed, per_token, per_position) == (pytest.approx(FIXED), pytest.approx(PER_TOKEN),
                                                pytest.approx(PER_POSITION))
    hit = 1920 * PER_TOKEN + PER_POSITION * _positions(0, 1920)
    assert worth.cached_token_seconds(row.view) == pytest.approx(hit / 1920)
    assert row.values[SAVED]["device"] == pytest.approx(16 * hit)
    linear = worth.prefill_seconds_per_token(row.view)
    assert linear * 1920 == pytest.approx(0.929 * hit, rel=1e-3)  # the linear price


def test_on_an_engine_of_one_cost_a_token_the_position_price_is_the_linear_one(fixtures_dir):
    # The same kind of polls on the fixed-pages engine of 23 us a token wherever it sits (PER_POSITION 0): the
    # third term fits to nothing and a hit is priced at 23 us, as the linear fit prices it.
    polls = [[(128, 0)], [(1024, 0)], [(1984, 0)]] + [[(1984, 1920)]] * 8 + [[(1408, 896)]] * 4
    [row] = polled(_position_pages(fixtures_dir, polls, per_position=0.0), engine="vllm", every=5.0).state.per_engine
    fixed, per_token, per_position = worth.fitted_position_cost(row.view)
    assert fixed == pytest.approx(FIXED) and per_token == pytest.approx(PER_TOKEN)
    assert per_position == pytest.approx(0.0, abs=1e-15)
    assert worth.cached_token_seconds(row.view) == pytest.approx(worth.prefill_seconds_per_token(row.view))
    assert row.values[SAVED]["device"] == pytest.approx((8 * 1920 + 4 * 896) * PER_TOKEN)


def test_prompts_of_one_shape_cannot_tell_the_position_apart_and_the_linear_price_stands(fixtures_dir):
    # Cold prompts of one size and warm ones of one shape: requests, computed tokens and their positions take
    # two shapes between them, so the third term is one of the others; the linear fit prices the hits.
    polls = [[(1024, 0)], [(1984, 1920)], [(1024, 0)], [(1984, 1920)]]
    [row] = polled(_position_pages(fixtures_dir, polls), engine="vllm", every=5.0).state.per_engine
    assert worth.fitted_position_cost(row.view) is None
    assert worth.cached_token_seconds(row.view) == worth.prefill_seconds_per_token(row.view)


def test_polls_of_several_requests_stay_out_of_the_position_fit(fixtures_dir):
    # A poll's sums say where one request's tokens sat; of mixed requests they say only their mean, and the
    # mean shape's positions are fewer than theirs (the square of a mean is at most the mean of squares). The
    # singles' fit is exact beside polls of two mixed cold prompts; with those polls fitted from their means
    # (the one-shape reading kvwatch had) the terms came out 6.2 ms, 32.8 us and 10.1 ns (5.8, 23 and 20).
    mixed = [[(128, 0), (1984, 0)], [(512, 0), (1536, 0)]] * 4
    [row] = polled(_position_pages(fixtures_dir, COLD + mixed + WARM), engine="vllm", every=5.0).state.per_engine
    assert worth.fitted_position_cost(row.view) == (pytest.approx(FIXED), pytest.approx(PER_TOKEN),
                                                    pytest.approx(PER_POSITION))
    hit = 1920 * PER_TOKEN + PER_POSITION * _positions(0, 1920)
    assert row.values[SAVED]["device"] == pytest.approx(16 * hit)
    # Mixed polls alone: nothing to fit positions from, and the hits priced linearly.
    [row] = polled(_position_pages(fixtures_dir, mixed + [[(1984, 1920), (1984, 1920)]] * 4),
                   engine="vllm", every=5.0).state.per_engine
    assert worth.position_fit(row.view) is None
    assert worth.cached_token_seconds(row.view) == worth.prefill_seconds_per_token(row.view)


def test_the_cached_tokens_mean_position_is_never_read_deeper_than_they_sat(fixtures_dir):
    # A poll of a 1,920-token hit and a 128-token one: their positions' sum 0 + ... + 1,919 and 0 + ... + 127
    # against the mean shape's 2 x (0 + ... + 1,023). The price reads the mean shape: under, never over.
    polls = COLD + WARM + [[(1984, 1920), (192, 128)]]
    [row] = polled(_position_pages(fixtures_dir, polls), engine="vllm", every=5.0).state.per_engine
    fixed, per_token, per_position = worth.fitted_position_cost(row.view)
    cached = 17 * 1920 + 128
    exact = (cached * per_token + per_position * (17 * _positions(0, 1920) + _positions(0, 128))) / cached
    read = worth.cached_token_seconds(row.view)
    assert read < exact
    assert read == pytest.approx((cached * per_token + per_position * (16 * _positions(0, 1920)
                                                                       + 2 * _positions(0, 1024))) / cached)
