# Two commands do all set-up on a fresh machine: `make run` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
# Two stamps: `make run` installs what running needs; the test extras
# (pytest, hypothesis, matplotlib, ...) come on top only for the targets that test.
RUN_STAMP := $(VENV)/.installed-run
STAMP := $(VENV)/.installed

# KVWATCH_CACHE_DIR points every cache the tests reuse at one folder (.ci/run
# explains): pip's goes there too, so an empty folder means a cold install.
ifdef KVWATCH_CACHE_DIR
export PIP_CACHE_DIR := $(KVWATCH_CACHE_DIR)/pip
endif

.PHONY: run test test-image test-vllm test-llamacpp capture-vllm capture-llamacpp bench generate check-generated screenshots system-deps lint test-fast clean

$(RUN_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e .
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

# Prometheus, Alertmanager (promtool) and Chromium for the end-to-end tests.
system-deps:
	scripts/install-system-deps.sh

run: $(RUN_STAMP)
	scripts/run-demo.sh

# The 25 slowest tests' times end the log: where the suite's time goes. Two
# workers, each test file on one (its module's fixtures started once), so a
# file's tests keep their order (pyproject.toml says why two).
test: $(STAMP) system-deps
	$(VENV)/bin/pytest -q -n 2 --dist loadfile --durations=25

test-vllm: $(STAMP) system-deps
	scripts/test-vllm.sh

# deploy/Dockerfile built with buildah on a base of Debian's packages (cached under
# KVWATCH_CACHE_DIR) and run by podman as the chart runs it (scripts/test-image.sh).
test-image: $(RUN_STAMP)
	PYTHON=$(PY) scripts/test-image.sh

# The same against a real llama.cpp llama-server, built from source once and cached.
test-llamacpp: $(STAMP)
	scripts/test-llamacpp.sh

# Fresh captures from the real vLLM of the tier, one per scenario it runs, to
# renew tests/fixtures/ (check their ground truth by hand before replacing one).
# VLLM_VERSION=0.10.2 or 0.20.2 records an older build instead, installed in a
# venv of its own beside the tier's (harness.py OLDER_BUILDS says how).
VLLM_VERSION ?=
CAPTURE_OUT ?= tests/fixtures/vllm$(if $(VLLM_VERSION),-$(VLLM_VERSION))-cpu-$(shell date +%Y%m%d)
capture-vllm: $(STAMP)
	KVWATCH_VLLM_VERSION=$(VLLM_VERSION) $(PY) -m tests.vllm_tier.record_captures --out $(CAPTURE_OUT)

# Fresh /metrics pages from the tier's llama-server (see tests/fixtures/README.md).
LLAMACPP_CAPTURE_OUT ?= tests/fixtures/llamacpp-b11434-cpu
capture-llamacpp: $(STAMP)
	$(PY) -m tests.llamacpp_tier.record_pages --out $(LLAMACPP_CAPTURE_OUT)

bench: $(STAMP)
	$(PY) benchmarks/run.py

# The status page in its tested states, as PNGs under docs/screenshots/ (needs Chromium).
screenshots: $(STAMP) system-deps
	$(PY) scripts/screenshots.py

generate: $(RUN_STAMP)
	$(VENV)/bin/kvwatch generate

# Fail when committed dashboards/, alerts/ or deploy/ are stale (a test checks it too).
check-generated: $(RUN_STAMP)
	$(VENV)/bin/kvwatch generate --check

# The developer loop: everything but the slow tests (tests/slow_tests.py, docs/contributing.md).
test-fast: $(STAMP)
	$(VENV)/bin/pytest -q -m "not slow"

# The rules chosen in pyproject.toml's [tool.ruff] and [tool.mypy] (tests/test_lint.py
# and tests/test_mypy.py run the same).
lint: $(STAMP)
	$(VENV)/bin/ruff check kvwatch tests benchmarks scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
