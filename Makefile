# Entry points for people and CI. `make demo` and `make test` each build the virtual
# environment they need (.venv) from PyPI on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PROTOS := $(wildcard proto/rlmesh/v1/*.proto)

.PHONY: demo demo-agent demo-environment atropos-check test sglang-source sglang-check gpu-check lint format proto proto-check docs docs-check bench compose-check compose-image compose-up compose-down clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch: an unpinned torch would pull several GB of CUDA packages.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,logging]'
	touch $(STAMP)

# SGLang's own source, which tests/service/test_sglang_fidelity.py checks rlmesh's engine
# requests against (docs/engine-api.md#checked-against-sglangs-source). Downloaded, never
# installed: the wheel alone, without its CUDA dependencies, read as a zip. The pinned version is
# PINNED_VERSION in tests/helpers/sglang_source.py; `make sglang-check SGLANG_VERSION=X` tries another.
SGLANG_VERSION ?= $(shell sed -n 's/^PINNED_VERSION = "\(.*\)"$$/\1/p' tests/helpers/sglang_source.py)
SGLANG_WHEEL := $(VENV)/sglang/.$(SGLANG_VERSION)

$(SGLANG_WHEEL): | $(STAMP)
	$(BIN)/pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_34_x86_64 --platform manylinux2014_x86_64 --platform any \
		-d $(VENV)/sglang sglang==$(SGLANG_VERSION)
	touch $@

sglang-source: $(SGLANG_WHEEL)

sglang-check: $(SGLANG_WHEEL)
	RLMESH_SGLANG_VERSION=$(SGLANG_VERSION) $(BIN)/python -m pytest -q tests/service/test_sglang_fidelity.py

demo: $(STAMP)
	$(BIN)/rlmesh demo

demo-agent: $(STAMP)
	$(BIN)/rlmesh demo --task agent

demo-environment: $(STAMP)
	$(BIN)/rlmesh demo --task environment

