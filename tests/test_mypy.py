"""The package type-checks: `mypy` with [tool.mypy] of pyproject.toml (mypy's
default strictness plus check_untyped_defs, unused ignores reported), as
`make lint` runs it. Slow: a cold check of the package takes about 10 s."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
needs_mypy = pytest.mark.skipif(importlib.util.find_spec("mypy") is None,
                                reason="mypy is not installed (pip install -e '.[test]')")


def mypy(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    # A cache of its own: nothing written into the checkout, nothing another run left behind.
    return subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@needs_mypy
def test_mypy_finds_no_error_in_the_package(tmp_path):
    result = mypy(tmp_path)  # the files of [tool.mypy]: kvwatch/
    assert result.returncode == 0, f"mypy found problems:\n{result.stdout[-8000:]}{result.stderr[-2000:]}"


@pytest.mark.slow
@needs_mypy
def test_the_check_fails_on_a_type_error(tmp_path):
    (tmp_path / "wrong.py").write_text("def half(n: int) -> int:\n    return n / 2\n")
    result = mypy(tmp_path, str(tmp_path / "wrong.py"))
    assert result.returncode == 1 and "Incompatible return value type" in result.stdout
