"""The page at `/`: a status console an on-call engineer reads in five
seconds, with or without Grafana.

From the top: a banner with the worst active finding (or one sentence on why
the engine is not read); the selected engine's key numbers as large figures,
coloured by the diagnosis' own thresholds (sent in the JSON, never copied
here) and by a finding only where their own value is bad; one row per engine, sortable, worst first, a click selects one; trend
charts over the window the sidecar holds, with findings and changes marked on
the time axis; the findings as cards (a headline, at most three deciding
numbers, one next action and its runbook; the prose, the other causes and
every value folded); the changes. With `demo_target` (make run), a strip
above the banner names the simulated phase now, the next and when.

The page carries the monitor's last state as JSON and draws itself from it at
once (it never waits on the engine), then a small inline script refreshes it
from `api/v1/signals`, `api/v1/diagnosis` and `api/v1/series` every few
seconds. Charts are inline SVG drawn by that script. No external assets: a
Content-Security-Policy with the hashes of the inline style and script allows
nothing else, and the script builds DOM nodes with textContent only, so model
names or config values from the engine can never become markup. Without
JavaScript a <noscript> summary (status, findings, signals) and a meta refresh
stand in. The target is shown without credentials.

Also home of the value formatting and the signal labels that `kvwatch
diagnose` prints with (labels and units come from the catalogue).
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
import time
from typing import Any

from kvwatch.diagnose.arbitration import DECIDERS
from kvwatch.diagnose.vocabulary import NEXT_ACTION, SEVERITIES
from kvwatch.sidecar.report import diagnosis_json, public_url, signals_json
from kvwatch.sidecar.series import series_json
from kvwatch.signals import SIGNALS, SIGNALS_BY_NAME, UNITS
from kvwatch.snapshot import bounded_text

REFRESH_SECONDS = 5
GROUP_TITLES = {
    "exhaustion": "KV cache and concurrency",
    "prefix": "Prefix cache",
    "first_token": "Time to first token",
    "throughput": "Throughput",
}
# The unit a reader sees beside a label when the formatted value does not say it.

# What the banner and the cards call each symptom and cause.
SYMPTOM_TITLES = {
    "exhaustion": "KV cache exhausted",
    "low_hit_rate": "Low prefix-cache hit rate",
    "slow_first_token": "Slow first token",
    "change": "Engine changed",
}
CAUSE_TITLES = {
    "concurrency_beyond_capacity": "more concurrent requests than the cache holds",
    "long_requests": "a few very long requests fill the cache",
    "capacity_below_max_num_seqs": "the scheduler admits more requests than the cache holds",
    "caching_disabled": "prefix caching is off",
    "cold_cache": "the cache is cold after a restart",
    "prefix_changed": "the prompt prefix changed",
    "eviction_before_reuse": "prefixes are evicted before they are reused",
    "no_reuse": "the requests share little prefix",
    "queueing_kv_bound": "requests queue for KV blocks",
    "queueing_compute_bound": "requests queue for compute, not KV",
    "prefill": "long uncached prompts (prefill)",
    "front_end": "time outside queue and prefill (front end)",
    "preemption": "requests preempted and recomputed in a full cache",
    "upstream": "time spent before the engine (upstream)",
    "model_changed": "the model changed",
    "lora_changed": "the LoRA adapters changed",
    "cache_dtype_changed": "the KV-cache dtype changed",
    "cache_config_changed": "the cache configuration changed",
    "engine_restarted": "the engine restarted",
}
# The two or three evidence values that decided each cause: highlighted on
# its card (the rest of the evidence is folded away). The first present win.
DECIDING = {
    "concurrency_beyond_capacity": ("kv_usage_max", "waiting_at_peak", "preemptions", "demand_at_peak"),
    "long_requests": ("kv_usage_max", "capacity_share_per_running_request", "running_mean"),
    "capacity_below_max_num_seqs": ("kv_cache_capacity_requests", "max_num_seqs", "preemptions"),
    "caching_disabled": ("enable_prefix_caching", "prompt_tokens"),
    "cold_cache": ("hit_ratio_since_restart", "hit_ratio_before_restart"),
    "prefix_changed": ("hit_ratio_baseline", "hit_ratio_recent", "kv_usage_recent_max", "kv_usage_max"),
    "eviction_before_reuse": ("hit_ratio_baseline", "hit_ratio_recent", "kv_usage_recent_max", "kv_usage_max"),
    "no_reuse": ("hit_ratio", "kv_usage_mean"),
    "queueing_kv_bound": ("ttft_p95_seconds", "queue_share", "kv_usage_max_while_waiting"),
    "queueing_compute_bound": ("ttft_p95_seconds", "queue_share", "kv_usage_max_while_waiting"),
    "prefill": ("ttft_p95_seconds", "prefill_share", "uncached_prompt_tokens_mean"),
    "front_end": ("ttft_p95_seconds", "other_share", "other_lower_bound_seconds"),
    "preemption": ("ttft_p95_seconds", "other_share", "preemptions"),
    "upstream": ("upstream_mean_seconds", "upstream_share", "ttft_mean_seconds"),
    "model_changed": ("detail", "seconds_ago"),
    "lora_changed": ("detail", "seconds_ago"),
    "cache_dtype_changed": ("detail", "seconds_ago"),
    "cache_config_changed": ("detail", "seconds_ago"),
    "engine_restarted": ("detail", "seconds_ago"),
}

# The key figures, and how each is coloured: `rules` compare the value with a
# threshold of the diagnosis (by name: the page reads its value from the
# JSON's `thresholds`) or with a stated value, first match wins; a figure
# that a rule marks (its own value is bad) and whose symptom has an active
# finding on that engine takes at least the finding's colour; a calm value
# stays calm whatever the finding. `series` names its trend in /api/v1/series.
FIGURES = (
    {"key": "kv_usage", "signal": "kvwatch_kv_cache_usage_ratio", "series": "kv_usage", "symptoms": ["exhaustion"],
     "over": "poll",
     "rules": [{"state": "bad", "threshold": "exhaustion_usage_ratio", "op": ">="},
               {"state": "warn", "threshold": "eviction_usage_ratio", "op": ">="}]},
    {"key": "headroom", "signal": "kvwatch_kv_cache_free_tokens", "same_as": "kv_usage", "symptoms": ["exhaustion"],
     "over": "poll",
     "rules": []},
    {"key": "hit_ratio", "signal": "kvwatch_prefix_cache_hit_ratio", "series": "hit_ratio", "over": "window",
     "symptoms": ["low_hit_rate"], "rules": [{"state": "warn", "threshold": "hit_ratio_low", "op": "<"}]},
    {"key": "ttft_p95", "signal": "kvwatch_time_to_first_token_seconds", "quantile": "0.95", "series": "ttft_p95",
     "over": "window",
     "symptoms": ["slow_first_token"], "rules": [{"state": "bad", "threshold": "ttft_p95_seconds", "op": ">"}]},
    {"key": "waiting", "signal": "kvwatch_requests_waiting", "series": "waiting", "symptoms": ["exhaustion"],
     "over": "poll",
     "rules": [{"state": "warn", "value": 0, "op": ">"}]},
    {"key": "preemptions", "signal": "kvwatch_preemptions_per_second", "series": "preemptions_per_second",
     "over": "window",
     "symptoms": ["exhaustion"], "rules": [{"state": "bad", "value": 0, "op": ">"}]},
)
# The trend charts: (series, title, unit, threshold drawn as a line).
TRENDS = (
    {"series": "kv_usage", "title": "KV cache usage", "unit": "ratio", "threshold": "exhaustion_usage_ratio",
     "max": 1},
    {"series": "hit_ratio", "title": "Prefix cache hit ratio", "unit": "ratio", "threshold": "hit_ratio_low",
     "max": 1},
    {"series": "ttft_p95", "title": "Time to first token p95", "unit": "seconds", "threshold": "ttft_p95_seconds"},
    {"series": "ttft_split", "title": "Time to first token: queue / prefill / other", "unit": "ratio",
     "stack": ["queue_share", "prefill_share", "other_share"], "max": 1},
    {"series": "waiting", "title": "Requests waiting", "unit": "requests"},
    {"series": "preemptions_per_second", "title": "Preemptions", "unit": "per_second"},
)


def signal_label(name: str) -> str:
    """A signal's human label with its unit where the value does not carry it."""
    signal = SIGNALS_BY_NAME[name]
    unit = UNITS[signal.unit].label
    return f"{signal.display} ({unit})" if unit else signal.display


# --------------------------------------------------------------------------
# Formatting shared with the CLI (the script below mirrors it)
# --------------------------------------------------------------------------


