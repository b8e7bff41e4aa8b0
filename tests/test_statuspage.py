"""The status page as HTML: findings and signals rendered server-side,
nothing from outside, nothing secret, nothing from the engine as markup."""

from __future__ import annotations

import base64
import hashlib
import re

from fastapi.testclient import TestClient

from kvwatch.sidecar.app import create_app
from kvwatch.sidecar.monitor import Monitor
from kvwatch.sidecar.settings import load_settings
from kvwatch.sidecar.statuspage import CONTENT_SECURITY_POLICY, SCRIPT, STYLE, format_value, render_status_page
from pageserver import Answer, PageServer


def page(fixtures_dir, name: str) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def polled(pages: list[str], target_prefix: str = "http://"):
    with PageServer([Answer(text) for text in pages]) as server:
        settings = load_settings(overrides={"target": server.url.replace("http://", target_prefix)}, environ={})
        monitor = Monitor(settings)
        for _ in pages:
            monitor.poll_once()
    return monitor, settings


def test_findings_and_signals_rendered(fixtures_dir):
    monitor, settings = polled([page(fixtures_dir, n) for n in ("idle", "prefix-load", "load")])
    html = render_status_page(monitor.state, settings)
    assert re.search(r"Findings \(\d+ active\)", html) and "Findings (0 active)" not in html
    assert 'data-symptom="exhaustion" data-cause="concurrency_beyond_capacity"' in html
    assert "waiting_at_peak=18" in html
    assert "<th>tiny-llama / 0</th>" in html
    assert "99.2%" in html and "4,096" in html
    for link in ('href="metrics"', 'href="api/v1/signals"', 'href="api/v1/diagnosis"'):
        assert link in html


def test_no_credentials_on_the_page(fixtures_dir):
    monitor, settings = polled([page(fixtures_dir, "idle")], "http://admin:hunter2@")
    html = render_status_page(monitor.state, settings)
    assert "hunter2" not in html and "admin" not in html
    assert "127.0.0.1" in html


def test_engine_text_is_escaped(fixtures_dir):
    hostile = page(fixtures_dir, "load").replace('model_name="tiny-llama"', 'model_name="<img src=x onerror=alert(1)>"')
    monitor, settings = polled([page(fixtures_dir, "idle").replace('model_name="tiny-llama"',
                                                                   'model_name="<img src=x onerror=alert(1)>"'), hostile])
    html = render_status_page(monitor.state, settings)
    assert monitor.state.findings  # the hostile model has a finding to show
    assert "<img src=x" not in html
    assert "&lt;img src=x onerror=alert(1)&gt;" in html


def test_no_external_assets():
    html = render_status_page(_down_state(), load_settings(overrides={"target": "http://10.0.0.5:8000"}, environ={}))
    urls = re.findall(r'(?:href|src)="([^"]*)"', html)
    assert urls and all(not re.match(r"^(https?:)?//", url) for url in urls), urls
    assert "@import" not in html and "url(" not in html
    assert "cdn" not in html.lower()


def test_csp_allows_exactly_the_inline_script_and_style():
    html = render_status_page(_down_state(), load_settings(environ={}))

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    assert f"<script>{SCRIPT}</script>" in html and f"<style>{STYLE}</style>" in html
    assert f"script-src {digest(SCRIPT)};" in CONTENT_SECURITY_POLICY
    assert f"style-src {digest(STYLE)};" in CONTENT_SECURITY_POLICY
    assert "default-src 'none'" in CONTENT_SECURITY_POLICY
    # No inline event handlers or style attributes, which those hashes would not allow.
    assert not re.search(r"\son[a-z]+=", html) and ' style="' not in html


def test_down_state_says_why():
    html = render_status_page(_down_state(), load_settings(environ={}))
    assert "down: refused connection refused" in html
    assert "No findings while the engine is not polled." in html


def test_served_at_root(fixtures_dir):
    monitor, settings = polled([page(fixtures_dir, "idle")])
    response = TestClient(create_app(monitor, settings)).get("/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    assert "Findings (0 active)" in response.text


def test_format_value():
    assert format_value(0.9921, "ratio") == "99.2%"
    assert format_value(0.0283, "seconds") == "28.3 ms"
    assert format_value(9.7e-06, "seconds") == "9.7 µs"
    assert format_value(3.875, "seconds") == "3.88 s"
    assert format_value(4096.0, "tokens") == "4,096"
    assert format_value({"0.5": 0.03, "0.95": 0.064}, "seconds") == "p50 30 ms, p95 64 ms"
    assert format_value(None, "ratio") == "–"


def _down_state():
    from kvwatch.sidecar.monitor import State

    return State(up=False, reason="refused", detail="connection refused", polls=3)
