"""GET /runbooks: kvwatch serves its runbooks itself, so the link of every
finding on the status page works without publishing anything, and an ingress
in front of it can be the alerts' runbook_base_url (<ingress>/runbooks).

The text is alerts/runbooks.md as `kvwatch generate` writes it for the
default mixin config (kvwatch/mixin/runbooks.py), rendered once per process
to HTML by the small subset of Markdown that generator writes: headings,
anchors, paragraphs, lists, tables, fenced code, `code`, **bold** and
*emphasis*. A deployment with its own mixin config publishes its own copy
(runbook_base_url) if its thresholds differ from the defaults'.
"""

from __future__ import annotations

import html
import re
import threading

_lock = threading.Lock()
_cache: dict[str, str] = {}

STYLE = ("body{font:15px/1.5 system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem;color:#222}"
         "code,pre{font:13px ui-monospace,monospace;background:#f3f3f3}pre{padding:.6rem;overflow-x:auto}"
         "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:.2rem .5rem;text-align:left}"
         "h2{border-top:1px solid #ddd;padding-top:1rem}:target+h2,:target+h3{background:#fff3c4}")


def markdown_text() -> str:
    with _lock:
        if "md" not in _cache:
            from kvwatch.mixin.config import MixinConfig
            from kvwatch.mixin.runbooks import render

            _cache["md"] = render(MixinConfig())
        return _cache["md"]


def page() -> str:
    with _lock:
        cached = _cache.get("html")
    if cached is None:
        cached = to_html(markdown_text())
        with _lock:
            _cache["html"] = cached
    return cached


def _inline(text: str) -> str:
    parts = re.split(r"(`[^`]*`)", text)
    out = []
    for part in parts:
        if part.startswith("`") and part.endswith("`") and len(part) > 1:
            out.append(f"<code>{html.escape(part[1:-1])}</code>")
            continue
        part = html.escape(part, quote=False)
        part = re.sub(r"\[([^\]]+)\]\((#[^)\s]+)\)", r'<a href="\2">\1</a>', part)
        part = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", part)
        part = re.sub(r"(?<![\w*])\*([^*\s][^*]*)\*(?![\w*])", r"<i>\1</i>", part)
        out.append(part)
    return "".join(out)


def to_html(markdown: str) -> str:
    out = ['<!doctype html><html lang="en"><head><meta charset="utf-8"><title>kvwatch runbooks</title>',
           f"<style>{STYLE}</style></head><body>"]
    lines = markdown.splitlines()
    i = 0
    paragraph: list[str] = []

    def flush() -> None:
        if paragraph:
            out.append("<p>" + _inline(" ".join(paragraph)) + "</p>")
            paragraph.clear()

    while i < len(lines):
        line = lines[i]
        anchor = re.fullmatch(r'<a id="([\w-]+)"></a>', line.strip())
        if line.startswith("<!--"):
            pass
        elif anchor:
            flush()
            out.append(f'<a id="{anchor.group(1)}"></a>')
        elif line.startswith("```"):
            flush()
            block = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                block.append(lines[i])
                i += 1
            out.append("<pre><code>" + html.escape("\n".join(block)) + "</code></pre>")
        elif re.match(r"#{1,4} ", line):
            flush()
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{_inline(line[level + 1:])}</h{level}>")
        elif line.startswith("|"):
            flush()
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in lines[i].strip().strip("|").split("|")]
                if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                    rows.append(cells)
                i += 1
            i -= 1
            head, body = rows[0], rows[1:]
            out.append("<table><tr>" + "".join(f"<th>{_inline(c)}</th>" for c in head) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in row) + "</tr>" for row in body)
                       + "</table>")
        elif re.match(r"\s*[-*] ", line):
            flush()
            items = []
            while i < len(lines) and re.match(r"\s*[-*] ", lines[i]):
                items.append(re.sub(r"^\s*[-*] ", "", lines[i]))
                i += 1
            i -= 1
            out.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in items) + "</ul>")
        elif not line.strip():
            flush()
        else:
            paragraph.append(line.strip())
        i += 1
    flush()
    out.append("</body></html>")
    return "\n".join(out)
