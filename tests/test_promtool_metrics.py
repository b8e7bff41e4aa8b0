"""`promtool check metrics` (Prometheus' own lint, the real binary) passes
on kvwatch's /metrics, in both serve modes, with every family present that
real pages light: windowed quantiles, pinned quantiles, findings, process
metrics (it exited 3 with 30 lines of "non-summary metrics should
not have "quantile" label")."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from fastapi.testclient import TestClient

from kvwatch.central.refresh import Central
from kvwatch.sidecar.app import create_app
from kvwatch.central.app import create_central_app
from promstub import StubClient
from test_central import START, history_text, settings  # noqa: F401 (fixture)

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (make system-deps)")


def check(exposition: bytes) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, timeout=60)


def test_the_sidecars_metrics_pass_promtool(fixtures_dir):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from fuzz.pipeline import Pipeline

    pipeline = Pipeline(max_series=10, window="5m")
    for name in ("idle", "prefix-load", "load", "long-load", "after"):
        assert pipeline.poll((fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()).up
    body = TestClient(create_app(pipeline.monitor, pipeline.settings)).get("/metrics").content
    # The families the lint once refused are here.
    assert b"kvwatch_time_to_first_token_seconds{" in body and b'quantile="0.95"' in body
    assert b"kvwatch_quantile_pinned{" in body
    result = check(body)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()[:3000]


def test_central_modes_metrics_pass_promtool(history_text):  # noqa: F811
    now = [START + 240]
    central = Central(StubClient(history_text), settings(), clock=lambda: now[0])
    assert central.refresh_once().up
    body = TestClient(create_central_app(central, settings())).get("/metrics").content
    assert b"kvwatch_time_to_first_token_seconds{" in body and b"kvwatch_central_store_up" in body
    result = check(body)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()[:3000]
