"""The low-severity inputs: what a command reads from outside, what a request
names, what a Helm value templates, what a flag parses, what the demo's
phase endpoint answers, and which scenario file `kvwatch sim` reads. Each
is one sentence and the right exit status, refused by the schema, or kept
from what it could reach."""

from __future__ import annotations

import copy
import json

import pytest

from kvwatch.cli import main
from pageserver import Answer, PageServer

ESCAPES = "\x1b]0;retitled\x07\x1b[2J\x1b[31m\u202e"


def kvwatch_diagnosis(engine: str = "0") -> dict:
    """A kvwatch's /api/v1/diagnosis as `capacity --kvwatch` reads it."""
    return {"kv_events": {
        "up": True, "block_size": 16, "table": {"sampling_rate": 1},
        "page_engine": {"engine": engine},
        "window": {"seconds": 60, "stored": 720, "stored_again": 540, "stored_again_ratio": 0.75},
        "sizing": {"hit_ratio_now": 0.5, "cache_blocks": 128, "note": "an estimate",
                   "points": [{"extra_cache": 1, "extra_blocks": 128, "extra_bytes": 2**20, "blocks_kept": 100,
                               "recomputation_avoided_ratio": 0.5, "hit_ratio": 0.6}]}}}


def capacity_of(answer: str, capsys) -> tuple[int, str, str]:
    with PageServer([Answer(answer, headers={"Content-Type": "application/json"})]) as served:
        status = main(["capacity", "--kvwatch", served.base_url])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_capacity_prints_a_kvwatchs_labels_with_their_escapes_written_out(capsys):
    status, out, err = capacity_of(json.dumps(kvwatch_diagnosis(engine="engine" + ESCAPES)), capsys)
    assert status == 0 and "x1" in out
    assert not any(ch in out for ch in "\x1b\x07\u202e"), out
    assert "engine\\x1b]0;retitled\\x07\\x1b[2J" in out


def wrong(path: str, value) -> str:
    diagnosis = kvwatch_diagnosis()
    *parents, last = path.split(".")
    at = diagnosis["kv_events"]
    for key in parents:
        at = at[int(key)] if isinstance(at, list) else at[key]
    at[last] = value
    return json.dumps(diagnosis)


@pytest.mark.parametrize("answer", [
    wrong("window", ["60 s"]),
    wrong("window.seconds", "60"),
    wrong("window.stored", {"n": 1}),
    wrong("window.stored_again_ratio", True),
    wrong("sizing", "a curve"),
    wrong("sizing.points", "many"),
    wrong("sizing.points", [1, 2]),
    wrong("sizing.points.0.blocks_kept", None),
    wrong("sizing.points.0.extra_cache", "x2"),
    wrong("sizing.points.0.hit_ratio", [0.5]),
    wrong("sizing.note", 7),
    wrong("table", "sampled"),
    wrong("page_engine", [ESCAPES]),
    wrong("window.seconds", 10**400),
    wrong("window.prefill_seconds_per_token", "fast"),
    wrong("window.by_label", "chat-lora"),
    wrong("window.by_label", [{"medium": "GPU", "lora_name": "a", "stored": "7", "stored_again": 1}]),
    wrong("window.by_label", [{"medium": "GPU", "lora_name": ["a"], "stored": 7, "stored_again": 1}]),
    wrong("block_size", "16"),
    json.dumps(kvwatch_diagnosis()).replace('"blocks_kept": 100', '"blocks_kept": 1e400'),
    json.dumps(kvwatch_diagnosis()).replace('"stored": 720', '"stored": NaN'),
    json.dumps(kvwatch_diagnosis()).replace('"stored": 720', '"stored": ' + "9" * 5000),
    "[" * 100_000 + "]" * 100_000,
    json.dumps({"kv_events": {"up": False, "detail": "no events" + ESCAPES}}),
])
def test_capacity_on_a_kvwatch_answer_of_the_wrong_types_is_one_sentence(capsys, answer):
    status, out, err = capacity_of(answer, capsys)
    assert status == 2 and out == ""
    assert err.startswith("kvwatch capacity: error: ") and err.count("\n") == 1, err[-2000:]
    assert "Traceback" not in err and "\x1b" not in err


