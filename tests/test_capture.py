"""`kvwatch capture` and the replays of what it records: pages byte-exact with
their fetch times, no secret in a capture, Ctrl-C keeps a finished bundle,
and a replay reports the findings timeline the live sidecar reported."""

from __future__ import annotations

import gzip
import io
import json
import socket
import tarfile
from dataclasses import asdict

import pytest

import kvwatch.commands.capture as capture_command
from kvwatch.capture.bundle import Capture, CaptureError, CaptureWriter
from kvwatch.capture.record import manifest_for, record
from kvwatch.capture.replay import ReplaySource, paced, replay
from kvwatch.cli import main
from kvwatch.diagnose.timeline import Timeline
from kvwatch.diagnose.vocabulary import Finding
from kvwatch.scrape import Fetcher, FetchResult
from kvwatch.pipeline.monitor import Monitor
from kvwatch.present import clean
from kvwatch.sidecar.report import finding_json
from kvwatch.settings import load_settings
from kvwatch.sim.server import start_background
from pageserver import Answer, PageServer

ORDER = ("idle", "prefix-load", "load", "long-load", "after")
BASE = 1_700_000_000.0


def page(fixtures_dir, name: str) -> str:
    return (fixtures_dir / "vllm-0.32-cpu" / f"metrics-{name}.txt").read_text()


def every_byte(path) -> bytes:
    """All the bytes a capture holds, a bundle's decompressed members included."""
    if path.is_dir():
        return b"".join(p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file())
    raw = path.read_bytes()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:gz") as tar:
        members = b"".join(tar.extractfile(m).read() for m in tar.getmembers() if m.isfile())
    return raw + gzip.decompress(raw) + members


def capture_cli(url: str, out, *extra: str, count: int = 5) -> int:
    return main(["capture", "--target", url, "--interval", "0.02s", "--duration", "10m", "--count", str(count),
                 "--out", str(out), *extra])


def test_pages_are_kept_byte_exact_with_their_fetch_times(fixtures_dir, tmp_path, capsys):
    texts = [page(fixtures_dir, name) for name in ORDER]
    gzipped = Answer(gzip.compress(texts[2].encode()),
                     headers={"Content-Type": "text/plain; version=0.0.4", "Content-Encoding": "gzip"})
    answers = [Answer(texts[0]), Answer(texts[1]), gzipped, Answer("oops\n", status=503), Answer(texts[4])]
    out = tmp_path / "capture"
    with PageServer(answers) as server:
        assert capture_cli(server.url, out) == 0
    captured = Capture(out)
    entries = captured.entries
    assert [e.ok for e in entries] == [True, True, True, False, True]
    assert entries[3].reason == "http_5xx" and entries[3].detail == "HTTP 503"
    stored = [(out / e.page).read_bytes() for e in entries if e.ok]
    assert stored == [texts[i].encode() for i in (0, 1, 2, 4)]  # gzip transfer encoding undone, nothing else
    times = [e.time for e in entries]
    assert times == sorted(times) and times[-1] - times[0] >= 0.08
    assert all(0 < e.seconds < 5 for e in entries)
    manifest = captured.manifest
    assert manifest["complete"] and not manifest["interrupted"]
    assert manifest["engine"] == "vllm" and manifest["pages"] == 4 and manifest["failed_by_reason"] == {"http_5xx": 1}
    assert manifest["cache_config_info"]["0"]["num_gpu_blocks"] == "128"
    assert manifest["kvwatch_version"] and manifest["interval_seconds"] == 0.02
    assert "4 pages, 1 failed (http_5xx 1)" in capsys.readouterr().err


