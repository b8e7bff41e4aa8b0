"""deploy/Dockerfile, checked without a Docker engine: its structure (two
stages on one pinned python slim image, wheels only in the runtime, numeric non-root
user, `kvwatch serve` as entry point), and the command line it and the
Kubernetes sidecar produce, run locally: ENTRYPOINT/CMD, the container's
command/args and env, the mounted kvwatch.yaml, against a loopback engine
until /readyz answers 200; and the central Deployment's command line the
same way, against a loopback stand-in of Prometheus' query API."""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import re
import shutil
import subprocess
import sys
import time
from urllib.parse import parse_qs, urlsplit
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import requests
import yaml

from kvwatch.settings import PARSERS, Settings, env_name
from pageserver import Answer, LoopbackServer, PageServer
from promstack import free_port, stop_process
from promstub import StubClient
from sim_support import fleet_openmetrics
from test_history_prometheus import fleet

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "deploy" / "Dockerfile"
KUBE = REPO / "deploy" / "kubernetes"
KNOWN_ENV = {env_name(key) for key in PARSERS if key != "diagnosis"} | {env_name("config")}


# ---------------------------------------------------------------- a small Dockerfile reader


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) with comments dropped and continuations joined."""
    instructions, pending = [], ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # comments inside a continued instruction
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for keyword, rest in dockerfile_instructions(text):
        if keyword == "ARG" and not stages:
            name, _, default = rest.partition("=")
            args[name] = default
        elif keyword == "FROM":
            words = rest.split()
            base = words[0]
            for name, default in args.items():
                base = base.replace("${%s}" % name, default).replace("$" + name, default)
            stages.append(Stage(base, words[2] if len(words) == 3 and words[1].upper() == "AS" else None))
        else:
            assert stages, f"{keyword} before FROM"
            stages[-1].instructions.append((keyword, rest))
    return args, stages


def env_pairs(stage: Stage) -> dict[str, str]:
    env = {}
    for rest in stage.all("ENV"):
        for word in shlex.split(rest):
            key, sep, value = word.partition("=")
            assert sep, f"ENV {rest!r}: use KEY=value"
            env[key] = value
    return env


def exec_form(stage: Stage, keyword: str) -> list[str] | None:
    found = stage.all(keyword)
    if not found:
        return None
    value = json.loads(found[-1])  # shell form would put `sh -c` in front and eat signals
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"{keyword} must be exec form"
    return value


@pytest.fixture(scope="module")
def dockerfile():
    return parse_dockerfile(DOCKERFILE.read_text())


# ---------------------------------------------------------------- structure


def test_two_stages_on_one_pinned_python_slim_with_only_wheels_in_the_runtime(dockerfile):
    args, stages = dockerfile
    # Pinned: an exact Python release on an exact Debian release (not a moving
    # `3.11-slim`), the same in both stages, and a Python the package supports.
    bases = {s.base for s in stages}
    assert len(bases) == 1, bases
    match = re.fullmatch(r"python:3\.(\d+)\.(\d+)-slim-(bookworm|trixie)(@sha256:[0-9a-f]{64})?", bases.pop())
    assert match, f"base image {stages[0].base!r} is not pinned to a Python release and a Debian release"
    requires = re.search(r'requires-python = ">=3\.(\d+)"', (REPO / "pyproject.toml").read_text())
    assert int(match.group(1)) >= int(requires.group(1))
    builder, runtime = stages
    assert builder.name and runtime.name
    assert any(run.startswith("pip wheel") and "--wheel-dir /wheels" in run for run in builder.all("RUN"))
    # Nothing is copied into the runtime stage: the wheels come through a
    # build-time mount, so neither source nor wheel files stay in a layer.
    assert runtime.all("COPY") == [] and runtime.all("ADD") == []
    installs = [run for run in runtime.all("RUN") if "pip install" in run]
    assert len(installs) == 1
    install = installs[0]
    assert f"--mount=type=bind,from={builder.name},source=/wheels,target=/wheels" in install
    assert "--no-index" in install and "--find-links=/wheels" in install and "--no-cache-dir" in install
    assert "gcc" not in " ".join(runtime.all("RUN")) and "apt-get" not in " ".join(runtime.all("RUN"))


def test_image_labels_carry_the_package_version(dockerfile):
    from kvwatch import __version__

    _, stages = dockerfile
    runtime = stages[-1]
    declared = dict(arg.partition("=")[::2] for arg in runtime.all("ARG"))
    assert declared["VERSION"] == __version__  # the CI workflow passes the tag's version over it
    labels = " ".join(runtime.all("LABEL"))
    assert 'org.opencontainers.image.version="${VERSION}"' in labels
    assert 'org.opencontainers.image.revision="${REVISION}"' in labels


def docker_engine() -> str | None:
    """Why there is no usable Docker engine here, or None when there is one."""
    if not shutil.which("docker"):
        return "no docker client is installed"
    try:
        result = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                                text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker info did not answer within 30 s"
    if result.returncode != 0 or not result.stdout.strip():
        return "no Docker engine answers (" + (result.stderr.strip().splitlines() or ["docker info failed"])[-1] + ")"
    return None


def test_docker_build_makes_a_non_root_image_that_runs_read_only():
    reason = docker_engine()
    if reason:
        pytest.skip(f"docker build not run: {reason}; the Dockerfile's structure is checked above")
    tag = f"kvwatch-test:{os.getpid()}"
    build = subprocess.run(["docker", "build", "-f", str(DOCKERFILE), "-t", tag, str(REPO)], capture_output=True,
                           text=True, timeout=900, env={**os.environ, "DOCKER_BUILDKIT": "1"})
    assert build.returncode == 0, build.stderr[-4000:]
    try:
        inspect = json.loads(subprocess.run(["docker", "image", "inspect", tag], capture_output=True, text=True,
                                            timeout=60, check=True).stdout)[0]
        assert inspect["Config"]["User"] == "10001:10001"
        assert inspect["Config"]["Entrypoint"] == ["kvwatch", "serve"]
        # As the sidecar runs it: read-only root, no capabilities, any uid but root refused nothing.
        run = subprocess.run(["docker", "run", "--rm", "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
                              "--security-opt", "no-new-privileges", "--network", "none", tag, "--help"],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and "--target" in run.stdout, run.stdout + run.stderr
        pip = subprocess.run(["docker", "run", "--rm", "--entrypoint", "sh", tag, "-c", "command -v pip || true"],
                             capture_output=True, text=True, timeout=120)
        assert pip.stdout.strip() == "", "pip is left in the runtime image"
    finally:
        subprocess.run(["docker", "image", "rm", "-f", tag], capture_output=True, timeout=120)


def test_the_build_is_skipped_with_its_reason_when_there_is_no_engine(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert docker_engine() == "no docker client is installed"


def test_builder_copies_only_what_the_wheel_needs_and_the_ignore_file_lets_it_through(dockerfile):
    _, (builder, _) = dockerfile
    copied = []
    for rest in builder.all("COPY"):
        *sources, _destination = rest.split()
        copied += sources
    assert sorted(copied) == ["README.md", "kvwatch", "pyproject.toml"]
    for source in copied:
        assert (REPO / source).exists(), source
    patterns = [line.strip() for line in (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def ignored(path: str) -> bool:
        result = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pattern = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/") or fnmatch.fnmatch(path, pattern.replace("**/", "*/")):
                result = not negate
        return result

    for source in copied:
        assert not ignored(source), f"{source} would be left out of the build context"
    assert ignored(".venv") and ignored("tests") and ignored("kvwatch/__pycache__")


def test_runs_as_a_numeric_non_root_user_with_kvwatch_serve_as_entry_point(dockerfile):
    _, stages = dockerfile
    runtime = stages[-1]
    users = runtime.all("USER")
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) > 0 and (not gid or int(gid) > 0)  # numeric: runAsNonRoot can verify it
    assert f"--uid {uid}" in " ".join(runtime.all("RUN"))
    assert exec_form(runtime, "ENTRYPOINT") == ["kvwatch", "serve"]
    assert exec_form(runtime, "CMD") == []
    assert runtime.all("EXPOSE") == [str(Settings().port)]
    # The Kubernetes sidecar runs as the same uid.
    container = kvwatch_in(yaml.safe_load((KUBE / "base" / "vllm-deployment.yaml").read_text()))
    assert container["securityContext"]["runAsUser"] == int(uid)


def test_environment_binds_all_interfaces_and_names_only_real_settings(dockerfile):
    _, stages = dockerfile
    env = env_pairs(stages[-1])
    assert env["KVWATCH_HOST"] == "0.0.0.0"
    assert Settings().host == "127.0.0.1"  # the package stays loopback by default
    kvwatch_env = {key for key in env if key.startswith("KVWATCH_")}
    assert kvwatch_env <= KNOWN_ENV, kvwatch_env - KNOWN_ENV
    # A port or config file fixed in the image would override the mounted
    # config file's keys (environment beats file), so the image sets neither.
    assert "KVWATCH_PORT" not in env and "KVWATCH_CONFIG" not in env


def test_reader_understands_continuations_and_rejects_shell_form():
    args, stages = parse_dockerfile(
        "ARG IMG=base:1\nFROM ${IMG} AS one\n# c\nENV A=1 \\\n    B='two words'\nENTRYPOINT kvwatch serve\n")
    assert stages[0].base == "base:1" and stages[0].name == "one"
    assert env_pairs(stages[0]) == {"A": "1", "B": "two words"}
    with pytest.raises(json.JSONDecodeError):
        exec_form(stages[0], "ENTRYPOINT")


# ---------------------------------------------------------------- the same command line, run here


def container_argv(image_entrypoint: list[str], image_cmd: list[str], container: dict) -> list[str]:
    """Kubernetes' rule: `command` replaces ENTRYPOINT (and drops CMD), `args` replaces CMD."""
    if "command" in container:
        return list(container["command"]) + list(container.get("args", []))
    return list(image_entrypoint) + list(container.get("args", image_cmd))


