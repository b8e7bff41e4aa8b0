"""kvwatch's own endpoints over a monitor polling a loopback replay of real
captures, and the failure modes of the core issue: each leaves kvwatch
serving with kvwatch_up 0 and the reason counted; the next good poll recovers."""

import html
import re

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.sidecar.app import create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import load_settings
from kvwatch.sidecar import statuspage
from kvwatch.present import format_value
from pageserver import Answer, PageServer


def metric_values(text):
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(text, name, **labels):
    return metric_values(text).get((name, tuple(sorted(labels.items()))))


@pytest.fixture
def capture(fixtures_dir):
    return lambda name: (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def make(server, **overrides):
    # 1 s: a loopback page of 54 KB once took over 0.5 s on a machine under a
    # load of 15; the timeout case below answers after 1.5 s.
    settings = load_settings(overrides={"target": server.url, "poll_interval": "1s", "timeout": "1s", **overrides}, environ={})
    monitor = Monitor(settings)
    return monitor, TestClient(create_app(monitor, settings))


def test_replayed_captures_are_exported_with_signals(capture):
    with PageServer([Answer(capture("load")), Answer(capture("long-load"))]) as server:
        monitor, client = make(server)
        assert client.get("/readyz").status_code == 503  # no poll yet
        monitor.poll_once()
        monitor.poll_once()
        body = client.get("/metrics").text
        assert value(body, "kvwatch_up") == 1.0
        engine = {"model_name": "tiny-llama", "engine": "0"}
        assert value(body, "kvwatch_engine_kv_cache_usage_ratio", **engine) == pytest.approx(0.9685039370078741)
        assert value(body, "kvwatch_engine_preemptions_total", **engine) == 12
        assert value(body, "kvwatch_engine_kv_cache_capacity_tokens", **engine) == 4096
        assert value(body, "kvwatch_engine_time_to_first_token_seconds_bucket", le="2.5", **engine) == 32
        assert value(body, "kvwatch_kv_cache_usage_max_ratio", **engine) == pytest.approx(0.9921259842519685)
        assert value(body, "kvwatch_prefix_cache_hit_ratio", **engine) == 0.0
        assert value(body, "kvwatch_model_requests_waiting", model_name="tiny-llama") == 2
        assert value(body, "kvwatch_requests_waiting_by_reason", reason="capacity", **engine) == 2
        assert client.get("/readyz").status_code == 200
        assert client.get("/healthz").status_code == 200
        signals = client.get("/api/v1/signals").json()
        assert signals["up"] is True
        assert signals["engines"][0]["signals"]["kvwatch_preemptions_per_second"] > 0
        assert signals["models"][0]["model_name"] == "tiny-llama"
        assert "kvwatch" in client.get("/").text
        assert client.get("/api/v1/diagnosis").json()["up"] is True


def test_a_pinned_quantile_is_a_bound_in_the_api_the_metrics_and_the_page(capture):
    """The load capture with every first token in the first bucket (le=0.001
    holds them all): the quantiles are upper bounds, and each surface says so
    from the structured `pinned`, never from prose."""
    count = re.search(r'^vllm:time_to_first_token_seconds_count\{[^}]*\} (\S+)$', capture("load"), re.M).group(1)
    load = re.sub(r'^(vllm:time_to_first_token_seconds_bucket\{engine="0",le="0.001",model_name="tiny-llama"\}) \S+$',
                  lambda m: f"{m.group(1)} {count}", capture("load"), flags=re.M)
    with PageServer([Answer(capture("idle")), Answer(load)]) as server:
        monitor, client = make(server)
        monitor.poll_once()
        monitor.poll_once()
        row = client.get("/api/v1/signals").json()["engines"][0]
        quantiles = row["signals"]["kvwatch_time_to_first_token_seconds"]
        pinned = row["pinned"].get("kvwatch_time_to_first_token_seconds", {})
        assert pinned == {"0.5": "<", "0.95": "<", "0.99": "<"}
        assert quantiles == {"0.5": 0.001, "0.95": 0.001, "0.99": 0.001}
        body = client.get("/metrics").text
        for quantile, bound in pinned.items():
            label = {"<": "upper", ">": "lower"}[bound]
            assert value(body, "kvwatch_quantile_pinned", signal="kvwatch_time_to_first_token_seconds",
                         quantile=quantile, bound=label, model_name="tiny-llama", engine="0") == 1.0
            assert value(body, "kvwatch_quantile_pinned", signal="kvwatch_model_time_to_first_token_seconds",
                         quantile=quantile, bound=label, model_name="tiny-llama", engine="") == 1.0
        page = client.get("/").text
        shown = format_value(quantiles, "seconds", pinned)
        assert shown == "p50 < 1 ms, p95 < 1 ms, p99 < 1 ms" and html.escape(shown) in page  # the <noscript> table
        assert "is at most" not in statuspage.SCRIPT and "is at least" not in statuspage.SCRIPT


@pytest.mark.parametrize(
    "bad, reason",
    [
        (Answer("this is not a metrics page\x00\x01 {{{\n"), "no_engine_metrics"),
        (Answer(""), "no_engine_metrics"),
        (Answer('vllm:num_requests_running{engine="0",model_name="tiny-ll'), "truncated"),
        (Answer("oops\n", status=500), "http_5xx"),
        (Answer("late\n", delay=1.5), "timeout"),
    ],
    ids=["garbage", "empty", "truncated", "500", "timeout"],
)
def test_bad_poll_leaves_kvwatch_serving_and_the_next_good_poll_recovers(capture, bad, reason):
    with PageServer([Answer(capture("idle")), bad, Answer(capture("prefix-load"))]) as server:
        monitor, client = make(server)
        monitor.poll_once()
        state = monitor.poll_once()
        assert state.up is False and state.reason == reason
        body = client.get("/metrics").text
        assert value(body, "kvwatch_up") == 0.0
        assert value(body, "kvwatch_poll_errors_total", reason=reason) == 1
        # Engine series are absent while down: values from the past would look current.
        assert value(body, "kvwatch_engine_kv_cache_usage_ratio", model_name="tiny-llama", engine="0") is None
        assert client.get("/readyz").status_code == 503
        state = monitor.poll_once()
        assert state.up is True
        body = client.get("/metrics").text
        assert value(body, "kvwatch_up") == 1.0
        # The good poll after the bad one is not lost: the window spans idle -> prefix-load.
        assert value(body, "kvwatch_prefix_cache_hit_ratio", model_name="tiny-llama", engine="0") == pytest.approx(2048 / 2640)


def test_refused_connection_is_reported_and_recovers(capture):
    with PageServer([Answer(capture("idle"))]) as server:
        url = server.url
    # the server is gone: the port refuses
    settings = load_settings(overrides={"target": url, "poll_interval": "1s"}, environ={})
    monitor = Monitor(settings)
    client = TestClient(create_app(monitor, settings))
    assert monitor.poll_once().reason == "refused"
    assert value(client.get("/metrics").text, "kvwatch_poll_errors_total", reason="refused") == 1
    assert "refused" in client.get("/readyz").text


def test_background_loop_polls_without_scrapes(capture):
    import time

    with PageServer([Answer(capture("idle"))]) as server:
        monitor, client = make(server, poll_interval="0.5s", timeout="0.4s")
        monitor.start()
        try:
            deadline = time.time() + 20
            while monitor.state.polls < 3 and time.time() < deadline:
                time.sleep(0.05)
        finally:
            monitor.stop()
        # Polls happen with nobody scraping; on a loaded machine one may time
        # out, but the loop goes on and good polls land.
        assert monitor.state.polls >= 3 and monitor.state.last_success_time is not None


def test_content_type_is_a_hint_not_a_gate(capture):
    # A good page behind a plain file server (application/octet-stream) counts;
    # an HTML error page is reported as a content-type problem.
    html = Answer("<html><body>502 Bad Gateway</body></html>\n", headers={"Content-Type": "text/html"})
    octet = Answer(capture("idle"), headers={"Content-Type": "application/octet-stream"})
    with PageServer([octet, html, Answer(capture("idle"))]) as server:
        monitor, _ = make(server)
        assert monitor.poll_once().up is True
        state = monitor.poll_once()
        assert state.up is False and state.reason == "content_type" and "text/html" in state.detail
        assert monitor.poll_once().up is True


def test_metrics_are_rendered_once_per_poll_and_follow_the_next_poll(capture):
    with PageServer([Answer(capture("idle")), Answer(capture("load"))]) as server:
        monitor, client = make(server)
        monitor.poll_once()
        first = client.get("/metrics").text
        assert client.get("/metrics").text == first  # same poll, same bytes
        monitor.poll_once()
        after = client.get("/metrics").text
        engine = {"model_name": "tiny-llama", "engine": "0"}
        assert value(first, "kvwatch_engine_requests_waiting", **engine) == 0
        assert value(after, "kvwatch_engine_requests_waiting", **engine) == 18


def test_a_scraped_exposition_has_the_next_one_rendered_ahead_by_the_poll_loop(capture, monkeypatch):
    import threading
    import time

    from kvwatch.sidecar.collector import Renderer

    renders = []  # the name of the thread of every render
    original = Renderer.render

    def recorded(self):
        renders.append(threading.current_thread().name)
        return original(self)

    monkeypatch.setattr(Renderer, "render", recorded)

    def wait_for_polls(monitor, count):
        deadline = time.time() + 20
        while monitor.state.polls < count and time.time() < deadline:
            time.sleep(0.02)
        assert monitor.state.polls >= count

    with PageServer([Answer(capture("idle")), Answer(capture("load"))]) as server:
        monitor, client = make(server, poll_interval="0.3s", timeout="0.25s")
        monitor.start()
        try:
            # Nobody scrapes: the loop renders nothing.
            wait_for_polls(monitor, 3)
            assert renders == []
            # One scrape renders on the scraper's side; the polls after it are
            # rendered ahead by the loop, as long as each is scraped in turn.
            client.get("/metrics", headers={"Accept-Encoding": "gzip"})
            assert renders and renders[0] != "kvwatch-poll"
            polls = monitor.state.polls
            wait_for_polls(monitor, polls + 1)
            # The loop renders ahead after the poll counts it: wait for that
            # render (a loaded machine may take longer than a fixed pause).
            deadline = time.time() + 20
            while "kvwatch-poll" not in renders and time.time() < deadline:
                time.sleep(0.02)
            assert "kvwatch-poll" in renders
            body = client.get("/metrics").text
            assert "kvwatch_up 1.0" in body
            # Scraping stops: after at most one more render ahead, none.
            wait_for_polls(monitor, monitor.state.polls + 2)
            settled = len(renders)
            wait_for_polls(monitor, monitor.state.polls + 3)
            assert len(renders) == settled
        finally:
            monitor.stop()


# --- the hot paths (kvwatch.sidecar.app.HotPaths answers GET /metrics, /healthz, /readyz before FastAPI) ---


def without_process_lines(text):
    # kvwatch's own process CPU and memory move between two renders; the rest is the State's.
    return [line for line in text.splitlines() if "process_" not in line]


def test_metrics_body_is_a_fresh_render_of_each_poll_with_its_content_type(capture):
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from kvwatch.sidecar.collector import make_registry
    from kvwatch.sidecar.renders import RefusedRenders

    with PageServer([Answer(capture("idle")), Answer(capture("load"))]) as server:
        monitor, client = make(server)
        del client.headers["accept-encoding"]  # httpx asks for gzip unless told not to
        for _ in range(2):
            monitor.poll_once()
            response = client.get("/metrics")
            assert response.status_code == 200
            assert response.headers["content-type"] == CONTENT_TYPE_LATEST
            assert response.headers["content-length"] == str(len(response.content))
            assert "content-encoding" not in response.headers
            registry = make_registry(monitor)
            registry.register(RefusedRenders())  # the app's count of renders past the bound: 0 here
            fresh = generate_latest(registry).decode()
            assert without_process_lines(response.text) == without_process_lines(fresh)
            assert any(line.startswith("process_cpu_seconds_total") for line in response.text.splitlines())


@pytest.mark.parametrize("accept, gzipped", [
    ("gzip", True), ("gzip, deflate, br", True), ("br;q=1.0, gzip;q=0.8", True), ("*", True),
    ("gzip;q=0", False), ("*;q=1, gzip;q=0", False), ("identity", False), ("deflate", False), (None, False),
])
def test_metrics_are_gzipped_once_per_poll_for_scrapers_that_accept_it(capture, accept, gzipped):
    import gzip

    with PageServer([Answer(capture("idle")), Answer(capture("load"))]) as server:
        monitor, client = make(server)
        del client.headers["accept-encoding"]  # httpx asks for gzip unless told not to
        for _ in range(2):
            monitor.poll_once()
            plain = client.get("/metrics", headers={"Accept-Encoding": "identity"})
            assert "content-encoding" not in plain.headers
            headers = {"Accept-Encoding": accept} if accept else {}
            # iter_raw: the bytes as sent (httpx would otherwise decompress them).
            with client.stream("GET", "/metrics", headers=headers) as response:
                raw = b"".join(response.iter_raw())
                assert response.status_code == 200
                assert response.headers["vary"] == "Accept-Encoding"
                assert response.headers["content-length"] == str(len(raw))
                if gzipped:
                    assert response.headers["content-encoding"] == "gzip"
                    assert len(raw) < len(plain.content) / 4
                    assert gzip.decompress(raw) == plain.content  # the same exposition, same poll
                else:
                    assert "content-encoding" not in response.headers
                    assert raw == plain.content


def test_hot_paths_keep_fastapis_answers_for_everything_else(capture):
    with PageServer([Answer(capture("idle"))]) as server:
        monitor, client = make(server)
        monitor.poll_once()
        for path in ("/metrics", "/healthz", "/readyz"):
            for method in ("HEAD", "POST", "PUT", "DELETE", "OPTIONS"):
                if method == "HEAD" and path != "/metrics":
                    continue  # the probes answer HEAD (test_probes_answer_head)
                response = client.request(method, path)
                assert response.status_code == 405, (method, path)
                allowed = {"GET"} if path == "/metrics" else {"GET", "HEAD"}
                assert set(response.headers["allow"].split(", ")) == allowed
        missing = client.get("/nope")
        assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
        assert client.get("/metrics?x=1").status_code == 200
        health = client.get("/healthz")
        assert (health.status_code, health.text, health.headers["content-type"]) == (200, "ok\n", "text/plain; charset=utf-8")
        monitor.poll_once()  # recent again: the requests above can outlast readiness' 3 s on a loaded machine
        ready = client.get("/readyz")
        assert (ready.status_code, ready.text, ready.headers["content-type"]) == (200, "ready\n", "text/plain; charset=utf-8")


def test_hot_paths_need_the_token_but_the_probes_do_not(capture, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with PageServer([Answer(capture("idle")), Answer(capture("idle")), Answer("oops\n", status=500)]) as server:
        monitor, client = make(server, auth_token_file=str(token_file))
        monitor.poll_once()
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-token"},
                        {"Authorization": "Bearer s3cret-token", "Accept-Encoding": "x"} | {"Authorization": "Basic s3cret-token"}):
            for path in ("/metrics", "/", "/api/v1/signals", "/nope"):
                for method in ("GET", "HEAD", "POST"):
                    response = client.request(method, path, headers=headers)
                    assert response.status_code == 401, (method, path, headers)
                    assert response.headers["www-authenticate"] == "Bearer"
                    assert "kvwatch_up" not in response.text
        # gzip or not, the token comes first
        assert client.get("/metrics", headers={"Accept-Encoding": "gzip"}).status_code == 401
        good = {"Authorization": "Bearer s3cret-token"}
        response = client.get("/metrics", headers=good)
        assert response.status_code == 200 and value(response.text, "kvwatch_up") == 1.0
        assert client.get("/healthz").status_code == 200
        monitor.poll_once()  # recent again: the 48 requests above can outlast readiness' 3 s on a loaded machine
        assert client.get("/readyz").text == "ready\n"
        monitor.poll_once()  # the 500: not ready, and still open
        ready = client.get("/readyz")
        assert ready.status_code == 503 and ready.text.startswith("not ready: last poll failed: http_5xx")
        assert client.request("HEAD", "/healthz").status_code == 200  # open without the token, HEAD too
        assert client.request("POST", "/healthz").status_code == 405  # other methods reach FastAPI untouched


def test_up_log_line_counts_engines_in_words(fixtures_dir, caplog):
    """The log said "up (1 engines)"."""
    import logging

    text = (fixtures_dir / "vllm-0.32-cpu" / "metrics-load.txt").read_text()
    with PageServer([Answer(text)]) as server:
        monitor = Monitor(load_settings(overrides={"target": server.url}, environ={}))
        with caplog.at_level(logging.INFO, logger="kvwatch"):
            monitor.poll_once()
    lines = [r.getMessage() for r in caplog.records if ": up (" in r.getMessage()]
    assert len(lines) == 1 and lines[0].endswith(": up (1 engine)"), lines


def test_runbooks_are_served_with_every_section_the_alerts_link():
    # Every alert's runbook_url names a section of alerts/runbooks.md; kvwatch serves
    # the same text (an ingress in front of it can be the alerts' runbook_base_url).
    import yaml

    from kvwatch.mixin.config import PUBLISHED_RUNBOOKS_URL
    from mixin_support import RULES

    with PageServer([Answer("")]) as server:
        _, client = make(server)
        page = client.get("/runbooks")
        markdown = client.get("/runbooks.md")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert markdown.status_code == 200 and markdown.text.startswith("<!-- Generated by `kvwatch generate`")
    anchors = set(re.findall(r'<a id="([\w-]+)"></a>', page.text))
    links = {rule["annotations"]["runbook_url"] for group in yaml.safe_load(RULES.read_text())["groups"]
             for rule in group["rules"] if "alert" in rule}
    assert links and all(link.split("#")[0] == PUBLISHED_RUNBOOKS_URL for link in links)
    assert {link.split("#")[1] for link in links} <= anchors
    assert "<h3>VllmTimeToFirstTokenBudgetBurn</h3>" in page.text and "<table>" in page.text


def _closed_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # closed on leaving: nothing listens there now


def test_an_engine_that_never_answered_is_starting_and_one_that_stopped_is_down(capture):
    # A native sidecar starts before vLLM, which answers nothing while it loads its weights.
    port = _closed_port()
    settings = load_settings(overrides={"target": f"http://127.0.0.1:{port}/metrics", "poll_interval": "1s",
                                        "timeout": "1s"}, environ={})
    monitor = Monitor(settings)
    client = TestClient(create_app(monitor, settings))
    monitor.poll_once()
    text = client.get("/metrics").text
    assert (value(text, "kvwatch_up"), value(text, "kvwatch_starting")) == (0, 1)  # starting, not down
    with PageServer([Answer(capture("load"))], port=port):
        monitor.poll_once()
        text = client.get("/metrics").text
        assert (value(text, "kvwatch_up"), value(text, "kvwatch_starting")) == (1, 0)
    monitor.poll_once()  # the port is closed again: the engine answered once, so it is down
    text = client.get("/metrics").text
    assert (value(text, "kvwatch_up"), value(text, "kvwatch_starting")) == (0, 0)
    assert monitor.state.reason == "refused"


def test_an_engine_silent_past_the_load_grace_is_down():
    settings = load_settings(overrides={"target": f"http://127.0.0.1:{_closed_port()}/metrics",
                                        "load_grace": "0s"}, environ={})  # no grace
    monitor = Monitor(settings)
    monitor.poll_once()
    text = TestClient(create_app(monitor, settings)).get("/metrics").text
    assert (value(text, "kvwatch_up"), value(text, "kvwatch_starting")) == (0, 0)


def test_an_engine_without_statistics_is_its_own_state_not_unreachable():
    # vLLM with --disable-log-stats answers /metrics with process series only.
    page = "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 1.5\n"
    with PageServer([Answer(page)]) as server:
        monitor, client = make(server)
        monitor.poll_once()
        text = client.get("/metrics").text
    assert value(text, "kvwatch_up") == 0
    assert value(text, "kvwatch_stats_disabled") == 1
    with PageServer([Answer(status=503)]) as server:
        monitor, client = make(server)
        monitor.poll_once()
        text = client.get("/metrics").text
    assert value(text, "kvwatch_up") == 0 and value(text, "kvwatch_stats_disabled") == 0


def test_probes_answer_head_as_get_without_a_body(capture, tmp_path):
    # HEAD /healthz answered 405: uptime checkers that ask with HEAD saw kvwatch down.
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    with PageServer([Answer(capture("idle"))]) as server:
        monitor = Monitor(load_settings(overrides={"target": server.url, "auth_token_file": str(token)}, environ={}))
        client = TestClient(create_app(monitor, monitor.settings))
        not_ready = client.head("/readyz")
        assert (not_ready.status_code, not_ready.content) == (503, b"")
        monitor.poll_once()
        for path in ("/healthz", "/readyz"):
            get, head = client.get(path), client.head(path)
            assert head.status_code == get.status_code == 200, path
            assert head.content == b"" and int(head.headers["content-length"]) == len(get.content) > 0
            assert head.headers["content-type"] == get.headers["content-type"]


def test_the_cli_prints_the_runbook_section_a_finding_names(capsys):
    # `kvwatch diagnose` prints `runbook: kvwatch runbook <section>`; that command prints it.
    from kvwatch import cli

    assert cli.main(["runbook", "runbooks#vllmkvcacheexhausted-long-requests"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### VllmKvCacheExhausted: long_requests") and "First five minutes" in out
    assert "### VllmKvCacheExhausted: concurrency_beyond_capacity" not in out
    assert cli.main(["runbook", "VllmTimeToFirstTokenBudgetBurn"]) == 0
    assert "VllmTimeToFirstTokenBudgetBurn" in capsys.readouterr().out
    assert cli.main(["runbook", "no-such-section"]) == 2
    assert "no section" in capsys.readouterr().err