def test_no_secret_enters_a_bundle(fixtures_dir, tmp_path):
    token, query_secret, password = "tok-Zq81-never-stored", "qs-Kp22-never-stored", "pw-Lm53-never-stored"
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    good = page(fixtures_dir, "idle")
    echo = Answer(good + f"# debug: Authorization: Bearer {token}\n")  # a page quoting the credential
    redirect = Answer(status=302, headers={"Location": f"http://elsewhere/metrics?api_key={query_secret}"})
    with PageServer([Answer(good), echo, redirect, Answer(good)]) as server:
        bundle = tmp_path / "with-token.tar.gz"
        assert capture_cli(server.url + f"?api_key={query_secret}", bundle, "--bearer-token-file",
                           str(token_file), count=4) == 0
        assert server.requests[0]["headers"]["Authorization"] == f"Bearer {token}"
        folder = tmp_path / "with-password"
        assert capture_cli(server.url.replace("http://", f"http://admin:{password}@"), folder, count=2) == 0
    for path in (bundle, folder):
        held = every_byte(path)
        for secret in (token, query_secret, password):
            assert secret.encode() not in held, (path, secret)
    entries = Capture(bundle).entries
    assert [e.reason for e in entries if not e.ok] == ["secret_in_page", "http_3xx"]
    assert Capture(bundle).manifest["target"] == server.url  # no query string, no user info
    assert Capture(folder).manifest["target"] == server.url


def test_ctrl_c_keeps_what_was_recorded_in_a_finished_bundle(fixtures_dir, tmp_path, monkeypatch):
    pages = [page(fixtures_dir, name) for name in ORDER]

    class Interrupted(Fetcher):
        calls = 0

        def fetch(self):
            Interrupted.calls += 1
            if Interrupted.calls == 3:
                raise KeyboardInterrupt
            return FetchResult(pages[Interrupted.calls], size=len(pages[Interrupted.calls]))

    monkeypatch.setattr(capture_command, "Fetcher", Interrupted)
    out = tmp_path / "stopped.tar.gz"
    assert main(["capture", "--target", "http://127.0.0.1:9/metrics", "--interval", "0.01s", "--duration", "1m",
                 "--out", str(out)]) == 0
    assert not (tmp_path / "stopped.tar.gz.partial").exists()
    captured = Capture(out)
    assert captured.manifest["interrupted"] is True and captured.manifest["complete"] is True
    assert [text for _, text in captured.pages()] == pages[1:3]


def test_a_capture_that_records_nothing_says_why_in_a_sentence(tmp_path, capsys):
    # It ended on "0 pages, 2 failed (refused 2)", and its first line promised "for 600s" under --count 2.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert main(["capture", "--target", f"http://127.0.0.1:{port}", "--interval", "0.01s", "--count", "2",
                 "--out", str(tmp_path / "none")]) == 1
    err = capsys.readouterr().err
    assert "every 0.01s for 600s or 2 fetches, whichever comes first into" in err
    assert err.rstrip().endswith(f"kvwatch capture: no page recorded: connection refused by 127.0.0.1:{port}: "
                                 "nothing listens there (engine down or starting?)")


