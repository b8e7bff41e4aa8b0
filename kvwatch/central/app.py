"""Central mode's HTTP surface (`kvwatch serve --prometheus URL`): the
sidecar's endpoints for every replica the store knows, from the state
kvwatch.central.refresh.Central publishes after each refresh.

- `/`: one table of replicas, worst finding first, with the fleet findings;
  `/?replica=NAME` is the sidecar's status page of that replica (its script
  refreshes from the API with the same `?replica=`).
- `/api/v1/diagnosis`: every replica's findings (each replica with its labels
  from the store) and the fleet findings; `?replica=NAME`: that replica's, as
  a sidecar serves them. `/api/v1/signals` and `/api/v1/series` the same way
  (series only per replica: it is the bulk of a page).
- `/metrics`: the sidecar's series of every replica, each sample carrying
  the replica's own labels as the store has them (job, instance, namespace,
  pod: --replica-labels), so the generated dashboards and rules group them
  as they group sidecars. Scrape it with `honor_labels: true`, or Prometheus
  renames them exported_job, exported_instance.
- `/healthz`; `/readyz` fails while the store does not answer, or holds no
  replica for the selector.
"""

from __future__ import annotations

import dataclasses
import html
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.gzip import GZipMiddleware
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

from kvwatch import __version__
from kvwatch.diagnose.vocabulary import SEVERITIES, Finding
from kvwatch.signals import CENTRAL_HEALTH
from kvwatch.sidecar.app import HotPaths, TokenFile, encodings, readiness, route_paths
from kvwatch.sidecar.collector import KvwatchCollector, Renderer
from kvwatch.sidecar.renders import GZIP_LEVEL, GZIP_MIN_BYTES, Exposition, RefusedRenders, json_route, page_route
from kvwatch.present import clean
from kvwatch.sidecar.report import diagnosis_json, finding_json, signals_json
from kvwatch.sidecar.series import series_json
from kvwatch.sidecar.statuspage import CONTENT_SECURITY_POLICY, STYLE, render_status_page

_RANK = {severity: index for index, severity in enumerate(SEVERITIES)}


class _Holder:
    """What KvwatchCollector reads: an object with a `state`."""

    def __init__(self, state):
        self.state = state


class CentralCollector(Collector):
    """The sidecar's families for every replica, merged by name, each sample
    with the replica's labels added."""

    def __init__(self, central):
        self.central = central

    def collect(self):
        merged: dict[str, Any] = {}  # metric families by name
        for view in self.central.state.replicas.values():
            extra = dict(view.labels)
            for family in KvwatchCollector(_Holder(view.state)).collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = type(family)(family.name, family.documentation, labels=[])
                    into.samples = []
                into.samples.extend(Sample(s.name, {**s.labels, **extra}, s.value, s.timestamp, s.exemplar)
                                    for s in family.samples)
        yield from merged.values()
        state = self.central.state
        values = {"kvwatch_central_store_up": 1.0 if state.up else 0.0,
                  "kvwatch_central_replicas": float(len(state.replicas)),
                  "kvwatch_central_replicas_dropped": float(state.dropped_replicas),
                  "kvwatch_central_last_success_timestamp_seconds": state.last_success_time}
        for health in CENTRAL_HEALTH:
            if values[health.name] is not None:
                yield GaugeMetricFamily(health.name, health.help, value=values[health.name])


def replica_settings(settings, name: str):
    """The sidecar's settings with the replica's name as the target the
    status page and the JSON name."""
    return dataclasses.replace(settings, target=name)


def worst(findings) -> tuple[int, Finding | None]:
    ranked = sorted(findings, key=lambda f: _RANK.get(f.severity, len(SEVERITIES)))
    return (_RANK.get(ranked[0].severity, len(SEVERITIES)), ranked[0]) if ranked else (len(SEVERITIES), None)


def central_status(state, central) -> dict:
    return {
        "mode": "central",
        "store": central.url,
        "selector": central.selector,
        "source": state.source,
        "up": state.up,
        "reason": state.reason,
        "detail": state.detail if not state.up else "",
        "refreshes": state.refreshes,
        "failed_refreshes": state.failures,
        "last_success_time": state.last_success_time,
        "last_step_time": state.last_step,
        "step_seconds": central.step,
        "window_seconds": central.window,
        "replicas_dropped": state.dropped_replicas,
        "cost": state.cost,
        **({"shard": state.shard, "store_replicas": state.store_replicas} if state.shard else {}),
    }


