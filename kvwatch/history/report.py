"""The history diagnosis as text, JSON and a self-contained HTML report
(inline SVG trend lines per replica: KV usage, waiting requests, prefix hit
ratio; no script, no external resource)."""

from __future__ import annotations

import html
import textwrap
import time
from typing import Any

from kvwatch.present import TextOut, clean, format_evidence

from kvwatch.history.run import MAX_TREND_POINTS, History


def clock(at: float | None) -> str:
    return "-" if at is None else time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(at))


def to_json(history: History, public_url: str) -> dict[str, Any]:
    replicas = [{"replica": name, "labels": state.labels, "models": sorted(state.models), "steps": state.steps,
                 "gaps": [{"start": a, "end": b} for a, b in history.timeline.gaps.get(name, [])]}
                for name, state in sorted(history.replicas.items())]
    models: dict[str, list[str]] = {}
    for name, state in sorted(history.replicas.items()):
        for model in state.models:
            models.setdefault(model, []).append(name)
    return clean({
        "prometheus": public_url,
        "selector": history.selector,
        "source": history.source,
        "start": history.start,
        "end": history.end,
        "step_seconds": history.step,
        "window_seconds": history.window,
        "steps": history.steps,
        "cost": history.cost,
        "replicas": replicas,
        "models": {model: {"replicas": names,
                           "findings": [i for i, e in enumerate(history.timeline.episodes) if e.model == model]}
                   for model, names in sorted(models.items())},
        "findings": history.timeline.findings_json(),
        "findings_dropped": history.timeline.dropped,
        "exit_code": 1 if history.timeline.actionable else 0,
    })


def _where(episode) -> str:
    return f"{episode.replica} {episode.model}" + (f"/{episode.engine}" if episode.engine is not None else "")


def print_text(out: TextOut, history: History, public_url: str) -> None:
    cost = history.cost
    print(f"kvwatch diagnose --prometheus {public_url}: {clock(history.start)} to {clock(history.end)}, step "
          f"{history.step:g}s, window {history.window:g}s, source {history.source}"
          + (f", selector {history.selector}" if history.selector else ""), file=out)
    print(f"  {len(history.replicas)} replicas, {history.steps} steps; read {cost['queries']} queries, "
          f"{cost['samples']:,} samples in {cost['seconds']:.1f}s; total {cost.get('total_seconds', 0):.1f}s",
          file=out)
    if not history.replicas:
        print("  no vLLM or kvwatch_engine_* series matched in the range", file=out)
        return
    by_model = history.timeline.by_model()
    for model in sorted({m for s in history.replicas.values() for m in s.models}):
        episodes = by_model.get(model, [])
        names = sorted(n for n, s in history.replicas.items() if model in s.models)
        print(f"\nMODEL {model}: {len(names)} replicas, {len(episodes)} findings", file=out)
        fleet = [e for e in episodes if e.symptom == "fleet"]
        if fleet:
            print("  fleet:", file=out)
            for episode in fleet:
                _episode(out, episode)
        for name in names:
            mine = [e for e in episodes if e.replica == name and e.symptom != "fleet"]
            gaps = history.timeline.gaps.get(name, [])
            if not mine and not gaps:
                continue
            print(f"  replica {name}:", file=out)
            for episode in mine:
                _episode(out, episode)
            for a, b in gaps:
                print(f"    no data {clock(a)} to {clock(b)}", file=out)


def _episode(out: TextOut, episode) -> None:
    worst = episode.worst
    until = "the end (still active)" if episode.active_at_end else clock(episode.end)
    print(f"    {worst['severity'].upper():8} {episode.symptom} / {episode.cause}  [{_where(episode)}]  "
          f"{clock(episode.start)} to {until}, {episode.polls} steps", file=out)
    for label, text in ((f"worst at {clock(worst['time'])}: ", worst["summary"]),
                        ("evidence: ", format_evidence(worst["evidence"])), ("next: ", worst["next_check"])):
        print(textwrap.fill(label + text, width=110, initial_indent="      ", subsequent_indent="        "),
              file=out)


