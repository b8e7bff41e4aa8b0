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
