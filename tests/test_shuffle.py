"""A shuffled run (`-p randomly`, pytest-randomly, docs/contributing.md): off
by default so a plain run keeps one order; a seed repeats its order, another
seed gives another, and a module's tests stay together."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MODULES = ("tests/test_causes.py", "tests/test_markers.py")


def collected(*options: str) -> list[str]:
    pytest.importorskip("pytest_randomly", reason="the test extra installs pytest-randomly (make test)")
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           *options, *MODULES], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_default_order_is_fixed_and_a_seed_repeats_its_shuffled_order():
    plain = collected()
    assert plain == collected()
    assert [line.split("::")[0] for line in plain] == sorted((line.split("::")[0] for line in plain),
                                                             key=lambda path: MODULES.index(path))
    first = collected("-p", "randomly", "--randomly-seed=1")
    assert first == collected("-p", "randomly", "--randomly-seed=1")
    assert first != plain and sorted(first) == sorted(plain)
    assert first != collected("-p", "randomly", "--randomly-seed=2")
    modules = [line.split("::")[0] for line in first]
    assert sum(1 for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m) == len(MODULES)
