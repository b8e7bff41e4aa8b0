"""The version lives in one place, kvwatch/__init__.py: pyproject.toml reads it
from there (setuptools' dynamic version, from the file's text), the Helm chart
and the manifests are generated from it, and every other mention (the
Dockerfile's default label, image tags in the docs and deploy files, the
workflows' tag checks) agrees with it."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import yaml

import kvwatch

REPO = Path(__file__).resolve().parent.parent
VERSION = kvwatch.__version__
# An image tag, a wheel or sdist name, a pin, a kustomize tag, the Dockerfile's default.
MENTIONS = re.compile(r"kvwatch(?::|-|==)v?(\d+\.\d+\.\d+\S*?)(?=[\s\"'`)]|\.tar|-py3|$)|"
                      r"newTag: v?(\d+\.\d+\.\d+)|ARG VERSION=(\S+)", re.M)


def mentioned_versions(text: str) -> list[str]:
    return [next(group for group in match.groups() if group) for match in MENTIONS.finditer(text)]


def files_that_mention_versions() -> list[Path]:
    roots = [REPO / "README.md", REPO / "Makefile", *(REPO / "docs").glob("*.md"),
             *(REPO / ".github" / "workflows").glob("*.yml")]
    roots += [p for p in (REPO / "deploy").rglob("*") if p.is_file() and p.suffix in ("", ".yaml", ".yml", ".md", ".json")]
    return [p for p in roots if p.is_file()]


def test_the_version_is_a_literal_that_pyproject_reads_without_importing_kvwatch():
    tree = ast.parse((REPO / "kvwatch" / "__init__.py").read_text())
    literals = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["__version__"]
                and isinstance(node.value, ast.Constant)]
    assert literals == [VERSION] and re.fullmatch(r"\d+\.\d+\.\d+", VERSION)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "kvwatch.__version__"}


def test_the_chart_carries_the_version():
    chart = yaml.safe_load((REPO / "deploy" / "helm" / "kvwatch" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == VERSION
    image = yaml.safe_load((REPO / "deploy" / "helm" / "kvwatch" / "values.yaml").read_text())["image"]
    assert image.get("tag") in (None, "", VERSION)  # empty: the chart's appVersion


def test_every_mention_of_a_version_agrees_with_the_package():
    found = {path.relative_to(REPO).as_posix(): mentioned_versions(path.read_text(errors="replace"))
             for path in files_that_mention_versions()}
    assert sum(map(len, found.values())) >= 10, found  # the manifests' images, the docs, the Dockerfile
    assert {path: versions for path, versions in found.items() if set(versions) - {VERSION}} == {}


def test_the_workflows_read_the_version_where_it_lives():
    for name in ("image.yml", "release.yml"):
        text = (REPO / ".github" / "workflows" / name).read_text()
        assert "kvwatch/__init__.py" in text and '["project"]["version"]' not in text, name


def test_the_mention_reader_finds_each_kind_of_mention():
    text = ("image: ghcr.io/o/kvwatch:1.2.3\n    newTag: 1.2.4\nARG VERSION=1.2.5\n"
            "pip install kvwatch-1.2.6-py3-none-any.whl kvwatch-1.2.7.tar.gz kvwatch==1.2.8 `kvwatch:1.2.9`\n"
            "kvwatch-sim kvwatch:latest kvwatch-0.x")
    assert mentioned_versions(text) == ["1.2.3", "1.2.4", "1.2.5", "1.2.6", "1.2.7", "1.2.8", "1.2.9"]
