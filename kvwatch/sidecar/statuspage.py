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
seconds. Charts are inline SVG drawn by that script. The style and the script
are static files (kvwatch/sidecar/static/status.css, status.js: package data)
put inline; no external assets: a Content-Security-Policy with their hashes
allows nothing else, and the script builds DOM nodes with textContent only, so model
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
import re
import time
from importlib import resources
from typing import Any

from kvwatch.diagnose.arbitration import DECIDED_HEADLINE, DECIDERS, decided_headline
from kvwatch.diagnose.causes import CAUSE_LIST, NEXT_ACTION, SEVERITIES, SYMPTOM_LIST
from kvwatch.present import format_value, public_url, signal_columns, signal_label
from kvwatch.sidecar import renders
from kvwatch.sidecar.report import caveat_lines, diagnosis_json, signals_json
from kvwatch.sidecar.series import series_json
from kvwatch.signals import SIGNALS, SIGNALS_BY_NAME

REFRESH_SECONDS = 5
GROUP_TITLES = {
    "exhaustion": "KV cache and concurrency",
    "prefix": "Prefix cache",
    "first_token": "Time to first token",
    "throughput": "Throughput",
}
# The unit a reader sees beside a label when the formatted value does not say it.

# What the banner and the cards call each symptom and cause, and the two or
# three evidence values that decided each cause (highlighted on its card; the
# rest of the evidence is folded away; the first present win): from the
# cause catalogue's records.
SYMPTOM_TITLES = {s.name: s.title for s in SYMPTOM_LIST if s.title}
CAUSE_TITLES = {c.name: c.title for c in CAUSE_LIST if c.title}
DECIDING = {c.name: c.deciding for c in CAUSE_LIST if c.deciding}

