"""The whole of kvwatch a page goes through, without the network: adapter,
window, signals, diagnosis, and every view a scraper or a person can read
(the exporter, the JSON APIs, the status page). Shared by the hypothesis
properties and the atheris harness, so both fuzz exactly what runs."""

from __future__ import annotations

import json

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvwatch.sidecar.collector import make_registry
from kvwatch.pipeline.monitor import Monitor
from kvwatch.sidecar.report import diagnosis_json, signals_json
from kvwatch.scrape import RenderedPage
from kvwatch.settings import load_settings
from kvwatch.sidecar.statuspage import render_status_page


class Pipeline:
    def __init__(self, max_series: int = 50, window: str = "10m"):
        self.settings = load_settings(overrides={
            "target": "http://127.0.0.1:9/metrics", "max_series": max_series, "window": window,
        }, environ={})
        self.monitor = Monitor(self.settings)
        self.registry = make_registry(self.monitor)

    def poll(self, text: str):
        """One poll of a page, as if the fetch had returned it."""
        self.monitor.fetcher = RenderedPage(lambda: text)
        return self.monitor.poll_once()

    def views(self, parse_back: bool = True) -> dict[str, object]:
        """Every view, each checked to be well-formed: the exposition parses
        back (unless told not to: prometheus_client's parser is most of the
        cost), the JSON is strict JSON (no NaN or Infinity)."""
        state = self.monitor.state
        exposition = generate_latest(self.registry).decode()
        families = list(text_string_to_metric_families(exposition)) if parse_back else []
        signals = json.loads(json.dumps(signals_json(state, self.settings), allow_nan=False))
        diagnosis = json.loads(json.dumps(diagnosis_json(state, self.settings), allow_nan=False))
        status_page = render_status_page(state, self.settings)
        return {"exposition": exposition, "families": families, "signals": signals,
                "diagnosis": diagnosis, "status_page": status_page}
