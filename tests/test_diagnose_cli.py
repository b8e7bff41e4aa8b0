"""`kvwatch diagnose` against a loopback page server playing the real
captures, and the upstream source it can add."""

from __future__ import annotations

import json
import socket

import pytest

from kvwatch.cli import main
from kvwatch.settings import Settings
from kvwatch.pipeline.upstream import UpstreamSource, histogram_base_name
from pageserver import Answer, PageServer


def page(fixtures_dir, name: str) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def diagnose_cli(url: str, *extra: str) -> int:
    # Four polls (slots 0, 0.1, 0.2 and 0.3 s) however loaded the machine:
    # the run counts its polls by their slots, not by the wall clock, and its
    # window keeps every one however late they come (test_a_late_run_...).
    return main(["diagnose", "--target", url, "--duration", "0.3s", "--interval", "0.1s", *extra])


def test_exit_1_and_table_when_exhausted(fixtures_dir, capsys):
    answers = [Answer(page(fixtures_dir, name)) for name in ("idle", "prefix-load", "load")]
    with PageServer(answers) as server:
        assert diagnose_cli(server.url) == 1
    out = capsys.readouterr().out
    assert "SIGNALS" in out and "tiny-llama / 0" in out
    # Signals by their catalogue labels, with units where the value does not carry them.
    assert "KV cache usage  " in out and "KV cache capacity (tokens)" in out and "99.2%" in out
    assert "kv_cache_usage_ratio" not in out
    assert "exhaustion / concurrency_beyond_capacity" in out
    assert "evidence: " in out and "waiting_at_peak=18" in out
    assert "next: " in out


def test_a_pinned_quantile_prints_as_a_bound(fixtures_dir, capsys):
    """Every first token of the load capture moved into the first bucket
    (le=0.001): the table says "< 1 ms", as the page and /api/v1/signals do."""
    import re

    load = page(fixtures_dir, "load")
    count = re.search(r"^vllm:time_to_first_token_seconds_count\{[^}]*\} (\S+)$", load, re.M).group(1)
    load = re.sub(r'^(vllm:time_to_first_token_seconds_bucket\{engine="0",le="0.001",model_name="tiny-llama"\}) \S+$',
                  lambda m: f"{m.group(1)} {count}", load, flags=re.M)
    with PageServer([Answer(page(fixtures_dir, "idle")), Answer(load)]) as server:
        diagnose_cli(server.url)
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.strip().startswith("Time to first token  "))
    assert "p50 < 1 ms, p95 < 1 ms, p99 < 1 ms" in line


def test_exit_0_when_idle(fixtures_dir, capsys):
    with PageServer([Answer(page(fixtures_dir, "idle"))]) as server:
        assert diagnose_cli(server.url) == 0
    assert "FINDINGS (0 active)" in capsys.readouterr().out


def test_json_for_scripts(fixtures_dir, capsys):
    answers = [Answer(page(fixtures_dir, name)) for name in ("idle", "load")]
    with PageServer(answers) as server:
        assert diagnose_cli(server.url, "--json") == 1
    body = json.loads(capsys.readouterr().out)
    assert body["exit_code"] == 1 and body["polls"] >= 2
    assert body["engines"][0]["model_name"] == "tiny-llama"
    assert body["engines"][0]["signals"]["kvwatch_requests_waiting"] == 18
    assert {(f["symptom"], f["cause"]) for f in body["findings"]} >= {("exhaustion", "concurrency_beyond_capacity")}


