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
