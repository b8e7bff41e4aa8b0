"""Fail fast: `kvwatch diagnose --target` and `kvwatch capture` report the first
failed poll at once (in the sidecar's sentence, each new reason once) and
stop after --max-failures failed polls in a row (3 by default) unless
--keep-trying. Polls are counted: each run is given far more time than its
polls need, so a command that did not stop would poll many more times."""

from __future__ import annotations

import json
import socket

from kvwatch.capture.bundle import Capture
from kvwatch.cli import main
from pageserver import Answer, PageServer


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def page(fixtures_dir, name: str) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def diagnose(url: str, *extra: str) -> int:
    # 100 polls' worth of time: only giving up ends it early.
    return main(["diagnose", "--target", url, "--duration", "5s", "--interval", "0.05s", "--json", *extra])


def test_diagnose_reports_the_first_failed_poll_at_once_and_stops_after_three(capsys):
    port = closed_port()
    assert diagnose(f"http://127.0.0.1:{port}/metrics") == 2
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["polls"] == 3
    assert "stopped after 3 failed polls in a row" in report["stopped"]
    lines = captured.err.splitlines()
    assert lines[0].startswith("kvwatch diagnose: polling")
    # The second line, right after the first poll: the failure in one sentence, said once.
    assert lines[1] == (f"kvwatch diagnose: poll 1 failed: connection refused by 127.0.0.1:{port}: "
                        "nothing listens there (engine down or starting?)")
    assert captured.err.count("connection refused") == 1


def test_diagnose_max_failures_and_keep_trying(capsys):
    port = closed_port()
    assert diagnose(f"http://127.0.0.1:{port}/metrics", "--max-failures", "5") == 2
    assert json.loads(capsys.readouterr().out)["polls"] == 5
    # --keep-trying polls for the whole duration: 0, 0.1, 0.2, 0.3 s.
    assert main(["diagnose", "--target", f"http://127.0.0.1:{port}/metrics", "--duration", "0.3s",
                 "--interval", "0.1s", "--json", "--keep-trying"]) == 2
    report = json.loads(capsys.readouterr().out)
    assert report["polls"] == 4 and report["stopped"] is None
    assert main(["diagnose", "--target", f"http://127.0.0.1:{port}/metrics", "--max-failures", "0"]) == 2
    assert "--max-failures must be at least 1" in capsys.readouterr().err


def test_diagnose_says_when_a_failing_target_recovers_and_keeps_polling(fixtures_dir, capsys):
    good = Answer(page(fixtures_dir, "idle"))
    with PageServer([Answer("starting", status=503), Answer("starting", status=503), good]) as server:
        code = main(["diagnose", "--target", server.url, "--duration", "0.4s", "--interval", "0.1s", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["polls"] == 5
    lines = captured.err.splitlines()
    assert lines[1].startswith("kvwatch diagnose: poll 1 failed: ")
    assert lines[2] == "kvwatch diagnose: poll 3 succeeded after 2 failed"


def test_capture_reports_the_first_failed_fetch_at_once_and_stops_after_three(tmp_path, capsys):
    port = closed_port()
    out = tmp_path / "none"
    assert main(["capture", "--target", f"http://127.0.0.1:{port}", "--interval", "0.05s", "--duration", "5s",
                 "--out", str(out)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[1] == (f"kvwatch capture: poll 1 failed: connection refused by 127.0.0.1:{port}: "
                        "nothing listens there (engine down or starting?)")
    assert "stopped after 3 failed polls in a row" in lines[-2]
    assert lines[-1] == (f"kvwatch capture: no page recorded: connection refused by 127.0.0.1:{port}: "
                         "nothing listens there (engine down or starting?)")
    # The bundle is finished and holds the three failures.
    assert Capture(str(out)).manifest["failed"] == 3


def test_capture_keep_trying_records_for_the_whole_count(tmp_path, capsys):
    port = closed_port()
    assert main(["capture", "--target", f"http://127.0.0.1:{port}", "--interval", "0.01s", "--count", "5",
                 "--keep-trying", "--out", str(tmp_path / "none")]) == 1
    assert Capture(str(tmp_path / "none")).manifest["failed"] == 5
    # Each reason is said once as it happens (not once a fetch), and in the closing line.
    assert capsys.readouterr().err.count("connection refused") == 2


def test_capture_out_with_a_file_suffix_it_cannot_write_is_refused(tmp_path, capsys):
    # `--out x.zip` silently made a folder named x.zip.
    for name in ("x.zip", "x.json", "x.tar"):
        out = tmp_path / name
        assert main(["capture", "--target", "http://127.0.0.1:9", "--count", "1", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"kvwatch writes a folder or a .tar.gz bundle, not a {out.suffix} file" in err
        assert f"{tmp_path / 'x'}.tar.gz" in err
        assert not out.exists()
