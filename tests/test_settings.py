import socket

import pytest

from kvwatch.cli import main
from kvwatch.settings import SettingsError, load_settings


def test_defaults_env_file_and_flags_layer_in_that_order(tmp_path):
    config = tmp_path / "kvwatch.yaml"
    config.write_text("target: http://engine:8000\nport: 9500\npoll_interval: 2s\nwindow: 1m\n")
    env = {"KVWATCH_PORT": "9600", "KVWATCH_LOG_LEVEL": "debug"}
    settings = load_settings(str(config), {"poll_interval": "1500ms"}, environ=env)
    assert settings.target == "http://engine:8000/metrics"  # bare host:port gets /metrics
    assert settings.port == 9600  # env over file
    assert settings.poll_interval == 1.5  # flag over file
    assert settings.window == 60 and settings.log_level == "debug"
    assert settings.host == "127.0.0.1"  # loopback unless told otherwise
    assert settings.fetch_timeout == pytest.approx(15.0)  # a late page is kept (polls never overlap)


def test_config_file_from_environment(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("port: 9700\n")
    assert load_settings(environ={"KVWATCH_CONFIG": str(config)}).port == 9700


def test_every_error_is_reported_at_once(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("target: ftp://nowhere\nport: 99999\npoll_interval: soon\nunknown_key: 1\nmax_body_bytes: 12XB\n")
    with pytest.raises(SettingsError) as raised:
        load_settings(str(config), {"bearer_token_file": "/does/not/exist"}, environ={"KVWATCH_TLS_VERIFY": "maybe"})
    text = str(raised.value)
    for fragment in ("ftp://nowhere", "99999", "soon", "unknown_key", "12XB", "/does/not/exist", "maybe"):
        assert fragment in text
    assert len(raised.value.problems) == 7


def test_timeout_must_stay_within_half_the_window_and_window_hold_two_polls():
    with pytest.raises(SettingsError) as raised:
        load_settings(overrides={"poll_interval": "5s", "timeout": "6s", "window": "8s"}, environ={})
    assert len(raised.value.problems) == 2


def test_unreadable_yaml_is_an_error_not_a_crash(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("target: [unclosed\n")
    with pytest.raises(SettingsError, match="not valid YAML"):
        load_settings(str(config), environ={})


def test_unreadable_yaml_is_told_in_one_line_with_where(tmp_path):
    config = tmp_path / "broken.yaml"
    config.write_text("target: [unclosed\n")
    with pytest.raises(SettingsError) as raised:
        load_settings(str(config), environ={})
    (problem,) = raised.value.problems
    assert "\n" not in problem and "<unicode string>" not in problem
    assert "line 2, column 1: expected ',' or ']'" in problem and "line 1, column 9" in problem


def test_a_port_or_count_that_is_not_a_number_is_told_without_python_words():
    with pytest.raises(SettingsError) as raised:
        load_settings(overrides={"port": "abc", "max_series": "many"}, environ={})
    assert raised.value.problems == ["--port: 'abc' is not a whole number",
                                     "--max-series: 'many' is not a whole number"]


def test_serve_with_bad_config_exits_non_zero_and_names_every_problem(tmp_path, capsys):
    config = tmp_path / "bad.yaml"
    config.write_text("port: -1\nwindow: never\n")
    assert main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "port" in err and "never" in err


def test_serve_on_a_port_already_taken_says_so_in_one_sentence_before_serving(capsys):
    # uvicorn logged `[Errno 98] error while attempting to bind on address ...` after
    # kvwatch had announced "serving", and exited 3.
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", "--port", str(port), "--target", "http://127.0.0.1:9/metrics"]) == 1
    err = capsys.readouterr().err
    assert err == f"kvwatch: cannot listen on 127.0.0.1:{port}: another process already listens on that port " \
                  "(choose another --port)\n"


def test_kubernetes_service_link_variable_is_not_taken_for_the_port():
    settings = load_settings(environ={"KVWATCH_PORT": "tcp://10.0.0.7:9400"})
    assert settings.port == 9400
    with pytest.raises(SettingsError):
        load_settings(environ={"KVWATCH_PORT": "http://10.0.0.7:9400"})


def test_serve_help_states_every_default_one_way_and_each_parses_back_to_the_setting(capsys):
    """Every option of `kvwatch serve --help` ends in "(default: X; env
    KVWATCH_Y)", X read from Settings, and X given back as the flag's value
    yields that default (no "5s" here and "5 seconds" there)."""
    import re
    from dataclasses import fields

    from kvwatch.settings import PARSERS, Settings, default_text

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    from kvwatch.commands.serve import OPTIONS

    options = [o for o in re.findall(r"--([a-z-]+) [A-Z_]+ ", text) if o.replace("-", "_") in OPTIONS]
    assert sorted(options) == sorted(key.replace("_", "-") for key in OPTIONS)
    for option in options:
        key = option.replace("-", "_")
        found = re.search(rf"--{option} {key.upper()} .*?\(default: ([^;]*); env KVWATCH_{key.upper()}\)", text)
        assert found, option
        assert found.group(1) == default_text(key)
    assert text.count("(default") == text.count("(default: ")  # one way
    defaults = {f.name: f.default for f in fields(Settings)}
    for key in ("poll_interval", "window", "max_body_bytes", "port", "max_series", "host", "tls_verify",
                "log_level", "engine", "target"):
        assert PARSERS[key](default_text(key)) == defaults[key], key


def test_an_unknown_setting_gets_the_nearest_known_one(tmp_path):
    path = tmp_path / "kvwatch.yaml"
    path.write_text("windw: 5m\npoll-intervl: 2s\nzzz: 1\ndiagnosis:\n  hit_ratio_lo: 0.2\n")
    with pytest.raises(SettingsError) as caught:
        load_settings(str(path), environ={})
    problems = caught.value.problems
    assert any("unknown setting 'windw': did you mean 'window'?" in p for p in problems), problems
    assert any("unknown setting 'poll-intervl': did you mean 'poll_interval'?" in p for p in problems), problems
    assert any("unknown setting 'zzz' (known:" in p for p in problems), problems  # nothing near: no guess
    assert any("unknown threshold 'hit_ratio_lo': did you mean 'hit_ratio_low'?" in p for p in problems), problems


def test_a_misspelt_flag_shows_the_subcommand_s_usage_and_the_nearest_flag(capsys):
    from kvwatch.cli import main

    with pytest.raises(SystemExit) as caught:
        main(["diagnose", "--durration", "30s"])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvwatch diagnose ")
    assert "unrecognized arguments: --durration 30s" in err
    assert "--durration: did you mean --duration?" in err
