"""kvwatch as a user installs it: `python -m build` on a clean copy of the
repository gives an sdist and a wheel; the wheel goes into a fresh venv with
nothing but its declared dependencies, and runs from a folder outside the
checkout (so the checkout cannot be imported): --version, the shipped
scenarios, `generate`, and `serve` against `sim` on loopback. A wheel built
from the sdist holds the same files. The release workflow runs the same steps
(docs/release.md)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Iterator

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

import kvwatch
from kvwatch.commands.generate import render_all
from kvwatch.mixin.config import load_config
from promstack import free_port, stop_process, wait_until

REPO = Path(__file__).resolve().parent.parent
# Building (setuptools into an isolated env) and a cold install (every dependency
# through pip) are bounded apart from the tests' own default.
BUILD_TIMEOUT_S = 300
INSTALL_TIMEOUT_S = 540
DIST_DIR_ENV = "KVWATCH_DIST_DIR"

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + INSTALL_TIMEOUT_S + 120)


def clean_env() -> dict[str, str]:
    """The environment without anything that would put the checkout on the path."""
    return {key: value for key, value in os.environ.items()
            if key not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")}


def build_env() -> dict[str, str]:
    """This interpreter's environment (its `build` module wherever it comes from),
    less the checkout on PYTHONPATH: the build reads only the clean copy."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
             if p and not Path(p).resolve().is_relative_to(REPO)]
    return {**clean_env(), **({"PYTHONPATH": os.pathsep.join(paths)} if paths else {})}


