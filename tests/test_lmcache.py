"""LMCache as a second source beside the engine (kvwatch/pipeline/lmcache.py).

No LMCache server runs here (it needs CUDA): the pages under
tests/fixtures/handwritten/lmcache-{a,b,c}.txt are written by hand from
LMCache's source (lmcache/observability.py, PrometheusLogger; provenance in
tests/fixtures/README.md). Expected figures are worked out by hand below.
"""

from __future__ import annotations

import json

import pytest

from kvwatch.cli import main
from kvwatch.diagnose import diagnose
from kvwatch.mixin.metrics_doc import render
from kvwatch.sidecar.collector import make_registry
from kvwatch.pipeline.lmcache import LMCacheSource
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sidecar.report import diagnosis_json, status_json
from kvwatch.settings import Settings, load_settings
from kvwatch.sidecar.statuspage import render_status_page
from kvwatch.signals import evaluate_window
from pageserver import Answer, PageServer
from test_diagnose import Run, causes, only

MODEL = "qwen3-8b"  # LMCache's served_model_name label on the handwritten pages


@pytest.fixture
def pages(fixtures_dir):
    return {name: (fixtures_dir / "handwritten" / f"lmcache-{name}.txt").read_text() for name in "abc"}


def source(window: float = 300.0) -> LMCacheSource:
    return LMCacheSource(Settings(target="http://127.0.0.1:9/metrics", lmcache_target="http://127.0.0.1:9/metrics"),
                         window)


def signals_of(report) -> dict:
    [row] = report["models"]
    assert row["model_name"] == MODEL
    return row["signals"]


def test_handwritten_pages_read_by_hand(pages):
    tier = source()
    first = tier.ingest(pages["a"], 1000.0)
    assert first["up"] and signals_of(first)["kvwatch_lmcache_hit_ratio"] is None  # one page: no increase yet
    report = tier.ingest(pages["b"], 1010.0)
    values = signals_of(report)
    # Worker 0 (role worker) from a to b, 10 s: requested 51200 - 40960 = 10240, hit 48128 - 38912 = 9216,
    # stored 117760 - 102400 = 15360.
    assert values["kvwatch_lmcache_hit_ratio"] == pytest.approx(9216 / 10240)  # 0.9
    # Worker 1 repeats worker 0's count (each TP rank loads its shard of the same tokens): the sum would
    # read 1843.2 and 3072 tokens/s.
    assert values["kvwatch_lmcache_retrieved_tokens_per_second"] == pytest.approx(921.6)
    assert values["kvwatch_lmcache_stored_tokens_per_second"] == pytest.approx(1536.0)
    # Prompt tokens 289280 - 266240 = 23040, of which LMCache delivered 9216.
    assert values["kvwatch_lmcache_prompt_tokens_served_ratio"] == pytest.approx(9216 / 23040)  # 0.4
    # Page b's retrieve_hit_rate gauge says 1.0 and its lookup_hit_rate 0.0: neither is read.
    assert 'lmcache:retrieve_hit_rate{model_name="Qwen/Qwen3-8B",worker_id="0",role="worker"' in pages["b"]
    assert "} 1.0\n" in pages["b"].split("lmcache:retrieve_hit_rate{")[2]
    assert report["families"] == {"lmcache:num_hit_tokens": True, "lmcache:num_prompt_tokens": True,
                                  "lmcache:num_requested_tokens": True, "lmcache:num_retrieve_requests": True,
                                  "lmcache:num_stored_tokens": True,
                                  # The multiprocess server's names, read beside the old ones: not on this page.
                                  "lmcache_mp_lookup_hit_l1_tokens": False, "lmcache_mp_lookup_hit_l2_tokens": False,
                                  "lmcache_mp_lookup_hit_tokens": False, "lmcache_mp_lookup_requested_tokens": False}
    assert report["models"][0]["latest"]["hit_tokens"] == 48128.0


def test_the_scheduler_series_is_never_the_one_read(pages):
    # The scheduler's series (role="scheduler", worker_id 0) reads 0: read, it would turn the ratio absent.
    tier = source()
    tier.ingest(pages["a"], 0.0)
    assert signals_of(tier.ingest(pages["b"], 10.0))["kvwatch_lmcache_hit_ratio"] == pytest.approx(0.9)
    no_role = pages["b"].replace(',role="worker"', "").replace(',role="scheduler"', "")
    older = source()  # builds before the `role` label: the lowest worker_id
    older.ingest(pages["a"].replace(',role="worker"', "").replace(',role="scheduler"', ""), 0.0)
    assert signals_of(older.ingest(no_role, 10.0))["kvwatch_lmcache_retrieved_tokens_per_second"] is not None


