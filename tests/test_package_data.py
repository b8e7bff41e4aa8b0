"""Every file kvwatch reads from its own package at run time (the runbook
prose, the status page's style and script, the scenarios) is package data
in pyproject.toml, so an installed wheel carries it, not only a checkout."""

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_non_python_file_in_the_package_is_package_data():
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["kvwatch"]
    package = ROOT / "kvwatch"
    files = [p.relative_to(package).as_posix() for p in package.rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert any(f.startswith("diagnose/runbooks/") for f in files) and "sidecar/static/status.js" in files
    missing = [f for f in files if not any(fnmatch.fnmatch(f, g) for g in globs)]
    assert not missing, f"not in [tool.setuptools.package-data]: {missing}"