def test_a_capture_never_overwrites(tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(CaptureError, match="exists"):
        CaptureWriter(tmp_path / "taken", {})
    assert main(["capture", "--target", "http://127.0.0.1:9/metrics", "--out", str(tmp_path / "taken")]) == 2


def recorded(fixtures_dir, out, gap: float = 10.0, quiet: int = 0):
    """The real captures as one recording, `gap` seconds apart (a failed fetch
    in the middle), then `quiet` more polls of the page after the load."""
    writer = CaptureWriter(out, manifest_for("http://127.0.0.1:8000/metrics", gap, gap * 6))
    for index, name in enumerate(ORDER[:3]):
        writer.add(BASE + gap * index, 0.01, page(fixtures_dir, name))
    writer.add(BASE + gap * 3, 0.5, None, "timeout", "no response within 0.5s")
    for index, name in enumerate(ORDER[3:] + ("after",) * quiet, start=4):
        writer.add(BASE + gap * index, 0.01, page(fixtures_dir, name))
    return writer.close(ended_at=BASE + gap * 6, interrupted=False)


@pytest.mark.parametrize("suffix", ["", ".tar.gz"])
def test_diagnose_replay_prints_the_timeline_at_recorded_times(fixtures_dir, tmp_path, capsys, suffix):
    path = recorded(fixtures_dir, tmp_path / f"real{suffix}")
    assert main(["diagnose", "--replay", str(path), "--json"]) == 1
    body = json.loads(capsys.readouterr().out)
    assert body["polls"] == 6 and body["failed_polls"] == 1 and body["start"] == BASE and body["end"] == BASE + 50
    # The timeout came 10 s after a page with the burst's load on it: the replay reads it as the live loop
    # does (busy, not down), from the recorded deadline and the page before it.
    assert body["outages"] == [{"reason": "timeout", "start": BASE + 30, "end": BASE + 30, "polls": 1,
                                "detail": "127.0.0.1:8000 is busy, not down: its /metrics did not answer within"
                                          " 0.5 s, and its latest page (10 s before) showed 6 running and 18"
                                          " waiting requests"}]
    burst = next(f for f in body["findings"] if f["cause"] == "concurrency_beyond_capacity")
    # One timeline format with `kvwatch diagnose --prometheus` (where `replica` names the replica).
    assert set(burst) == {"symptom", "cause", "model_name", "engine", "start", "end", "polls", "worst",
                          "active_at_end", "replica"} and burst["replica"] == ""
    assert body["findings_dropped"] == 0
    # It starts at the burst's page (20 s in) and lasts while the burst is in the 5 min window.
    assert burst["start"] == BASE + 20 and burst["end"] == BASE + 50 and burst["active_at_end"] is True
    assert burst["worst"]["evidence"]["waiting_at_peak"] == 18
    # The window in recorded seconds (the replay took milliseconds).
    assert burst["worst"]["evidence"]["window_seconds"] == burst["worst"]["time"] - BASE >= 20
    assert main(["diagnose", "--replay", str(path)]) == 1
    text = capsys.readouterr().out
    assert "exhaustion / concurrency_beyond_capacity" in text and "(+0:00:20)" in text
    assert "waiting_at_peak=18" in text and "FAILED FETCHES" in text and "timeout x1" in text


def test_a_timeline_episode_names_its_finding_as_the_api_does():
    # One name per field across the surfaces: the episode's model is the
    # API's `model_name` (the metrics' label), never a `model` of its own.
    finding = Finding("exhaustion", "concurrency_beyond_capacity", "warning", "high", "tiny-llama", "0",
                      "the burst is beyond the cache", {"waiting_at_peak": 18})
    timeline = Timeline()
    timeline.add("", BASE, [finding], replica="")
    (episode,) = timeline.finish().findings_json()
    api = finding_json(finding)
    assert {key: episode[key] for key in ("symptom", "cause", "model_name", "engine")} == \
        {key: api[key] for key in ("symptom", "cause", "model_name", "engine")}
    assert "model" not in episode and "model" not in api


def test_a_short_window_ends_the_episode_when_the_burst_leaves_it(fixtures_dir, tmp_path, capsys):
    path = recorded(fixtures_dir, tmp_path / "real", gap=60.0, quiet=3)
    assert main(["diagnose", "--replay", str(path), "--json", "--window", "150s"]) == 1
    burst = next(f for f in json.loads(capsys.readouterr().out)["findings"]
                 if f["cause"] == "concurrency_beyond_capacity")
    assert burst["start"] == BASE + 120 and BASE + 240 <= burst["end"] < BASE + 480
    assert not burst["active_at_end"]


def test_a_cut_off_or_foreign_capture_is_one_sentence_not_a_traceback(fixtures_dir, tmp_path, capsys):
    # A bundle copied halfway raised tarfile.ReadError out of `kvwatch diagnose --replay`.
    whole = (fixtures_dir / "vllm-0.32-cpu-scenarios" / "concurrency" / "capture.tar.gz").read_bytes()
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole[:len(whole) // 2])
    assert main(["diagnose", "--replay", str(cut)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwatch diagnose: cannot replay:\n") and "Traceback" not in err
    assert "cut.tar.gz: the bundle is cut off or damaged after " in err and " of 31 pages" in err
    (tmp_path / "page.html").write_text("<html></html>")
    (tmp_path / "empty").mkdir()
    assert main(["diagnose", "--replay", str(tmp_path / "page.html")]) == 2
    assert "not a kvwatch capture (a capture is a folder or a .tar.gz bundle" in capsys.readouterr().err
    assert main(["diagnose", "--replay", str(tmp_path / "empty")]) == 2
    assert "not a kvwatch capture (no manifest.json in it)" in capsys.readouterr().err


def test_paced_replay_waits_the_recorded_gaps_divided_by_the_speed(fixtures_dir, tmp_path):
    source = ReplaySource(Capture(recorded(fixtures_dir, tmp_path / "real")).pages())
    now = [0.0]
    waits = []

    def wait(seconds):
        waits.append(seconds)
        now[0] += seconds
        return False

    assert paced(source, source.fetch, speed=4, wait=wait, monotonic=lambda: now[0]) == 6
    assert waits == [0, 2.5, 2.5, 2.5, 2.5, 2.5]


def test_serve_replay_is_the_sidecar_over_recorded_time(fixtures_dir, tmp_path):
    from kvwatch.commands.serve import replaying

    path = recorded(fixtures_dir, tmp_path / "real.tar.gz")
    capture = Capture(path)
    settings = load_settings(overrides={"target": capture.manifest["target"], "poll_interval": "10s"}, environ={})
    monitor, start = replaying(capture, settings, speed=0)
    start()
    monitor._thread.join(10)
    state = monitor.state
    assert state.polls == 6 and state.up and state.last_poll_time == BASE + 50
    assert any(f.cause == "concurrency_beyond_capacity" for f in state.findings)
    assert monitor.ready() == (True, "ok")


def findings_of(state) -> list:
    return [clean(asdict(f)) for f in state.findings] if state.up else None


def test_a_simulator_recording_replays_to_the_live_sidecars_timeline(tmp_path):
    # The simulator's clock stands still (speed 0) and moves 5 s per fetch,
    # and one clock stamps the live sidecar's polls and the capture's
    # fetches: both read the same page at the same time.
    with start_background("exhaustion", speed=0) as sim:
        now = [BASE]
        settings = load_settings(overrides={"target": sim.metrics_url, "poll_interval": "5s", "window": "2m"},
                                 environ={})
        live = Monitor(settings, clock=lambda: now[0])
        live_timeline, live_polls = Timeline(), []
        fetcher = Fetcher(sim.metrics_url, 5.0, 16 << 20)

        class Alongside:
            """The capture's fetcher; the live sidecar polls just before each fetch."""

            def fetch(self):
                state = live.poll_once()
                live_timeline.add_state(state)
                live_polls.append(findings_of(state))
                return fetcher.fetch()

            def _secrets(self):
                return fetcher._secrets()

        def sleep(seconds):
            sim.advance(seconds)
            now[0] += seconds

        bundle = tmp_path / "sim.tar.gz"
        writer = CaptureWriter(bundle, manifest_for(sim.metrics_url, 5.0, 420.0))
        assert record(Alongside(), writer, 5.0, 420.0, clock=lambda: now[0], monotonic=lambda: now[0] - BASE,
                      sleep=sleep) == 85
        writer.close(ended_at=now[0], interrupted=False)

    replayed_polls = []
    timeline = replay(Capture(bundle), lambda source: Monitor(settings, fetcher=source, clock=source.now),
                      on_state=lambda state: replayed_polls.append(findings_of(state)))
    live_timeline.finish()
    assert replayed_polls == live_polls
    assert timeline.signature() == live_timeline.signature()
    # and the timeline says something: exhaustion, named during the overload (60 s to 240 s).
    burst = [e for e in timeline.episodes if e.symptom == "exhaustion"]
    assert burst and 60 <= burst[0].start - BASE <= 240 and timeline.polls == 85


def test_serve_replay_is_marked_as_a_replay_on_every_surface(fixtures_dir, tmp_path):
    """`serve --replay` looked live ("up · last poll 06:21:25 · refreshes
    every 5 s" after the replay ended): the JSON, /readyz and the page say it
    is a replay, at what speed, and that it finished."""
    from fastapi.testclient import TestClient

    from kvwatch.commands.serve import replaying
    from kvwatch.sidecar.app import create_app

    path = recorded(fixtures_dir, tmp_path / "real.tar.gz")
    capture = Capture(path)
    settings = load_settings(overrides={"target": capture.manifest["target"], "poll_interval": "10s"}, environ={})
    monitor, start = replaying(capture, settings, speed=0)
    assert monitor.state.replay == {"capture": "real.tar.gz", "speed": 0, "recorded_polls": 6, "finished": False,
                                    "stopped": None}
    start()
    monitor._thread.join(10)
    client = TestClient(create_app(monitor, settings))
    replay = client.get("/api/v1/signals").json()["replay"]
    assert replay["finished"] and replay["capture"] == "real.tar.gz" and replay["speed"] == 0
    assert "finished" in replay["text"] and "as fast as it reads" in replay["text"]
    assert client.get("/api/v1/diagnosis").json()["replay"]["finished"]
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.text == f"ready: {replay['text']}\n"
    page = client.get("/").text
    assert "refreshes every" not in page and "Replay of real.tar.gz" in page and "recorded time" in page

    # Live: no replay key, /readyz unchanged.
    live = load_settings(overrides={"target": "http://127.0.0.1:9/metrics"}, environ={})
    from kvwatch.pipeline.monitor import Monitor

    assert "replay" not in TestClient(create_app(Monitor(live), live)).get("/api/v1/signals").json()


# --- hostile captures: every member read with a byte cap, every
# field checked, every failure one sentence ------------------------------------


def replay_error(path, capsys) -> str:
    assert main(["diagnose", "--replay", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvwatch diagnose: cannot replay:\n") and "Traceback" not in err, err
    assert len(err.splitlines()) == 2, err
    return err


class Filler(io.RawIOBase):
    """`size` bytes of one byte value, made as they are read."""

    def __init__(self, size: int, byte: bytes = b"a"):
        self.left, self.byte = size, byte

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = self.byte * n
        self.left -= n
        return n


def bundle_of(path, members) -> None:
    """A .tar.gz of (name, bytes or (size, filler byte)) in order."""
    with tarfile.open(path, "w:gz", compresslevel=1) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, tuple):
                info.size = data[0]
                tar.addfile(info, Filler(*data))
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


MANIFEST_OK = json.dumps({"format": "kvwatch-capture", "format_version": 1, "target": "http://x/metrics",
                          "interval_seconds": 5}).encode()


def index_of(*lines) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def test_a_gzip_bomb_bundle_is_refused_at_the_member_cap(tmp_path, capsys, monkeypatch):
    """A page member far past the page cap (a 15 MB bundle held a 2 GiB page,
    read whole: 13.4 GB RSS): refused by its size, in one sentence; a member
    is never decompressed past the cap. The cap is made 1 MiB here so the
    bomb stays small (16 MiB of one byte, 16 KB compressed)."""
    import kvwatch.capture.bundle as bundle

    monkeypatch.setattr(bundle, "MAX_PAGE_BYTES", 1024 * 1024)
    bomb = tmp_path / "bomb.tar.gz"
    bundle_of(bomb, [("manifest.json", MANIFEST_OK),
                     ("index.jsonl", index_of({"seq": 1, "time": BASE, "ok": True, "page": "pages/000001.txt",
                                               "size": 1})),
                     ("pages/000001.txt", (16 * 1024 * 1024, b"\n"))])
    assert bomb.stat().st_size < 100_000
    err = replay_error(bomb, capsys)
    assert "over the 1,048,576 a capture's page may hold" in err
    # Read through the cap itself (the header is honest in a tar, so this is
    # the second line of defence): at most cap + 1 bytes come out.
    capture = Capture(bomb)
    with capture._tar() as tar:
        tar.next(), tar.next()
        member = tar.next()
        with pytest.raises(CaptureError, match="holds more than the 1,048,576 bytes"):
            capture._read(tar, member, 1024 * 1024)


def test_a_huge_manifest_or_index_is_refused_at_its_cap(tmp_path, capsys):
    """A 2 MiB manifest (a 1 GiB one in a 4.7 MB bundle took 2.1 GB) and an
    index over its cap: one sentence each, read no further than the cap."""
    import kvwatch.capture.bundle as bundle

    big = tmp_path / "manifest.tar.gz"
    bundle_of(big, [("manifest.json", b" " * (2 * 1024 * 1024) + MANIFEST_OK), ("index.jsonl", b"")])
    assert "manifest.json declares 2,097," in replay_error(big, capsys)
    folder = tmp_path / "folder"
    (folder / "pages").mkdir(parents=True)
    (folder / "manifest.json").write_bytes(b" " * (2 * 1024 * 1024) + MANIFEST_OK)
    (folder / "index.jsonl").write_bytes(b"")
    assert f"over the {bundle.MAX_MANIFEST_BYTES:,} a capture's manifest.json may hold" in replay_error(folder, capsys)


def test_a_folder_index_names_only_the_captures_own_pages(tmp_path, capsys):
    """An index naming a file outside the capture (`/dev/zero` ran to 24 GB),
    and pages/ holding a link out or something other than a file: each
    refused in one sentence, nothing outside read."""
    import os

    secret = tmp_path / "secret.txt"
    secret.write_text('vllm:num_requests_running{model_name="m",engine="0"} 1\n')

    def folder(name, page_name, make_page=None):
        path = tmp_path / name
        (path / "pages").mkdir(parents=True)
        (path / "manifest.json").write_bytes(MANIFEST_OK)
        (path / "index.jsonl").write_bytes(index_of({"seq": 1, "time": BASE, "ok": True, "page": page_name,
                                                     "size": 10}))
        if make_page is not None:
            make_page(path / "pages" / "000001.txt")
        return path

    for name, page_name in (("absolute", "/dev/null"), ("climbing", "../secret.txt"),
                            ("sideways", "pages/../../secret.txt"), ("manifest", "manifest.json")):
        err = replay_error(folder(name, page_name), capsys)
        assert "is not a recorded fetch (page does not name a file of the capture's pages/ folder)" in err
    err = replay_error(folder("link", "pages/000001.txt", lambda p: p.symlink_to(secret)), capsys)
    assert "pages/000001.txt is a link; a capture holds its own files" in err
    err = replay_error(folder("fifo", "pages/000001.txt", lambda p: os.mkfifo(p)), capsys)
    assert "pages/000001.txt is not a regular file" in err
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "manifest.json").symlink_to(tmp_path / "manifest" / "manifest.json")
    assert "manifest.json is a link" in replay_error(tmp_path / "linked", capsys)


@pytest.mark.parametrize("manifest, index, page, says", [
    (b"[1, 2]", None, None, "manifest.json is a JSON list, not an object"),
    (b'{"format": "kvwatch-capture", "format_version": "x"}', None, None, "format_version is not a whole number"),
    (b'{"format": "kvwatch-capture", "format_version": 1, "interval_seconds": "5s"}', None, None,
     "interval_seconds is not a number of seconds"),
    (b'{"format": "kvwatch-capture", "format_version": 1, "target": ["a"]}', None, None,
     "target is not what kvwatch writes there"),
    (b"\xff\xfe{}", None, None, "manifest.json is not JSON"),
    (None, b'{"seq": 1, "time": Infinity, "ok": false}\n', None, "line 1 is not a recorded fetch (time is not a finite"),
    (None, b'{"seq": 1, "time": 1e300, "ok": false}\n', None, "time is past the year 5000"),
    (None, b'{"seq": "1", "time": 1, "ok": false}\n', None, "seq is not a positive whole number"),
    (None, b'[1]\n', None, "a JSON list, not an object"),
    (None, b'{"seq": 1, "time": 1, "ok": "yes"}\n', None, "ok is not true or false"),
    (None, b"[" * 100_000 + b"\n", None, "line 1 is not a recorded fetch"),
    (None, b"\xff\n", None, "index.jsonl is not UTF-8 text"),
    (None, None, b"vllm:x 1\n\xff\xfe\n", "pages/000001.txt is not UTF-8 text"),
])
@pytest.mark.parametrize("suffix", ["", ".tar.gz"])
def test_capture_json_of_the_wrong_types_is_one_sentence(tmp_path, capsys, manifest, index, page, says, suffix):
    """A manifest that is a list, a format_version of "x", a time of
    Infinity (it killed the `serve --replay` thread), a non-UTF-8 page:
    tracebacks on main; one sentence now, from diagnose and serve alike."""
    manifest = manifest if manifest is not None else MANIFEST_OK
    index = index if index is not None else index_of({"seq": 1, "time": BASE, "ok": True,
                                                      "page": "pages/000001.txt", "size": 10})
    page = page if page is not None else b"vllm:num_requests_running 1\n"
    path = tmp_path / f"capture{suffix}"
    members = [("manifest.json", manifest), ("index.jsonl", index), ("pages/000001.txt", page)]
    if suffix:
        bundle_of(path, members)
    else:
        (path / "pages").mkdir(parents=True)
        for name, data in members:
            (path / name).write_bytes(data)
    assert says in replay_error(path, capsys)
    if page is not None and b"\xff" in page:
        return  # read while replaying: serve says it in its log and keeps serving
    assert main(["serve", "--replay", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
