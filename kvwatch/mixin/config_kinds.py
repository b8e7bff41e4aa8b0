"""The kinds of the mixin config's fields: what a value must be, said once
per kind. Every MixinConfig field declares its kind in its metadata
(`field(metadata=described(KIND, help))`), and checking a value is its
kind's check: a field without a declared kind stops the import, so a new
threshold can never accept any value."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from kvwatch.diagnose.causes import SEVERITIES
from kvwatch.mixin.objectives import check_windows
from kvwatch.mixin.paging import ALERTS, DEFAULT_FOR, DEFAULT_SEVERITIES
from kvwatch.mixin.promql import check_selector
from kvwatch.units import is_prometheus_duration

_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")


@dataclass(frozen=True)
class Kind:
    """A field's kind: its check (field name, value -> problems, each one
    sentence) and how a YAML value becomes the field's (lists to tuples)."""

    check: Callable[[str, Any], list[str]]
    convert: Callable[[Any], Any] = lambda value: value
    optional: bool = False  # None (empty in YAML) is allowed

    def problems(self, name: str, value: Any) -> list[str]:
        if value is None and self.optional:
            return []
        return self.check(name, value)


class UndeclaredKindError(TypeError):
    """A config field without a declared kind."""


def described(kind: Kind, help_text: str) -> dict:
    """A field's metadata: its kind and its help text."""
    return {"kind": kind, "help": help_text}


def require_kinds(cls: type) -> None:
    """Every field of `cls` declares its Kind, or the class is refused."""
    for f in fields(cls):
        if not isinstance(f.metadata.get("kind"), Kind):
            raise UndeclaredKindError(f"{cls.__name__}.{f.name} declares no kind: give it "
                                      "metadata=described(KIND, help) (kvwatch/mixin/config_kinds.py)")


def kind_of(cls: type, name: str) -> Kind:
    return next(f.metadata["kind"] for f in fields(cls) if f.name == name)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _when(test: Callable[[Any], bool], problem: str) -> Callable[[str, Any], list[str]]:
    """A check that says `problem` (with {name} and {value}) when `test` fails."""
    def check(name: str, value: Any) -> list[str]:
        return [] if test(value) else [problem.format(name=name, value=repr(value))]
    return check


def _selector(name: str, value: Any) -> list[str]:
    if not isinstance(value, str):
        return [f"{name}: must be a string"]
    problem = check_selector(value)
    return [f"{name}: {problem}"] if problem else []


def _selector_or_empty(name: str, value: Any) -> list[str]:
    return [] if isinstance(value, str) and not value.strip() else _selector(name, value)


def _mapping(keys: dict, key_word: str, value_ok: Callable[[Any], bool], value_word: str, whole: str):
    def check(name: str, value: Any) -> list[str]:
        if not isinstance(value, dict):
            return [f"{name}: must be a mapping of {whole}"]
        problems = []
        for key, item in value.items():
            if key not in keys:
                problems.append(f"{name}: unknown {key_word} {key!r} (known: {', '.join(keys)})")
            elif not value_ok(item):
                problems.append(f"{name}: {key}: {item!r} is not {value_word}")
        return problems
    return check


def _dashboard_url_pattern(name: str, value: Any) -> list[str]:
    if not isinstance(value, str) or "{uid}" not in value:
        return [f"{name}: must be a string containing {{uid}}"]
    try:
        value.format(uid="u", panel_id=1, model_name="m", engine="e")
    except (KeyError, IndexError, ValueError) as exc:
        return [f"{name}: unknown placeholder {exc} (known: {{uid}}, {{panel_id}}, {{model_name}}, {{engine}})"]
    return []


def _duration_ok(value: Any) -> bool:
    return is_prometheus_duration(value)


DURATION = Kind(_when(_duration_ok, "{name}: {value} is not a Prometheus duration (examples: 30s, 5m, 1h)"))
OPTIONAL_DURATION = Kind(DURATION.check, optional=True)
RATIO = Kind(_when(lambda v: _is_number(v) and 0 < v <= 1, "{name}: {value} must be a number in (0, 1]"))
OBJECTIVE = Kind(_when(lambda v: _is_number(v) and 0 < v < 1,
                       "{name}: {value} must be a number strictly between 0 and 1 (0.99: 99%)"))
POSITIVE = Kind(_when(lambda v: _is_number(v) and v > 0, "{name}: {value} must be a positive number"))
POSITIVE_INTEGER = Kind(_when(lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                              "{name}: {value} must be a positive integer"))
FLAG = Kind(_when(lambda v: isinstance(v, bool), "{name}: {value} must be true or false"))
LABEL = Kind(_when(lambda v: isinstance(v, str) and bool(_LABEL_NAME.match(v)), "{name}: {value} is not a label name"))
LABELS = Kind(_when(lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) and _LABEL_NAME.match(x)
                                                                    for x in v),
                    "{name}: {value} must be a list of label names"), convert=tuple)
STRINGS = Kind(_when(lambda v: isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v),
                     "{name}: must be a list of strings"), convert=tuple)
MODES = ("sidecar", "central")
MODE = Kind(_when(lambda v: v in MODES, "{name}: {value} is not one of " + ", ".join(MODES)))
SELECTOR_OR_EMPTY = Kind(_selector_or_empty)
OPTIONAL_SELECTOR = Kind(_selector, optional=True)
OPTIONAL_METRIC = Kind(_when(lambda v: isinstance(v, str) and bool(_METRIC_NAME.match(v)),
                             "{name}: {value} is not a metric name"), optional=True)
SHORT_NAME = Kind(_when(lambda v: isinstance(v, str) and bool(re.fullmatch(r"[a-zA-Z0-9][a-zA-Z0-9_.-]{0,39}", v)),
                        "{name}: {value} must be 1-40 letters, digits, '-', '_' or '.'"))
STRING_MAP = Kind(_when(lambda v: isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str)
                                                              for k, x in v.items()),
                        "{name}: must be a mapping of strings to strings"))
# A link base an on-call reader opens: a literal host (never a template, which
# renders empty on an alert without that label), no fragment, nothing YAML quotes.
LINK_BASE_URL = re.compile(r"https?://[A-Za-z0-9][A-Za-z0-9.:\[\]-]*(/[^\s#{}\"'<>|\\^`]*)?")
BASE_URL = Kind(_when(lambda v: isinstance(v, str) and bool(LINK_BASE_URL.fullmatch(v)),
                      "{name}: {value} must be an http(s) URL with a host of its own (no {{{{ template }}}}, "
                      "no #fragment, no quotes or spaces)"))
OPTIONAL_BASE_URL = Kind(BASE_URL.check, optional=True)
OPTIONAL_RUNBOOK_PATTERN = Kind(_when(lambda v: isinstance(v, str) and "{anchor}" in v,
                                      "{name}: must be a string containing {{anchor}}"), optional=True)
OPTIONAL_DASHBOARD_PATTERN = Kind(_dashboard_url_pattern, optional=True)
BURN_WINDOWS = Kind(lambda name, value: check_windows(value), convert=lambda v: tuple(dict(pair) for pair in v))
FOR_DURATIONS = Kind(_mapping(ALERTS, "alert", _duration_ok, "a Prometheus duration", "alert name to duration"),
                     convert=lambda v: {**DEFAULT_FOR, **v})
SEVERITY_MAP = Kind(_mapping(DEFAULT_SEVERITIES, "cause", lambda v: v in SEVERITIES,
                             f"one of {', '.join(SEVERITIES)}", "cause to severity"),
                    convert=lambda v: {**DEFAULT_SEVERITIES, **v})
