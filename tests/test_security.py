"""Exposure: what kvwatch fetches, who may read it, and what it lets slip.

- kvwatch fetches only its configured target: no route takes a URL, a host
  or a redirect from a request, and no scrape triggers a fetch at all.
- Its own endpoints: bearer auth on all but /healthz and /readyz, failing
  closed on path tricks; TLS serving; loopback unless told otherwise (the
  container image says 0.0.0.0 explicitly).
- The engine's TLS certificate is verified unless told otherwise.
- Secrets (the engine's bearer token, credentials and query string in the
  target URL) never reach logs, failure details, the status page, the JSON
  APIs or the metrics, on good polls and on every kind of failed one.
- A bad config file names every problem at once and exits non-zero.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from fastapi.testclient import TestClient

from fuzz.pages import Engine, page
from kvwatch.sidecar.app import OPEN_PATHS, create_app
from kvwatch.pipeline.monitor import Monitor
from kvwatch.settings import Settings, load_settings
from pageserver import Answer, PageServer, serving
from test_reliability_faults import Blackhole, RawServer, free_port, never_answer, page_server_on, value

REPO = Path(__file__).resolve().parent.parent
SCRAPE_TOKEN = "kvwatch-scrape-token-8d41c0"
ENGINE_TOKEN = "engine-bearer-token-5e7a19"
PASSWORD = "url-password-3f90b2"
QUERY_KEY = "query-api-key-c02d7e"
SECRETS = (ENGINE_TOKEN, PASSWORD, QUERY_KEY)
GOOD = page(Engine(prompt_tokens=100, running=1, usage=0.25))


def assert_no_secret(text: str, where: str) -> None:
    for secret in SECRETS:
        assert secret not in text, f"{secret!r} in {where}: ...{text[max(0, text.find(secret) - 200):][:400]}..."


def every_view(client) -> dict[str, str]:
    return {path: client.get(path).text for path in ("/", "/metrics", "/api/v1/signals", "/api/v1/diagnosis",
                                                     "/readyz", "/healthz")}


def routes_of(app) -> list[tuple[str, set[str]]]:
    found = []
    for route in app.routes:
        path = getattr(route, "path", None)
        if path is not None:
            found.append((re.sub(r"\{[^}]*\}", "x", path), set(getattr(route, "methods", None) or {"GET"})))
    return found


# --- kvwatch fetches only its target --------------------------------------------


def test_no_route_fetches_anything_but_the_configured_target():
    """Every route of the app (found from the app itself, so a route added
    later is covered), every method, with every parameter and header an
    attacker might use to point kvwatch elsewhere: the other server is never
    asked, and the engine is asked only by polls, never by a request."""
    with PageServer([Answer(GOOD)]) as engine, PageServer([Answer(GOOD)]) as elsewhere:
        settings = load_settings(overrides={"target": engine.url}, environ={})
        monitor = Monitor(settings)
        app = create_app(monitor, settings)
        client = TestClient(app)
        monitor.poll_once()
        assert len(engine.requests) == 1
        host = elsewhere.url.split("/")[2]
        params = {key: elsewhere.url for key in ("target", "url", "uri", "endpoint", "upstream", "upstream_target",
                                                 "lmcache", "lmcache_target",
                                                 "redirect", "next", "host", "metrics")}
        headers = {"X-Forwarded-Host": host, "X-Forwarded-For": "127.0.0.1", "Forwarded": f"host={host}",
                   "Referer": elsewhere.url, "X-Original-URL": elsewhere.url, "X-Rewrite-URL": elsewhere.url}
        paths = routes_of(app)
        assert {"/", "/metrics", "/healthz", "/readyz", "/api/v1/signals", "/api/v1/diagnosis"} <= {p for p, _ in paths}
        for path, methods in paths:
            for method in sorted(methods | {"GET", "POST", "PUT", "DELETE"}):
                response = client.request(method, path, params=params, headers=headers,
                                          json={"target": elsewhere.url} if method in ("POST", "PUT") else None)
                assert response.status_code < 500, (method, path, response.status_code)
                if elsewhere.url in response.text:
                    # Reflecting the parameter would be harmless; fetching it is not. But say so.
                    pytest.fail(f"{method} {path} reflects a request parameter")
        assert elsewhere.requests == []
        assert len(engine.requests) == 1  # scrapes never fetch: the poll loop does


def test_a_redirect_even_to_the_same_host_is_not_followed():
    with PageServer([Answer(status=307, headers={"Location": "/metrics-moved"}), Answer(GOOD)]) as engine:
        monitor = Monitor(load_settings(overrides={"target": engine.url}, environ={}))
        state = monitor.poll_once()
        assert (state.up, state.reason) == (False, "http_3xx")
        assert [r["path"] for r in engine.requests] == ["/metrics"]


def test_status_page_escapes_what_the_engine_sends():
    with PageServer([Answer(status=302, headers={"Location": "http://x/<script>alert(1)</script>"})]) as engine:
        settings = load_settings(overrides={"target": engine.url}, environ={})
        monitor = Monitor(settings)
        monitor.poll_once()
        page_html = TestClient(create_app(monitor, settings)).get("/").text
        assert "<script>alert(1)</script>" not in page_html
        # What the engine sent is logged, never shown: the page says it in one sentence.
        assert "alert(1)" not in page_html and "answered with a redirect" in page_html


# --- kvwatch's own endpoints ---------------------------------------------------------


@pytest.fixture
def token_file(tmp_path):
    path = tmp_path / "scrape-token"
    path.write_text(SCRAPE_TOKEN + "\n")  # as a Kubernetes secret or `echo` writes it
    return path


def test_every_route_needs_the_token_except_the_health_probes(token_file):
    with PageServer([Answer(GOOD)]) as engine:
        settings = load_settings(overrides={"target": engine.url, "auth_token_file": str(token_file)}, environ={})
        monitor = Monitor(settings)
        monitor.poll_once()
        app = create_app(monitor, settings)
        client = TestClient(app)
        wrong = ["", "Bearer", f"Bearer {SCRAPE_TOKEN}x", f"Bearer {SCRAPE_TOKEN[:-1]}", f"Basic {SCRAPE_TOKEN}",
                 f"Token {SCRAPE_TOKEN}", SCRAPE_TOKEN, f"Bearer  {SCRAPE_TOKEN}", f"Bearer {SCRAPE_TOKEN}\t"]
        for path, _ in routes_of(app):
            right = client.get(path, headers={"Authorization": f"Bearer {SCRAPE_TOKEN}"})
            assert right.status_code in (200, 503), (path, right.status_code)
            for header in wrong:
                response = client.get(path, headers={"Authorization": header} if header else {})
                if path in OPEN_PATHS:
                    assert response.status_code in (200, 503), (path, header)
                else:
                    assert response.status_code == 401, (path, header, response.status_code)
                    assert response.headers["WWW-Authenticate"] == "Bearer"
                    assert SCRAPE_TOKEN not in response.text
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").status_code == 200
        assert "kvwatch_up" not in client.get("/metrics").text


@pytest.mark.parametrize("path", ["/metrics/", "//metrics", "/METRICS", "/healthz/", "/readyz/../metrics",
                                  "/%6detrics", "/healthz%2f..%2fmetrics", "/api/v1/signals?x=/healthz"])
def test_path_tricks_fail_closed(token_file, path):
    with PageServer([Answer(GOOD)]) as engine:
        settings = load_settings(overrides={"target": engine.url, "auth_token_file": str(token_file)}, environ={})
        monitor = Monitor(settings)
        monitor.poll_once()
        response = TestClient(create_app(monitor, settings)).get(path, follow_redirects=False)
        assert response.status_code in (401, 404), (path, response.status_code)
        assert "kvwatch_up" not in response.text and "engines" not in response.text


def test_default_bind_address_is_loopback_and_the_image_sets_its_own():
    assert Settings().host == "127.0.0.1"
    assert load_settings(environ={}).host == "127.0.0.1"
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    assert re.search(r"KVWATCH_HOST=0\.0\.0\.0", dockerfile), "the image must choose 0.0.0.0 explicitly"


# --- TLS ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1, made with the openssl CLI."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return cert, key


class TlsPageServer(PageServer):
    def __init__(self, answers, cert, key):
        super().__init__(answers)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        self.httpd.socket = context.wrap_socket(self.httpd.socket, server_side=True)

    @property
    def url(self) -> str:
        return super().url.replace("http://", "https://")


def test_engine_certificate_is_verified(certificate):
    cert, key = certificate
    with TlsPageServer([Answer(GOOD)], cert, key) as engine:
        untrusted = Monitor(load_settings(overrides={"target": engine.url}, environ={}))
        assert (untrusted.poll_once().reason) == "tls"
        trusted = Monitor(load_settings(overrides={"target": engine.url, "ca_bundle": str(cert)}, environ={}))
        assert trusted.poll_once().up
        # Off only when told, for a lab engine with a throwaway certificate.
        unverified = Monitor(load_settings(overrides={"target": engine.url, "tls_verify": "false"}, environ={}))
        assert unverified.poll_once().up


# --- secrets -----------------------------------------------------------------------


def faulty(kind: str, port: int):
    """A context manager playing one failure on the port, or a good engine."""
    answers = {
        "good": [Answer(GOOD)],
        "http_5xx": [Answer("boom\n", status=500)],
        "http_3xx": [Answer(status=302, headers={"Location": "http://elsewhere.invalid/metrics"})],
        "truncated": [Answer(GOOD, close_after=100)],
        "no_engine_metrics": [Answer("garbage\n")],
    }
    if kind in answers:
        return page_server_on(port, answers[kind])
    if kind == "timeout":
        return _closing(RawServer(port, never_answer))
    if kind == "connect_timeout":
        return _closing(Blackhole(port))
    return _closing(None)  # refused: nothing listens


class _closing:
    def __init__(self, thing):
        self.thing = thing

    def __enter__(self):
        return self.thing

    def __exit__(self, *exc):
        if self.thing is not None:
            self.thing.close()


@pytest.mark.parametrize("credentials", ["url", "token-file"])
def test_secrets_never_appear_on_any_poll_outcome(tmp_path, caplog, credentials):
    token = tmp_path / "engine-token"
    token.write_text(ENGINE_TOKEN + "\n")
    port = free_port()
    userinfo = f"scraper:{PASSWORD}@" if credentials == "url" else ""
    overrides = {"target": f"http://{userinfo}127.0.0.1:{port}/metrics?api_key={QUERY_KEY}",
                 "poll_interval": "2s", "timeout": "0.3s"}
    if credentials == "token-file":
        overrides["bearer_token_file"] = str(token)
    settings = load_settings(overrides=overrides, environ={})
    monitor = Monitor(settings)
    client = TestClient(create_app(monitor, settings))
    caplog.set_level(logging.DEBUG, logger="kvwatch")
    outcomes = ["good", "refused", "http_5xx", "good", "timeout", "http_3xx", "truncated", "connect_timeout",
                "no_engine_metrics", "good"]
    for kind in outcomes:
        with faulty(kind, port) as server:
            state = monitor.poll_once()
            if kind == "good":
                assert state.up
                sent = server.requests[-1]
                assert sent["path"] == f"/metrics?api_key={QUERY_KEY}"  # the engine does get its credentials
                expected = f"Bearer {ENGINE_TOKEN}" if credentials == "token-file" else "Basic "
                assert sent["headers"]["Authorization"].startswith(expected)
            else:
                assert not state.up and state.reason == kind.replace("connect_timeout", "timeout"), state
            assert_no_secret(state.detail, f"the {kind} detail")
            for path, text in every_view(client).items():
                assert_no_secret(text, f"{path} after {kind}")
    assert_no_secret(caplog.text, "the log")
    assert "refused" in caplog.text and "timeout" in caplog.text  # the failures were logged, details and all


def test_a_token_file_that_is_not_a_header_value_is_reported_without_its_content(tmp_path, caplog):
    token = tmp_path / "engine-token"
    token.write_text(f"{ENGINE_TOKEN}\n{ENGINE_TOKEN}-second-line\n")
    with PageServer([Answer(GOOD)]) as engine:
        settings = load_settings(overrides={"target": engine.url, "bearer_token_file": str(token)}, environ={})
        monitor = Monitor(settings)
        caplog.set_level(logging.DEBUG, logger="kvwatch")
        state = monitor.poll_once()
        assert (state.up, state.reason) == (False, "error")
        assert "bearer token" in state.detail
        assert engine.requests == []
        assert_no_secret(state.detail + caplog.text, "the detail and log")
        for path, text in every_view(TestClient(create_app(monitor, settings))).items():
            assert_no_secret(text, path)


# --- the real command: TLS, auth, loopback, logs ----------------------------------------


def listening_addresses(port: int) -> set[str]:
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def wait_for(condition, what: str, deadline: float = 30.0):
    end = time.monotonic() + deadline
    while True:
        try:
            result = condition()
            if result:
                return result
        except requests.RequestException:
            pass
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting: {what}")
        time.sleep(0.1)


def test_kvwatch_serve_over_tls_with_auth_on_loopback_keeps_secrets_out_of_its_log(tmp_path, certificate, token_file):
    """The real command, as deployed: TLS, a scrape token, the engine's
    token from a file and an API key in the target's query string, at debug
    level. Scraped by a keep-alive client (as Prometheus scrapes), it serves
    only on loopback, only over TLS, only with the token; nothing secret
    reaches a response or the log, also once the engine goes away; and it
    stops on SIGTERM while that client still holds its connection."""
    cert, key = certificate
    engine_token = tmp_path / "engine-token"
    engine_token.write_text(ENGINE_TOKEN)
    port = free_port()
    engine = PageServer([Answer(GOOD)])
    engine.thread.start()
    engine_stopped = False
    command = [sys.executable, "-m", "kvwatch", "serve",
               "--target", engine.url + f"?api_key={QUERY_KEY}", "--port", str(port),
               "--poll-interval", "0.3s", "--timeout", "0.2s", "--log-level", "debug",
               "--bearer-token-file", str(engine_token), "--auth-token-file", str(token_file),
               "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    environment = {key: value for key, value in os.environ.items() if not key.startswith("KVWATCH_")}
    environment["PYTHONPATH"] = str(REPO)
    process = subprocess.Popen(command, cwd=tmp_path, env=environment, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    base = f"https://127.0.0.1:{port}"
    scraper = requests.Session()  # keeps its connection open between scrapes
    authorized = {"Authorization": f"Bearer {SCRAPE_TOKEN}"}

    def get(path: str, **kwargs) -> requests.Response:
        # verify= on each request: a session's own is overridden by REQUESTS_CA_BUNDLE.
        return scraper.get(base + path, verify=str(cert), timeout=5, **kwargs)

    views: dict[str, str] = {}
    try:
        wait_for(lambda: get("/readyz").status_code == 200, "kvwatch to be ready over TLS")
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1 and nothing else
        with pytest.raises(requests.RequestException):
            requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5)  # no plaintext on the TLS port
        assert get("/metrics").status_code == 401
        metrics = get("/metrics", headers=authorized)
        assert metrics.status_code == 200 and value(metrics.text, "kvwatch_up") == 1.0
        assert engine.requests[0]["headers"]["Authorization"] == f"Bearer {ENGINE_TOKEN}"
        for path in ("/", "/metrics", "/api/v1/signals", "/api/v1/diagnosis", "/readyz"):
            views[path] = get(path, headers=authorized).text
        # Now the engine goes away: the failure's detail quotes the request URL.
        engine.__exit__(None, None, None)
        engine_stopped = True

        def readyz_says_refused():
            text = get("/readyz").text
            return text if "refused" in text else None

        views["/readyz (engine gone)"] = wait_for(readyz_says_refused, "kvwatch to see the engine gone")
        views["/api/v1/signals (engine gone)"] = get("/api/v1/signals", headers=authorized).text
        process.send_signal(signal.SIGTERM)  # as Kubernetes stops a pod, the scraper still connected
        try:
            log, _ = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("kvwatch did not stop within 20 s of SIGTERM while a scraper held a connection")
    finally:
        scraper.close()
        if not engine_stopped:
            engine.__exit__(None, None, None)
        if process.poll() is None:
            process.kill()
            log, _ = process.communicate()
    for where, text in views.items():
        assert_no_secret(text, where)
    assert_no_secret(log, "kvwatch's log at debug level")
    assert SCRAPE_TOKEN not in log
    assert "refused" in log and "<redacted>" in log  # the failure was logged, with the query string redacted


def test_bad_config_names_every_problem_at_once_and_exits_non_zero(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text(
        f"target: ftp://admin:{PASSWORD}@engine:8000\n"
        "port: 70000\n"
        "poll_interval: often\n"
        "max_body_bytes: 12XB\n"
        "tls_cert_file: /no/such/cert.pem\n"
        "log_level: loud\n"
        "colour: blue\n"
        "timeout: 200s\n"  # above half the (default) 5m window: a problem across settings
    )
    environment = {key: value for key, value in os.environ.items() if not key.startswith("KVWATCH_")}
    environment["PYTHONPATH"] = str(REPO)
    finished = subprocess.run([sys.executable, "-m", "kvwatch", "serve", "--config", str(config)], cwd=tmp_path,
                              env=environment, capture_output=True, text=True, timeout=60)
    assert finished.returncode != 0
    output = finished.stdout + finished.stderr
    for fragment in ("ftp://admin:<redacted>@engine:8000", "70000", "often", "12XB", "/no/such/cert.pem",
                     "loud", "colour", "must be at most half the window"):
        assert fragment in output, fragment
    assert len(re.findall(r"^\s+- ", output, flags=re.MULTILINE)) == 8
    assert "Traceback" not in output
    assert_no_secret(output, "the configuration errors")


# --- round two: kvwatch's own HTTP surface, the token, configuration -------------------


def serve_command(tmp_path, *arguments: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if not key.startswith("KVWATCH_")}
    environment["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "kvwatch", "serve", *arguments], cwd=tmp_path,
                          env=environment, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("content", [b"", b"   \n\t\n"], ids=["empty", "whitespace"])
def test_an_empty_auth_token_file_refuses_to_start(tmp_path, content):
    """It used to turn authentication off without a word."""
    token = tmp_path / "scrape-token"
    token.write_bytes(content)
    finished = serve_command(tmp_path, "--auth-token-file", str(token), "--port", "1")
    assert finished.returncode == 2
    assert "holds no token" in finished.stderr and "Traceback" not in finished.stderr


def test_every_configuration_error_of_round_two_is_reported_at_once(tmp_path, certificate):
    """A bad port in the target, NaN and infinite durations, a token file
    that is not UTF-8, a TLS key that is not a key: each used to pass
    validation and end in a traceback, or poll ~240 times a second (NaN)."""
    cert, _key = certificate
    not_a_key = tmp_path / "key.pem"
    not_a_key.write_text("-----BEGIN PRIVATE KEY-----\nbm90IGEga2V5\n-----END PRIVATE KEY-----\n")
    token = tmp_path / "scrape-token"
    token.write_bytes(b"token-\xff\xfe\n")
    config = tmp_path / "bad.yaml"
    config.write_text("poll_interval: .nan\nwindow: .inf\n")
    finished = serve_command(tmp_path, "--config", str(config), "--target", "http://127.0.0.1:99999/metrics",
                             "--auth-token-file", str(token), "--tls-cert-file", str(cert),
                             "--tls-key-file", str(not_a_key), "--port", "1")
    output = finished.stdout + finished.stderr
    assert finished.returncode == 2, output
    for fragment in ("99999", "poll_interval: nan", "window: inf", "is not UTF-8", "not a certificate and its private key"):
        assert fragment in output, fragment
    assert len(re.findall(r"^\s+- ", output, flags=re.MULTILINE)) == 5
    assert "Traceback" not in output


def test_the_auth_token_is_reread_when_it_rotates_and_a_utf8_token_matches(tmp_path):
    token = tmp_path / "scrape-token"
    token.write_text("first-token\n")
    with PageServer([Answer(GOOD)]) as engine:
        settings = load_settings(overrides={"target": engine.url, "auth_token_file": str(token)}, environ={})
        monitor = Monitor(settings)
        monitor.poll_once()
        client = TestClient(create_app(monitor, settings))

        def status(value: bytes) -> int:
            return client.get("/metrics", headers=[(b"authorization", b"Bearer " + value)]).status_code

        assert status(b"first-token") == 200
        # Rotation as Kubernetes does it: a new file swapped in under the same path.
        rotated = tmp_path / "scrape-token.new"
        rotated.write_text("jeton-\u00e9t\u00e9-\u4ee4\u724c\n", encoding="utf-8")
        os.replace(rotated, token)
        assert status("jeton-\u00e9t\u00e9-\u4ee4\u724c".encode()) == 200
        assert status(b"first-token") == 401
        # The same text sent as latin-1 bytes is another token.
        assert status("jeton-\u00e9t\u00e9".encode("latin-1")) == 401
        # Emptied by mistake: nobody gets in, the probes stay open.
        token.write_text("")
        assert status(b"") == 401 and status("jeton-\u00e9t\u00e9-\u4ee4\u724c".encode()) == 401
        assert client.get("/healthz").status_code == 200


def test_readyz_never_echoes_what_the_engine_sent():
    """/readyz answers without a token: a redirect's Location (with its
    query string) or any other detail the engine controls stays behind the
    authenticated views; the reason is named."""
    location = "http://elsewhere.invalid/login?next=%2Fmetrics&session=engine-controlled-4b1d"
    with PageServer([Answer(status=302, headers={"Location": location})]) as engine:
        settings = load_settings(overrides={"target": engine.url}, environ={})
        monitor = Monitor(settings)
        state = monitor.poll_once()
        assert state.reason == "http_3xx"
        ready = TestClient(create_app(monitor, settings)).get("/readyz")
    assert ready.status_code == 503 and "http_3xx" in ready.text
    assert "elsewhere" not in ready.text and "session" not in ready.text and "login" not in ready.text


@pytest.fixture
def bounded_server(monkeypatch):
    """kvwatch's uvicorn server with the options `kvwatch serve` uses, on a
    loopback port, with the bounds made small so a test stays small."""
    from kvwatch.sidecar import app as app_module
    from kvwatch.commands.serve import server_options

    monkeypatch.setattr(app_module, "HEADER_TIMEOUT_SECONDS", 1.0)
    monkeypatch.setattr(app_module, "MAX_CONNECTIONS", 40)
    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics", "port": 0}, environ={})
    monitor = Monitor(settings)
    with serving(create_app(monitor, settings), **server_options(settings)) as kvwatch:
        yield kvwatch.port


def probe(port: int) -> int:
    return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=3).status_code


def test_a_flood_of_half_sent_requests_leaves_the_probes_answerable(bounded_server):
    """100 connections that send half a request line and wait (40 allowed):
    the oldest waiting ones are closed to make room, the rest at the header
    deadline; /healthz answers all along."""
    import socket

    port = bounded_server
    flood = []
    try:
        for _ in range(100):
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(b"GET /metr")
            flood.append(sock)
        for _ in range(5):
            assert probe(port) == 200
        # The header deadline (1 s here, 10 s as shipped) closes every one still waiting.
        time.sleep(1.5)
        for sock in flood:
            sock.settimeout(3)
            try:
                assert sock.recv(1024) in (b"", b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            except ConnectionResetError:
                pass  # closed to make room
    finally:
        for sock in flood:
            sock.close()


def test_a_flood_of_slow_bodies_leaves_both_probes_answerable(bounded_server):
    """100 connections (40 allowed) send whole headers declaring a 100 MB
    body, or a body under the cap that never ends, then one byte of it, on
    the probes' own paths and others: each is refused (413) or closed to
    make room, and /healthz and /metrics answer 200 all along (before the
    body phase had its own deadline it was never evicted: every probe got 503)."""
    import socket

    port = bounded_server
    targets = (b"GET /healthz", b"POST /metrics", b"GET /", b"POST /api/v1/signals")
    flood = []
    try:
        for n in range(100):
            length = b"100000000" if n % 2 else b"60000"
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(targets[n % 4] + b" HTTP/1.1\r\nHost: x\r\nContent-Length: " + length + b"\r\n\r\nx")
            flood.append(sock)
        for _ in range(5):
            assert probe(port) == 200
            assert requests.get(f"http://127.0.0.1:{port}/metrics", timeout=3).status_code == 200
        for n, sock in enumerate(flood):
            # Each connection ends (a socket timeout here would fail the test).
            sock.settimeout(5)
            answer = b""
            try:
                while more := sock.recv(1 << 16):
                    answer += more
            except ConnectionResetError:
                continue  # closed to make room
            if n % 2:  # declared over the cap: refused before anything is read
                assert answer in (b"", b"HTTP/1.1 413 Content Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            # else: the body never ends: closed at the request deadline (1 s
            # here), after the answer where the route answers without the body
    finally:
        for sock in flood:
            sock.close()


def test_a_body_over_the_cap_sent_in_chunks_is_refused(bounded_server):
    """No declared length, a chunked body past 64 KiB: 413, closed; the
    probe answers."""
    import socket

    port = bounded_server
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        sock.sendall(b"POST /api/v1/signals HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        try:
            for _ in range(40):
                sock.sendall(b"1000\r\n" + b"x" * 4096 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        answer = b""
        try:
            while True:
                more = sock.recv(1 << 16)
                if not more:
                    break
                answer += more
        except ConnectionResetError:
            pass
        assert b"HTTP/1.1 413 Content Too Large" in answer or answer == b"", answer[-200:]
    finally:
        sock.close()
    assert probe(port) == 200


def test_huge_headers_are_refused_without_holding_the_probes(bounded_server):
    """A 4 MB header (and a 1 MB Accept-Encoding) are refused at 16 KiB with
    431, before any parsing of their content; /healthz answers meanwhile."""
    import socket

    port = bounded_server
    for name in (b"X-Filler", b"Accept-Encoding"):
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n" + name + b": ")
            try:
                for _ in range(64):
                    sock.sendall(b"gzip," * 13_000)
            except (BrokenPipeError, ConnectionResetError):
                pass  # kvwatch closed the connection while the header was still coming
            try:
                answer = sock.recv(1024)
            except ConnectionResetError:
                answer = b""
            assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:100]
        finally:
            sock.close()
        assert probe(port) == 200


def test_config_and_token_files_are_read_with_a_byte_cap(tmp_path, capsys):
    """A config file of 2 MiB, a scrape-token file of 2 MiB, a config path
    naming a FIFO (it blocked for ever) or a device: each one sentence, exit 2
    (read whole before: a path to /dev/zero never ended)."""
    import os

    from kvwatch.cli import main

    big = tmp_path / "big.yaml"
    # (An invalid port as well, so that no version of kvwatch starts serving here.)
    big.write_text("# padding\n" * 220_000 + "port: 99999999\n")
    assert main(["serve", "--config", str(big)]) == 2
    assert "larger than the 1,048,576 bytes kvwatch reads of it" in capsys.readouterr().err
    token = tmp_path / "token"
    token.write_text("a" * (2 * 1024 * 1024))
    assert main(["serve", "--target", "http://127.0.0.1:9/metrics", "--auth-token-file", str(token),
                 "--port", "99999999"]) == 2
    assert "larger than the 65,536 bytes kvwatch reads of it" in capsys.readouterr().err
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert main(["serve", "--config", str(fifo), "--port", "99999999"]) == 2
    assert f"config file {fifo}: not a regular file" in capsys.readouterr().err
    assert main(["serve", "--config", "/dev/null", "--port", "99999999"]) == 2  # a device: refused, never read
    assert "/dev/null: not a regular file" in capsys.readouterr().err


def test_tls_and_ca_files_are_regular_files_within_a_byte_cap(tmp_path, capsys):
    """A CA bundle of 2 GiB (sparse), a certificate path naming a FIFO: the
    TLS library reads them whole (a CA bundle at every new connection to the
    engine) and a FIFO blocks it for ever. Each is one sentence, exit 2,
    before anything is read."""
    import os

    from kvwatch.cli import main
    from kvwatch.settings import MAX_PEM_BYTES

    bundle = tmp_path / "ca.pem"
    with open(bundle, "wb") as handle:
        handle.truncate(2 * 1024 ** 3)
    assert main(["serve", "--target", "https://127.0.0.1:9/metrics", "--ca-bundle", str(bundle),
                 "--port", "99999999"]) == 2
    assert f"is larger than the {MAX_PEM_BYTES:,} bytes kvwatch reads of it" in capsys.readouterr().err
    fifo = tmp_path / "cert.pem"
    os.mkfifo(fifo)
    key = tmp_path / "key.pem"
    key.write_text("not a key")
    assert main(["serve", "--target", "http://127.0.0.1:9/metrics", "--tls-cert-file", str(fifo),
                 "--tls-key-file", str(key), "--port", "99999999"]) == 2
    assert f"{str(fifo)!r} is not a regular file" in capsys.readouterr().err
