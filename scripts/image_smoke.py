"""Runs a built kvwatch image as the chart runs it and checks what a pod needs of it.

The container's user, read-only root, dropped capabilities, no privilege
escalation, memory limit, environment and mounts are read from the container
the chart and the kustomize manifests render (kvwatch.mixin.manifests, the
same settings: tests/test_helm_chart.py holds them equal), so the smoke test
follows the chart. A key of the security context it cannot translate into a
podman flag fails the run rather than being skipped. Checks: `kvwatch
--version`; `kvwatch sim` and `kvwatch serve` from the image; /healthz,
/metrics (kvwatch_up 1 once it has read the simulator), the status page with
the package's static files in it; a write to the root refused; the whole
process's CPU per poll and resident memory, as the bench's process section
reads them; and `kvwatch capture` writing a bundle to the writable volume
(/tmp, an emptyDir in the pod).

Everything listens on 127.0.0.1 ports picked here (the host's network: no
network namespace is needed), and every container started is removed.
    .venv/bin/python scripts/image_smoke.py --image localhost/kvwatch:dev --version 0.1.0 [--root DIR ...]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvwatch.mixin import manifests  # noqa: E402
from kvwatch.mixin.config import DeploySettings  # noqa: E402

READ_LIMIT = 4 << 20  # bytes of any answer read
COST_POLLS = 20  # polls the whole process's CPU is read over
DEADLINE_S = 90.0  # for kvwatch to answer and to read the simulator (a cold import on 2 loaded cores)


class SmokeFailure(Exception):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def security_flags(security: dict) -> list[str]:
    """podman flags for a Kubernetes securityContext; an unknown key fails."""
    flags: list[str] = []
    for key, value in security.items():
        if key == "runAsNonRoot":
            if value and security.get("runAsUser", 0) == 0:
                raise SmokeFailure("runAsNonRoot with no non-root runAsUser")
        elif key == "runAsUser":
            flags.append(f"--user={value}:{security.get('runAsGroup', value)}")
        elif key == "runAsGroup":
            pass  # with runAsUser
        elif key == "readOnlyRootFilesystem":
            # Podman would add its own tmpfs on /tmp, /run, /var/tmp: a pod has only the volumes it mounts.
            flags += ["--read-only", "--read-only-tmpfs=false"] if value else []
        elif key == "allowPrivilegeEscalation":
            flags += [] if value else ["--security-opt=no-new-privileges"]
        elif key == "capabilities":
            flags += [f"--cap-drop={c}" for c in value.get("drop", [])]
            flags += [f"--cap-add={c}" for c in value.get("add", [])]
        elif key == "seccompProfile" and value == {"type": "RuntimeDefault"}:
            pass  # podman's default profile is the runtime's default
        else:
            raise SmokeFailure(f"the smoke test cannot run the chart's securityContext key {key}={value!r}")
    return flags


def host_flags() -> list[str]:
    """What this machine needs of podman: limits at or below its own (podman's defaults are above what a process
    without CAP_SYS_RESOURCE may set; runc was refused an nproc above 32768 here), and no HEALTHCHECK timer (podman
    runs it from systemd; a pod has the chart's liveness probe instead, the /healthz checked here)."""
    flags = ["--network=host", "--no-healthcheck"]
    for name, limit, most in (("nofile", resource.RLIMIT_NOFILE, 1 << 20), ("nproc", resource.RLIMIT_NPROC, 32768)):
        hard = resource.getrlimit(limit)[1]
        value = most if hard == resource.RLIM_INFINITY else min(hard, most)
        flags.append(f"--ulimit={name}={value}:{value}")
    return flags


class Podman:
    def __init__(self, storage: list[str]):
        runtime = ["--runtime=runc"] if shutil.which("runc") and not Path("/sys/fs/cgroup/cgroup.controllers").exists() \
            else []
        self.base = ["podman", *storage, "--cgroup-manager=cgroupfs", *runtime]
        self.started: list[str] = []

    def __call__(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True, timeout=timeout)
        if check and done.returncode != 0:
            raise SmokeFailure(f"podman {args[0]} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
        return done

    def start(self, name: str, *args: str) -> str:
        self("run", "--detach", f"--name={name}", *args)
        self.started.append(name)
        return name

    def remove_all(self) -> None:
        for name in reversed(self.started):
            self("rm", "--force", "--time=5", name, check=False)


def get(url: str, timeout: float = 5) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read(READ_LIMIT).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(READ_LIMIT).decode("utf-8", "replace")


def wait_for(what: str, check, deadline: float, podman: Podman, *containers: str) -> str:
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            ok, text = check()
            if ok:
                return text
            last = text[:300]
        except OSError as exc:
            last = str(exc)
        time.sleep(0.5)
    logs = "".join(f"\n--- {c}:\n" + (done.stdout + done.stderr)[-2000:]
                   for c in containers for done in [podman("logs", c, check=False)])
    raise SmokeFailure(f"{what}: not within {DEADLINE_S:.0f} s (last: {last}); the logs:{logs}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", required=True)
    parser.add_argument("--version", required=True, help="the version `kvwatch --version` must say")
    parser.add_argument("--root"), parser.add_argument("--runroot"), parser.add_argument("--storage-driver")
    return parser.parse_args(argv)


def run(args: argparse.Namespace, podman: Podman, work: Path) -> list[str]:
    settings = DeploySettings()
    spec = manifests.kvwatch_container(settings, native=True)
    flags = security_flags(spec["securityContext"]) + host_flags()
    if limit := spec["resources"].get("limits", {}).get("memory"):
        flags.append(f"--memory={limit.removesuffix('i').lower()}")
    said = []

    version = podman("run", "--rm", *flags, "--entrypoint=kvwatch", args.image, "--version").stdout.strip()
    if version != f"kvwatch {args.version}":
        raise SmokeFailure(f"`kvwatch --version` said {version!r}, not 'kvwatch {args.version}'")
    said.append(f"--version: {version}")

    sim_port, port = free_port(), free_port()
    tag = f"{os.getpid()}"
    sim = podman.start(f"kvwatch-smoke-sim-{tag}", *flags, "--entrypoint=kvwatch", args.image,
                       "sim", "--host=127.0.0.1", f"--port={sim_port}", "--engines=2")

    # The pod's volumes: the ConfigMap's kvwatch.yaml (read-only) and the emptyDir at /tmp.
    volumes = {"kvwatch-config": work / "config", "kvwatch-tmp": work / "tmp"}
    config = {**manifests.kvwatch_config(settings), "target": f"http://127.0.0.1:{sim_port}/metrics",
              "poll_interval": "1s"}
    volumes["kvwatch-config"].mkdir()
    (volumes["kvwatch-config"] / manifests.CONFIG_FILE_NAME).write_text(yaml.safe_dump(config))
    volumes["kvwatch-tmp"].mkdir()
    volumes["kvwatch-tmp"].chmod(0o1777)  # an emptyDir is writable by any user of the pod
    mounts = [f"--volume={volumes[m['name']]}:{m['mountPath']}:{'ro' if m.get('readOnly') else 'rw'}"
              for m in spec["volumeMounts"]]
    # The chart's environment, on a port picked here and on loopback (the host's network, not a pod's).
    env = {e["name"]: e["value"] for e in spec["env"]} | {"KVWATCH_PORT": str(port), "KVWATCH_HOST": "127.0.0.1"}
    serve = podman.start(f"kvwatch-smoke-serve-{tag}", *flags, *mounts, *[f"--env={k}={v}" for k, v in env.items()],
                         args.image)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + DEADLINE_S
    wait_for("/healthz answering 200", lambda: (get(base + "/healthz")[0] == 200, ""), deadline, podman, serve)
    said.append("/healthz: 200")
    wait_for("the simulator's page read (kvwatch_up 1 in /metrics)",
             lambda: (_up(text := get(base + "/metrics")[1]), text), deadline, podman, serve, sim)
    said.append("/metrics: kvwatch_up 1")

    status, page = get(base + "/")
    static = REPO / "kvwatch" / "sidecar" / "static"
    missing = [name for name in ("status.css", "status.js")
               if (static / name).read_text().rstrip("\n") not in page]
    if status != 200 or missing:
        raise SmokeFailure(f"the status page answered {status} without the package's {', '.join(missing)}")
    said.append("status page: 200 with status.css and status.js")

    wrote = podman("exec", serve, "python", "-c", "open('/kvwatch-smoke', 'w')", check=False)
    if wrote.returncode == 0 or "Read-only file system" not in wrote.stderr:
        raise SmokeFailure(f"a write to the image's root was not refused as read-only: {wrote.stderr.strip()}")
    said.append("root: read-only")

    said.append(process_cost(podman, serve, base))

    podman("exec", serve, "kvwatch", "capture", f"--target=http://127.0.0.1:{sim_port}/metrics", "--count=2",
           "--interval=1s", "--out=/tmp/smoke-capture.tar.gz")
    bundle = volumes["kvwatch-tmp"] / "smoke-capture.tar.gz"
    with tarfile.open(bundle) as archive:
        names = archive.getnames()
    if "manifest.json" not in names or len(names) < 3:
        raise SmokeFailure(f"the capture bundle holds {names}")
    said.append(f"capture: {bundle.stat().st_size} bytes in the writable volume, {len(names)} files")
    return said


def process_cost(podman: Podman, container: str, base: str) -> str:
    """The container's whole process, as its cgroup bills it, over COST_POLLS polls with nothing reading it
    (the probe of the bench's process section, benchmarks/process_probe.py, on the image)."""
    pid = int(podman("inspect", "--format={{.State.Pid}}", container).stdout.strip())
    before, cpu0 = _polls(base), _on_cpu(pid)
    time.sleep(COST_POLLS)  # at the 1 s poll set above
    cpu1, rss = _on_cpu(pid), _rss_kib(pid)
    polls = _polls(base) - before
    return f"whole process: {(cpu1 - cpu0) / max(polls, 1) * 1e3:.2f} ms CPU per poll over {polls} polls, " \
           f"{rss / 1024:.1f} MiB resident"


def _on_cpu(pid: int) -> float:
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0]) / 1e9
        except (OSError, ValueError, IndexError):
            continue
    return total


def _rss_kib(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1])


def _polls(base: str) -> int:
    return int(sum(float(line.split()[-1]) for line in get(base + "/metrics")[1].splitlines()
                   if line.startswith(("kvwatch_polls_total ", "kvwatch_polls_total{"))))


def _up(text: str) -> bool:
    return any(line.startswith(("kvwatch_up ", "kvwatch_up{")) and float(line.split()[-1]) == 1
               for line in text.splitlines())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    storage = [f"--{key.replace('_', '-')}={value}" for key, value in
               (("root", args.root), ("runroot", args.runroot), ("storage_driver", args.storage_driver)) if value]
    podman = Podman(storage)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvwatch-smoke-") as work:
        try:
            said = run(args, podman, Path(work))
        except (SmokeFailure, subprocess.TimeoutExpired) as exc:
            print(f"image smoke test FAILED: {exc}", file=sys.stderr)
            return 1
        finally:
            podman.remove_all()
    print(f"image smoke test passed in {time.monotonic() - started:.1f} s ({args.image}):")
    for line in said:
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
