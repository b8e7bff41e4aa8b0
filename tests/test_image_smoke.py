"""scripts/image_smoke.py (make test-image) runs the image as the chart does: the chart's securityContext
turned into podman flags, a key it cannot translate refused rather than dropped."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from kvwatch.mixin import manifests
from kvwatch.mixin.config import DeploySettings

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "image_smoke.py"
spec = importlib.util.spec_from_file_location("image_smoke", SCRIPT)
smoke = importlib.util.module_from_spec(spec)
spec.loader.exec_module(smoke)


def test_the_charts_security_context_becomes_podman_flags():
    security = manifests.kvwatch_container(DeploySettings(run_as_user=4242), native=True)["securityContext"]
    assert sorted(smoke.security_flags(security)) == sorted([
        "--user=4242:4242", "--read-only", "--read-only-tmpfs=false", "--security-opt=no-new-privileges",
        "--cap-drop=ALL"])


@pytest.mark.parametrize("security", [
    {"runAsUser": 0, "runAsNonRoot": True},
    {"runAsUser": 10001, "privileged": True},
    {"seccompProfile": {"type": "Unconfined"}},
    {"readOnlyRootFilesystem": True, "procMount": "Unmasked"},
])
def test_a_context_it_cannot_reproduce_fails_the_run(security):
    with pytest.raises(smoke.SmokeFailure):
        smoke.security_flags(security)


def test_kvwatch_up_is_read_as_a_number():
    assert smoke._up("# TYPE kvwatch_up gauge\nkvwatch_up 1.0\n")
    assert smoke._up('kvwatch_up{engine="0"} 1\n')
    assert not smoke._up("kvwatch_up 0.0\nkvwatch_up_seconds 1\n")