def test_a_build_without_num_prompt_tokens_leaves_only_that_ratio_absent(pages):
    older = {name: "\n".join(line for line in text.splitlines() if "num_prompt_tokens" not in line) + "\n"
             for name, text in pages.items()}
    tier = source()
    tier.ingest(older["a"], 0.0)
    report = tier.ingest(older["b"], 10.0)
    assert report["families"]["lmcache:num_prompt_tokens"] is False
    values = signals_of(report)
    assert values["kvwatch_lmcache_prompt_tokens_served_ratio"] is None  # unknown, not 0
    assert values["kvwatch_lmcache_hit_ratio"] == pytest.approx(0.9)


def test_no_retrievals_in_the_window_give_no_ratio(pages):
    tier = source()
    tier.ingest(pages["b"], 0.0)
    report = tier.ingest(pages["b"], 10.0)  # nothing retrieved; the page's retrieve_hit_rate gauge reads 1.0
    values = signals_of(report)
    assert values["kvwatch_lmcache_hit_ratio"] is None  # absent: not 1.0, not 0
    assert values["kvwatch_lmcache_prompt_tokens_served_ratio"] is None
    assert values["kvwatch_lmcache_retrieved_tokens_per_second"] == 0.0


def test_a_counter_reset_counts_from_zero(pages):
    tier = source()
    tier.ingest(pages["a"], 0.0)
    tier.ingest(pages["b"], 10.0)
    report = tier.ingest(pages["c"], 20.0)  # LMCache restarted: every counter fell
    row = report["models"][0]
    assert row["restarts"] == 1
    # a->b: hit 9216 of 10240; b->c: the new values, hit 1024 of 2048.
    assert row["increase"]["hit_tokens"] == 9216 + 1024
    assert row["increase"]["requested_tokens"] == 10240 + 2048
    assert row["signals"]["kvwatch_lmcache_hit_ratio"] == pytest.approx(10240 / 12288)
    assert row["signals"]["kvwatch_lmcache_stored_tokens_per_second"] == pytest.approx((15360 + 3072) / 20)


def test_a_page_without_lmcache_counters_is_a_clear_status(fixtures_dir):
    vllm_page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    report = source().ingest(vllm_page, 0.0)
    assert not report["up"] and report["reason"] == "no_lmcache_metrics"
    assert report["families"] == dict.fromkeys(report["families"], False) and report["models"] == []


def monitor_for(engine_url: str, lmcache_url: str | None) -> Monitor:
    overrides = {"target": engine_url, "poll_interval": "1s", "timeout": "0.5s"}
    if lmcache_url:
        overrides["lmcache_target"] = lmcache_url
    return Monitor(load_settings(overrides=overrides, environ={}))


def samples(monitor) -> dict:
    found = {}
    for family in make_registry(monitor).collect():
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def test_the_monitor_exports_the_tier_beside_the_engine(fixtures_dir, pages):
    engine_page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(engine_page)]) as engine, PageServer([Answer(pages["a"]), Answer(pages["b"])]) as tier:
        monitor = monitor_for(engine.url, tier.url)
        monitor.poll_once()
        monitor.poll_once()
    found = samples(monitor)
    assert found[("kvwatch_lmcache_up", ())] == 1.0
    assert found[("kvwatch_lmcache_hit_ratio", (("model_name", MODEL),))] == pytest.approx(0.9)
    assert found[("kvwatch_lmcache_hit_tokens_total", (("model_name", MODEL),))] == 48128.0
    assert found[("kvwatch_source_present", (("family", "lmcache:num_hit_tokens"),))] == 1.0
    # Every kvwatch_lmcache_* family exported is in docs/metrics.md.
    documented = render()
    assert all(f"`{name}`" in documented for name, _ in found if name.startswith("kvwatch_lmcache_"))
    # The engine's own external-cache series are the engine's alone: nothing of LMCache's is added.
    external = [v for (name, _), v in found.items() if name == "kvwatch_engine_external_prefix_cache_hits_total"]
    assert all(v != 48128.0 for v in external)
    status = status_json(monitor.state, monitor.settings)
    assert status["lmcache"]["up"] and status["lmcache"]["reason"] is None
    assert diagnosis_json(monitor.state, monitor.settings)["lmcache"]["models"][0]["model_name"] == MODEL
    html = render_status_page(monitor.state, monitor.settings)
    assert "<h2>LMCache tier</h2>" in html and "qwen3-8b: hit ratio 90.0%" in html
    tier_text = html.split("<h2>LMCache tier</h2>")[1].split("</noscript>")[0]
    assert "prompt tokens from LMCache 40.0%" in tier_text and "tokens retrieved " in tier_text, tier_text