# The key figures, and how each is coloured: `rules` compare the value with a
# threshold of the diagnosis (by name: the page reads its value from the
# JSON's `thresholds`) or with a stated value, first match wins; a figure
# that a rule marks (its own value is bad) and whose symptom has an active
# finding on that engine takes at least the finding's colour; a calm value
# stays calm whatever the finding. `series` names its trend in /api/v1/series.
FIGURES: tuple[dict[str, Any], ...] = (
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


# --------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------

# The page's style and script are static files shipped as package data
# (kvwatch/sidecar/static/), read once and put inline, so the page needs no
# other request and the Content-Security-Policy below admits exactly them.
STATIC = resources.files("kvwatch.sidecar").joinpath("static")
STATIC_MAX_BYTES = 256 * 1024


def read_static(name: str) -> str:
    """A static file's text (without its final newline), bounded in bytes."""
    with STATIC.joinpath(name).open("rb") as handle:
        data = handle.read(STATIC_MAX_BYTES + 1)
    if len(data) > STATIC_MAX_BYTES:
        raise ValueError(f"kvwatch/sidecar/static/{name} is over {STATIC_MAX_BYTES} bytes")
    return data.decode("utf-8").strip()


STYLE = read_static("status.css")
SCRIPT = read_static("status.js")


def _csp_hash(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


CONTENT_SECURITY_POLICY = (
    f"default-src 'none'; script-src {_csp_hash(SCRIPT)}; style-src {_csp_hash(STYLE)}; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'"
)

_FIGURE_EXTRAS: dict[str, dict[str, Any]] = {
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
        "decided": DECIDED_HEADLINE,
        "severities": list(SEVERITIES),
    }


def _json_for_script(value: Any, bounded: bool = False) -> str:
    # Inside <script type="application/json"> only "</" could end the element.
    # `bounded`: the state, refused past the render bound before the page is built.
    text = renders.bounded_json(value, "the status page's state") if bounded else json.dumps(value, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


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
    busy = signals.get("busy")
    if busy:
        state = f'<span class="busy" data-state="busy">busy: {_e(busy["sentence"])}</span>'
    elif signals["up"]:
        state = '<span class="up">up</span>'
    else:
        state = f'<span class="down">{_e(("down: " + (signals["reason"] or "") + " " + (signals["detail"] or "")).strip())}</span>'
    replay = signals.get("replay")
    return (
        (f'<p class="replay"><b>{_e(replay["text"][0].upper() + replay["text"][1:])}.</b> Times are the recording\'s.</p>'
         if replay else "")
        + f'<p>Target <code>{_e(signals["target"] or "")}</code>: {state} · {signals["polls"]} polls, '
        f'last success {_time_text(signals["last_success_time"])} · window {window_text(signals)}'
        + (f' · names spelled <code data-spelling="{_e(spelling)}">{_e(spelling)}</code>'
           if (spelling := signals.get("engine_spelling")) else "")
        + (f' · {_e(trimmed)}' if (trimmed := signals.get("window_trimmed")) else "") + '</p>'
    )


def _faults_html(signals: dict[str, Any]) -> str:
    """Values the engine reported that cannot be true (the script's renderFaults)."""
    faults = signals.get("source_faults") or []
    if not faults:
        return ""
    return (f'<h2>Source faults ({len(faults)})</h2>'
            + "".join(f'<p data-fault="{_e(f["fault"])}">{_e(f["sentence"])}</p>' for f in faults))


def _evidence_unit(key: str) -> str:
    """The script's evidenceUnit: the unit an evidence key's name says."""
    if "seconds" in key:
        return "seconds"
    if any(word in key for word in ("ratio", "share", "usage")) and "tokens" not in key:
        return "ratio"
    return "tokens" if "tokens" in key else ""


def _evidence_label(key: str) -> str:
    """The script's evidenceLabel."""
    label = re.sub(r"\bttft\b", "TTFT", re.sub(r"\bkv\b", "KV", re.sub(r"_seconds$", "", key).replace("_", " ")))
    return label[:1].upper() + label[1:]


def ended_text(f: dict[str, Any]) -> str:
    """A finding whose condition stopped: when, and its peak (the figure
    leading its card, as last seen); the script's endedText."""
    evidence = f.get("evidence") or {}
    peak = next((key for key in DECIDING.get(f["cause"], ()) if evidence.get(key) is not None), None)
    text = f"ended at {_time_text(f['clearing_since'])}"
    if peak is None:
        return text
    value = evidence[peak]
    shown = format_value(value, _evidence_unit(peak), (f.get("pinned") or {}).get(peak)) \
        if isinstance(value, (int, float)) else str(value)
    return f"{text}, peak {_evidence_label(peak)} {shown}"


def _findings_html(diagnosis: dict[str, Any]) -> str:
    findings = diagnosis["findings"]
    out = [f"<h2>Findings ({len(findings)} active)</h2>"]
    if not findings:
        out.append("<p>" + ("No active findings." if diagnosis["up"]
                            else "No findings while the engine is not polled.") + "</p>")
    for f in findings:
        if f.get("cause_of"):
            continue  # told inside the card of the finding it causes (arbitration.caused_by)
        where = f["model_name"] + (f" / {f['engine']}" if f["engine"] is not None else "")
        since = f", since {_time_text(f['since'])}" if f.get("since") else ""
        if f.get("clearing_since"):
            since += f", clearing: {ended_text(f)}"
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
            + _e(decided_headline(f.get("evidence") or {}))
            + f' ({_e(where)}, {_e(f["confidence"])} confidence{since})</p>'
            f'<p>{_e(f["summary"])}</p>{_because_html(f.get("caused_by"))}{notes}<p>Next: {_e(f["next_check"])}</p>'
            f'{runbook}</div>'
        )
    # Each finding's evidence figures (a kilobyte each, a fifth of the page
    # at 8 engines) are left to the script and /api/v1/diagnosis (the
    # footer's link): the fallback stays small.
    return "".join(out)


def _because_html(cause: dict[str, Any] | None) -> str:
    """The finding that is a card's named cause, told inside it: one story."""
    if not cause:
        return ""
    return (f'<div class="because" data-caused-by="{_e(cause["symptom"])}/{_e(cause["cause"])}">'
            f'<p><b>Because: {_e(SYMPTOM_TITLES.get(cause["symptom"], cause["symptom"]))}</b>, '
            f'{_e(CAUSE_TITLES.get(cause["cause"], cause["cause"]))} ({_e(cause["severity"].upper())}, '
            f'{_e(cause["confidence"])} confidence). {_e(cause["summary"])}</p>'
            + "".join(f"<p>{_e(key.replace('_', ' '))}: {_e(note)}</p>" for key, note in (cause.get("notes") or {}).items())
            + f'<p>Next: {_e(cause["next_check"])}</p>'
            + (f'<p>Runbook: <a href="{_e(cause["runbook"])}" rel="noopener">{_e(cause["runbook"])}</a></p>'
               if cause.get("runbook") else "") + "</div>")


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
            f'{_e(format_value(v.get("kvwatch_lmcache_stored_tokens_per_second"), "per_second"))}'
            + _lookup_tiers(v.get("kvwatch_lmcache_lookup_tokens_by_tier_ratio")) + "</p>")
    return "".join(out)


def _lookup_tiers(shares: dict[str, float] | None) -> str:
    """The multiprocess server's lookups by tier, token-weighted (absent without them)."""
    if not shares:
        return ""
    parts = ", ".join(f"{_e(tier)} {_e(format_value(shares.get(tier), 'ratio'))}"
                      for tier in ("l1", "l2", "not_found") if tier in shares)
    return f"; looked-up tokens by tier: {parts}"


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


def _worth_html(signals: dict[str, Any]) -> str:
    """What the cache is worth per engine: the sentences kvwatch/signals/worth.py writes."""
    worth = signals.get("worth") or []
    if not worth:
        return ""
    out = ["<h2>What the cache is worth</h2>"]
    for item in worth:
        if len(worth) > 1:
            where = item["model_name"] + ("" if item.get("engine") is None else f" / {item['engine']}")
            out.append(f'<p class="muted">{_e(where)}</p>')
        out += [f"<p>{_e(line)}</p>" for line in item.get("lines") or []]
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
    out += [f'<p class="note caveat" data-caveat="{_e(name)}"><b>{_e(heading)}, {_e(signal_label(name))}:</b> '
            f"{_e(text)}</p>" for heading, name, text in caveat_lines(signals)]
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
    state_json = _json_for_script(data, bounded=True)
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
<div id="faults"></div>
<section id="figures"></section>
<section id="engines"></section>
<section id="trends"></section>
<section id="findings"></section>
<section id="worth"></section>
<section id="changes"></section>
{_dark_html(signals)}
<noscript>
{_status_html(signals)}
{_faults_html(signals)}
{_findings_html(diagnosis)}
{_signals_html(signals)}
{_worth_html(signals)}
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
<script type="application/json" id="kvwatch-state">{state_json}</script>
<script>{SCRIPT}</script>
</body></html>
"""
