"""The page at `/`: a live status page of kvwatch's signals and findings,
readable without Grafana.

The server renders the whole page, so it reads fine without JavaScript (a
<noscript> meta refresh reloads it); a small inline script then fetches
`api/v1/signals` and `api/v1/diagnosis` every few seconds and rebuilds the same
sections from the JSON. No external assets: a Content-Security-Policy with the
hashes of the inline style and script allows nothing else, and the script only
builds DOM nodes with textContent, so model names or config values from the
engine can never become markup. The target is shown without credentials.

Also home of the value formatting that `kvwatch diagnose` prints with.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import time
from typing import Any

from kvwatch.sidecar.report import diagnosis_json, public_url, signals_json
from kvwatch.signals import SIGNALS

REFRESH_SECONDS = 5
GROUP_TITLES = {
    "exhaustion": "KV cache and concurrency",
    "prefix": "Prefix cache",
    "first_token": "Time to first token",
    "throughput": "Throughput",
}


# --------------------------------------------------------------------------
# Formatting shared with the CLI (the script below mirrors it)
# --------------------------------------------------------------------------


def _label_key(key: str) -> str:
    try:
        quantile = float(key)
    except ValueError:
        return key
    return f"p{quantile * 100:g}" if 0 < quantile < 1 else key


def format_value(value: Any, unit: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, dict):
        return ", ".join(f"{_label_key(k)} {format_value(v, unit)}" for k, v in value.items()) or "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value):
        return "–"
    if unit == "ratio":
        return f"{value * 100:.1f}%"
    if unit == "seconds":
        if abs(value) >= 1:
            return f"{value:.2f} s"
        return f"{value * 1000:.3g} ms" if abs(value) >= 0.001 or value == 0 else f"{value * 1e6:.3g} µs"
    if unit == "tokens":
        return f"{value:,.0f}"
    if unit == "per_second":
        return f"{value:.3g}/s"
    if float(value).is_integer():
        return f"{value:.0f}"
    return f"{value:.3g}"


def format_evidence(evidence: dict[str, Any]) -> str:
    parts = []
    for key, value in evidence.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        parts.append(f"{key}={value}")
    return ", ".join(parts)


def signal_columns(signals: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(heading, signal values) per engine, plus a merged column per model
    that runs on more than one engine, from /api/v1/signals' JSON."""
    engines = signals.get("engines", [])
    columns = [(f"{row['model_name']} / {row.get('engine', '?')}", row["signals"]) for row in engines]
    per_model_count: dict[str, int] = {}
    for row in engines:
        per_model_count[row["model_name"]] = per_model_count.get(row["model_name"], 0) + 1
    for row in signals.get("models", []):
        if per_model_count.get(row["model_name"], 0) > 1:
            columns.append((f"{row['model_name']} (all engines)", row["signals"]))
    return columns