def test_the_shape_check_passes_kvwatchs_own_answer():
    from kvwatch.commands.capacity import _stream_shape_problem

    stream = copy.deepcopy(kvwatch_diagnosis()["kv_events"])
    assert _stream_shape_problem(stream, stream["window"], stream["sizing"]) is None


# --- redirects name no host a request chose ---------------------------------------


def sidecar_and_central_apps():
    from kvwatch.central.app import create_central_app
    from kvwatch.central.refresh import Central
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings
    from kvwatch.sidecar.app import create_app
    from promstub import StubClient

    settings = load_settings(overrides={"target": "http://127.0.0.1:9/metrics"}, environ={})
    return {"sidecar": create_app(Monitor(settings), settings),
            "central": create_central_app(Central(StubClient(""), settings), settings)}


@pytest.mark.parametrize("mode", ["sidecar", "central"])
def test_a_trailing_slash_redirect_is_relative_whatever_host_the_request_names(mode):
    """Without a token, `/runbooks/` answered 307 to `http://<Host header>/runbooks`:
    any page could send a user through kvwatch to a host of its choosing."""
    from urllib.parse import urljoin

    from fastapi.testclient import TestClient

    from test_security import routes_of

    app = sidecar_and_central_apps()[mode]
    client = TestClient(app)
    paths = [path for path, _ in routes_of(app) if path != "/"]
    assert "/api/v1/diagnosis" in paths and ("/runbooks" in paths or mode == "central")
    for path in paths:
        for headers in ({"Host": "evil.example"}, {"Host": "evil.example", "X-Forwarded-Host": "evil.example"}):
            answer = client.get(path + "/", params={"replica": "a"}, headers=headers, follow_redirects=False)
            location = answer.headers.get("location", "")
            assert answer.status_code == 307 and "evil" not in location, (path, location)
            # Resolved against where it was asked (behind a proxy's prefix too), it is the route.
            assert urljoin(f"http://kvwatch.local{path}/", location) == f"http://kvwatch.local{path}?replica=a"
            assert urljoin(f"http://kvwatch.local/prefix{path}/", location) == \
                f"http://kvwatch.local/prefix{path}?replica=a"


# --- --shard -------------------------------------------------------------------------


@pytest.mark.parametrize("shard, pod", [
    ("0/\u00b2", ""), ("\u00b2/4", ""), ("0/\u0663", ""), ("0/" + "9" * 5000, ""), ("9" * 5000 + "/4", ""),
    ("ordinal/4", "kvwatch-central-\u00b2"), ("ordinal/4", "kvwatch-central-" + "7" * 5000),
])
def test_a_shard_that_is_no_number_is_one_sentence(capsys, monkeypatch, shard, pod):
    """`--shard 0/²` and a 5,000-digit count gave a traceback (str.isdigit
    takes "²", int() refuses it and 5,000 digits)."""
    monkeypatch.setenv("POD_NAME", pod)
    status = main(["serve", "--prometheus", "http://127.0.0.1:9", "--shard", shard])
    err = capsys.readouterr().err
    assert status == 2 and "--shard: " in err and "Traceback" not in err, err[-500:]
    assert len(err) < 1000


# --- --demo-target -------------------------------------------------------------------


