"""One settings model: each setting of `kvwatch serve` is declared once,
beside its field in kvwatch/settings.py (parser and help), and its flag,
its --help line, its environment variable and its row in
docs/configuration.md are all made from that declaration."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from kvwatch.cli import main
from kvwatch.mixin.settings_doc import render
from kvwatch.settings import DECLARED, ENV_KEYS, FLAGS, PARSERS, Settings, env_name, flag_name, load_settings

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
# The one setting that is only a YAML key: a mapping of thresholds has no one-line flag or variable.
YAML_ONLY = {"diagnosis"}


def test_committed_configuration_reference_is_current():
    assert DOC.read_text() == render(), "docs/configuration.md is stale: run `make generate`"


def test_every_setting_is_declared_with_a_parser_and_help():
    assert list(DECLARED) == [f.name for f in fields(Settings)]
    for f in fields(Settings):
        meta = f.metadata
        assert callable(meta["parse"]) and PARSERS[f.name] is meta["parse"], f.name
        assert meta["help"] and meta["help"] == meta["help"].strip() and "\n" not in meta["help"], f.name
        assert f.default is not MISSING or meta["default_rule"], f"{f.name}: a default --help can state"


def test_every_setting_has_a_flag_and_an_environment_name_but_the_yaml_only_one():
    assert {key for key in DECLARED if key not in FLAGS} == YAML_ONLY
    assert {key for key in DECLARED if key not in ENV_KEYS} == YAML_ONLY
    assert flag_name("poll_interval") == "--poll-interval" and env_name("poll_interval") == "KVWATCH_POLL_INTERVAL"


def test_every_setting_appears_in_the_reference_with_its_flag_variable_and_help():
    text = render()
    for key, meta in DECLARED.items():
        rows = [line for line in text.splitlines() if line.startswith(f"| `{key}` |")]
        assert len(rows) == 1, key
        row = rows[0]
        assert meta["help"].replace("|", "/") in row, key
        if key in YAML_ONLY:
            assert row.count("YAML only") == 2, key
        else:
            assert f"| `{flag_name(key)}` | `{env_name(key)}` |" in row, key


def test_serve_help_has_each_flag_with_its_declared_help(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for key in FLAGS:
        words = " ".join(DECLARED[key]["help"].split())
        assert f"{flag_name(key)} {key.upper()} {words} (default: " in text, key
    for key in YAML_ONLY:
        assert flag_name(key) not in text


def test_a_yaml_only_setting_is_not_read_from_the_environment(tmp_path):
    # KVWATCH_DIAGNOSIS is no variable of kvwatch: set, it is ignored (as before the declarations).
    settings = load_settings(environ={env_name("diagnosis"): "not a mapping", env_name("window"): "2m"})
    assert settings.diagnosis == {} and settings.window == 120.0


@pytest.mark.parametrize("command, keys", [
    ("capture", ("target", "bearer_token_file", "ca_bundle", "tls_verify", "timeout", "max_body_bytes")),
    ("diagnose", ("target", "engine")),
])
def test_other_commands_take_a_setting_as_flag_with_its_declared_help(capsys, command, keys):
    args = [command, "--help"] if command != "capture" else [command, "--out", "x", "--help"]
    with pytest.raises(SystemExit):
        main(args)
    text = " ".join(capsys.readouterr().out.split())
    for key in keys:
        words = " ".join(DECLARED[key]["help"].split())
        assert f"{flag_name(key)} {key.upper()} {words}" in text, key
        assert f"; env {env_name(key)})" in text, key