def sidecar_deployments() -> list[tuple[str, dict, dict]]:
    """(layout, kvwatch container, kvwatch.yaml ConfigMap) for the base and the sidecar patch."""
    base = yaml.safe_load((KUBE / "base" / "vllm-deployment.yaml").read_text())
    base_container = kvwatch_in(base)
    patch = yaml.safe_load((KUBE / "sidecar-patch" / "kvwatch-sidecar.yaml").read_text())
    return [
        ("base", base_container, yaml.safe_load((KUBE / "base" / "kvwatch-config.yaml").read_text())),
        ("sidecar-patch", kvwatch_in(patch), yaml.safe_load((KUBE / "sidecar-patch" / "kvwatch-config.yaml").read_text())),
    ]


def kvwatch_in(deployment: dict) -> dict:
    spec = deployment["spec"]["template"]["spec"]
    (container,) = [c for c in spec.get("initContainers", []) + spec.get("containers", []) if c["name"] == "kvwatch"]
    return container


@pytest.mark.parametrize("layout", ["base", "sidecar-patch"])
def test_the_containers_command_line_serves_and_becomes_ready(layout, dockerfile, fixtures_dir, tmp_path):
    _, stages = dockerfile
    runtime = stages[-1]
    _, container, config_map = [d for d in sidecar_deployments() if d[0] == layout][0]

    argv = container_argv(exec_form(runtime, "ENTRYPOINT"), exec_form(runtime, "CMD") or [], container)
    assert argv[0] == "kvwatch"
    # The image's `kvwatch` is the console script; here it is the venv's.
    argv[0] = str(Path(sys.executable).with_name("kvwatch"))

    # The image's environment, then the container's (Kubernetes order), with
    # the paths and addresses that only exist in a pod mapped to this machine.
    env = {key: value for key, value in os.environ.items() if not key.startswith("KVWATCH_")}
    env.update(env_pairs(runtime))
    container_env = {e["name"]: e["value"] for e in container.get("env", [])}
    assert set(container_env) <= KNOWN_ENV, set(container_env) - KNOWN_ENV
    env.update(container_env)

    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    config_dir = tmp_path / "etc-kvwatch"
    config_dir.mkdir()
    mounted_config = Path(env["KVWATCH_CONFIG"])
    assert str(mounted_config.parent) == mounts["kvwatch-config"]
    config = yaml.safe_load(config_map["data"][mounted_config.name])

    port = free_port()
    assert int(env["KVWATCH_PORT"]) == [p for p in container["ports"] if p["name"] == container["livenessProbe"]["httpGet"]["port"]][0]["containerPort"]
    assert env["KVWATCH_HOST"] == "0.0.0.0"
    env["KVWATCH_PORT"] = str(port)
    env["KVWATCH_HOST"] = "127.0.0.1"  # tests stay on loopback; the image's 0.0.0.0 is asserted above
    env["KVWATCH_CONFIG"] = str(config_dir / mounted_config.name)

    page = (fixtures_dir / "vllm-0.32-cpu" / "metrics-idle.txt").read_text()
    with PageServer([Answer(page)]) as engine:
        assert config["target"].startswith("http://127.0.0.1:")  # vLLM in the same pod
        config["target"] = engine.url
        (config_dir / mounted_config.name).write_text(yaml.safe_dump(config))
        log = open(tmp_path / "kvwatch.log", "w")
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base_url = f"http://127.0.0.1:{port}"

            def answered(path: str) -> requests.Response | None:
                if process.poll() is not None:
                    raise AssertionError(f"kvwatch exited {process.returncode}: {(tmp_path / 'kvwatch.log').read_text()[-2000:]}")
                try:
                    response = requests.get(base_url + path, timeout=2)
                except requests.ConnectionError:
                    return None
                return response if response.status_code == 200 else None

            # Not promstack.wait_until: it would keep waiting after kvwatch exited.
            # The probes reflect kvwatch alone (readiness is /healthz), so wait
            # on /readyz, which turns 200 once the engine was polled.
            deadline = time.monotonic() + 30
            while not answered("/readyz"):
                assert time.monotonic() < deadline, "/readyz did not answer 200 within 30 s"
                time.sleep(0.2)
            assert "readinessProbe" not in container  # a sidecar never takes its pod out of rotation
            assert answered(container["livenessProbe"]["httpGet"]["path"]).text == "ok\n"
            metrics = answered("/metrics").text
            assert "kvwatch_up 1.0" in metrics
            assert "kvwatch_engine_kv_cache_capacity_tokens" in metrics
            assert engine.requests and engine.requests[0]["path"] == "/metrics"
        finally:
            stop_process(process)
            log.close()


