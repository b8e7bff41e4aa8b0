"""One grammar for the sizes and durations every command and config accepts.

Durations: a number of seconds (`5`, `0.5`) or a number with a unit (`500ms`,
`5s`, `2m`, `1h`); finite and above zero. Prometheus' own durations (the
mixin's windows and `for:`, scrape intervals) have their own grammar, read
here too: whole numbers each with a unit, in one or more parts (`30s`,
`1h30m`, `1d`, `0s`), never a bare number. Sizes: a whole number of bytes
(`4194304`) or a number with a unit, decimal (`KB`, `MB`, `GB`, `TB`: powers of
1000) or binary (`KiB`, `MiB`, `GiB`, `TiB`: powers of 1024). A bare `M` or `G`
is refused because it could mean either, and a size is exact: `1.5GiB` is
1610612736 bytes, not a float near it.

A YAML file that does not parse is told in one line: where, and what.
"""

from __future__ import annotations

import math
import re
from typing import Any

_DURATION = re.compile(r"\s*([-+]?[0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}

# Prometheus' duration units; `y` is 365 days, as Prometheus counts it.
PROMETHEUS_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}

_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")
_BYTES = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_duration(value: Any) -> float:
    """Seconds from a number or a text such as `500ms`, `5s`, `2m`, `1h`."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        match = _DURATION.fullmatch(str(value))
        if not match:
            raise ValueError(f"{value!r} is not a duration (examples: 5, 5s, 500ms, 2m, 1h)")
        seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    if not math.isfinite(seconds):
        raise ValueError(f"{value!r} is not a finite duration")
    if seconds <= 0:
        raise ValueError(f"{value!r} must be positive")
    return seconds


def parse_prometheus_duration(value: Any, units: str = "ms|s|m|h|d|w|y") -> float:
    """Seconds of a Prometheus duration (`30s`, `5m`, `1h30m`, `1d`, `0s`),
    each part a whole number with one of `units` (alternatives of a regular
    expression, longest first). ValueError, one sentence, for anything else:
    not a string, a bare number, a fraction, another unit."""
    if not isinstance(value, str) or not re.fullmatch(rf"(?:\d+(?:{units}))+", value):
        raise ValueError(f"{value!r} is not a Prometheus duration (examples: 30s, 5m, 1h)")
    return sum(float(n) * PROMETHEUS_UNITS[u] for n, u in re.findall(rf"(\d+)({units})", value))


def is_prometheus_duration(value: Any, units: str = "ms|s|m|h|d|w|y") -> bool:
    """Whether parse_prometheus_duration reads `value`."""
    try:
        parse_prometheus_duration(value, units)
    except ValueError:
        return False
    return True


def prometheus_duration(seconds: float) -> str:
    """Seconds as a Prometheus duration: whole minutes as `Nm`, else `Ns`."""
    whole = int(round(seconds))
    return f"{whole // 60}m" if whole and whole % 60 == 0 else f"{whole}s"


def parse_whole_number(value: Any) -> int:
    """An integer from an int or a text of digits: "'abc' is not a whole number"."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a whole number")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a whole number") from None


def parse_port(value: Any) -> int:
    port = parse_whole_number(value)
    if not 0 <= port <= 65535:
        raise ValueError(f"{value!r} is not a port (0-65535)")
    return port


def parse_number(value: Any, minimum: float | None = None) -> float:
    """A finite number (`2`, `0.5`), at least `minimum` when given."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is not a number") from None
    if not math.isfinite(number):
        raise ValueError(f"{value!r} is not a finite number")
    if minimum is not None and number < minimum:
        raise ValueError(f"{value!r} must be at least {minimum:g}")
    return number


def finite_number(value: Any) -> float | None:
    """A value as a float where it is a finite number (a sample as a store
    wrote it, a figure read from a report), None where it is not."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def parse_size(value: Any) -> int:
    """Bytes from a whole number or a text such as `3GiB`, `16MiB`, `10MB`."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size")
    if isinstance(value, int):
        size = value
    else:
        if isinstance(value, float):
            value = repr(value) if math.isfinite(value) else str(value)
        match = _SIZE.fullmatch(str(value))
        if not match:
            raise ValueError(f"cannot read {value!r} as a size: write a number and a unit, for example "
                             "3GiB (3 x 2^30 bytes), 3GB (3 x 10^9 bytes) or 4194304 (bytes)")
        number, unit = match.group(1), match.group(2)
        multiplier = _BYTES.get(unit.lower())
        if multiplier is None:
            raise ValueError(f"unknown size unit {unit!r} in {value!r}: use B, KB, MB, GB, TB "
                             "(powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)")
        whole, _, fraction = number.partition(".")
        numerator = int(whole + fraction) * multiplier
        denominator = 10 ** len(fraction)
        if numerator % denominator:
            raise ValueError(f"{value!r} is not a whole number of bytes")
        size = numerator // denominator
    if size <= 0:
        raise ValueError(f"size {value!r} must be more than zero bytes")
    return size


def yaml_problem(exc: Exception) -> str:
    """Where and what, in one line: PyYAML's own text spans several lines,
    quotes the file and names a "<unicode string>" the reader never wrote."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    if mark is None or not problem:
        return " ".join(str(exc).split())
    text = f"line {mark.line + 1}, column {mark.column + 1}: {problem}"
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None:
        text += f" ({context} from line {context_mark.line + 1}, column {context_mark.column + 1})"
    return text


def did_you_mean(name: Any, known) -> str:
    """`: did you mean 'window'?` for a misspelt key or flag, or "" when no
    known name is close (difflib's ratio of at least 0.6)."""
    import difflib

    near = difflib.get_close_matches(str(name).replace("-", "_"), [str(k) for k in known], n=1, cutoff=0.6)
    return f": did you mean {near[0]!r}?" if near else ""


def read_small_file(path, cap: int) -> bytes:
    """A configuration-sized file (a config, a token), read up to `cap`
    bytes: a regular file (a link to one is fine: Kubernetes mounts secrets
    so), never a FIFO or a device that would block or never end.
    OSError for what cannot be read, ValueError, one sentence, for a file
    too large or not regular."""
    import os
    import stat

    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise ValueError("not a regular file")
        data = handle.read(cap + 1)
    if len(data) > cap:
        raise ValueError(f"larger than the {cap:,} bytes kvwatch reads of it")
    return data