def _label_key(key: str) -> str:
    try:
        quantile = float(key)
    except ValueError:
        return key
    return f"p{quantile * 100:g}" if 0 < quantile < 1 else key


def format_value(value: Any, unit: str, pinned: dict[str, str] | str | None = None) -> str:
    """A value as a person reads it. `pinned` says which values are bounds
    (the JSON's `pinned`): {quantile: "<" | ">"} for a dict of quantiles, or
    "<" / ">" for a single value, written before it ("< 300 ms", "> 80 s")."""
    if value is None:
        return "–"
    if isinstance(value, dict):
        bounds = pinned if isinstance(pinned, dict) else {}
        return ", ".join(f"{_label_key(k)} {format_value(v, unit, bounds.get(k))}" for k, v in value.items()) or "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if not math.isfinite(value):
        return "–"
    text = _format_number(value, unit)
    return bounded_text(text, pinned if isinstance(pinned, str) else None)


def _three(value: float) -> str:
    """Three significant digits, never in exponent notation: 3040, 0.0123,
    as the page's script writes Number(x.toPrecision(3)) (`:.3g` wrote
    3.04e+03 and, for 0.9996 s, "1e+03 ms")."""
    rounded = float(f"{value:.3g}")
    if rounded == 0:
        return "0"
    decimals = max(0, 2 - math.floor(math.log10(abs(rounded))))
    text = f"{rounded:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _format_number(value: float, unit: str) -> str:
    if unit == "ratio":
        return f"{value * 100:.1f}%"
    if unit == "seconds":
        if abs(value) >= 1:
            return f"{value:.2f} s"
        return f"{_three(value * 1000)} ms" if abs(value) >= 0.001 or value == 0 else f"{_three(value * 1e6)} µs"
    if unit in ("tokens", "bytes"):
        # Halves up, as the script's Math.round (format's own rounding goes to even: 12.5 -> 12).
        return f"{math.floor(value + 0.5):,}"
    if unit == "per_second":
        return f"{_three(value)}/s"
    if float(value).is_integer():
        return f"{value:.0f}"
    return _three(value)


def format_evidence(evidence: dict[str, Any], pinned: dict[str, str] | None = None) -> str:
    parts = []
    for key, value in evidence.items():
        if isinstance(value, float):
            value = f"{value:.4g}"
        bound = (pinned or {}).get(key)
        parts.append(f"{key}{bound if bound else '='}{value}")
    return ", ".join(parts)


def signal_columns(signals: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, dict[str, str]]]]:
    """(heading, signal values, pinned quantiles) per engine, plus a merged
    column per model that runs on more than one engine, from /api/v1/signals' JSON."""
    engines = signals.get("engines", [])
    columns = [(f"{row['model_name']} / {row.get('engine', '?')}", row["signals"], row.get("pinned") or {})
               for row in engines]
    per_model_count: dict[str, int] = {}
    for row in engines:
        per_model_count[row["model_name"]] = per_model_count.get(row["model_name"], 0) + 1
    for row in signals.get("models", []):
        if per_model_count.get(row["model_name"], 0) > 1:
            columns.append((f"{row['model_name']} (all engines)", row["signals"], row.get("pinned") or {}))
    return columns


# --------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------

STYLE = """
:root{--bg:#f6f8fa;--panel:#fff;--fg:#1b1f24;--muted:#59636e;--line:#d1d9e0;--ok:#1a7f37;--warn:#9a6700;
--bad:#cf222e;--info:#0969da;--okbg:#dafbe1;--warnbg:#fff8c5;--badbg:#ffebe9;--infobg:#ddf4ff;--chart:#0969da;
--c1:#bf8700;--c2:#8250df;--c3:#59636e}
@media (prefers-color-scheme:dark){:root{--bg:#0d1117;--panel:#161b22;--fg:#e6edf3;--muted:#9198a1;--line:#30363d;
--ok:#3fb950;--warn:#d29922;--bad:#f85149;--info:#58a6ff;--okbg:#12261e;--warnbg:#272115;--badbg:#2d1214;
--infobg:#121d2f;--chart:#58a6ff;--c1:#d29922;--c2:#a371f7;--c3:#9198a1}}
*{box-sizing:border-box}html{color-scheme:light dark}
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:var(--fg);background:var(--bg);
overflow-wrap:anywhere}
main{max-width:1600px;margin:0 auto;padding:12px 16px 24px}
h1{font-size:18px;margin:0}h2{font-size:15px;margin:20px 0 8px}a{color:var(--info)}
header{display:flex;flex-wrap:wrap;gap:4px 16px;align-items:baseline}
.muted{color:var(--muted)}code{font-family:ui-monospace,monospace;font-size:.92em}
.banner{margin:12px 0;padding:12px 16px;border-radius:8px;border-left:6px solid var(--muted);background:var(--panel)}
.banner .head{font-size:18px;font-weight:650}.banner p{margin:4px 0 0}
.sev-critical{border-color:var(--bad);background:var(--badbg)}.sev-warning{border-color:var(--warn);background:var(--warnbg)}
.sev-info{border-color:var(--info);background:var(--infobg)}.sev-ok{border-color:var(--ok);background:var(--okbg)}
.sev-down{border-color:var(--bad);background:var(--badbg)}
.pill{display:inline-block;font-size:11px;font-weight:700;text-transform:uppercase;letter-spacing:.04em;
padding:1px 7px;border-radius:10px;color:#fff;background:var(--muted);vertical-align:2px;margin-right:6px}
.pill.critical{background:var(--bad)}.pill.warning{background:var(--warn)}.pill.info{background:var(--info)}
.pill.ok{background:var(--ok)}.pill,td{overflow-wrap:normal}.pill{white-space:nowrap}
#engines td:first-child{white-space:nowrap}
.figures{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:8px}
.fig{background:var(--panel);border:1px solid var(--line);border-top:4px solid var(--line);border-radius:8px;
padding:8px 12px}
.fig .label{color:var(--muted);font-size:12px}.fig .value{font-size:30px;font-weight:650;line-height:1.2;
font-variant-numeric:tabular-nums}.fig .sub{color:var(--muted);font-size:12px}
.state-ok{border-top-color:var(--ok)}.state-warn{border-top-color:var(--warn)}.state-bad{border-top-color:var(--bad)}
.state-warn .value,td.state-warn{color:var(--warn)}.state-bad .value,td.state-bad{color:var(--bad)}
td.state-warn,td.state-bad{font-weight:650}
.scroll{overflow-x:auto}
table{border-collapse:collapse;width:100%;background:var(--panel)}
th,td{border-bottom:1px solid var(--line);padding:5px 8px;text-align:left;vertical-align:top}
th{font-size:12px;color:var(--muted);font-weight:600;white-space:nowrap}td.num,th.num{text-align:right;
font-variant-numeric:tabular-nums}
#engines th{cursor:pointer;user-select:none}#engines tbody tr{cursor:pointer}
#engines tr.selected td{background:var(--infobg)}
.charts{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,320px),1fr));gap:8px}
.chart{background:var(--panel);border:1px solid var(--line);border-radius:8px;padding:6px 10px}
.chart .title{display:flex;justify-content:space-between;gap:8px;font-size:12px;color:var(--muted)}
.chart .now{color:var(--fg);font-weight:600}
.chart svg{display:block;width:100%;height:72px}
.chart .axis{display:flex;justify-content:space-between;font-size:11px;color:var(--muted)}
.line{fill:none;stroke:var(--chart);stroke-width:1.5;vector-effect:non-scaling-stroke}
.thr{stroke:var(--bad);stroke-dasharray:4 3;stroke-width:1;vector-effect:non-scaling-stroke;opacity:.7}
.band0{fill:var(--c1)}.band1{fill:var(--c2)}.band2{fill:var(--c3);opacity:.5}
.mark{stroke-width:1.5;vector-effect:non-scaling-stroke}.mark.change{stroke:var(--muted);stroke-dasharray:2 2}
.mark.critical{stroke:var(--bad)}.mark.warning{stroke:var(--warn)}.mark.info{stroke:var(--info)}
.legend span{margin-right:8px}.legend .k0{color:var(--c1)}.legend .k1{color:var(--c2)}.legend .k2{color:var(--c3)}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(min(100%,420px),1fr));gap:8px}
.card{background:var(--panel);border:1px solid var(--line);border-left:6px solid var(--muted);border-radius:8px;
padding:10px 14px}
.card h3{font-size:15px;margin:0 0 4px}.card p{margin:6px 0}.card .where{color:var(--muted);font-size:12px}
.card.critical{border-left-color:var(--bad)}.card.warning{border-left-color:var(--warn)}
.card.info{border-left-color:var(--info)}
.card.clearing,.banner.clearing{opacity:.6;border-left-color:var(--muted)}.card .factor{font-size:13px}
.deciding{display:flex;flex-wrap:wrap;gap:6px;margin:6px 0}
.num-chip{border:1px solid var(--line);border-radius:6px;padding:2px 8px;font-size:12px;color:var(--muted)}
.num-chip b{font-size:15px;color:var(--fg);margin-left:4px;font-variant-numeric:tabular-nums}
.phase-strip{margin:10px 0 0;padding:6px 12px;border:1px dashed var(--line);border-radius:8px;background:var(--panel)}
.phase-strip b{margin-right:6px}.phase-strip .now,.phase-strip .next{font-weight:650}
details{margin-top:6px}summary{cursor:pointer;color:var(--muted);font-size:12px}
details table{font-size:12px;margin-top:4px}
ul.changes{padding-left:18px;margin:0}
@media (max-width:720px){main{padding:8px}.fig .value{font-size:24px}.wide{display:none}
#engines .pill{font-size:0;width:10px;height:10px;padding:0;vertical-align:0;margin-right:4px}
#engines th,#engines td{padding:5px 3px;font-size:13px}
.figures{grid-template-columns:repeat(2,minmax(0,1fr))}}
""".strip()