def test_lmcache_down_is_its_own_status_and_leaves_the_engine_alone(fixtures_dir):
    engine_page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(engine_page)]) as engine:
        plain = monitor_for(engine.url, None)
        with_tier = monitor_for(engine.url, "http://127.0.0.1:9/metrics")  # nothing listens there
        for monitor in (plain, with_tier):
            monitor.poll_once()
            monitor.poll_once()
    assert with_tier.state.up
    status = status_json(with_tier.state, with_tier.settings)
    assert status["lmcache"]["up"] is False and status["lmcache"]["reason"] == "refused"
    found, baseline = samples(with_tier), samples(plain)
    assert found[("kvwatch_lmcache_up", ())] == 0.0
    assert not [key for key in found if key[0].startswith("kvwatch_lmcache_") and key[0] != "kvwatch_lmcache_up"]
    # Every engine series and signal is what a kvwatch without the tier exports.
    engine_keys = {k for k in baseline if k[0].startswith(("kvwatch_engine_", "kvwatch_prefix", "kvwatch_kv_cache"))}
    assert engine_keys and {k: found[k] for k in engine_keys} == {k: baseline[k] for k in engine_keys}
    assert "lmcache" not in status_json(plain.state, plain.settings)
    html = render_status_page(with_tier.state, with_tier.settings)
    assert "<h2>LMCache tier</h2>" in html and "down: refused" in html
    assert "LMCache tier" not in render_status_page(plain.state, plain.settings).split("<noscript>")[1]


def test_the_setting_is_a_flag_an_environment_variable_and_a_config_key(tmp_path):
    assert load_settings(environ={"KVWATCH_LMCACHE_TARGET": "http://127.0.0.1:8000"}).lmcache_target == \
        "http://127.0.0.1:8000/metrics"
    config = tmp_path / "kvwatch.yaml"
    config.write_text("lmcache_target: http://lmcache:9090/metrics\n")
    assert load_settings(str(config), environ={}).lmcache_target == "http://lmcache:9090/metrics"
    assert load_settings(overrides={"lmcache_target": ""}, environ={}).lmcache_target is None


def lmcache_page(hit: float, requested: float, model: str = "tiny-llama") -> str:
    labels = f'{{model_name="/models/{model}",worker_id="0",role="worker",served_model_name="{model}"}}'
    return (f"# TYPE lmcache:num_hit_tokens_total counter\nlmcache:num_hit_tokens_total{labels} {hit}\n"
            f"# TYPE lmcache:num_requested_tokens_total counter\nlmcache:num_requested_tokens_total{labels} {requested}\n")


def tier_report(hit_tokens: float) -> dict:
    tier = source()
    tier.ingest(lmcache_page(0, 0), 0.0)
    return tier.ingest(lmcache_page(hit_tokens, hit_tokens), 180.0)


