import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


# Where the real vLLM captures live: beside the checkout (the team's layout),
# or at the workplace's shared folder when the checkout is a clone elsewhere.
FIXTURE_CANDIDATES = (REPO.parent / "shared" / "fixtures", Path("/work/shared/fixtures"))


def find_fixtures() -> Path:
    if "KVWATCH_FIXTURES" in os.environ:
        return Path(os.environ["KVWATCH_FIXTURES"])
    return next((p for p in FIXTURE_CANDIDATES if p.is_dir()), FIXTURE_CANDIDATES[0])


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    path = find_fixtures()
    if not path.is_dir():
        pytest.fail(f"real vLLM captures not found at {path} (set KVWATCH_FIXTURES)")
    return path
