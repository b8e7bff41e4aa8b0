"""The page at `/`: what kvwatch watches, whether it is up, and links."""

from __future__ import annotations

import html

from kvwatch.report import public_url


def render_status_page(state, settings) -> str:
    status = "up" if state.up else f"down: {state.reason} {state.detail}"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvwatch</title></head>
<body>
<h1>kvwatch</h1>
<p>Target: <code>{html.escape(public_url(settings.target) or "")}</code>, {html.escape(status)}</p>
<ul>
<li><a href="metrics">/metrics</a>: Prometheus metrics</li>
<li><a href="api/v1/signals">/api/v1/signals</a>: windowed signals (JSON)</li>
<li><a href="api/v1/diagnosis">/api/v1/diagnosis</a>: findings (JSON)</li>
<li><a href="healthz">/healthz</a>, <a href="readyz">/readyz</a></li>
</ul>
</body></html>
"""