def diagnosis_all(state, central, settings) -> dict:
    replicas = []
    for name, view in state.replicas.items():
        replicas.append({"replica": name, "labels": view.labels,
                         **diagnosis_json(view.state, replica_settings(settings, name))})
    fleet = [{"replica": str(f.evidence.get("replica", "")), **finding_json(f, since)} for f, since in state.fleet]
    return clean({**central_status(state, central), "replicas": replicas, "fleet": fleet})


def index_page(state, central) -> str:
    e = html.escape
    rows = []
    for name, view in sorted(state.replicas.items(),
                             key=lambda item: (worst(item[1].state.findings)[0] if item[1].state.up else -1, item[0])):
        rank, top = worst(view.state.findings) if view.state.up else (None, None)
        if not view.state.up:
            cell = f'<span class="down">{e(view.state.detail)}</span>'
        elif top is None:
            cell = "no active findings"
        else:
            cell = (f"<b>{e(top.severity.upper())}</b> {e(top.symptom)} / {e(top.cause)} ({e(top.model)})"
                    + (f" and {len(view.state.findings) - 1} more" if len(view.state.findings) > 1 else ""))
        models = sorted({row.model for row in view.state.per_engine})
        rows.append(f'<tr data-replica="{e(name)}"><td><a href="?replica={e(_quote(name))}">{e(name)}</a></td>'
                    f"<td>{e(', '.join(models))}</td><td>{cell}</td></tr>")
    fleet_items = "".join(
        f'<li data-cause="{e(f.cause)}"><b>{e(f.severity.upper())}</b> {e(f.cause)} ({e(f.model)}): {e(f.summary)}</li>'
        for f, _since in state.fleet)
    if state.shard:
        fleet = (f"<p>This is shard {e(state.shard)} ({len(state.replicas)} of the store's "
                 f"{state.store_replicas or 0} replicas): the fleet findings are the store's fleet alert "
                 "(VllmFleetReplicaOutlier) over every shard's series.</p>")
    else:
        fleet = "<ul>" + fleet_items + "</ul>" if fleet_items else "<p>None.</p>"
    if state.up:
        status = (f"Read from <code>{e(central.url or '')}</code> ({e(state.source or 'no series')}) at "
                  f"{_clock(state.last_step)}; {len(state.replicas)} replicas, window {central.window:g} s, "
                  f"every {central.step:g} s.")
    else:
        status = f'<span class="down">{e(state.detail)}</span>'
        if state.last_success_time:
            status += f" The last good read was at {_clock(state.last_success_time)}."
    dropped = (f"<p>{state.dropped_replicas} more replicas are not shown (max replicas reached).</p>"
               if state.dropped_replicas else "")
    table = ("<table><tr><th>Replica</th><th>Models</th><th>Worst finding</th></tr>" + "".join(rows) + "</table>"
             if rows else "<p>No replica has data in the store.</p>")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{e(CONTENT_SECURITY_POLICY)}">