def test_a_low_engine_ratio_while_lmcache_serves_the_prefixes_is_not_no_reuse():
    run = Run()
    run.steps(18, usage=0.4, running=3, requests=4, hit_ratio=0.03)
    assert causes(run.findings(), "low_hit_rate") == {"no_reuse"}
    per_engine, _ = evaluate_window(run.window)
    prompt = per_engine[0].view.increase.counters["prompt_tokens"]  # 17 steps x 4 requests x 500 tokens
    assert prompt == 17 * 4 * 500
    # LMCache delivered half the prompt tokens: the requests share prefixes, the engine's cache misses them.
    served = diagnose(run.window, per_engine, (), run.thresholds, None, None, tier_report(0.5 * prompt))
    assert causes(served, "low_hit_rate") == set()
    # A trickle (5 %, under hit_ratio_low) changes nothing but the evidence, which names the tier.
    trickle = diagnose(run.window, per_engine, (), run.thresholds, None, None, tier_report(0.05 * prompt))
    finding = only(trickle, "no_reuse")
    assert finding.evidence["external_tier"] == "lmcache"
    assert finding.evidence["lmcache_share_of_prompt_tokens"] == pytest.approx(0.05)
    # LMCache down: the diagnosis is the engine's alone.
    down = dict(tier_report(0.5 * prompt), up=False)
    assert causes(diagnose(run.window, per_engine, (), run.thresholds, None, None, down), "low_hit_rate") == {"no_reuse"}


def test_kvwatch_diagnose_prints_the_tier_from_the_config(fixtures_dir, pages, tmp_path, capsys):
    engine_page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(engine_page)]) as engine, PageServer([Answer(pages["a"]), Answer(pages["b"])]) as tier:
        config = tmp_path / "kvwatch.yaml"
        config.write_text(f"lmcache_target: {tier.url}\n")
        # Intervals of 1 s: LMCache gets half of one (0.5 s) per fetch, enough on a loaded machine.
        main(["diagnose", "--target", engine.url, "--duration", "2s", "--interval", "1s", "--config", str(config)])
        out = capsys.readouterr().out
        assert f"LMCACHE {MODEL}: hit ratio 90.0%" in out
        main(["diagnose", "--target", engine.url, "--duration", "2s", "--interval", "1s", "--config", str(config),
              "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["lmcache"]["up"] and report["lmcache"]["models"][0]["model_name"] == MODEL


def test_lmcache_on_the_engines_own_page_is_fetched_once(fixtures_dir, pages):
    engine_page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    # vLLM's page with LMCache's families in it (LMCache sharing vLLM's multiprocess registry).
    with PageServer([Answer(engine_page + pages["a"]), Answer(engine_page + pages["b"])]) as engine:
        monitor = monitor_for(engine.url, engine.url)
        monitor.poll_once()
        monitor.poll_once()
        assert len(engine.requests) == 2
    assert monitor.state.up and monitor.state.per_engine
    [row] = monitor.state.lmcache["models"]
    assert row["increase"]["hit_tokens"] == 9216 and row["signals"]["kvwatch_lmcache_hit_ratio"] == pytest.approx(0.9)


def test_the_engines_token_goes_only_to_the_engines_origin(fixtures_dir, pages, tmp_path):
    engine_page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with PageServer([Answer(engine_page)]) as engine, PageServer([Answer(pages["a"])]) as elsewhere:
        settings = load_settings(overrides={"target": engine.url, "lmcache_target": elsewhere.url,
                                            "bearer_token_file": str(token)}, environ={})
        Monitor(settings).poll_once()
        assert "s3cret" in engine.requests[0]["headers"].get("Authorization", "")
        assert "Authorization" not in elsewhere.requests[0]["headers"]
        # LMCache's API server on the engine's host and port (another path): the same origin, the same token.
        same_origin = engine.url.replace("/metrics", "/lmcache/metrics")
        settings = load_settings(overrides={"target": engine.url, "lmcache_target": same_origin,
                                            "bearer_token_file": str(token)}, environ={})
        Monitor(settings).poll_once()
        assert engine.requests[-1]["path"] == "/lmcache/metrics"
        assert "s3cret" in engine.requests[-1]["headers"].get("Authorization", "")


def test_the_models_read_are_bounded():
    page = "".join(lmcache_page(10, 10, f"model-{n:03d}") for n in range(30))
    tier = LMCacheSource(Settings(target="http://127.0.0.1:9/metrics", lmcache_target="http://127.0.0.1:9/metrics",
                                  max_series=4), 300.0)
    report = tier.ingest(page, 0.0)
    assert [row["model_name"] for row in report["models"]] == [f"model-{n:03d}" for n in range(4)]


# --- the multiprocess server (LMCache 0.5): lmcache_mp_* beside the old names --


@pytest.fixture
def mp_pages(fixtures_dir):
    return [(fixtures_dir / "handwritten" / f"lmcache-mp-{name}.txt").read_text() for name in "ab"]


def test_the_multiprocess_servers_lookup_counters_are_read_and_summed_over_tenants(mp_pages):
    tier = source()
    first = tier.ingest(mp_pages[0], 1000.0)
    assert first["up"], first
    [row] = first["models"]
    # Two cache_salt series (tenants) per counter: disjoint, summed.
    assert row["model_name"] == MODEL
    assert row["latest"] == {"lookup_requested_tokens": 100000.0, "lookup_hit_tokens": 70000.0,
                             "lookup_hit_l1_tokens": 50000.0, "lookup_hit_l2_tokens": 20000.0}
    assert first["families"]["lmcache_mp_lookup_hit_l2_tokens"] is True
    assert first["families"]["lmcache:num_hit_tokens"] is False
    second = tier.ingest(mp_pages[1], 1060.0)
    [row] = second["models"]
    assert row["increase"] == {"lookup_requested_tokens": 60000.0, "lookup_hit_tokens": 48000.0,
                               "lookup_hit_l1_tokens": 34000.0, "lookup_hit_l2_tokens": 14000.0}
    # The old names' signals have no inputs here: absent, not 0.
    assert row["signals"]["kvwatch_lmcache_hit_ratio"] is None


def test_the_multiprocess_counters_are_exported_and_documented(fixtures_dir, mp_pages):
    engine_page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(engine_page)]) as engine, PageServer([Answer(p) for p in mp_pages]) as tier:
        monitor = monitor_for(engine.url, tier.url)
        monitor.poll_once()
        monitor.poll_once()
    found = samples(monitor)
    model = (("model_name", MODEL),)
    assert found[("kvwatch_lmcache_up", ())] == 1.0
    assert found[("kvwatch_lmcache_lookup_hit_l1_tokens_total", model)] == 84000.0
    assert found[("kvwatch_lmcache_lookup_hit_l2_tokens_total", model)] == 34000.0
    assert found[("kvwatch_source_present", (("family", "lmcache_mp_lookup_hit_tokens"),))] == 1.0
    documented = render()
    assert all(f"`{name}`" in documented for name, _ in found if name.startswith("kvwatch_lmcache_"))
    assert "`lmcache_mp_lookup_hit_l1_tokens_total`" in documented and "not OTLP" in documented


