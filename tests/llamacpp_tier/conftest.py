"""Fixtures of the real llama.cpp tier: one `llama-server` for the whole session.

The slow, once-per-machine part (fetching the llama.cpp source, building
`llama-server`, writing the tiny GGUF) runs when collection finishes, before
any test starts, so that no per-test timeout covers a cold build that takes
many minutes. A failure there is not a skip: every test using
`real_llamacpp` errors with the message.
"""

import pytest

from vllm_tier.harness import HarnessError
from vllm_tier.kvwatch_support import tier_reporter

from .harness import build_tiny_gguf, ensure_llama_server, llama_server

SLOTS = 4

_prepared = pytest.StashKey[tuple]()
_failure = pytest.StashKey[str]()


def reporter(config: pytest.Config):
    return tier_reporter(config, prefix="llamacpp-tier")


def _prepare(config: pytest.Config) -> tuple:
    if _failure in config.stash:
        pytest.fail(config.stash[_failure], pytrace=False)
    if _prepared not in config.stash:
        report = reporter(config)
        try:
            root = ensure_llama_server(report=report)
            model = build_tiny_gguf(root, report=report)
        except HarnessError as err:
            config.stash[_failure] = f"real llama.cpp unavailable: {err}"
            pytest.fail(config.stash[_failure], pytrace=False)
        config.stash[_prepared] = (root, model)
    return config.stash[_prepared]


def pytest_collection_finish(session: pytest.Session) -> None:
    if any("real_llamacpp" in getattr(item, "fixturenames", ()) for item in session.items):
        try:
            _prepare(session.config)
        except pytest.fail.Exception:
            pass  # stashed; each test using real_llamacpp reports it as its error


@pytest.fixture(scope="session")
def real_llamacpp(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A running llama-server --metrics serving the tiny GGUF: 4 slots sharing a 4096-token context."""
    root, _ = _prepare(request.config)
    log_path = tmp_path_factory.mktemp("llama-server") / "server.log"
    try:
        with llama_server(slots=SLOTS, root=root, log_path=log_path,
                          report=reporter(request.config)) as server:
            yield server
    except HarnessError as err:
        pytest.fail(f"real llama.cpp did not start: {err}", pytrace=False)
