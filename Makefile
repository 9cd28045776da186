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

.PHONY: test test-containers demo bench soak lint proto proto-check venv clean images lock

# Every package comes from requirements/dev.lock, pinned with its SHA-256 hash (`make
# lock` re-pins it). uv installs it (seconds; pip takes minutes on two cores): uv itself
# first, from requirements/bootstrap.lock with its hashes, then the lock without
# resolving anything (`uv pip check` then confirms the set is consistent), then medfed
# itself. torch is the lock's CPU build, torch==2.13.0+cpu: uv looks for it where pip is
# configured to look (PIP_FIND_LINKS or pip's find-links: our machines cache the wheel
# there); elsewhere UV_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu
# --index-strategy unsafe-best-match" names PyTorch's CPU index. Where uv cannot be
# installed or cannot install the lock, pip installs the same pins (torch first, its
# lock entry left out; PIP_EXTRA as UV_EXTRA) and says so.
PIP_EXTRA ?=
UV_EXTRA  ?=
$(STAMP_RUNTIME): pyproject.toml requirements/dev.lock requirements/bootstrap.lock
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) on PATH"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@links=""; \
	for dir in $${PIP_FIND_LINKS:-$$($(PIP) config get global.find-links 2>/dev/null)}; do \
		links="$$links --find-links $$dir"; \
	done; \
	if $(PIP) install --quiet --require-hashes -r requirements/bootstrap.lock \
		&& $(VENV)/bin/uv pip install --python $(PY) --quiet --no-deps --require-hashes \
			$$links $(UV_EXTRA) -r requirements/dev.lock \
		&& $(VENV)/bin/uv pip check --python $(PY) --quiet; then \
		echo "installed requirements/dev.lock with uv"; \
	else \
		echo "uv could not install requirements/dev.lock: installing it with pip (minutes)"; \
		$(PIP) install --quiet $(PIP_EXTRA) torch==2.13.0 \
		&& sed '/^torch==/,/^[a-z]/{/^torch==/d;/^ /d;}' requirements/dev.lock \
			> $(VENV)/dev-without-torch.lock \
		&& $(PIP) install --quiet --require-hashes $(PIP_EXTRA) \
			-r $(VENV)/dev-without-torch.lock || exit 1; \
	fi
	$(PIP) install --quiet --no-deps --no-build-isolation -e .
	touch $@

$(STAMP_DEV): $(STAMP_RUNTIME)
	touch $@

venv: $(STAMP_DEV)

# mypy runs inside the suite (tests/unit/test_type_check.py), beside the other tests.
test: $(STAMP_DEV)
	$(MAKE) --no-print-directory proto-check
	$(VENV)/bin/ruff check common coordinator site_agent demo bench tests
	$(VENV)/bin/pytest -q --durations=25

# The shipped images built and run with podman, alone (tests/deploy/test_containers.py,
# also part of `make test`; .ci/scripts/install-container-engine.sh installs podman).
test-containers: $(STAMP_DEV)
	$(VENV)/bin/pytest -q -n 0 -rs --durations=10 tests/deploy/test_containers.py

lint: $(STAMP_DEV)
	$(VENV)/bin/ruff check common coordinator site_agent demo bench tests
	$(VENV)/bin/mypy common coordinator site_agent demo

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
	$(PY) -m common.commands.protogen $(PROTO_OUT)

# Fails when the committed stubs drift from the .proto files.
proto-check: $(STAMP_DEV)
	$(PY) -m common.commands.protogen --check $(PROTO_OUT)

# Container images (docker-compose.yml and deploy/k8s use these tags). Settings:
#   ENGINE       podman or docker (default: podman where installed)
#   VERSION      image tag (default: the version in pyproject.toml)
#   BASE_IMAGE   Python 3.11 base image (python:3.11-slim)
#   TORCH_INDEX  index serving torch==2.13.0+cpu ("" = none: WHEELS or pip.conf finds it)
#   WHEELS       a folder of wheels (air-gapped builds): linked into deploy/docker/wheels
#   IMAGE_BUILD_FLAGS  extra flags for every build (mounts, --network host, ...)
# Every package comes from requirements/*.lock, pinned with SHA-256 hashes.
VERSION     ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml | head -n 1)
ENGINE      ?= $(shell command -v podman >/dev/null 2>&1 && echo podman || echo docker)
BASE_IMAGE  ?= python:3.11-slim
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
WHEELS      ?=
IMAGE_BUILD_FLAGS ?=
# podman/buildah write OCI images by default, which have no HEALTHCHECK.
IMAGE_FORMAT := $(if $(filter podman buildah,$(notdir $(ENGINE))),--format docker,)
IMAGE_ARGS = $(IMAGE_FORMAT) $(IMAGE_BUILD_FLAGS) --build-arg BASE_IMAGE=$(BASE_IMAGE) \
	--build-arg TORCH_INDEX=$(TORCH_INDEX) --build-arg VERSION=$(VERSION)

images:
	@if [ -n "$(WHEELS)" ]; then \
		for wheel in $(WHEELS)/*.whl; do \
			ln -f "$$wheel" deploy/docker/wheels/ 2>/dev/null \
				|| cp -f "$$wheel" deploy/docker/wheels/; \
		done; \
	fi
	$(ENGINE) build $(IMAGE_ARGS) -f deploy/docker/site_agent.Dockerfile \
		-t medfed-site-agent:$(VERSION) .
	$(ENGINE) build $(IMAGE_ARGS) -f deploy/docker/coordinator.Dockerfile \
		-t medfed-coordinator:$(VERSION) .

# Re-pin requirements/*.lock (with hashes) after a change to requirements/*.in;
# needs pip-tools (pip install pip-tools) and an index that serves torch's CPU wheel.
lock:
	cd requirements && for role in site coordinator dev; do \
		pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras \
			--no-emit-find-links --no-emit-index-url --no-emit-trusted-host \
			-o $$role.lock $$role.in || exit 1; \
	done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache demo-run
