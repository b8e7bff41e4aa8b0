"""Presentation helpers shared by the status page, the CLI and the reports:
URLs as a person or a scraper may read them (never with credentials), values
and evidence as a person reads them, and JSON without the floats JSON cannot
carry. They read nothing but their arguments (and the catalogue's labels),
but for Throttle, which remembers when each kind of thing was last said."""

from __future__ import annotations

import math
import re
import time
from typing import Any, Callable, Hashable, Protocol, overload
from urllib.parse import urlsplit, urlunsplit

from kvwatch.signals.catalogue import SIGNALS_BY_NAME, UNITS
from kvwatch.snapshot import bounded_text


# --------------------------------------------------------------------------
# URLs
# --------------------------------------------------------------------------


@overload
def public_url(url: str) -> str: ...
@overload
def public_url(url: None) -> None: ...
def public_url(url: str | None) -> str | None:
    """The URL without credentials, for anything a user or scraper can read."""
    if not url:
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def public_host(url: str) -> str:
    """host:port of a URL, without credentials."""
    parts = urlsplit(url)
    host = parts.hostname or "?"
    return f"{host}:{parts.port}" if parts.port else host


def origin(url: str) -> str:
    """scheme://host:port of a URL, lower-cased: what a credential is scoped to."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def normalize_target(value: Any) -> str:
    """A URL kvwatch can fetch from: http(s) with a host and a valid port; a
    bare origin gets /metrics. ValueError in one sentence, without a password."""
    text = str(value).strip()
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        # The message goes to the terminal and CI logs: not the password.
        shown = text.replace(f":{parts.password}@", ":<redacted>@", 1) if parts.password else text
        raise ValueError(f"{shown!r} is not an http(s) URL")
    try:
        parts.port  # noqa: B018 - raises for a port that is not a number or out of range
    except ValueError:
        shown = parts.netloc.rsplit("@", 1)[-1]
        raise ValueError(f"{shown!r} has no valid port (1-65535)") from None
    if parts.port == 0 or not parts.hostname:
        raise ValueError(f"{parts.netloc.rsplit('@', 1)[-1]!r} is not a host and port kvwatch can fetch from")
    path = parts.path if parts.path not in ("", "/") else "/metrics"
    return urlunsplit((parts.scheme, parts.netloc, path, parts.query, ""))


# --------------------------------------------------------------------------
# Values, evidence and labels (the page's script mirrors format_value)
# --------------------------------------------------------------------------


def clean(value: Any) -> Any:
    """A value for JSON: a float that is not finite becomes None (null), in
    dicts, lists and tuples too."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


def signal_label(name: str) -> str:
    """A signal's human label with its unit where the value does not carry it."""
    signal = SIGNALS_BY_NAME[name]
    unit = UNITS[signal.unit].label
    return f"{signal.display} ({unit})" if unit else signal.display


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
# Text for a terminal
# --------------------------------------------------------------------------

# Control characters, and the format characters that reorder or hide text
# (right-to-left overrides, isolates, line and paragraph separators).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_CONTROL_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: Any, keep_lines: bool = False) -> str:
    """Text from outside (an engine's label, a store's error, a sidecar's
    answer) as kvwatch prints or logs it: control characters written as
    escapes, never sent raw (they could clear the screen, retitle it or hide
    lines). `keep_lines`: newline and tab stay (kvwatch's own reports)."""
    pattern = _CONTROL_BUT_LINES if keep_lines else _CONTROL
    return pattern.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), str(text))


class TextOut(Protocol):
    """What the reports write to: a stream, or TerminalText over one."""

    def write(self, text: str, /) -> int: ...

    def flush(self) -> None: ...


class TerminalText:
    """A text stream for people's terminals, written through printable()
    (newlines and tabs kept). JSON output is escaped by json.dumps already."""

    def __init__(self, out):
        self.out = out

    def write(self, text: str) -> int:
        return self.out.write(printable(text, keep_lines=True))

    def flush(self) -> None:
        self.out.flush()

    def __getattr__(self, name: str):  # isatty, encoding, ...: the stream's own
        return getattr(self.out, name)


class Throttle:
    """Whether a kind of thing may be said again now: at most once every
    `seconds` per kind, remembering at most `max_kinds` (a new kind past
    them waits until one has been quiet that long). Callers hold their lock."""

    def __init__(self, seconds: float, max_kinds: int = 64, clock: Callable[[], float] = time.monotonic):
        self.seconds, self.max_kinds, self.clock = seconds, max_kinds, clock
        self.said: dict[Hashable, float] = {}

    def ready(self, kind: Hashable) -> bool:
        now = self.clock()
        last = self.said.get(kind)
        if last is not None and now - last < self.seconds:
            return False
        if last is None and len(self.said) >= self.max_kinds:
            for quiet in [k for k, at in self.said.items() if now - at >= self.seconds]:
                del self.said[quiet]
            if len(self.said) >= self.max_kinds:
                return False
        self.said[kind] = now
        return True