SCRIPT = r"""
(function () {
  "use strict";
  var meta = JSON.parse(document.getElementById("kvwatch-meta").textContent);
  var data = JSON.parse(document.getElementById("kvwatch-state").textContent);
  var body = document.body;
  var every = Number(body.getAttribute("data-refresh-seconds")) * 1000;
  var updates = 0, selected = null, sortKey = "worst", sortDir = 1;
  var SVGNS = "http://www.w3.org/2000/svg";
  var SEV = {critical: 0, warning: 1, info: 2};
  var STATE_RANK = {bad: 3, warn: 2, ok: 1, none: 0};

  function el(tag, cls, text) {
    var node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }
  function svg(tag, attrs) {
    var node = document.createElementNS(SVGNS, tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    return node;
  }
  function add(parent) {
    for (var i = 1; i < arguments.length; i++) if (arguments[i]) parent.appendChild(arguments[i]);
    return parent;
  }
  function swap(id, node) { node.id = id; document.getElementById(id).replaceWith(node); }
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
      if (Math.abs(value) >= 0.001 || value === 0) return three(value * 1000) + " ms";
      return three(value * 1e6) + " \u00b5s";
    }
    if (unit === "tokens" || unit === "bytes") return (Math.round(value) || 0).toLocaleString("en-US");
    if (unit === "per_second") return three(value) + "/s";
    if (Number.isInteger(value)) return String(value);
    return three(value);
  }
  // Three significant digits, never in exponent notation (statuspage._three).
  function three(value) {
    var rounded = Number(value.toPrecision(3));
    if (rounded === 0) return "0";
    var text = rounded.toFixed(Math.max(0, 2 - Math.floor(Math.log10(Math.abs(rounded)))));
    return text.indexOf(".") >= 0 ? text.replace(/0+$/, "").replace(/\.$/, "") : text;
  }
  function clock(seconds) { return seconds ? new Date(seconds * 1000).toTimeString().slice(0, 8) : "never"; }
  function minutes(seconds) { return new Date(seconds * 1000).toTimeString().slice(0, 5); }
  // "since 14:02, 6 min ago": when a finding was first seen, against the latest poll.
  // A held finding (diagnosis: finding_hold_seconds) says it is clearing, and when it ends unless it returns.
  function sinceText(f, now, hold) {
    var text = f.since ? "since " + minutes(f.since) + ", " + span(Math.max(0, (now || f.since) - f.since)) + " ago"
      : "active now";
    if (!f.clearing_since) return text;
    return text + " \u00b7 clearing: condition clear since " + clock(f.clearing_since) +
      (hold ? ", ends at " + clock(f.clearing_since + hold) + " unless it returns" : "");
  }
  function where(f) { return f.model_name + (f.engine !== null && f.engine !== undefined ? " / " + f.engine : ""); }
  // The runbook section: a link (kvwatch serves the runbooks at runbooks#<section>).
  function runbookNode(f) {
    if (!f.runbook) return null;
    var p = el("p", "runbook");
    p.setAttribute("data-runbook", f.runbook);
    p.appendChild(el("b", null, "Runbook: "));
    if (/^(https?:\/\/|runbooks#|\/runbooks#)/.test(f.runbook)) {
      var a = el("a", null, f.runbook);
      a.href = f.runbook;
      a.rel = "noopener";
      p.appendChild(a);
    } else p.appendChild(el("code", null, f.runbook));
    return p;
  }
  function span(seconds) {
    seconds = Math.max(0, Math.round(seconds));
    if (seconds < 90) return seconds + " s";
    if (seconds < 5400) return Math.round(seconds / 60) + " min";
    return (seconds / 3600).toFixed(1) + " h";
  }
  function keyOf(row) { return row.model_name + " / " + row.engine; }
  // A finding that cannot be told from another cause says so in its title, not only below it:
  // the headline never claims more than its evidence (diagnose/arbitration.py, alternatives).
  function title(f) {
    var alts = (f.alternatives || []).map(function (a) { return meta.causes[a.cause] || a.cause; });
    return (meta.symptoms[f.symptom] || f.symptom) + ": " + (meta.causes[f.cause] || f.cause) +
      (alts.length ? ", or " + alts.join(", or ") : "");
  }
  // A quantile pinned at a bucket edge is a bound: "< 300 ms", "> 80 s"
  // (the row's `pinned`: {signal: {quantile: "<" | ">"}}).
  function pinnedBound(row, signal, quantile) {
    var bounds = (row.pinned || {})[signal] || {};
    return bounds[quantile] === "<" || bounds[quantile] === ">" ? bounds[quantile] : null;
  }
  function bounded(text, bound) { return bound ? bound + " " + text : text; }
  function figureValue(fig, row) {
    var v = row.signals[fig.signal];
    if (fig.quantile) v = v ? v[fig.quantile] : null;
    return (v === undefined) ? null : v;
  }
  function compare(value, rule, thresholds) {
    var limit = rule.threshold ? thresholds[rule.threshold] : rule.value;
    if (value === null || limit === null || limit === undefined) return false;
    if (rule.op === ">=") return value >= limit;
    if (rule.op === ">") return value > limit;
    if (rule.op === "<") return value < limit;
    return value <= limit;
  }
  function findingsFor(row, findings) {
    return findings.filter(function (f) { return f.model_name === row.model_name && (f.engine === row.engine || f.engine === null); });
  }
  // The state of every figure of one engine: its threshold, raised by an active finding of its symptom.
  function figureStates(row, findings, thresholds) {
    var states = {};
    meta.figures.forEach(function (fig) {
      if (fig.same_as) return;
      var value = figureValue(fig, row);
      var state = value === null ? "none" : "ok";
      for (var i = 0; i < fig.rules.length; i++) {
        if (compare(value, fig.rules[i], thresholds)) { state = fig.rules[i].state; break; }
      }
      // A finding deepens the colour of a figure its own threshold already marks, never of a
      // calm one: "Waiting 0" or "KV usage 0.0%" is not red because exhaustion was diagnosed.
      var own = state;
      findings.forEach(function (f) {
        if (fig.symptoms.indexOf(f.symptom) < 0 || f.severity === "info") return;
        if (own !== "warn" && own !== "bad") return;
        var raised = f.severity === "critical" ? "bad" : "warn";
        if (STATE_RANK[raised] > STATE_RANK[state]) state = raised;
      });
      states[fig.key] = state;
    });
    meta.figures.forEach(function (fig) { if (fig.same_as) states[fig.key] = states[fig.same_as]; });
    return states;
  }
  function figureText(fig, row) {
    var value = figureValue(fig, row);
    var text = fmt(value, meta.units[fig.signal]);
    if (fig.quantile && value !== null) text = bounded(text, pinnedBound(row, fig.signal, fig.quantile));
    return text;
  }
  function worstRank(row, findings) {
    var mine = findingsFor(row, findings);
    return mine.length ? Math.min.apply(null, mine.map(function (f) { return SEV[f.severity]; })) : 3;
  }
  function enginesWorstFirst(signals, diagnosis) {
    var findings = diagnosis.findings || [];
    return (signals.engines || []).slice().sort(function (a, b) {
      var d = worstRank(a, findings) - worstRank(b, findings);
      if (d) return d;
      var ua = a.signals.kvwatch_kv_cache_usage_ratio || 0, ub = b.signals.kvwatch_kv_cache_usage_ratio || 0;
      return ub - ua || keyOf(a).localeCompare(keyOf(b));
    });
  }

  // "22 of 60 s" while the window fills; once full, the span the figures cover (it holds
  // one poll at or before its start, so it spans a little more than set: not "62 of 60 s").
  function windowText(signals) {
    var covered = Math.round(signals.window_covered_seconds || 0), set = Math.round(signals.window_seconds);
    return covered < set ? covered + " of " + set + " s" : covered + " s";
  }
  // A replay (kvwatch serve --replay) is marked, with recorded times: it must never read as live.
  function renderStatus(signals) {
    var p = el("p", "muted"), replay = signals.replay;
    if (replay) {
      var mark = el("span", "pill " + (replay.finished ? "info" : "warning"), replay.finished ? "replay ended" : "replay");
      mark.setAttribute("data-replay", replay.finished ? "finished" : "running");
      add(p, mark, document.createTextNode(replay.text + " \u00b7 "));
    }
    add(p, document.createTextNode("Target "), el("code", null, signals.target || ""),
      document.createTextNode(" \u00b7 " + (signals.up ? "up" : "down") + " \u00b7 " + signals.polls +
        " polls \u00b7 window " + windowText(signals) + " \u00b7 " + (replay ? "recorded time " : "last poll ") +
        clock(signals.last_success_time)));
    swap("status", p);
  }
  function liveText(signals) {
    var replay = signals.replay;
    if (replay && replay.finished) return "Replay ended: the page shows the recording's last state (recorded " +
      clock(signals.last_success_time) + "); nothing new will come.";
    return (replay ? "Replay: refreshed " : "Live: refreshed ") + clock(Date.now() / 1000) + ", every " + (every / 1000) + " s.";
  }

  // Why, in the sidecar's one sentence per failure (kvwatch.scrape.SENTENCES: the JSON's
  // `detail`, which /readyz and the CLI print too).
  function downSentence(signals) {
    var why = signals.detail || "the poll failed (" + (signals.reason || "") + ")";
    var last = signals.last_success_time ? "The last good poll was at " + clock(signals.last_success_time) + "." :
      "No poll has succeeded yet.";
    return "kvwatch cannot read the engine's metrics at " + (signals.target || "its target") + ": " + why + ". " + last;
  }

  // The demo's phase strip (demo_target, set by make run): the simulated phase now, the next and when.
  function clockText(seconds) {
    var whole = Math.max(0, Math.round(seconds)), h = Math.floor(whole / 3600), m = Math.floor(whole % 3600 / 60),
      s = whole % 60, two = function (n) { return (n < 10 ? "0" : "") + n; };
    return h ? h + ":" + two(m) + ":" + two(s) : m + ":" + two(s);
  }
  var countdownFrom = null;
  window.setInterval(function () {
    if (countdownFrom && countdownFrom.node.isConnected) countdownFrom.node.textContent =
      clockText(Math.max(0, countdownFrom.seconds - (Date.now() - countdownFrom.at) / 1000));
  }, 1000);
  function renderPhase(signals) {
    var node = el("div"), d = signals.demo;
    countdownFrom = null;
    if (d !== undefined) {
      node.className = "phase-strip";
      node.appendChild(el("b", null, "Demo:"));
      if (!d) node.appendChild(document.createTextNode(" the simulator's phase is unknown (its /sim/phase did not answer)."));
      else {
        node.setAttribute("data-phase", d.phase);
        node.setAttribute("data-next", d.next || "");
        add(node, document.createTextNode(" now: "), el("span", "now", d.phase),
          d.note ? document.createTextNode(" (" + d.note + ")") : null);
        if (d.next && d.next_in_seconds !== null) {
          var countdown = el("span", "countdown", clockText(d.next_in_seconds));
          add(node, document.createTextNode(" \u00b7 next: "), el("span", "next", d.next),
            document.createTextNode(" in "), countdown, document.createTextNode(d.clock === "simulated" ? " (simulated)" : ""));
          // In wall time the countdown runs between refreshes (from when this data arrived).
          if (d.clock === "wall") countdownFrom = {node: countdown, seconds: d.next_in_seconds, at: Date.now()};
        }
        if (d.cycle_seconds) node.appendChild(document.createTextNode(" \u00b7 a loop of " + (d.phases || "its") +
          " phases takes " + clockText(d.cycle_seconds) + (d.speed ? " at speed " + d.speed : "") +
          " (SPEED=N make run runs it N times faster)"));
      }
    }
    swap("phase", node);
  }

  function renderBanner(signals, diagnosis) {
    var div = el("div", "banner");
    var findings = diagnosis.findings || [];
    if (!signals.up) {
      div.className += " sev-down";
      div.setAttribute("data-state", "down");
      add(div, add(el("div", "head"), el("span", "pill critical", "down"), document.createTextNode("Engine not read")),
        el("p", null, downSentence(signals)));
    } else if (!findings.length) {
      div.className += " sev-ok";
      div.setAttribute("data-state", "ok");
      var n = (signals.engines || []).length;
      add(div, add(el("div", "head"), el("span", "pill ok", "ok"), document.createTextNode("No active findings")),
        el("p", null, "Nothing in the last " + span(signals.window_covered_seconds || 0) + " on " + n +
          (n === 1 ? " engine" : " engines") + " crossed a threshold of the diagnosis."));
    } else {
      // The worst active finding; one held while clearing only when nothing else is active
      // (findings come active first, most severe first: diagnose.vocabulary.finding_order).
      var active = findings.filter(function (x) { return !x.clearing_since; });
      var f = active.length ? active[0] : findings[0];
      div.className += " sev-" + f.severity + (f.clearing_since ? " clearing" : "");
      div.setAttribute("data-state", f.severity);
      if (f.clearing_since) div.setAttribute("data-clearing", "true");
      div.setAttribute("data-symptom", f.symptom);
      div.setAttribute("data-cause", f.cause);
      var since = el("span", "since", sinceText(f, signals.last_success_time, (signals.thresholds || {}).finding_hold_seconds));
      add(div, add(el("div", "head"), el("span", "pill " + f.severity, f.severity), document.createTextNode(title(f))),
        add(el("p"), document.createTextNode(where(f) + " \u00b7 "), since, document.createTextNode(" \u00b7 " + f.confidence + " confidence" +
          (findings.length > 1 ? " \u00b7 " + (findings.length - 1) + " more finding" + (findings.length > 2 ? "s" : "") + " below" : ""))),
        el("p", null, f.summary), add(el("p"), el("b", null, "Next: "), document.createTextNode(meta.actions[f.cause] || f.next_check)));
    }
    swap("banner", div);
  }

  function renderFigures(row, signals, diagnosis) {
    var section = el("section");
    if (!row) {
      section.appendChild(el("p", "muted", signals.up ? "No engine data yet." : ""));
      swap("figures", section);
      return;
    }
    var findings = findingsFor(row, diagnosis.findings || []);
    var states = figureStates(row, findings, signals.thresholds || {});
    section.appendChild(el("h2", null, "Now on " + keyOf(row)));
    var grid = el("div", "figures");
    meta.figures.forEach(function (fig) {
      var box = el("div", "fig state-" + states[fig.key]);
      box.setAttribute("data-figure", fig.key);
      box.setAttribute("data-state", states[fig.key]);
      add(box, el("div", "label", fig.label), el("div", "value", figureText(fig, row)));
      if (fig.sub) {
        var subValue = row.signals[fig.sub];
        if (subValue !== null && subValue !== undefined) box.appendChild(el("div", "sub", fig.sub_label + " " + fmt(subValue, meta.units[fig.sub])));
      }
      grid.appendChild(box);
    });
    section.appendChild(grid);
    // Which figures are the last poll's and which span the window: the trends below end
    // on shorter spans, so a p95 or a ratio differs there and must not look like an error.
    var over = function (kind) {
      return meta.figures.filter(function (f) { return f.over === kind; }).map(function (f) { return f.short; }).join(", ");
    };
    section.appendChild(el("p", "muted span-note", over("poll") + ": the last poll; " + over("window") +
      ": over the last " + span(signals.window_covered_seconds || 0) + "."));
    swap("figures", section);
  }

  function renderEngines(signals, diagnosis, rows) {
    var section = el("section");
    if (rows.length < 2) { swap("engines", section); return; }
    var findings = diagnosis.findings || [];
    section.appendChild(el("h2", null, "Engines (" + rows.length + "), worst first; click a row for its detail"));
    var columns = [{key: "worst", label: "Engine"}, {key: "finding", label: "Worst finding", cls: "wide"}]
      .concat(meta.figures.map(function (fig) { return {key: fig.key, label: fig.short, fig: fig, cls: fig.wide ? "num wide" : "num"}; }));
    var ordered = rows.slice();
    if (sortKey !== "worst") {
      var fig = meta.figures.filter(function (f) { return f.key === sortKey; })[0];
      ordered.sort(function (a, b) {
        var va = fig ? figureValue(fig, a) : null, vb = fig ? figureValue(fig, b) : null;
        if (sortKey === "finding") { va = worstRank(a, findings); vb = worstRank(b, findings); }
        va = va === null ? -Infinity : va; vb = vb === null ? -Infinity : vb;
        return (va < vb ? 1 : va > vb ? -1 : 0) * sortDir;
      });
    } else if (sortDir < 0) ordered.reverse();
    var table = el("table"), thead = el("thead"), head = el("tr");
    columns.forEach(function (c) {
      var th = el("th", c.cls || null, c.label + (sortKey === c.key ? (sortDir > 0 ? " \u25be" : " \u25b4") : ""));
      th.setAttribute("data-sort", c.key);
      th.addEventListener("click", function () {
        sortDir = sortKey === c.key ? -sortDir : 1;
        sortKey = c.key;
        render();
      });
      head.appendChild(th);
    });
    add(table, add(thead, head));
    var tbody = el("tbody");
    ordered.forEach(function (row) {
      var mine = findingsFor(row, findings);
      var states = figureStates(row, mine, signals.thresholds || {});
      var tr = el("tr", keyOf(row) === selected ? "selected" : null);
      tr.setAttribute("data-engine", keyOf(row));
      var worst = mine[0];
      var name = el("td");
      add(name, el("span", "pill " + (worst ? worst.severity : "ok"), worst ? worst.severity : "ok"), document.createTextNode(keyOf(row)));
      add(tr, name, el("td", "wide", worst ? title(worst) : "\u2013"));
      meta.figures.forEach(function (fig) {
        var td = el("td", (fig.wide ? "num wide" : "num") + " state-" + states[fig.key], figureText(fig, row));
        td.setAttribute("data-figure", fig.key);
        tr.appendChild(td);
      });
      tr.addEventListener("click", function () { selected = keyOf(row); render(); });
      tbody.appendChild(tr);
    });
    add(section, add(el("div", "scroll"), add(table, tbody)));
    swap("engines", section);
  }

  function chart(spec, series, times, markers, thresholds) {
    var box = el("div", "chart");
    box.setAttribute("data-series", spec.series);
    var W = 300, H = 72, n = times.length;
    var t0 = n ? times[0] : 0, t1 = n ? times[n - 1] : 1;
    var x = function (t) { return t1 > t0 ? (t - t0) / (t1 - t0) * W : W; };
    var values = spec.stack ? null : (series[spec.series] || []);
    var top = spec.max || 0;
    if (!spec.stack) values.forEach(function (v) { if (v !== null && v > top) top = v; });
    var limit = spec.threshold ? thresholds[spec.threshold] : null;
    if (!spec.max && limit && limit > top) top = limit;
    if (!top) top = 1;
    var y = function (v) { return H - 2 - (v / top) * (H - 4); };
    var g = svg("svg", {viewBox: "0 0 " + W + " " + H, preserveAspectRatio: "none", role: "img",
      "aria-label": spec.title, "data-points": String(n)});
    var latest = null;
    if (spec.stack) {
      var lower = times.map(function () { return 0; });
      spec.stack.forEach(function (name, k) {
        var vals = series[name] || [];
        var upper = lower.map(function (l, i) { return vals[i] === null || vals[i] === undefined ? null : l + vals[i]; });
        var top_ = [], bottom = [];
        for (var i = 0; i < n; i++) if (upper[i] !== null) { top_.push(x(times[i]) + "," + y(upper[i])); bottom.unshift(x(times[i]) + "," + y(lower[i])); }
        if (top_.length) g.appendChild(svg("polygon", {"class": "band" + k, points: top_.concat(bottom).join(" ")}));
        lower = upper.map(function (u, i) { return u === null ? lower[i] : u; });
      });
      var lastShares = spec.stack.map(function (name) { var s = series[name] || []; return s.length ? s[s.length - 1] : null; });
      latest = lastShares[0] === null || lastShares[0] === undefined ? "\u2013" : lastShares.map(function (v) { return fmt(v, "ratio"); }).join(" / ");
    } else {
      var seg = [];
      var flush = function () { if (seg.length) g.appendChild(svg("polyline", {"class": "line", points: seg.join(" ")})); seg = []; };
      for (var i = 0; i < n; i++) {
        var v = values[i];
        if (v === null || v === undefined) { flush(); continue; }
        seg.push(x(times[i]).toFixed(1) + "," + y(v).toFixed(1));
      }
      flush();
      var lastIndex = values.length - 1;
      while (lastIndex >= 0 && (values[lastIndex] === null || values[lastIndex] === undefined)) lastIndex--;
      latest = lastIndex >= 0 ? fmt(values[lastIndex], spec.unit) : "\u2013";
      if (lastIndex >= 0 && spec.series === "ttft_p95" && series.ttft_p95_pinned && series.ttft_p95_pinned[lastIndex])
        latest = bounded(latest, series.ttft_p95_pinned[lastIndex]);
      if (limit !== null && limit !== undefined && limit <= top)
        g.appendChild(svg("line", {"class": "thr", x1: 0, x2: W, y1: y(limit), y2: y(limit)}));
    }
    markers.forEach(function (m) {
      // A finding first seen before the charted span has been active all along: marked at its start.
      var at = m.kind === "finding" ? Math.max(m.time, t0) : m.time;
      if (!n || at < t0 || at > t1) return;
      var line = svg("line", {"class": "mark " + (m.kind === "change" ? "change" : m.severity), x1: x(at), x2: x(at), y1: 0, y2: H});
      line.setAttribute("data-kind", m.kind);
      line.setAttribute("data-time", String(m.time));
      var tip = svg("title");
      tip.textContent = clock(m.time) + " " + (m.kind === "change" ? m.change + ": " : (meta.causes[m.cause] || m.cause) + ": ") + m.text;
      line.appendChild(tip);
      g.appendChild(line);
    });
    add(box, add(el("div", "title"), el("span", null, spec.title), el("span", "now", latest)), g);
    if (spec.stack) {
      var legend = el("div", "legend axis");
      add(legend, add(el("span"), el("span", "k0", "\u25a0 queue"), el("span", "k1", " \u25a0 prefill"), el("span", "k2", " \u25a0 other")));
      box.appendChild(legend);
    }
    add(box, add(el("div", "axis"), el("span", null, n ? "\u2212" + span(t1 - t0) : ""),
      el("span", null, limit !== null && limit !== undefined ? "threshold " + fmt(limit, spec.unit) : ""), el("span", null, "now")));
    return box;
  }

  function renderTrends(row, series) {
    var section = el("section");
    var line = row ? (series.engines || []).filter(function (e) { return e.model_name === row.model_name && e.engine === row.engine; })[0] : null;
    if (!line) { swap("trends", section); return; }
    var markers = (series.markers || []).filter(function (m) {
      return (m.model_name === null || m.model_name === row.model_name) && (m.engine === null || m.engine === row.engine);
    });
    section.appendChild(el("h2", null, "Trends over the window on " + keyOf(row) + " (each point over the " +
      series.trend_seconds + " s before it; marks: findings and changes)"));
    var grid = el("div", "charts");
    meta.trends.forEach(function (spec) { grid.appendChild(chart(spec, line, series.times || [], markers, data.signals.thresholds || {})); });
    section.appendChild(grid);
    swap("trends", section);
  }

  function evidenceUnit(key) {
    if (/seconds/.test(key)) return "seconds";
    if (/(ratio|share|usage)/.test(key) && !/tokens/.test(key)) return "ratio";
    if (/tokens/.test(key)) return "tokens";
    return "";
  }
  function evidenceLabel(key) {
    return key.replace(/_seconds$/, "").replace(/_/g, " ").replace(/\bkv\b/g, "KV").replace(/\bttft\b/g, "TTFT")
      .replace(/^./, function (c) { return c.toUpperCase(); });
  }
  function evidenceText(f, key) {
    var value = (f.evidence || {})[key];
    if (typeof value !== "number") return fmt(value, "");
    return bounded(fmt(value, evidenceUnit(key)), (f.pinned || {})[key]);
  }

  function renderFindings(signals, diagnosis) {
    var section = el("section");
    var findings = diagnosis.findings || [];
    section.appendChild(el("h2", null, "Findings (" + findings.length + " active)"));
    if (!findings.length) {
      section.appendChild(el("p", "muted", signals.up ? "No active findings." : "No findings while the engine is not polled."));
      swap("findings", section);
      return;
    }
    var grid = el("div", "cards"), opened = {};
    // A refresh redraws the cards: what the reader unfolded stays unfolded.
    Array.prototype.forEach.call(document.querySelectorAll("#findings details.more[open]"), function (d) {
      opened[d.getAttribute("data-key")] = true;
    });
    findings.forEach(function (f) {
      // Held while clearing: drawn muted, below the active ones (the list's order).
      var card = el("article", "card " + f.severity + (f.clearing_since ? " clearing" : ""));
      card.setAttribute("data-symptom", f.symptom);
      card.setAttribute("data-cause", f.cause);
      if (f.clearing_since) card.setAttribute("data-clearing", "true");
      // What an on-call engineer reads: the headline, the deciding numbers, one next action.
      // The rest (why in prose, other causes, the full check, every value) is folded.
      add(card, add(el("h3"), el("span", "pill " + f.severity, f.severity), document.createTextNode(title(f))),
        add(el("div", "where"), document.createTextNode(where(f) + " \u00b7 " + f.confidence + " confidence \u00b7 "),
          el("span", "since", sinceText(f, signals.last_success_time, (signals.thresholds || {}).finding_hold_seconds))));
      var deciding = el("div", "deciding"), shown = 0;
      (meta.deciding[f.cause] || []).forEach(function (key) {
        var v = (f.evidence || {})[key];
        if (shown >= 3 || v === null || v === undefined) return;
        shown += 1;
        var chip = add(el("span", "num-chip"), document.createTextNode(evidenceLabel(key)), el("b", null, evidenceText(f, key)));
        chip.setAttribute("data-evidence", key);
        deciding.appendChild(chip);
      });
      // The span of the chips' numbers, beside them, where the eye compares them with the figures
      // and the trends (which end on shorter spans): "TTFT p95 28 s" here and 4.56 s at a trend's end.
      var spanned = (f.evidence || {}).window_seconds;
      if (shown && spanned) {
        var spanNote = el("span", "muted span-note", (f.clearing_since ? "as last seen, over " : "over the last ") +
          span(spanned));
        spanNote.setAttribute("data-span", String(spanned));
        deciding.appendChild(spanNote);
      }
      if (shown) card.appendChild(deciding);
      var next = add(el("p", "next"), el("b", null, "Next: "), document.createTextNode(meta.actions[f.cause] || f.next_check));
      next.setAttribute("data-next", f.cause);
      add(card, next, runbookNode(f));
      var more = el("details", "more"), counted = [], key = [f.symptom, f.cause, f.model_name, f.engine].join("|");
      more.setAttribute("data-key", key);
      more.open = !!opened[key];
      var notes = Object.keys(f.notes || {}), extra = (f.contributing || []).length + (f.alternatives || []).length;
      if (notes.length) counted.push(notes.length + (notes.length === 1 ? " note" : " notes"));
      if (extra) counted.push(extra + " other cause" + (extra === 1 ? "" : "s"));
      counted.push("the full check", Object.keys(f.evidence || {}).length + " values");
      more.appendChild(el("summary", null, "Why, in words: " + counted.join(", ")));
      more.appendChild(el("p", null, f.summary));
      // Prose the diagnosis wrote beside the numbers (`notes`, apart from `evidence`).
      notes.forEach(function (key) {
        var note = add(el("p", "note"), el("b", null, evidenceLabel(key) + ": "), document.createTextNode(f.notes[key]));
        note.setAttribute("data-note", key);
        more.appendChild(note);
      });
      // One story: the other causes found for this symptom ride here, not as rival cards;
      // the causes the data cannot tell apart say what would decide.
      (f.contributing || []).forEach(function (c) {
        var p = add(el("p", "factor"), el("b", null, "Contributing: "),
          document.createTextNode((meta.causes[c.cause] || c.cause) + " (" + c.confidence + " confidence). " + c.summary));
        p.setAttribute("data-contributor", c.cause);
        more.appendChild(p);
      });
      (f.alternatives || []).forEach(function (a) {
        var p = add(el("p", "factor"), el("b", null, "Cannot tell apart from: "),
          document.createTextNode((meta.causes[a.cause] || a.cause) + ". Decided by " +
            (a.decided_by || []).map(function (d) { return meta.deciders[d] || d; }).join(" or ") + "."));
        p.setAttribute("data-alternative", a.cause);
        more.appendChild(p);
      });
      more.appendChild(add(el("p"), el("b", null, "Full check: "), document.createTextNode(f.next_check)));
      var table = el("table");
      Object.keys(f.evidence || {}).forEach(function (key) {
        add(table, add(el("tr"), el("td", null, evidenceLabel(key)), el("td", "num", evidenceText(f, key))));
      });
      add(card, add(more, table));
      grid.appendChild(card);
    });
    section.appendChild(grid);
    swap("findings", section);
  }

  function renderChanges(diagnosis) {
    var section = el("section");
    var events = diagnosis.events || [];
    section.appendChild(el("h2", null, "Changes in the window"));
    if (!events.length) section.appendChild(el("p", "muted", "None."));
    else {
      var ul = el("ul", "changes");
      events.forEach(function (e) {
        ul.appendChild(el("li", null, clock(e.time) + " \u00b7 " + e.kind.replace(/_/g, " ") + " \u00b7 " +
          (e.model || "all models") + " / " + (e.engine || "all engines") + ": " + e.detail));
      });
      section.appendChild(ul);
    }
    var u = diagnosis.upstream;
    if (u) {
      section.appendChild(el("h2", null, "Upstream"));
      section.appendChild(el("p", null, u.histogram + " at " + (u.target || "") + ": " +
        (u.up ? "up" : "down (" + (u.reason || "") + ")") + ", mean " + fmt(u.mean_seconds, "seconds") +
        ", p95 " + bounded(fmt(u.p95_seconds, "seconds"), u.p95_pinned) + " over " + fmt(u.count, "requests") + " requests"));
    }
    var tier = diagnosis.lmcache;
    if (tier) {
      section.appendChild(el("h2", null, "LMCache tier"));
      if (!tier.up) section.appendChild(el("p", "muted", "LMCache at " + (tier.target || "") + ": down (" +
        (tier.reason || "") + (tier.detail ? ": " + tier.detail : "") + "); the engine's signals do not depend on it."));
      (tier.up ? tier.models || [] : []).forEach(function (m) {
        var v = m.signals || {};
        section.appendChild(el("p", null, m.model_name + " at " + (tier.target || "") + ": hit ratio " +
          fmt(v.kvwatch_lmcache_hit_ratio, "ratio") + " (tokens delivered / asked for), prompt tokens from LMCache " +
          fmt(v.kvwatch_lmcache_prompt_tokens_served_ratio, "ratio") + ", tokens retrieved " +
          fmt(v.kvwatch_lmcache_retrieved_tokens_per_second, "per_second") + ", tokens stored " +
          fmt(v.kvwatch_lmcache_stored_tokens_per_second, "per_second")));
      });
    }
    var stream = diagnosis.kv_events;
    if (stream) {
      section.appendChild(el("h2", null, "KV-cache events"));
      if (!stream.up) section.appendChild(el("p", "muted", "Events at " + (stream.endpoint || "") + ": down (" +
        (stream.reason || "") + (stream.detail ? ": " + stream.detail : "") + "); the page's signals do not depend on them."));
      else {
        var w = stream.window || {}, intake = stream.intake || {};
        section.appendChild(el("p", null, "At " + stream.endpoint + " over " + fmt(w.seconds, "seconds") + ": blocks stored " +
          fmt(w.stored_per_second, "per_second") + ", evicted " + fmt(w.evicted_per_second, "per_second") +
          ", stored again after their eviction " + fmt(w.stored_again_ratio, "ratio") + " of those stored (median " +
          fmt(w.return_seconds_median, "seconds") + " after the eviction); " + (w.missed || 0) + " messages missed, " +
          (w.dropped || 0) + " dropped"));
        var points = (stream.sizing || {}).points || [];
        if (points.length) section.appendChild(el("p", null, "With more cache (an estimate from the returns' distances): " +
          points.map(function (p) {
            return "x" + p.extra_cache + " " + (p.hit_ratio == null ? fmt(p.recomputation_avoided_ratio, "ratio") + " of the recomputation avoided"
              : "hit ratio " + fmt(p.hit_ratio, "ratio"));
          }).join(", ")));
      }
    }
    swap("changes", section);
  }

  // The signals left dark, grouped by the flag that lights them (dark_groups on the server).
  function darkGroups(dark) {
    var groups = [], index = {};
    dark.forEach(function (item) {
      var flags = (item.lit_by || []).join(" and ") || null;
      var key = JSON.stringify([flags, flags ? "" : item.why]);
      if (!(key in index)) { index[key] = groups.length; groups.push({flags: flags, why: flags ? "" : item.why, items: []}); }
      groups[index[key]].items.push(item);
    });
    return groups;
  }
  function renderDark(signals) {
    var dark = signals.dark_signals || [], section = el("section");
    var before = document.querySelector("#dark details");
    if (dark.length) {
      section.appendChild(el("h2", null, "Signals this engine leaves dark (" + dark.length + ")"));
      var details = el("details"), ul = el("ul");
      details.open = !!(before && before.open);
      details.appendChild(el("summary", null, "Which, why, and the flag that lights them"));
      darkGroups(dark).forEach(function (g) {
        var li = el("li");
        li.setAttribute("data-flag", g.flags || "");
        if (g.flags) add(li, el("code", null, g.flags), document.createTextNode(" lights: "));
        else li.appendChild(document.createTextNode("No flag lights these (" + g.why + "): "));
        g.items.forEach(function (item, i) {
          var s = el("span", null, meta.labels[item.signal] || item.signal);
          s.setAttribute("data-signal", item.signal);
          s.title = item.signal + ": " + item.why;
          if (i) li.appendChild(document.createTextNode(", "));
          li.appendChild(s);
        });
        ul.appendChild(li);
      });
      section.appendChild(add(details, ul));
    }
    swap("dark", section);
  }

  function render() {
    var signals = data.signals, diagnosis = data.diagnosis;
    var rows = enginesWorstFirst(signals, diagnosis);
    var row = rows.filter(function (r) { return keyOf(r) === selected; })[0] || rows[0] || null;
    selected = row ? keyOf(row) : null;
    renderStatus(signals);
    renderPhase(signals);
    renderBanner(signals, diagnosis);
    renderFigures(row, signals, diagnosis);
    renderEngines(signals, diagnosis, rows);
    renderTrends(row, data.series);
    renderFindings(signals, diagnosis);
    renderChanges(diagnosis);
    renderDark(signals);
  }

  function get(path) {
    return fetch(path, {cache: "no-store", credentials: "same-origin", headers: {"Accept": "application/json"}})
      .then(function (response) {
        if (!response.ok) throw new Error(path + ": HTTP " + response.status);
        return response.json();
      });
  }

  function refresh() {
    // The page's own query (central mode's ?replica=) selects what the API serves.
    var query = window.location.search;
    Promise.all([get("api/v1/signals" + query), get("api/v1/diagnosis" + query), get("api/v1/series" + query)]).then(function (all) {
      data = {signals: all[0], diagnosis: all[1], series: all[2]};
      render();
      updates += 1;
      body.setAttribute("data-updates", String(updates));
      document.getElementById("live").textContent = liveText(data.signals);
    }).catch(function (error) {
      document.getElementById("live").textContent = "Live refresh paused (" + error.message +
        "); showing the last data, retrying every " + (every / 1000) + " s.";
    }).then(function () {
      window.setTimeout(refresh, every);
    });
  }
  render();
  if (data.signals.replay) document.getElementById("live").textContent = liveText(data.signals);
  body.setAttribute("data-rendered", "1");
  window.setTimeout(refresh, every);
})();
""".strip()


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; script-src {_csp_hash(SCRIPT)}; style-src {_csp_hash(STYLE)}; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)