def run(args: list, cwd: Path, timeout: float, env: dict[str, str] | None = None) -> str:
    result = subprocess.run([str(a) for a in args], cwd=cwd, env=env or clean_env(), capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{args}: exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def clean_copy(out: Path) -> Path:
    """The files a clone would have (tracked, or new and not ignored): no build/,
    no egg-info, no __pycache__ from this checkout reach the build."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True, timeout=60).stdout.decode().split("\0")
    for relative in filter(None, listed):
        source = REPO / relative
        if source.is_file():  # a file deleted but not yet committed is listed and absent
            target = out / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read_bytes())
    return out


def build(source: Path, out: Path, *only: str) -> None:
    run([sys.executable, "-m", "build", *only, "--outdir", out, source], cwd=source, timeout=BUILD_TIMEOUT_S,
        env=build_env())


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> dict[str, Path]:
    """The sdist and the wheel: built here, or the release's own files where
    KVWATCH_DIST_DIR names the folder they were built into (the release workflow)."""
    tmp = tmp_path_factory.mktemp("dist")
    if os.environ.get(DIST_DIR_ENV):
        shutil.copytree(os.environ[DIST_DIR_ENV], tmp / "dist")
    else:
        build(clean_copy(tmp / "src"), tmp / "dist")
    wheels, sdists = sorted((tmp / "dist").glob("*.whl")), sorted((tmp / "dist").glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted((tmp / "dist").iterdir())
    return {"wheel": wheels[0], "sdist": sdists[0], "tmp": tmp}


@pytest.fixture(scope="module")
def venv(dist) -> Path:
    """A fresh venv (no site-packages of ours) with the wheel and what it declares."""
    root = dist["tmp"] / "venv"
    run([sys.executable, "-m", "venv", root], cwd=dist["tmp"], timeout=120)
    run([root / "bin" / "python", "-m", "pip", "install", "--quiet", "--disable-pip-version-check", dist["wheel"]],
        cwd=dist["tmp"], timeout=INSTALL_TIMEOUT_S)
    return root


@pytest.fixture
def outside(tmp_path) -> Path:
    """A working folder with no kvwatch/ beside it."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


def package_files() -> set[str]:
    """Every file of the package in the checkout, as a wheel names it."""
    return {p.relative_to(REPO).as_posix() for p in (REPO / "kvwatch").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"}


def wheel_names(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as wheel:
        return set(wheel.namelist())


def test_the_wheel_and_the_sdist_carry_every_file_of_the_package(dist):
    version = kvwatch.__version__
    assert dist["wheel"].name == f"kvwatch-{version}-py3-none-any.whl"
    assert dist["sdist"].name == f"kvwatch-{version}.tar.gz"
    expected = package_files()
    assert {"kvwatch/sidecar/static/status.css", "kvwatch/scenarios/demo.yaml"} <= expected
    in_wheel = {name for name in wheel_names(dist["wheel"]) if name.startswith("kvwatch/")}
    assert in_wheel == expected
    prefix = f"kvwatch-{version}/"
    with tarfile.open(dist["sdist"]) as sdist:
        members = {m.name.removeprefix(prefix) for m in sdist.getmembers() if m.isfile()}
    assert {name for name in members if name.startswith("kvwatch/")} == expected
    assert {"pyproject.toml", "README.md"} <= members and not any(m.startswith("tests/") for m in members)


def test_a_wheel_built_from_the_sdist_holds_the_same_files(dist):
    tmp = dist["tmp"] / "from-sdist"
    with tarfile.open(dist["sdist"]) as sdist:
        sdist.extractall(tmp / "src", filter="data")
    (source,) = (tmp / "src").iterdir()
    build(source, tmp / "dist", "--wheel")
    (wheel,) = (tmp / "dist").glob("*.whl")
    assert wheel.name == dist["wheel"].name
    assert wheel_names(wheel) == wheel_names(dist["wheel"])


def test_the_installed_command_reports_the_version_and_the_shipped_scenarios(venv, outside):
    where = run([venv / "bin" / "python", "-c", "import kvwatch; print(kvwatch.__file__)"], outside, 60)
    assert Path(where.strip()).is_relative_to(venv), where
    assert run([venv / "bin" / "kvwatch", "--version"], outside, 60).strip() == f"kvwatch {kvwatch.__version__}"
    listed = run([venv / "bin" / "kvwatch", "sim", "--list-scenarios"], outside, 60)
    names = {line.split()[0] for line in listed.splitlines() if line.strip()}
    assert names == {p.stem for p in (REPO / "kvwatch" / "scenarios").glob("*.yaml")}


def test_the_installed_generate_writes_what_the_checkout_generates(venv, outside):
    run([venv / "bin" / "kvwatch", "generate", "--out", outside / "out"], outside, 180)
    expected = render_all(load_config(None))
    written = {p.relative_to(outside / "out").as_posix(): p for p in (outside / "out").rglob("*") if p.is_file()}
    assert any(name.startswith("dashboards/") for name in written)
    assert set(written) == set(expected)
    assert [name for name, path in sorted(written.items()) if path.read_text() != expected[name]] == []


@contextlib.contextmanager
def started(args: list, cwd: Path, name: str) -> Iterator[subprocess.Popen]:
    with open(cwd / f"{name}.log", "w") as log:
        process = subprocess.Popen([str(a) for a in args], cwd=cwd, env=clean_env(), stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield process
        finally:
            stop_process(process)


def kvwatch_up(url: str) -> float | None:
    answer = requests.get(f"{url}/metrics", timeout=2)
    for family in text_string_to_metric_families(answer.text):
        for sample in family.samples:
            if sample.name == "kvwatch_up":
                return sample.value
    return None


def test_the_installed_sidecar_serves_a_simulated_engine(venv, outside):
    sim_port, kvwatch_port = free_port(), free_port()
    kvwatch_url = f"http://127.0.0.1:{kvwatch_port}"
    with started([venv / "bin" / "kvwatch", "sim", "--scenario", "healthy", "--port", sim_port, "--duration", "300s"],
                 outside, "sim") as sim, \
         started([venv / "bin" / "kvwatch", "serve", "--target", f"http://127.0.0.1:{sim_port}/metrics",
                  "--port", kvwatch_port, "--poll-interval", "1s"], outside, "serve") as serve:
        wait_until(lambda: kvwatch_up(kvwatch_url) == 1.0, 60, f"kvwatch_up 1 at {kvwatch_url}/metrics")
        assert requests.get(f"{kvwatch_url}/healthz", timeout=2).status_code == 200
        page = requests.get(f"{kvwatch_url}/", timeout=5)
        assert page.status_code == 200
        # The status page's style and script (package data) are put inline.
        for name in ("status.css", "status.js"):
            assert (REPO / "kvwatch" / "sidecar" / "static" / name).read_text().strip() in page.text, name
        runbooks = requests.get(f"{kvwatch_url}/runbooks", timeout=5)
        assert runbooks.status_code == 200 and "VllmKvCacheExhausted" in runbooks.text
        assert sim.poll() is None and serve.poll() is None
    assert sim.returncode is not None and serve.returncode is not None