@pytest.mark.parametrize("answer", [
    "[" * 8000 + "]" * 8000,
    '{"phase": ' + "[" * 5000 + "]" * 5000 + "}",
    '{"phase": "p", "phases": ' + "9" * 5000 + "}",
    '{"phase": ["p"], "next_in_seconds": 1e400, "speed": NaN}',
    "\xff\xfe not json",
])
def test_a_hostile_demo_answer_leaves_the_engines_poll_alone(answer):
    """The demo's phase endpoint answering brackets nested thousands deep
    raised out of the engine's poll: `kvwatch_up` 0, `internal`."""
    from fuzz.pages import Engine, page
    from kvwatch.pipeline.monitor import Monitor
    from kvwatch.settings import load_settings

    good = page(Engine(prompt_tokens=100, running=1, usage=0.25))
    with PageServer([Answer(good)]) as engine, \
            PageServer([Answer(answer + "\n", headers={"Content-Type": "application/json"})]) as demo:
        settings = load_settings(overrides={"target": engine.url, "demo_target": demo.base_url + "/sim/phase"},
                                 environ={})
        monitor = Monitor(settings)
        for _ in range(2):
            state = monitor.poll_once()
            assert state.up and state.reason in ("", None) and state.demo is None
        assert len(demo.requests) == 2
    assert sum(monitor.state.errors_by_reason.values()) == 0


def test_the_demo_endpoint_waits_a_quarter_of_the_poll_interval_at_most():
    from kvwatch.pipeline.demo import DemoSource

    assert DemoSource("http://127.0.0.1:9/sim/phase", 10.0, 1.0).fetcher.timeout == 0.25
    assert DemoSource("http://127.0.0.1:9/sim/phase", 10.0, 30.0).fetcher.timeout == 2.0
    assert DemoSource("http://127.0.0.1:9/sim/phase", 0.5, 30.0).fetcher.timeout == 0.5


# --- kvwatch sim --scenario ------------------------------------------------------------


@pytest.mark.parametrize("shadow", ["folder", "file"])
def test_the_current_directory_never_shadows_a_shipped_scenario(tmp_path, monkeypatch, shadow):
    """A `demo/` folder (or a file named `demo`) in the current directory
    was taken for the scenario: the folder failed `kvwatch sim`, the file
    ran instead of the shipped demo. A bare name is always the package's; a
    file of one's own is named by a path (a slash, or .yaml)."""
    from kvwatch.sim.scenario import ScenarioError, load_scenario

    shipped = load_scenario("demo")
    monkeypatch.chdir(tmp_path)
    from importlib import resources

    own = resources.files("kvwatch").joinpath("scenarios/idle.yaml").read_text().replace("name: idle", "name: mine", 1)
    if shadow == "folder":
        (tmp_path / "demo").mkdir()
    else:
        (tmp_path / "demo").write_text(own)
    (tmp_path / "healthy.yaml").write_text(own)
    assert load_scenario("demo") == shipped
    assert load_scenario("healthy").name == "healthy"
    assert load_scenario("healthy.yaml").name == "mine"  # a .yaml ending names a file
    if shadow == "file":
        assert load_scenario("./demo").name == "mine"  # so does a slash
    else:
        with pytest.raises(ScenarioError, match="Is a directory"):
            load_scenario("./demo")


@pytest.mark.parametrize("path", ["/dev/zero", "./absent.yaml"])
def test_a_scenario_path_that_is_no_small_file_is_one_sentence(tmp_path, monkeypatch, capsys, path):
    monkeypatch.chdir(tmp_path)
    assert main(["sim", "--scenario", path, "--report", "60"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") <= 2, err


def test_every_command_that_prints_text_from_outside_writes_its_escapes_out():
    """One helper (present.printable) for capacity, diagnose, capture's and
    diagnose's failure lines and sweep --compare's report."""
    import io

    from kvwatch.commands.failfast import FailureReport
    from kvwatch.present import TerminalText, printable

    out = io.StringIO()
    FailureReport(out, "kvwatch capture", None).failed(1, "content_type", "it answered text/html" + ESCAPES)
    assert "\x1b" not in out.getvalue() and "\\x1b]0;retitled" in out.getvalue()
    assert printable("a\tb\nc" + ESCAPES, keep_lines=True).startswith("a\tb\nc\\x1b")
    assert "\n" not in printable("a\nb") and "\u202e" not in printable(ESCAPES)
    assert TerminalText(io.StringIO()).isatty() is False