_FIGURE_EXTRAS = {
    "kv_usage": {"short": "KV usage", "sub": "kvwatch_kv_cache_usage_max_ratio", "sub_label": "window peak"},
    "headroom": {"short": "Headroom", "sub": "kvwatch_kv_cache_capacity_tokens", "sub_label": "of", "wide": True},
    "hit_ratio": {"short": "Hit ratio", "sub": "kvwatch_prompt_tokens_cached_ratio", "sub_label": "prompt tokens cached"},
    "ttft_p95": {"short": "TTFT p95", "label": "Time to first token p95", "sub": "kvwatch_time_to_first_token_mean_seconds",
                 "sub_label": "mean"},
    "waiting": {"short": "Waiting", "sub": "kvwatch_requests_running", "sub_label": "running"},
    "preemptions": {"short": "Preempt/s", "label": "Preemptions per second", "wide": True},
}


def page_meta() -> dict[str, Any]:
    """What the script needs besides the state: labels and units from the
    catalogue, the figures and charts and how they are coloured (threshold
    names; the values come with the state), the titles of the vocabulary."""
    figures = []
    for figure in FIGURES:
        extras = _FIGURE_EXTRAS.get(figure["key"], {})
        figures.append({**figure, "label": extras.get("label") or signal_label(figure["signal"]), **extras})
    return {
        "figures": figures,
        "trends": list(TRENDS),
        "units": {s.name: s.unit for s in SIGNALS},
        "labels": {s.name: signal_label(s.name) for s in SIGNALS},
        "symptoms": SYMPTOM_TITLES,
        "causes": CAUSE_TITLES,
        # The banner's "Next:" (the card has the full next_check).
        "actions": NEXT_ACTION,
        "deciding": {cause: list(keys) for cause, keys in DECIDING.items()},
        "deciders": DECIDERS,
        "severities": list(SEVERITIES),
    }


