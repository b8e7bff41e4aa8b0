"""The release workflow (.github/workflows/release.yml), read as GitHub reads it:
it runs on version tags only, builds the sdist and the wheel, smoke-tests
those very files, and publishes them by trusted publishing with build
provenance, the write permissions held by the publishing job alone."""

from __future__ import annotations

from pathlib import Path

import yaml
from test_wheel import DIST_DIR_ENV

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / ".github" / "workflows" / "release.yml"


def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def uses(step: dict) -> str:
    return str(step.get("uses", "")).partition("@")[0]


def test_it_runs_on_version_tags_only_and_reads_the_repository_by_default():
    release = workflow()
    assert release[True] == {"push": {"tags": ["v*"]}}  # YAML 1.1 reads the key `on` as true
    assert release["permissions"] == {"contents": "read"}


def test_the_build_job_builds_checks_the_tag_and_smoke_tests_the_files_it_uploads():
    build = workflow()["jobs"]["build"]
    assert build["permissions"] == {"contents": "read"}
    steps = build["steps"]
    runs = [step.get("run", "") for step in steps]
    order = {name: next(i for i, text in enumerate(runs) if marker in text) for name, marker in {
        "tag": 'test "v${version}" = "${GITHUB_REF_NAME}"',
        "build": "python -m build --outdir dist",
        "smoke": "tests/test_wheel.py",
    }.items()}
    upload = next(i for i, step in enumerate(steps) if uses(step) == "actions/upload-artifact")
    assert order["tag"] < order["build"] < order["smoke"] < upload
    # The version is read where it lives, and the smoke test installs the files built, not a rebuild.
    assert "kvwatch/__init__.py" in runs[order["tag"]]
    assert steps[order["smoke"]]["env"] == {DIST_DIR_ENV: "dist"}
    assert steps[upload]["with"]["path"].rstrip("/") == "dist"


def test_the_publish_job_attests_and_publishes_by_trusted_publishing():
    jobs = workflow()["jobs"]
    publish = jobs["publish"]
    assert publish["needs"] == "build"
    assert publish["environment"]["name"] == "pypi"
    assert publish["permissions"] == {"contents": "read", "id-token": "write", "attestations": "write"}
    steps = publish["steps"]
    actions = [uses(step) for step in steps]
    assert actions == ["actions/download-artifact", "actions/attest-build-provenance", "pypa/gh-action-pypi-publish"]
    assert steps[1]["with"]["subject-path"] == "dist/*"
    # Trusted publishing: no password or token is handed to the action.
    assert set(steps[2].get("with", {})) <= {"packages-dir", "attestations", "print-hash", "verbose"}
    # Only the publishing job may mint an OIDC token.
    assert [name for name, job in jobs.items() if job.get("permissions", {}).get("id-token")] == ["publish"]


def test_the_release_is_documented_beside_the_image():
    release_doc = (REPO / "docs" / "release.md").read_text()
    assert ".github/workflows/release.yml" in release_doc and ".github/workflows/image.yml" in release_doc
    assert "(release.md)" in (REPO / "docs" / "deploy.md").read_text()
    assert "release.md" in WORKFLOW.read_text()
