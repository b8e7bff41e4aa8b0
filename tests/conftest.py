import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    path = Path(os.environ.get("KVWATCH_FIXTURES", REPO.parent / "shared" / "fixtures"))
    if not path.is_dir():
        pytest.fail(f"real vLLM captures not found at {path} (set KVWATCH_FIXTURES)")
    return path