def _json_for_script(value: Any) -> str:
    # Inside <script type="application/json"> only "</" could end the element.
    return json.dumps(value, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _time_text(seconds: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(seconds)) if seconds else "never"


# The <noscript> stand-in: the same state as text, for curl and browsers without JavaScript.


def window_text(signals: dict[str, Any]) -> str:
    """"22 of 60 s" while the window fills; once full, the span the figures
    cover (one poll at or before its start makes it a little more than set:
    "62 of 60 s" read as an error). The page's script writes the same."""
    covered, configured = round(signals["window_covered_seconds"] or 0), round(signals["window_seconds"])
    return f"{covered} of {configured} s" if covered < configured else f"{covered} s"


def _status_html(signals: dict[str, Any]) -> str:
    if signals["up"]:
        state = '<span class="up">up</span>'
    else:
        state = f'<span class="down">{_e(("down: " + (signals["reason"] or "") + " " + (signals["detail"] or "")).strip())}</span>'
    replay = signals.get("replay")
    return (
        (f'<p class="replay"><b>{_e(replay["text"][0].upper() + replay["text"][1:])}.</b> Times are the recording\'s.</p>'
         if replay else "")
        + f'<p>Target <code>{_e(signals["target"] or "")}</code>: {state} · {signals["polls"]} polls, '
        f'last success {_time_text(signals["last_success_time"])} · window {window_text(signals)}</p>'
    )


def _findings_html(diagnosis: dict[str, Any]) -> str:
    findings = diagnosis["findings"]
    out = [f"<h2>Findings ({len(findings)} active)</h2>"]
    if not findings:
        out.append("<p>" + ("No active findings." if diagnosis["up"]
                            else "No findings while the engine is not polled.") + "</p>")
    for f in findings:
        where = f["model_name"] + (f" / {f['engine']}" if f["engine"] is not None else "")
        since = f", since {_time_text(f['since'])}" if f.get("since") else ""
        if f.get("clearing_since"):
            since += f", clearing: condition clear since {_time_text(f['clearing_since'])}"
        notes = "".join(f"<p>{_e(key.replace('_', ' '))}: {_e(note)}</p>" for key, note in (f.get("notes") or {}).items())
        runbook = (f'<p>Runbook: <a href="{_e(f["runbook"])}" rel="noopener">{_e(f["runbook"])}</a></p>'
                   if f.get("runbook") else "")
        notes += "".join(f"<p>Contributing: {_e(CAUSE_TITLES.get(c['cause'], c['cause']))} ({_e(c['confidence'])} "
                         f"confidence). {_e(c['summary'])}</p>" for c in f.get("contributing") or ())
        notes += "".join(f"<p>Cannot tell apart from: {_e(CAUSE_TITLES.get(a['cause'], a['cause']))}. Decided by "
                         f"{_e(' or '.join(DECIDERS.get(d, d) for d in a['decided_by']))}.</p>"
                         for a in f.get("alternatives") or ())
        out.append(
            f'<div class="finding{" clearing" if f.get("clearing_since") else ""}" data-symptom="{_e(f["symptom"])}" data-cause="{_e(f["cause"])}">'
            f'<p><b>{_e(f["severity"].upper())}</b> {_e(SYMPTOM_TITLES.get(f["symptom"], f["symptom"]))}: '
            f'{_e(CAUSE_TITLES.get(f["cause"], f["cause"]))}'
            + "".join(f", or {_e(CAUSE_TITLES.get(a['cause'], a['cause']))}" for a in f.get("alternatives") or ())
            + f' ({_e(where)}, {_e(f["confidence"])} confidence{since})</p>'
            f'<p>{_e(f["summary"])}</p>{notes}<p>Next: {_e(f["next_check"])}</p>{runbook}'
            f'<p><small>{_e(format_evidence(f["evidence"], f.get("pinned")))}</small></p></div>'
        )
    return "".join(out)


def _tier_html(diagnosis: dict[str, Any]) -> str:
    """The LMCache tier beside the engine (absent unless lmcache_target is set)."""
    tier = diagnosis.get("lmcache")
    if not tier:
        return ""
    where = f'LMCache at <code>{_e(tier.get("target") or "")}</code>'
    if not tier.get("up"):
        why = _e(("down: " + (tier.get("reason") or "") + " " + (tier.get("detail") or "")).strip())
        return (f'<h2>LMCache tier</h2><p>{where}: <span class="down">{why}</span>; '
                "the engine's signals do not depend on it.</p>")
    out = ["<h2>LMCache tier</h2>"]
    for row in tier.get("models") or []:
        v = row.get("signals") or {}
        out.append(
            f'<p>{where}, {_e(row["model_name"])}: hit ratio {_e(format_value(v.get("kvwatch_lmcache_hit_ratio"), "ratio"))}'
            " (tokens delivered / asked for), prompt tokens from LMCache "
            f'{_e(format_value(v.get("kvwatch_lmcache_prompt_tokens_served_ratio"), "ratio"))}, tokens retrieved '
            f'{_e(format_value(v.get("kvwatch_lmcache_retrieved_tokens_per_second"), "per_second"))}, tokens stored '
            f'{_e(format_value(v.get("kvwatch_lmcache_stored_tokens_per_second"), "per_second"))}</p>')
    return "".join(out)


def _stream_html(diagnosis: dict[str, Any]) -> str:
    """The engine's KV-cache event stream (absent unless kv_events is set)."""
    stream = diagnosis.get("kv_events")
    if not stream:
        return ""
    where = f'Events at <code>{_e(stream.get("endpoint") or "")}</code>'
    if not stream.get("up"):
        why = _e(("down: " + (stream.get("reason") or "") + " " + (stream.get("detail") or "")).strip())
        return (f'<h2>KV-cache events</h2><p>{where}: <span class="down">{why}</span>; '
                "the page's signals do not depend on them.</p>")
    w = stream.get("window") or {}
    out = ["<h2>KV-cache events</h2>",
           f'<p>{where} over {_e(format_value(w.get("seconds"), "seconds"))}: blocks stored '
           f'{_e(format_value(w.get("stored_per_second"), "per_second"))}, evicted '
           f'{_e(format_value(w.get("evicted_per_second"), "per_second"))}, stored again after their eviction '
           f'{_e(format_value(w.get("stored_again_ratio"), "ratio"))} of those stored (median '
           f'{_e(format_value(w.get("return_seconds_median"), "seconds"))} after the eviction); '
           f'{w.get("missed") or 0} messages missed, {w.get("dropped") or 0} dropped</p>']
    points = (stream.get("sizing") or {}).get("points") or []
    if points:
        out.append("<p>With more cache (an estimate from the returns' distances): " + ", ".join(
            f'x{p["extra_cache"]:g} ' + (f'hit ratio {_e(format_value(p["hit_ratio"], "ratio"))}'
                                         if p.get("hit_ratio") is not None else
                                         f'{_e(format_value(p.get("recomputation_avoided_ratio"), "ratio"))} of the '
                                         "recomputation avoided") for p in points) + "</p>")
    return "".join(out)


def _signals_html(signals: dict[str, Any]) -> str:
    columns = signal_columns(signals)
    if not columns:
        return "<p>No engine data yet.</p>"
    out = ["<h2>Signals over the window</h2><table><tr><th>Signal</th>"
           + "".join(f"<th>{_e(h)}</th>" for h, _, _ in columns) + "</tr>"]
    order = list(GROUP_TITLES)
    for s in sorted(SIGNALS, key=lambda s: order.index(s.group) if s.group in order else len(order)):
        out.append(f'<tr><td title="{_e(s.name)}">{_e(signal_label(s.name))}</td>'
                   + "".join(f'<td class="num">{_e(format_value(values.get(s.name), s.unit, pinned.get(s.name)))}</td>'
                             for _, values, pinned in columns) + "</tr>")
    out.append("</table>")
    return "".join(out)


def dark_groups(dark: list[dict[str, Any]]) -> list[tuple[str | None, str, list[dict[str, Any]]]]:
    """/api/v1/signals' `dark_signals` grouped by what would light them:
    (flags, why, items) in catalogue order of each group's first signal, one
    group per flag (None where no flag does: not exported, or a hybrid
    model). The page's script groups the same way (darkGroups)."""
    groups: dict[tuple[str | None, str], list[dict[str, Any]]] = {}
    for item in dark:
        flags = " and ".join(item.get("lit_by") or []) or None
        groups.setdefault((flags, "" if flags else item["why"]), []).append(item)
    return [(flags, why, items) for (flags, why), items in groups.items()]


def _dark_title(item: dict[str, Any]) -> str:
    name = item["signal"]
    return signal_label(name) if name in SIGNALS_BY_NAME else name


def _dark_html(signals: dict[str, Any]) -> str:
    """The signals this engine leaves dark and the flag that lights each
    (empty section when none is): collapsed, under the engine's figures."""
    dark = signals.get("dark_signals") or []
    if not dark:
        return '<section id="dark"></section>'
    out = [f'<section id="dark"><h2>Signals this engine leaves dark ({len(dark)})</h2><details>'
           "<summary>Which, why, and the flag that lights them</summary><ul>"]
    for flags, why, items in dark_groups(dark):
        titles = ", ".join(f'<span data-signal="{_e(i["signal"])}" title="{_e(i["signal"])}: {_e(i["why"])}">'
                           f"{_e(_dark_title(i))}</span>" for i in items)
        lead = f"<code>{_e(flags)}</code> lights: " if flags else f"No flag lights these ({_e(why)}): "
        out.append(f'<li data-flag="{_e(flags or "")}">{lead}{titles}</li>')
    out.append("</ul></details></section>")
    return "".join(out)


def _live_html(signals: dict[str, Any]) -> str:
    replay = signals.get("replay")
    if replay:
        return _e(f"{replay['text'][0].upper()}{replay['text'][1:]} (recorded time "
                  f"{_time_text(signals['last_success_time'])}).")
    return f"Rendered {_time_text(time.time())}; refreshes every {REFRESH_SECONDS} s."


def page_state(state, settings) -> dict[str, Any]:
    """The JSON the page draws from: what the three API routes serve."""
    return {"signals": signals_json(state, settings), "diagnosis": diagnosis_json(state, settings),
            "series": series_json(state, settings)}


_META_JSON = None


def render_status_page(state, settings, nav: str = "") -> str:
    """`nav`: markup put under the heading (central mode's link back to
    every replica); made by kvwatch, never from the engine's text."""
    global _META_JSON
    if _META_JSON is None:
        _META_JSON = _json_for_script(page_meta())
    data = page_state(state, settings)
    signals, diagnosis = data["signals"], data["diagnosis"]
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
<main>
<header><h1>kvwatch</h1>{nav}<p id="status" class="muted"></p>
<p id="live" class="muted">{_live_html(signals)}</p></header>
<div id="phase"></div>
<div id="banner"></div>
<section id="figures"></section>
<section id="engines"></section>
<section id="trends"></section>
<section id="findings"></section>
<section id="changes"></section>
{_dark_html(signals)}
<noscript>
{_status_html(signals)}
{_findings_html(diagnosis)}
{_signals_html(signals)}
{_tier_html(diagnosis)}
{_stream_html(diagnosis)}
</noscript>
<footer><h2>More</h2><ul>
<li><a href="metrics">/metrics</a>: Prometheus metrics (kvwatch_* signals, kvwatch_finding, kvwatch_engine_*)</li>
<li><a href="api/v1/signals">/api/v1/signals</a>: windowed signals (JSON)</li>
<li><a href="api/v1/diagnosis">/api/v1/diagnosis</a>: findings with evidence (JSON)</li>
<li><a href="api/v1/series">/api/v1/series</a>: trends over the window (JSON)</li>
<li><a href="healthz">/healthz</a>, <a href="readyz">/readyz</a></li>
</ul>
<p class="muted">A prefix-cache hit means KV computed earlier was reused; it proves neither that an answer is current nor that the caller may see it.</p>
</footer>
</main>
<script type="application/json" id="kvwatch-meta">{_META_JSON}</script>
<script type="application/json" id="kvwatch-state">{_json_for_script(data)}</script>
<script>{SCRIPT}</script>
</body></html>
"""