# --------------------------------------------------------------------------
# HTML
# --------------------------------------------------------------------------

_STYLE = """body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse}
td,th{border-bottom:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
.critical{color:#b00}.warning{color:#a60}.info{color:#06a}svg{background:#fafafa;border:1px solid #eee}
small{color:#666}"""
_W, _H = 360, 48


def _svg(trend: list, column: int, lo: float, hi: float | None, start: float, end: float, marks) -> str:
    points = [(row[0], row[column]) for row in trend if row[column] is not None]
    if len(points) > MAX_TREND_POINTS:
        every = -(-len(points) // MAX_TREND_POINTS)
        points = points[::every]
    top = hi if hi is not None else max([v for _, v in points] + [1.0])
    span = max(end - start, 1.0)
    coords = " ".join(f"{(t - start) / span * _W:.1f},{_H - (v - lo) / max(top - lo, 1e-9) * (_H - 2) - 1:.1f}"
                      for t, v in points)
    bands = "".join(f'<rect x="{(a - start) / span * _W:.1f}" y="0" width="{max((b - a) / span * _W, 1.5):.1f}" '
                    f'height="{_H}" fill="{colour}" opacity="0.25"/>' for a, b, colour in marks)
    return (f'<svg width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" role="img">{bands}'
            f'<polyline fill="none" stroke="#36c" stroke-width="1.2" points="{coords}"/></svg>'
            f"<br><small>max {top:.3g}</small>")


_COLOURS = {"critical": "#d00", "warning": "#e90", "info": "#39c"}


def write_html(path: str, history: History, public_url: str) -> None:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>kvwatch history</title>"
             f"<style>{_STYLE}</style></head><body>",
             f"<h1>kvwatch: what happened from {e(clock(history.start))} to {e(clock(history.end))}</h1>",
             f"<p>Store {e(public_url)}, source {e(history.source)}, step {history.step:g}s, window "
             f"{history.window:g}s, {len(history.replicas)} replicas. Read: {history.cost['queries']} queries, "
             f"{history.cost['samples']:,} samples, {history.cost['seconds']:.1f}s.</p>"]
    by_model = history.timeline.by_model()
    for model in sorted({m for s in history.replicas.values() for m in s.models}):
        episodes = by_model.get(model, [])
        parts.append(f"<h2>Model {e(model)}</h2>")
        if episodes:
            parts.append("<table><tr><th>severity</th><th>finding</th><th>replica</th><th>from</th><th>to</th>"
                         "<th>worst point and evidence</th></tr>")
            for ep in episodes:
                w = ep.worst
                parts.append(
                    f"<tr><td class='{e(w['severity'])}'>{e(w['severity'])}</td><td>{e(ep.symptom)} / "
                    f"{e(ep.cause)}</td><td>{e(ep.replica)}</td><td>{e(clock(ep.start))}</td><td>"
                    f"{'still active' if ep.active_at_end else e(clock(ep.end))}</td><td>{e(clock(w['time']))}: "
                    f"{e(w['summary'])}<br><small>{e(format_evidence(w['evidence']))}</small></td></tr>")
            parts.append("</table>")
        else:
            parts.append("<p>No findings.</p>")
        parts.append("<table><tr><th>replica</th><th>KV usage</th><th>waiting</th><th>prefix hit ratio</th></tr>")
        for name, state in sorted(history.replicas.items()):
            if model not in state.models:
                continue
            marks = [(ep.start, ep.end, _COLOURS.get(ep.worst["severity"], "#999"))
                     for ep in episodes if ep.replica == name]
            cells = [_svg(state.trend, 1, 0.0, 1.0, history.start, history.end, marks),
                     _svg(state.trend, 2, 0.0, None, history.start, history.end, marks),
                     _svg(state.trend, 3, 0.0, 1.0, history.start, history.end, marks)]
            parts.append(f"<tr><td>{e(name)}</td>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
    parts.append("</body></html>\n")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("".join(parts))