# --------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1f24;background:#fff}
h1{font-size:1.5em;margin:0 0 .2em}h2{font-size:1.15em;margin:1.4em 0 .4em}
table{border-collapse:collapse;margin:.3em 0}th,td{border-bottom:1px solid #d0d7de;padding:.25em .6em;
text-align:left;vertical-align:top}th{background:#f6f8fa}td.num{text-align:right;white-space:nowrap}
.sev{font-weight:600;text-transform:uppercase;font-size:.85em}.critical{color:#b42318}.warning{color:#9a6700}
.info{color:#0969da}.up{color:#1a7f37;font-weight:600}.down{color:#b42318;font-weight:600}
.muted{color:#57606a;font-size:.9em}.evidence{font-family:ui-monospace,monospace;font-size:.8em;color:#57606a;
word-break:break-word}.group th{background:#eef1f4}code{background:#f6f8fa;padding:0 .2em}
""".strip()

SCRIPT = r"""
(function () {
  "use strict";
  var meta = JSON.parse(document.getElementById("kvwatch-signals-meta").textContent);
  var body = document.body;
  var every = Number(body.getAttribute("data-refresh-seconds")) * 1000;
  var updates = 0;

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function labelKey(key) {
    var q = Number(key);
    return (key !== "" && q > 0 && q < 1) ? "p" + Number((q * 100).toFixed(6)) : key;
  }
  function fmt(value, unit) {
    if (value === null || value === undefined) return "\u2013";
    if (typeof value === "object") {
      var parts = Object.keys(value).map(function (k) { return labelKey(k) + " " + fmt(value[k], unit); });
      return parts.length ? parts.join(", ") : "\u2013";
    }
    if (typeof value !== "number") return String(value);
    if (!isFinite(value)) return "\u2013";
    if (unit === "ratio") return (value * 100).toFixed(1) + "%";
    if (unit === "seconds") {
      if (Math.abs(value) >= 1) return value.toFixed(2) + " s";
      if (Math.abs(value) >= 0.001 || value === 0) return Number((value * 1000).toPrecision(3)) + " ms";
      return Number((value * 1e6).toPrecision(3)) + " \u00b5s";
    }
    if (unit === "tokens") return Math.round(value).toLocaleString("en-US");
    if (unit === "per_second") return Number(value.toPrecision(3)) + "/s";
    if (Number.isInteger(value)) return String(value);
    return String(Number(value.toPrecision(3)));
  }
  function evidenceText(evidence) {
    return Object.keys(evidence).map(function (k) {
      var v = evidence[k];
      if (typeof v === "number" && !Number.isInteger(v)) v = Number(v.toPrecision(4));
      return k + "=" + v;
    }).join(", ");
  }
  function timeText(seconds) {
    return seconds ? new Date(seconds * 1000).toLocaleTimeString() : "never";
  }

  function renderStatus(signals, diagnosis) {
    var p = el("p");
    p.id = "status";
    p.appendChild(document.createTextNode("Target "));
    p.appendChild(el("code", null, signals.target || ""));
    p.appendChild(document.createTextNode(": "));
    p.appendChild(el("span", signals.up ? "up" : "down",
      signals.up ? "up" : ("down: " + (signals.reason || "") + " " + (signals.detail || "")).trim()));
    p.appendChild(document.createTextNode(" \u00b7 " + signals.polls + " polls, last success " +
      timeText(signals.last_success_time) + " \u00b7 window " +
      Math.round(signals.window_covered_seconds || 0) + " of " + Math.round(signals.window_seconds) + " s"));
    document.getElementById("status").replaceWith(p);
  }

  function renderFindings(diagnosis) {
    var section = el("section");
    section.id = "findings";
    var findings = diagnosis.findings || [];
    section.appendChild(el("h2", null, "Findings (" + findings.length + " active)"));
    if (!findings.length) {
      section.appendChild(el("p", "muted", diagnosis.up ? "No active findings." : "No findings while the engine is not polled."));
    } else {
      var table = el("table");
      var head = el("tr");
      ["Severity", "Symptom", "Cause", "Model / engine", "Confidence", "What and why"].forEach(function (h) {
        head.appendChild(el("th", null, h));
      });
      table.appendChild(head);
      findings.forEach(function (f) {
        var tr = el("tr", "finding");
        tr.setAttribute("data-symptom", f.symptom);
        tr.setAttribute("data-cause", f.cause);
        tr.appendChild(el("td", "sev " + f.severity, f.severity));
        tr.appendChild(el("td", null, f.symptom));
        tr.appendChild(el("td", null, f.cause));
        tr.appendChild(el("td", null, f.model + (f.engine !== null && f.engine !== undefined ? " / " + f.engine : "")));
        tr.appendChild(el("td", null, f.confidence));
        var what = el("td");
        what.appendChild(el("div", null, f.summary));
        what.appendChild(el("div", "evidence", evidenceText(f.evidence || {})));
        what.appendChild(el("div", "muted", "Next: " + f.next_check));
        tr.appendChild(what);
        table.appendChild(tr);
      });
      section.appendChild(table);
    }
    document.getElementById("findings").replaceWith(section);
  }

  function renderSignals(signals) {
    var section = el("section");
    section.id = "signals";
    section.appendChild(el("h2", null, "Signals over the window"));
    var columns = [];
    var perModel = {};
    (signals.engines || []).forEach(function (row) {
      columns.push([row.model_name + " / " + row.engine, row.signals]);
      perModel[row.model_name] = (perModel[row.model_name] || 0) + 1;
    });
    (signals.models || []).forEach(function (row) {
      if (perModel[row.model_name] > 1) columns.push([row.model_name + " (all engines)", row.signals]);
    });
    if (!columns.length) {
      section.appendChild(el("p", "muted", "No engine data yet."));
    } else {
      var table = el("table");
      var head = el("tr");
      head.appendChild(el("th", null, "Signal"));
      columns.forEach(function (c) { head.appendChild(el("th", null, c[0])); });
      table.appendChild(head);
      var group = null;
      meta.forEach(function (s) {
        if (s.group !== group) {
          group = s.group;
          var g = el("tr", "group");
          var th = el("th", null, s.group_title);
          th.colSpan = columns.length + 1;
          g.appendChild(th);
          table.appendChild(g);
        }
        var tr = el("tr");
        var name = el("td", null, s.short);
        name.title = s.name + ": " + s.help;
        tr.appendChild(name);
        columns.forEach(function (c) { tr.appendChild(el("td", "num", fmt(c[1][s.name], s.unit))); });
        table.appendChild(tr);
      });
      section.appendChild(table);
    }
    document.getElementById("signals").replaceWith(section);
  }

  function renderChanges(diagnosis) {
    var section = el("section");
    section.id = "changes";
    section.appendChild(el("h2", null, "Changes in the window"));
    var events = diagnosis.events || [];
    if (!events.length) {
      section.appendChild(el("p", "muted", "None."));
    } else {
      var ul = el("ul");
      events.forEach(function (e) {
        ul.appendChild(el("li", null, timeText(e.time) + " " + e.kind + " " +
          (e.model || "*") + " / " + (e.engine || "*") + ": " + e.detail));
      });
      section.appendChild(ul);
    }
    var u = diagnosis.upstream;
    if (u) {
      section.appendChild(el("h2", null, "Upstream"));
      section.appendChild(el("p", null, u.histogram + " at " + (u.target || "") + ": " +
        (u.up ? "up" : "down (" + (u.reason || "") + ")") + ", mean " + fmt(u.mean_seconds, "seconds") +
        ", p95 " + fmt(u.p95_seconds, "seconds") + " over " + fmt(u.count, "requests") + " requests"));
    }
    document.getElementById("changes").replaceWith(section);
  }

  function get(path) {
    return fetch(path, {cache: "no-store", credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (response) {
        if (!response.ok) throw new Error(path + ": HTTP " + response.status);
        return response.json();
      });
  }

  function refresh() {
    Promise.all([get("api/v1/signals"), get("api/v1/diagnosis")]).then(function (both) {
      renderStatus(both[0], both[1]);
      renderFindings(both[1]);
      renderSignals(both[0]);
      renderChanges(both[1]);
      updates += 1;
      body.setAttribute("data-updates", String(updates));
      document.getElementById("live").textContent = "Live: refreshed " + new Date().toLocaleTimeString() +
        ", every " + (every / 1000) + " s.";
    }).catch(function (error) {
      document.getElementById("live").textContent = "Live refresh paused (" + error.message +
        "); showing the last data. Reload the page to retry.";
    }).then(function () {
      window.setTimeout(refresh, every);
    });
  }
  window.setTimeout(refresh, every);
})();
""".strip()


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; script-src {_csp_hash(SCRIPT)}; style-src {_csp_hash(STYLE)}; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)


def _signals_meta() -> list[dict[str, str]]:
    order = list(GROUP_TITLES)
    ordered = sorted(SIGNALS, key=lambda s: order.index(s.group) if s.group in order else len(order))
    return [
        {"name": s.name, "short": s.name[len("kvwatch_"):], "unit": s.unit, "help": s.help, "group": s.group,
         "group_title": GROUP_TITLES.get(s.group, s.group)}
        for s in ordered
    ]


def _json_for_script(value: Any) -> str:
    # Inside <script type="application/json"> only "</" could end the element.
    return json.dumps(value).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _time_text(seconds: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(seconds)) if seconds else "never"


def _status_html(signals: dict[str, Any]) -> str:
    if signals["up"]:
        state = '<span class="up">up</span>'
    else:
        state = f'<span class="down">{_e(("down: " + (signals["reason"] or "") + " " + (signals["detail"] or "")).strip())}</span>'
    return (
        f'<p id="status">Target <code>{_e(signals["target"] or "")}</code>: {state} · {signals["polls"]} polls, '
        f'last success {_time_text(signals["last_success_time"])} · window '
        f'{round(signals["window_covered_seconds"] or 0)} of {round(signals["window_seconds"])} s</p>'
    )


def _findings_html(diagnosis: dict[str, Any]) -> str:
    findings = diagnosis["findings"]
    out = [f'<section id="findings"><h2>Findings ({len(findings)} active)</h2>']
    if not findings:
        out.append('<p class="muted">' + ("No active findings." if diagnosis["up"]
                                          else "No findings while the engine is not polled.") + "</p>")
    else:
        out.append("<table><tr><th>Severity</th><th>Symptom</th><th>Cause</th><th>Model / engine</th>"
                   "<th>Confidence</th><th>What and why</th></tr>")
        for f in findings:
            where = f["model"] + (f" / {f['engine']}" if f["engine"] is not None else "")
            out.append(
                f'<tr class="finding" data-symptom="{_e(f["symptom"])}" data-cause="{_e(f["cause"])}">'
                f'<td class="sev {_e(f["severity"])}">{_e(f["severity"])}</td><td>{_e(f["symptom"])}</td>'
                f'<td>{_e(f["cause"])}</td><td>{_e(where)}</td><td>{_e(f["confidence"])}</td>'
                f'<td><div>{_e(f["summary"])}</div><div class="evidence">{_e(format_evidence(f["evidence"]))}</div>'
                f'<div class="muted">Next: {_e(f["next_check"])}</div></td></tr>'
            )
        out.append("</table>")
    out.append("</section>")
    return "".join(out)


def _signals_html(signals: dict[str, Any]) -> str:
    columns = signal_columns(signals)
    out = ['<section id="signals"><h2>Signals over the window</h2>']
    if not columns:
        out.append('<p class="muted">No engine data yet.</p></section>')
        return "".join(out)
    out.append("<table><tr><th>Signal</th>" + "".join(f"<th>{_e(h)}</th>" for h, _ in columns) + "</tr>")
    group = None
    for s in _signals_meta():
        if s["group"] != group:
            group = s["group"]
            out.append(f'<tr class="group"><th colspan="{len(columns) + 1}">{_e(s["group_title"])}</th></tr>')
        out.append(f'<tr><td title="{_e(s["name"] + ": " + s["help"])}">{_e(s["short"])}</td>'
                   + "".join(f'<td class="num">{_e(format_value(values.get(s["name"]), s["unit"]))}</td>'
                             for _, values in columns) + "</tr>")
    out.append("</table></section>")
    return "".join(out)


def _changes_html(diagnosis: dict[str, Any]) -> str:
    out = ['<section id="changes"><h2>Changes in the window</h2>']
    events = diagnosis["events"]
    if not events:
        out.append('<p class="muted">None.</p>')
    else:
        out.append("<ul>" + "".join(
            f"<li>{_time_text(e['time'])} {_e(e['kind'])} {_e(e['model'] or '*')} / {_e(e['engine'] or '*')}: "
            f"{_e(e['detail'])}</li>" for e in events) + "</ul>")
    upstream = diagnosis.get("upstream")
    if upstream:
        state = "up" if upstream.get("up") else f"down ({upstream.get('reason') or ''})"
        out.append(
            f"<h2>Upstream</h2><p>{_e(upstream.get('histogram'))} at {_e(upstream.get('target') or '')}: {_e(state)}, "
            f"mean {_e(format_value(upstream.get('mean_seconds'), 'seconds'))}, p95 "
            f"{_e(format_value(upstream.get('p95_seconds'), 'seconds'))} over "
            f"{_e(format_value(upstream.get('count'), 'requests'))} requests</p>")
    out.append("</section>")
    return "".join(out)


def render_status_page(state, settings) -> str:
    signals = signals_json(state, settings)
    diagnosis = diagnosis_json(state, settings)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{_e(CONTENT_SECURITY_POLICY)}">
<noscript><meta http-equiv="refresh" content="{REFRESH_SECONDS * 2}"></noscript>
<link rel="icon" href="data:,">
<title>kvwatch: {_e(public_url(settings.target) or "")}</title>
<style>{STYLE}</style>
</head>
<body data-refresh-seconds="{REFRESH_SECONDS}" data-updates="0">
<header><h1>kvwatch</h1>
{_status_html(signals)}
<p id="live" class="muted">Rendered {_time_text(time.time())}; refreshes every {REFRESH_SECONDS} s.</p>
</header>
{_findings_html(diagnosis)}
{_signals_html(signals)}
{_changes_html(diagnosis)}
<footer><h2>More</h2><ul>
<li><a href="metrics">/metrics</a>: Prometheus metrics (kvwatch_* signals, kvwatch_finding, kvwatch_engine_*)</li>
<li><a href="api/v1/signals">/api/v1/signals</a>: windowed signals (JSON)</li>
<li><a href="api/v1/diagnosis">/api/v1/diagnosis</a>: findings with evidence (JSON)</li>
<li><a href="healthz">/healthz</a>, <a href="readyz">/readyz</a></li>
</ul>
<p class="muted">A prefix-cache hit means KV computed earlier was reused; it proves neither that an answer is current nor that the caller may see it.</p>
</footer>
<script type="application/json" id="kvwatch-signals-meta">{_json_for_script(_signals_meta())}</script>
<script>{SCRIPT}</script>
</body></html>
"""
