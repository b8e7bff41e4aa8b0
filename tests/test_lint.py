"""The code passes `ruff check` with the rules chosen in pyproject.toml's [tool.ruff]."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# What the rules cover: the package, its tests, the benchmarks and the scripts.
LINTED = ("kvwatch", "tests", "benchmarks", "scripts")


@pytest.mark.skipif(importlib.util.find_spec("ruff") is None, reason="ruff is not installed (pip install -e '.[test]')")
def test_ruff_check_passes():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", *LINTED],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, f"ruff check found problems (ruff check --fix fixes some):\n{result.stdout}{result.stderr}"
