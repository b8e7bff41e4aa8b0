"""The real-vLLM test tier (`make test-vllm`): tests against a real vLLM 0.32 on the CPU."""

import sys
from pathlib import Path

# tests/ on the path, as tests/conftest.py puts it, so the tier shares the
# loopback servers of tests/pageserver.py also when a module of it runs alone
# (python -m tests.vllm_tier.record_captures).
_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
