import os
import random
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


# KVWATCH_TEST_SHUFFLE=<seed> (or =random) runs the modules in a shuffled
# order and each module's tests shuffled within it, so a test that passes only
# after another shows; the header prints the seed that reproduces the order.
SHUFFLE_VARIABLE = "KVWATCH_TEST_SHUFFLE"
_shuffle_seed = pytest.StashKey[int]()


def shuffle_seed(value: str | None) -> int | None:
    """The seed KVWATCH_TEST_SHUFFLE names: None when unset, a fresh one for 'random'."""
    if not value or not value.strip():
        return None
    if value.strip().lower() == "random":
        return random.SystemRandom().randrange(2 ** 32)
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{SHUFFLE_VARIABLE} must be a whole number (the seed) or 'random', not {value!r}") from None


def shuffled(items: list, seed: int) -> list:
    """The modules in an order the seed picks, each one's tests in an order the seed picks."""
    chance = random.Random(seed)
    modules: dict = {}
    for item in items:
        modules.setdefault(item.path, []).append(item)
    groups = list(modules.values())
    chance.shuffle(groups)
    for group in groups:
        chance.shuffle(group)
    return [item for group in groups for item in group]


def pytest_configure(config):
    seed = shuffle_seed(os.environ.get(SHUFFLE_VARIABLE))
    if seed is not None:
        config.stash[_shuffle_seed] = seed


def _shuffle_line(config) -> str | None:
    if _shuffle_seed in config.stash:
        return f"tests shuffled: {SHUFFLE_VARIABLE}={config.stash[_shuffle_seed]} repeats this order"
    return None


def pytest_report_header(config):
    return _shuffle_line(config)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    # Again at the end, where a failure is read (and -q prints no header).
    line = _shuffle_line(config)
    if line:
        terminalreporter.write_line(line)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    # tryfirst: the marks are on before -m selects (the mark plugin's hook).
    mark_slow(items)
    if _shuffle_seed in config.stash:
        items[:] = shuffled(items, config.stash[_shuffle_seed])
    left_out = tier_items_left_out(config.getoption("markexpr"), items)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        dropped = set(map(id, left_out))
        items[:] = [item for item in items if id(item) not in dropped]