<meta http-equiv="refresh" content="{max(5, int(central.step))}">
<link rel="icon" href="data:,">
<title>kvwatch central: {e(central.url or '')}</title>
<style>{STYLE}</style>
</head>
<body><main>
<header><h1>kvwatch: every replica</h1><p id="status" class="muted">{status}</p></header>
{dropped}
<section id="fleet"><h2>Fleet findings ({len(state.fleet)})</h2>{fleet}</section>
<section id="replicas"><h2>Replicas</h2>{table}</section>
<footer><ul>
<li><a href="api/v1/diagnosis">/api/v1/diagnosis</a>: every replica's findings and the fleet's (JSON)</li>
<li><a href="metrics">/metrics</a>: every replica's kvwatch series, with its labels from the store</li>
<li><a href="healthz">/healthz</a>, <a href="readyz">/readyz</a></li>
</ul></footer>
</main></body></html>
"""


def _quote(name: str) -> str:
    from urllib.parse import quote

    return quote(name, safe="")


def _clock(at: float | None) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(at)) + " UTC" if at else "never"


def create_central_app(central, settings) -> FastAPI:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CentralCollector(central))
    ProcessCollector(registry=registry)
    refused = RefusedRenders()
    registry.register(refused)
    # Rendered once per refresh, whatever scrapes it (as the sidecar does
    # per poll), in a worker thread, within the render bound.
    exposition = Exposition(Renderer(registry), lambda: central.state, refused)
    app = FastAPI(title="kvwatch", version=__version__, docs_url=None, redoc_url=None, redirect_slashes=False)
    token = TokenFile(settings.auth_token_file) if settings.auth_token_file else None
    _add_pages(app, central, settings, exposition, refused)
    _add_api(app, central, settings, refused)
    app.add_middleware(GZipMiddleware, minimum_size=GZIP_MIN_BYTES, compresslevel=GZIP_LEVEL)
    app.add_middleware(HotPaths, monitor=central, exposition=exposition, token=token, paths=route_paths(app))
    return app


def _replica_view(central, request: Request):
    """(view, None) for ?replica=NAME, (None, None) without one, (None,
    response) for a replica the store does not have."""
    name = request.query_params.get("replica")
    if name is None:
        return None, None
    view = central.state.replicas.get(name)
    if view is None:
        return None, JSONResponse({"error": f"no replica {name!r} in the store (see /api/v1/diagnosis)"},
                                  status_code=404)
    return view, None


def _add_pages(app: FastAPI, central, settings, exposition: Exposition, refused: RefusedRenders) -> None:
    """The status page (every replica, or one), /metrics and the probes."""
    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> Response:
        view, missing = _replica_view(central, request)
        if missing is not None:
            return HTMLResponse(f"<!doctype html><p>No replica {html.escape(request.query_params['replica'])} "
                                f'in the store. <a href="./">Every replica</a></p>', status_code=404)
        if view is None:
            return page_route(lambda: index_page(central.state, central), refused, encodings(request))
        return page_route(lambda: render_status_page(view.state, replica_settings(settings, view.name),
                                                     nav='<p><a href="./">\u2190 every replica</a></p>'),
                          refused, encodings(request))

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(exposition.serve(False), media_type=CONTENT_TYPE_LATEST)

    @app.get("/healthz")
    def healthz() -> PlainTextResponse:
        return PlainTextResponse("ok\n")

    @app.get("/readyz")
    def readyz() -> PlainTextResponse:
        status, text = readiness(central)
        return PlainTextResponse(text, status_code=status)


def _add_api(app: FastAPI, central, settings, refused: RefusedRenders) -> None:
    """The JSON API: diagnosis and signals of every replica or one, series of one."""
    @app.get("/api/v1/diagnosis")
    def diagnosis(request: Request) -> Response:
        view, missing = _replica_view(central, request)
        if missing is not None:
            return missing
        state = central.state
        if view is None:
            return json_route(lambda: diagnosis_all(state, central, settings), "/api/v1/diagnosis", refused,
                              encodings(request))
        return json_route(lambda: {"replica": view.name, "labels": view.labels,
                                   **diagnosis_json(view.state, replica_settings(settings, view.name))},
                          "/api/v1/diagnosis", refused, encodings(request))

    @app.get("/api/v1/signals")
    def signals(request: Request) -> Response:
        view, missing = _replica_view(central, request)
        if missing is not None:
            return missing
        state = central.state
        if view is None:
            return json_route(lambda: clean({**central_status(state, central), "replicas": [
                {"replica": name, "labels": v.labels, **signals_json(v.state, replica_settings(settings, name))}
                for name, v in state.replicas.items()]}), "/api/v1/signals", refused, encodings(request))
        return json_route(lambda: {"replica": view.name, "labels": view.labels,
                                   **signals_json(view.state, replica_settings(settings, view.name))},
                          "/api/v1/signals", refused, encodings(request))

    @app.get("/api/v1/series")
    def series(request: Request) -> Response:
        view, missing = _replica_view(central, request)
        if missing is not None:
            return missing
        if view is None:
            return JSONResponse({"error": "central mode serves series per replica: add ?replica=NAME",
                                 "replicas": sorted(central.state.replicas)}, status_code=400)
        return json_route(lambda: series_json(view.state, replica_settings(settings, view.name)), "/api/v1/series",
                          refused, encodings(request))
