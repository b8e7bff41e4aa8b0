"""The real llama.cpp test tier (`make test-llamacpp`): kvwatch against a real llama-server on the CPU."""

import sys
from pathlib import Path

# tests/ on the path, as tests/conftest.py puts it, so the tier shares the vLLM
# tier's helpers (vllm_tier) also when a module of it runs alone
# (python -m tests.llamacpp_tier.record_pages).
_TESTS = str(Path(__file__).resolve().parent.parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