# Another atroposlib against the trajectory API's tests (docs/environments.md), one setting:
# `make atropos-check ATROPOSLIB=0.4.0`. A scratch venv (.venv-atropos) layered over .venv's
# packages (a .pth adds them after its own) gets that version and whatever it needs beyond them.
ATROPOSLIB ?= 0.4.0
ATROPOS_VENV := .venv-atropos
atropos-check: $(STAMP)
	rm -rf $(ATROPOS_VENV) && $(PY) -m venv $(ATROPOS_VENV)
	base=$$($(BIN)/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	own=$$($(ATROPOS_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") && \
	echo "import site; site.addsitedir('$$base')" > $$own/rlmesh-base.pth
	$(ATROPOS_VENV)/bin/pip install -q atroposlib==$(ATROPOSLIB)
	$(ATROPOS_VENV)/bin/python -c "import importlib.metadata as m, atroposlib; print('atroposlib', m.version('atroposlib'), atroposlib.__file__)"
	$(ATROPOS_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/e2e/test_environments.py tests/e2e/test_demos.py -k "environment"

# Two processes: the end-to-end suite starts whole stacks inside the test process, and what
# their background tasks leave behind must not eat into the tight deadlines of the contract
# tests (seen: remote-reward timeouts and a stalled rollout after the whole e2e suite ran first).
test: $(STAMP) $(SGLANG_WHEEL) proto-check docs-check lint
	$(BIN)/python -m pytest -q tests/unit tests/service
	$(BIN)/python -m pytest -q -n 2 --dist loadfile tests/e2e

# On a machine with a CUDA GPU (docs/gpu.md): the tests marked gpu (bf16 training, the engine on
# CUDA, colocated updates over CUDA IPC, megatron-core without CPU shims, the demo on CUDA), then
# bench.gpu. Without a GPU every test skips and bench.gpu says it needs one. PYTEST_ARGS adds options.
# GPU_PYTHON: the interpreter with CUDA torch and the rlmesh wheels (.venv's when there is one).
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
gpu-check:
	$(GPU_PYTHON) -m pytest -q -m gpu -rs tests/gpu $(PYTEST_ARGS)
	$(GPU_PYTHON) -m bench.gpu

# ruff (lint and format), and the service boundary (services share only rlmesh.common and
# rlmesh.v1; see docs/architecture.md): a break fails here, before any test runs.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit/test_boundaries.py

# Rewrite the tree as `make lint` wants it (formatting, then the fixable lint findings).
format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

# Regenerate the Python code for the .proto contracts (committed).
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto \
		--grpc_python_out=proto $(PROTOS)

# Fails when the committed generated code differs from what the .proto files give.
proto-check: $(STAMP)
	@tmp=$$(mktemp -d) && \
	$(BIN)/python -m grpc_tools.protoc -I proto --python_out=$$tmp --pyi_out=$$tmp \
		--grpc_python_out=$$tmp $(PROTOS) && \
	for f in $$tmp/rlmesh/v1/*.py*; do \
		cmp -s $$f proto/rlmesh/v1/$$(basename $$f) || { echo "stale generated code: proto/rlmesh/v1/$$(basename $$f); run 'make proto'"; exit 1; }; \
	done; echo "generated code is up to date"

# Regenerate docs/run-config.md from the run config's schema (committed).
docs: $(STAMP)
	$(BIN)/python -m rlmesh.cli.config_reference docs/run-config.md

# Fails when the committed docs/run-config.md differs from what the schema gives.
docs-check: $(STAMP)
	@$(BIN)/python -m rlmesh.cli.config_reference --check docs/run-config.md

bench: $(STAMP)
	$(BIN)/python -m bench.wire
	$(BIN)/python -m bench.buffer
	$(BIN)/python -m bench.reward
	$(BIN)/python -m bench.metrics

compose-check:
	MODEL_DIR=/tmp DATA_DIR=/tmp RLMESH_TOKEN=check REDIS_PASSWORD=check docker-compose -f deploy/docker-compose.yml config -q
	MODEL_DIR=/tmp DATA_DIR=/tmp RLMESH_TOKEN=check REDIS_PASSWORD=check docker-compose -f deploy/docker-compose.yml -f deploy/docker-compose.colocated.yml config -q

# The cpu profile of deploy/docker-compose.yml on this host, detached (export RLMESH_TOKEN and
# REDIS_PASSWORD first; the API is then on 127.0.0.1:8000). With Podman (deploy/podman/, as root):
# its Docker-compatible API, a base image built from Debian packages (no image pulls) and the
# image built from a host-filled wheelhouse; otherwise Docker builds the image itself.
PODMAN := $(shell command -v podman 2>/dev/null)
COMPOSE_CPU := docker-compose -f deploy/docker-compose.yml --profile cpu
ifneq ($(PODMAN),)
COMPOSE_ENV := DOCKER_HOST=unix:///run/podman/podman.sock REDIS_IMAGE=$${REDIS_IMAGE:-localhost/rlmesh-base:bookworm}
endif

compose-image: $(STAMP)
ifneq ($(PODMAN),)
	deploy/podman/setup.sh
	deploy/podman/build-image.sh $(BIN)/python
else
	docker build -f deploy/Dockerfile -t rlmesh:latest .
endif

compose-up: compose-image
	$(COMPOSE_ENV) $(COMPOSE_CPU) up -d --no-build
	@echo "the API: http://127.0.0.1:$${RLMESH_API_PORT:-8000} (docker-compose ps shows the health checks)"

compose-down:  # (compose wants the variables set even to stop)
	RLMESH_TOKEN=$${RLMESH_TOKEN:-unused} REDIS_PASSWORD=$${REDIS_PASSWORD:-unused} $(COMPOSE_ENV) $(COMPOSE_CPU) down -v --remove-orphans

clean:
	rm -rf $(VENV) $(ATROPOS_VENV) .rlmesh