def test_the_multiprocess_servers_l1_l2_split_is_a_token_weighted_tier_view(fixtures_dir, mp_pages):
    """Over the 60 s of lmcache-mp-{a,b}: 60,000 tokens looked up, 34,000 found in L1, 14,000 added by L2,
    12,000 in neither; the shares are those tokens over the 60,000, not an average of the tenants' ratios
    (tenant-a's and tenant-b's own shares differ)."""
    name = "kvwatch_lmcache_lookup_tokens_by_tier_ratio"
    expected = {"l1": 34000 / 60000, "l2": 14000 / 60000, "not_found": 12000 / 60000}
    tier = source()
    tier.ingest(mp_pages[0], 1000.0)
    [row] = tier.ingest(mp_pages[1], 1060.0)["models"]
    assert row["signals"][name] == pytest.approx(expected)
    assert sum(row["signals"][name].values()) == pytest.approx(1.0)
    engine_page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(engine_page)]) as engine, PageServer([Answer(p) for p in mp_pages]) as server:
        monitor = monitor_for(engine.url, server.url)
        monitor.poll_once()
        monitor.poll_once()
    found = samples(monitor)
    for key, share in expected.items():
        assert found[(name, (("model_name", MODEL), ("tier", key)))] == pytest.approx(share, rel=0.05)
    html = render_status_page(monitor.state, monitor.settings)
    assert "looked-up tokens by tier: l1 " in html and "not_found" in html
    body = json.loads(json.dumps(diagnosis_json(monitor.state, monitor.settings)))
    assert body["lmcache"]["models"][0]["signals"][name]["l2"] == pytest.approx(expected["l2"], rel=0.05)
    assert f"`{name}` | gauge | model_name, tier |" in render()


def test_the_old_names_give_no_tier_view(pages):
    tier = source()
    tier.ingest(pages["a"], 1000.0)
    [row] = tier.ingest(pages["b"], 1010.0)["models"]
    assert row["signals"]["kvwatch_lmcache_lookup_tokens_by_tier_ratio"] is None
