"""docs/configuration.md, generated from the settings' declarations
(kvwatch/settings.py: each field of Settings with its parser and help): every
setting of `kvwatch serve` with its YAML key, flag, environment variable,
default and what it does, so the reference, `--help` and the parsers cannot
disagree."""

from __future__ import annotations

from kvwatch.settings import DECLARED, DEFAULT_RULES, default_text, env_name, flag_name

HEADER = """\
# Configuration of `kvwatch serve`

Generated from the settings' declarations in `kvwatch/settings.py` by `kvwatch generate`; do not edit by hand.

Each setting is a key of the YAML file given by `--config` (or `KVWATCH_CONFIG`), a flag and a `KVWATCH_*`
environment variable (except where the table says YAML only); flags beat the environment, which beats the file.
A bad configuration reports every problem at once and exits with status 2. Durations read `500ms`, `5s`, `2m`,
`1h` or a number of seconds; sizes `8MiB` (powers of 1024), `8MB` (of 1000) or a number of bytes; booleans `true`
or `false`.
"""

FOOTER = """\
`kvwatch serve --help` also lists the flags of replay (`--replay`, `--speed`) and of central mode
(`--prometheus`, `--selector`, `--source`, `--replica-labels`, `--max-replicas`, `--shard`), which are not settings
of the file.
"""


def _cell(text: str) -> str:
    return text.replace("|", "/")


def _default(key: str) -> str:
    if key in DEFAULT_RULES:
        return DEFAULT_RULES[key]
    text = default_text(key)
    return "unset" if text == "none" else "(empty)" if text == "" else f"`{text}`"


def rows() -> list[str]:
    lines = []
    for key, meta in DECLARED.items():
        flag = f"`{flag_name(key)}`" if meta["flag"] else "YAML only"
        env = f"`{env_name(key)}`" if meta["env"] else "YAML only"
        what = meta["help"] + (f"; {meta['doc']}" if meta["doc"] else "")
        lines.append(f"| `{key}` | {flag} | {env} | {_cell(_default(key))} | {_cell(what)} |")
    return lines


def render() -> str:
    lines = [HEADER, "| YAML key | flag | environment | default | |", "|---|---|---|---|---|", *rows(), "", FOOTER]
    return "\n".join(lines)
