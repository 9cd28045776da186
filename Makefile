# The two commands a newcomer needs: `make demo` and `make test`.
# Each creates .venv and installs what it needs on its own.

PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP_RUNTIME := $(VENV)/.stamp-runtime
STAMP_DEV     := $(VENV)/.stamp-dev
PROTO_SRC := $(wildcard protos/medfed/v1/*.proto)
PROTO_OUT := common/proto

.PHONY: test demo bench soak lint proto proto-check venv clean

$(STAMP_RUNTIME): pyproject.toml
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first, pinned: this version has a CPU wheel cached on our machines;
	# anything else pulls gigabytes of CUDA wheels.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e .
	touch $@

$(STAMP_DEV): $(STAMP_RUNTIME)
	$(PIP) install --quiet -e '.[dev,bench]'
	touch $@

venv: $(STAMP_DEV)

test: $(STAMP_DEV)
	$(MAKE) --no-print-directory proto-check
	$(MAKE) --no-print-directory lint
	$(VENV)/bin/pytest -q --durations=25

lint: $(STAMP_DEV)
	$(VENV)/bin/ruff check common coordinator site_agent bench tests
	$(VENV)/bin/mypy common coordinator site_agent

demo: $(STAMP_RUNTIME)
	$(VENV)/bin/medfed demo

# The benchmarks recorded in docs/benchmarks.md (several minutes on 2 cores).
bench: $(STAMP_RUNTIME)
	$(VENV)/bin/medfed bench secagg --sites 10 --dim 1000000 --dropouts 2
	$(VENV)/bin/medfed bench secagg --sites 50 --dim 100000 --dropouts 5 --neighbors 0
	$(VENV)/bin/medfed bench secagg --sites 100 --dim 1000000 --dropouts 10
	$(VENV)/bin/medfed bench dpsgd
	$(VENV)/bin/medfed bench round --sites 10 --dim 1000000 --dropouts 2 --rounds 3

# 30 minutes, 5 sites, one killed and restarted every minute (not part of `make test`);
# the figures are recorded in docs/benchmarks.md.
soak: $(STAMP_RUNTIME)
	$(VENV)/bin/medfed bench soak --sites 5 --minutes 30 --kill-every 60

# Regenerate the committed gRPC/protobuf stubs from protos/.
proto: $(STAMP_DEV)
	$(PY) -m common.protogen $(PROTO_OUT)

# Fails when the committed stubs drift from the .proto files.
proto-check: $(STAMP_DEV)
	$(PY) -m common.protogen --check $(PROTO_OUT)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache demo-run