def test_a_late_run_keeps_every_poll_in_its_window(fixtures_dir, monkeypatch, capsys):
    """A run of 0.3 s polls four times, 0.1 s apart, in a window planned at
    0.4 s; a loaded machine or a slow engine that makes each poll 0.25 s late
    stretches them over 0.75 s. The run's window widens to keep them all, so
    the idle first page still counts; the sidecar's window (its last
    `window` seconds) keeps what fits."""
    from kvwatch.pipeline import monitor as monitor_module
    from kvwatch.scrape import RenderedPage
    from kvwatch.settings import load_settings

    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "poll_interval": "0.1s",
                                        "window": "0.4s"}, environ={})
    covered = {}
    for whole_run, kept in ((True, 4), (False, 3)):
        now = [1000.0]
        pages = [page(fixtures_dir, name) for name in ("idle", "load", "load", "load")]

        def late(pages=pages, now=now) -> str:
            now[0] += 0.25
            return pages.pop(0)

        monitor = monitor_module.Monitor(settings, fetcher=RenderedPage(late), clock=lambda now=now: now[0],
                                         whole_run=whole_run)
        states = [monitor.poll_once() for _ in range(4)]
        assert [len(state.entries) for state in states] == [1, 2, 3, kept]
        covered[whole_run] = (states[-1].window_seconds, monitor.judgment.window.seconds)
    # The now span widens with the window (to now_seconds at most): the run's findings are judged on all of it.
    assert covered == {True: (pytest.approx(0.75), pytest.approx(0.75)), False: (pytest.approx(0.5), 0.4)}
    # `kvwatch diagnose` runs so.
    runs = []

    class Recorded(monitor_module.Monitor):
        def __init__(self, *args, **kwargs):
            runs.append(kwargs.get("whole_run"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(monitor_module, "Monitor", Recorded)
    with PageServer([Answer(page(fixtures_dir, "idle"))]) as server:
        assert diagnose_cli(server.url) == 0
    assert runs == [True]


def test_info_findings_alone_exit_0(fixtures_dir, tmp_path, capsys):
    # The idle page with max_num_seqs configured: nothing happened, nothing to act on.
    config = tmp_path / "kvwatch.yaml"
    config.write_text("diagnosis:\n  max_num_seqs: 8\n")
    with PageServer([Answer(page(fixtures_dir, "idle"))]) as server:
        assert diagnose_cli(server.url, "--config", str(config)) == 0


def test_unreachable_target_exits_2(capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # Nothing listens on the port now: every poll is refused.
    assert diagnose_cli(f"http://127.0.0.1:{port}/metrics") == 2
    assert "refused" in capsys.readouterr().err


def test_page_without_engine_metrics_exits_2(capsys):
    with PageServer([Answer("# nothing here\nup 1\n")]) as server:
        assert diagnose_cli(server.url, "--json") == 2
    assert json.loads(capsys.readouterr().out)["reason"] == "no_engine_metrics"


def test_bad_config_exits_2_listing_every_problem(tmp_path, capsys):
    config = tmp_path / "kvwatch.yaml"
    config.write_text("diagnosis:\n  hit_ratio_low: 7\n  nonsense: 1\n")
    assert main(["diagnose", "--target", "http://127.0.0.1:1/metrics", "--duration", "nope",
                 "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "--duration" in err
    assert main(["diagnose", "--target", "http://127.0.0.1:1/metrics", "--duration", "1s", "--interval", "0.5s",
                 "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "hit_ratio_low" in err and "nonsense" in err


def test_a_window_asked_of_a_live_run_is_refused_not_ignored(capsys):
    # A live run's window is its duration: --window 3s was taken silently and the run said "window 6s".
    assert main(["diagnose", "--target", "http://127.0.0.1:1/metrics", "--duration", "1s", "--interval", "0.5s",
                 "--window", "3s"]) == 2
    err = capsys.readouterr().err
    assert "--window (3s) applies to --replay and --prometheus: a live run's window is its --duration" in err
    assert "Traceback" not in err


def test_credentials_never_printed(fixtures_dir, capsys):
    with PageServer([Answer(page(fixtures_dir, "idle"))]) as server:
        url = server.url.replace("http://", "http://admin:hunter2@")
        diagnose_cli(url)
        diagnose_cli(url, "--json")
    captured = capsys.readouterr()
    assert "hunter2" not in captured.out + captured.err


# --------------------------------------------------------------------------
# upstream
# --------------------------------------------------------------------------

def retrieval_page(counts: list[float], total: float, labels: str = 'route="/chat"') -> str:
    bounds = ("0.1", "0.5", "1.0", "2.5", "+Inf")
    lines = ["# TYPE app_retrieval_seconds histogram"]
    for bound, count in zip(bounds, counts):
        lines.append(f'app_retrieval_seconds_bucket{{{labels},le="{bound}"}} {count}')
    lines.append(f"app_retrieval_seconds_sum{{{labels}}} {total}")
    lines.append(f"app_retrieval_seconds_count{{{labels}}} {counts[-1]}")
    return "\n".join(lines) + "\n"


def upstream_settings(url: str = "http://127.0.0.1:9/metrics") -> Settings:
    return Settings(upstream_target=url, upstream_histogram="app_retrieval_seconds_bucket", poll_interval=1.0)


def test_upstream_window_mean_and_p95():
    source = UpstreamSource(upstream_settings(), window_seconds=60)
    assert source.name == "app_retrieval_seconds"
    first = source.ingest(retrieval_page([0, 0, 0, 0, 0], 0.0), now=100.0)
    assert first["up"] and first["count"] == 0
    report = source.ingest(retrieval_page([0, 0, 10, 20, 20], 30.0), now=110.0)
    assert report["count"] == 20 and report["mean_seconds"] == pytest.approx(1.5)
    assert 1.0 < report["p95_seconds"] <= 2.5
    # 70 s later the first step has left the 60 s window.
    source.ingest(retrieval_page([0, 0, 10, 20, 20], 30.0), now=170.0)
    report = source.ingest(retrieval_page([0, 10, 20, 30, 30], 33.0), now=180.0)
    assert report["count"] == 10 and report["mean_seconds"] == pytest.approx(0.3)


def test_upstream_reset_counts_from_zero():
    source = UpstreamSource(upstream_settings(), window_seconds=60)
    source.ingest(retrieval_page([0, 0, 10, 20, 20], 30.0), now=100.0)
    report = source.ingest(retrieval_page([0, 4, 4, 4, 4], 1.0), now=110.0)
    assert report["count"] == 4 and report["mean_seconds"] == pytest.approx(0.25)


def test_upstream_sums_label_sets_and_reports_missing_histogram():
    source = UpstreamSource(upstream_settings(), window_seconds=60)
    both = retrieval_page([0, 0, 0, 0, 0], 0.0) + retrieval_page([0, 0, 0, 0, 0], 0.0, 'route="/rag"').split("\n", 1)[1]
    source.ingest(both, now=100.0)
    both = retrieval_page([0, 0, 2, 2, 2], 2.0) + retrieval_page([0, 0, 0, 2, 2], 4.0, 'route="/rag"').split("\n", 1)[1]
    assert source.ingest(both, now=110.0)["count"] == 4
    missing = source.ingest("other_metric 1\n", now=120.0)
    assert not missing["up"] and missing["reason"] == "histogram_missing"
    assert histogram_base_name("x_seconds_count") == "x_seconds"


def test_upstream_poll_over_http_without_the_engine_token(tmp_path):
    token = tmp_path / "token"
    token.write_text("engine-secret")
    with PageServer([Answer(retrieval_page([0, 0, 1, 1, 1], 0.6))]) as server:
        settings = upstream_settings(server.url.replace("http://", "http://u:p@"))
        settings.bearer_token_file = str(token)
        report = UpstreamSource(settings, window_seconds=60).poll()
        assert report["up"] and report["histogram"] == "app_retrieval_seconds"
        assert "u:p" not in report["target"]
        # URL credentials are the upstream's own (basic auth); the engine's bearer token never goes there.
        assert server.requests and all("engine-secret" not in str(r["headers"]) for r in server.requests)
    down = UpstreamSource(upstream_settings("http://127.0.0.1:9/metrics"), window_seconds=60).poll()
    assert not down["up"] and down["reason"]


def test_a_refused_target_is_one_human_sentence_printed_once(capsys, caplog):
    # It printed `_WatchedHTTPPool(host=...) Max retries exceeded...` twice.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert diagnose_cli(f"http://127.0.0.1:{port}/metrics") == 2
    err = capsys.readouterr().err + caplog.text
    assert err.count(f"connection refused by 127.0.0.1:{port}") == 1, err
    for raw in ("Max retries", "HTTPPool", "Error(", "NewConnectionError", "Errno"):
        assert raw not in err, err


def test_an_unreachable_prometheus_is_one_human_sentence(capsys):
    # It printed requests' `ConnectionError: HTTPConnectionPool(...) Max retries exceeded...`.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["diagnose", "--prometheus", f"http://127.0.0.1:{port}", "--since", "1h"]) == 2
    err = capsys.readouterr().err
    assert f"connection refused by 127.0.0.1:{port}: nothing listens there" in err, err
    for raw in ("Max retries", "ConnectionPool", "Error(", "NewConnectionError", "Errno"):
        assert raw not in err, err


def test_without_a_target_diagnose_says_where_it_comes_from(capsys, monkeypatch):
    monkeypatch.delenv("KVWATCH_TARGET", raising=False)
    main(["diagnose", "--duration", "0.1s", "--interval", "0.1s"])
    err = capsys.readouterr().err
    assert "polling http://127.0.0.1:8000/metrics (the default" in err and "KVWATCH_TARGET" in err


def test_readyz_and_the_json_api_carry_the_sentence_not_the_exception():
    from fastapi.testclient import TestClient

    from kvwatch.sidecar.app import create_app
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    settings = load_settings(overrides={"target": f"http://127.0.0.1:{port}/metrics", "poll_interval": "1s"},
                             environ={})
    monitor = Monitor(settings)
    client = TestClient(create_app(monitor, settings))
    assert monitor.poll_once().reason == "refused"
    sentence = f"connection refused by 127.0.0.1:{port}"
    for text in (client.get("/readyz").text, client.get("/api/v1/diagnosis").text, client.get("/api/v1/signals").text):
        assert sentence in text
        assert "Max retries" not in text and "HTTPPool" not in text


def test_counts_in_summaries_are_whole_numbers(fixtures_dir, capsys):
    """`diagnose --replay` of the concurrency capture said "with 9.0 waiting
    for 3.0 running": counts print as integers; only a mean that is not near
    a whole number keeps a decimal, and says it is an average."""
    import re

    from kvwatch.diagnose.exhaustion import count_text

    capture = fixtures_dir / "vllm-0.32-cpu-scenarios" / "concurrency" / "capture.tar.gz"
    assert main(["diagnose", "--replay", str(capture), "--json"]) == 1
    summaries = [episode["worst"]["summary"] for episode in json.loads(capsys.readouterr().out)["findings"]]
    text = " ".join(summaries)
    assert "with 9 waiting for 3 running." in text, text
    assert not re.search(r"\b\d+\.0 (requests|waiting|running|preemptions)\b", text), text
    assert [count_text(v) for v in (9.0, 3.02, 0, 2.44, 12.96)] == ["9", "3", "0", "2.4", "13"]


def test_a_signal_an_older_vllm_counts_differently_is_marked_under_the_table(fixtures_dir, capsys):
    """Two pages of the real vLLM 0.10.2 burst (tests/fixtures/vllm-0.10.2-cpu):
    its lookups count re-lookups and its preemptions come late; the table is
    followed by the sentence for each."""
    from kvwatch.capture.bundle import Capture
    from kvwatch.engines.vllm import LATE_PREEMPTIONS, RELOOKUPS

    pages = [text for _, text in Capture(fixtures_dir / "vllm-0.10.2-cpu" / "load.tar.gz").pages() if text]
    with PageServer([Answer(pages[10]), Answer(pages[60])]) as server:
        diagnose_cli(server.url)
    out = " ".join(capsys.readouterr().out.split())  # the sentences are wrapped
    table_end = out.index("FINDINGS")
    hit = out.index("* Prefix cache hit ratio [tiny-llama / 0]: the window's lookups")
    assert hit < table_end and RELOOKUPS in out[hit:table_end]
    assert f"* Preemptions [tiny-llama / 0]: {LATE_PREEMPTIONS}" in out[:table_end]


def test_upstream_recent_part_is_what_is_true_now():
    """The now span (diagnose/now.py) reads the upstream histogram's last
    seconds only: 3 s retrievals that ended 40 s ago are the window's
    evidence, not what is true now."""
    source = UpstreamSource(upstream_settings(), window_seconds=300)
    source.ingest(retrieval_page([0, 0, 0, 0, 0], 0.0), now=100.0)
    source.ingest(retrieval_page([0, 0, 0, 0, 20], 60.0), now=110.0)  # 20 slow, 3 s each
    report = source.ingest(retrieval_page([20, 20, 20, 20, 40], 61.0), now=150.0)  # 20 fast since
    assert report["count"] == 40
    recent = source.recent(report, 30.0)
    assert recent["count"] == 20 and recent["mean_seconds"] == pytest.approx(0.05)
    assert source.recent({**report, "up": False}, 30.0)["up"] is False  # a failed poll is reported as it was
