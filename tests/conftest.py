import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest

REPO = Path(__file__).resolve().parent.parent


# The real captures live in the repository, each folder with its provenance.
FIXTURES = REPO / "tests" / "fixtures"


def find_fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    path = find_fixtures()
    if not path.is_dir():
        pytest.fail(f"real vLLM captures not found at {path}")
    return path


from slow_tests import SLOW_MODULES, SLOW_TESTS  # noqa: E402

# Every test, the tiers' included, stays on loopback (tests/network_guard.py).
import network_guard  # noqa: E402

network_guard.install()


@pytest.fixture(autouse=True)
def _stays_on_loopback():
    network_guard.take_violations()
    yield
    made = network_guard.take_violations()
    if made:
        pytest.fail("a test left loopback:\n" + "\n".join(made), pytrace=False)


# A thread or child process a test starts ends with it (tests/leak_guard.py).
import leak_guard  # noqa: E402


@pytest.fixture(autouse=True)
def _leaves_no_thread_or_process():
    threads, children = leak_guard.thread_snapshot(), leak_guard.running_children()
    yield
    left = [f"thread {name}" for name in leak_guard.leftover_threads(threads)]
    left += [f"process {name}" for name in leak_guard.leftover_children(children)]
    if left:
        pytest.fail(f"the test left running ({leak_guard.GRACE_S:g} s after it ended):\n  " + "\n  ".join(left),
                    pytrace=False)


# The real-engine tiers run only when a -m expression names their marker
# (scripts/test-vllm.sh: -m vllm; scripts/test-llamacpp.sh: -m llamacpp). Any
# other run leaves them out, so `pytest -m "not slow"` needs no "and not vllm
# and not llamacpp" of its own (a -m on the command line replaces addopts').
TIERS = ("vllm", "llamacpp")


def tier_items_left_out(markexpr: str, items: list) -> list:
    """The items of a real-engine tier that the -m expression does not name."""
    named = set(re.findall(r"\w+", markexpr or ""))
    return [item for item in items if any(tier not in named and item.get_closest_marker(tier) for tier in TIERS)]


def mark_slow(items: list) -> None:
    """The slow marker on the tests tests/slow_tests.py lists."""
    for item in items:
        module = item.path.name
        function = getattr(item, "originalname", None) or item.name.split("[")[0]
        if module in SLOW_MODULES or function in SLOW_TESTS.get(module, ()):
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # A shuffled run (`-p randomly`, pytest-randomly) prints its seed in the
    # header, which -q leaves out: again at the end, where a failure is read.
    seed = getattr(config.option, "randomly_seed", None)
    if config.pluginmanager.has_plugin("randomly") and isinstance(seed, int):
        terminalreporter.write_line(f"tests shuffled: -p randomly --randomly-seed={seed} repeats this order")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: the marks are on before -m selects (the mark plugin's hook).
    mark_slow(items)
    left_out = tier_items_left_out(config.getoption("markexpr"), items)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        dropped = set(map(id, left_out))
        items[:] = [item for item in items if id(item) not in dropped]