class StoreServer(LoopbackServer):
    """Prometheus' query API (series and query_range, as PrometheusClient
    posts them) over HTTP on loopback, answered from a promstub.StubClient."""

    def __init__(self, openmetrics: str):
        super().__init__(name="store")
        self.stub = StubClient(openmetrics)

    def respond(self, request):
        path = urlsplit(request.path).path
        params = {key: values[-1] for key, values in parse_qs(request.body.decode()).items()}
        if request.method != "POST" or path not in ("/api/v1/series", "/api/v1/query_range"):
            return Answer(json.dumps({"status": "error", "errorType": "bad_data", "error": path}), status=400,
                          headers={"Content-Type": "application/json"})
        data = self.stub._get(path, params)
        return Answer(json.dumps({"status": "success", "data": data}), headers={"Content-Type": "application/json"})

    @property
    def url(self) -> str:
        return self.base_url


def test_the_central_deployments_command_line_reads_the_store_and_becomes_ready(dockerfile, tmp_path):
    _, stages = dockerfile
    runtime = stages[-1]
    deployment = yaml.safe_load((KUBE / "central" / "deployment.yaml").read_text())
    namespace = yaml.safe_load((KUBE / "central" / "kustomization.yaml").read_text())["namespace"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    argv = container_argv(exec_form(runtime, "ENTRYPOINT"), exec_form(runtime, "CMD") or [], container)
    assert argv[:2] == ["kvwatch", "serve"]
    argv[0] = str(Path(sys.executable).with_name("kvwatch"))

    env = {key: value for key, value in os.environ.items() if not key.startswith("KVWATCH_")}
    env.update(env_pairs(runtime))
    container_env = {e["name"]: e["value"] for e in container.get("env", [])}
    assert set(container_env) <= KNOWN_ENV, set(container_env) - KNOWN_ENV
    env.update(container_env)
    assert env["KVWATCH_HOST"] == "0.0.0.0"
    probe_port = [p for p in container["ports"] if p["name"] == container["readinessProbe"]["httpGet"]["port"]][0]
    assert int(env["KVWATCH_PORT"]) == probe_port["containerPort"]
    port = free_port()
    env["KVWATCH_PORT"], env["KVWATCH_HOST"] = str(port), "127.0.0.1"

    # One replica scraped by the store for the last 6 minutes, in the
    # namespace the default selector names (the operator adds namespace).
    now = float(int(time.time()) // 15 * 15)
    history = fleet_openmetrics(fleet()[4:5], now - 360, 360, 15)
    history = re.sub(r'\{instance="', '{namespace="%s",instance="' % namespace, history)
    with StoreServer(history) as store:
        store_url = argv[argv.index("--prometheus") + 1]
        assert store_url.startswith("http://") and ".svc" in store_url  # the cluster's store
        argv[argv.index("--prometheus") + 1] = store.url
        log = open(tmp_path / "kvwatch.log", "w")
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base_url = f"http://127.0.0.1:{port}"

            def answered(path: str) -> requests.Response | None:
                if process.poll() is not None:
                    raise AssertionError(f"kvwatch exited {process.returncode}: {(tmp_path / 'kvwatch.log').read_text()[-2000:]}")
                try:
                    response = requests.get(base_url + path, timeout=5)
                except requests.ConnectionError:
                    return None
                return response if response.status_code == 200 else None

            # Central mode's readiness is the probe: 200 once the store answered with replicas.
            assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            deadline = time.monotonic() + 30
            while not answered("/readyz"):
                assert time.monotonic() < deadline, "/readyz did not answer 200 within 30 s"
                time.sleep(0.2)
            assert answered(container["livenessProbe"]["httpGet"]["path"]).text == "ok\n"
            metrics = answered("/metrics").text
            # The replica's series under the store's own labels (what honorLabels keeps).
            usage = [line for line in metrics.splitlines() if line.startswith("kvwatch_engine_kv_cache_usage_ratio{")]
            assert usage and all(f'namespace="{namespace}"' in line and 'job="vllm"' in line for line in usage)
            assert {"/api/v1/series", "/api/v1/query_range"} <= set(store.stub.paths)
        finally:
            stop_process(process)
            log.close()


def test_kubernetes_argument_rule():
    entrypoint, cmd = ["kvwatch", "serve"], ["--log-level", "info"]
    assert container_argv(entrypoint, cmd, {}) == ["kvwatch", "serve", "--log-level", "info"]
    assert container_argv(entrypoint, cmd, {"args": ["--port", "1"]}) == ["kvwatch", "serve", "--port", "1"]
    assert container_argv(entrypoint, cmd, {"command": ["kvwatch"]}) == ["kvwatch"]


# ---------------------------------------------------------------- the CI workflow that publishes it


def test_the_image_workflow_builds_this_dockerfile_and_publishes_only_on_a_version_tag():
    workflow = yaml.safe_load((REPO / ".github" / "workflows" / "image.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as true
    assert triggers["push"]["tags"] == ["v*"] and "pull_request" in triggers
    assert workflow["permissions"] == {"contents": "read"}
    (job,) = workflow["jobs"].values()
    assert job["permissions"]["packages"] == "write"
    steps = job["steps"]
    builds = [s for s in steps if str(s.get("uses", "")).startswith("docker/build-push-action@")]
    assert builds and all(s["with"]["file"] == "deploy/Dockerfile" and s["with"]["context"] == "." for s in builds)
    assert (REPO / builds[0]["with"]["file"]).is_file()
    tag_only = "${{ startsWith(github.ref, 'refs/tags/v') }}"
    assert builds[0]["with"]["push"] == tag_only  # pull requests and main build, never publish
    assert "linux/arm64" in builds[0]["with"]["platforms"]
    login = [s for s in steps if str(s.get("uses", "")).startswith("docker/login-action@")]
    assert login and login[0]["if"] == "startsWith(github.ref, 'refs/tags/v')"
    # The build arguments it passes are ones the Dockerfile declares.
    _, stages = parse_dockerfile(DOCKERFILE.read_text())
    declared = {arg.partition("=")[0] for arg in stages[-1].all("ARG")}
    passed = {line.strip().partition("=")[0] for line in builds[0]["with"]["build-args"].splitlines() if line.strip()}
    assert passed <= declared, passed - declared
    # The smoke test runs the image as the sidecar does, and the tag must be the package's version.
    text = (REPO / ".github" / "workflows" / "image.yml").read_text()
    assert "--read-only" in text and "--cap-drop ALL" in text and '"10001:10001"' in text
    assert 'test "v${version}" = "${GITHUB_REF_NAME}"' in text
    # docs/deploy.md describes it.
    assert ".github/workflows/image.yml" in (REPO / "docs" / "deploy.md").read_text()
