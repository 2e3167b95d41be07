# `make serve` and `make test` each set up the project-local virtualenv first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-to-serve

.PHONY: install serve test check bench evals clean offline-base-image offline-images

# Debian's docker-compose validates docker-compose.yml without a Docker engine
# (tests/test_compose.py); its Docker engine (docker.io) and debootstrap, which makes
# the base image where no registry is reachable (deploy/offline-base-image.sh), let
# tests/test_compose_stack.py build both images and run the stack. `make test` installs
# them (`make serve` and `make install` leave the system alone); that needs apt-get and
# root; where either is missing, or SYSTEM_PACKAGES=0 asks to leave the system's
# packages alone, the tests go on and those that need them skip, saying why.
SYSTEM_PACKAGES ?= 1
DOCKER_TOOLS := missing=""; \
	command -v docker-compose >/dev/null 2>&1 || missing="$$missing docker-compose"; \
	command -v dockerd >/dev/null 2>&1 || missing="$$missing docker.io"; \
	command -v debootstrap >/dev/null 2>&1 || missing="$$missing debootstrap"; \
	[ -z "$$missing" ] \
	|| { [ "$(SYSTEM_PACKAGES)" != 0 ] && [ "$$(id -u 2>/dev/null)" = 0 ] \
	     && command -v apt-get >/dev/null 2>&1 \
	     && echo "installing Debian's$$missing for the compose tests (SYSTEM_PACKAGES=0: not)" \
	     && apt-get update -qq \
	     && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; } \
	|| echo "not installed:$$missing (needs apt-get as root, and SYSTEM_PACKAGES not 0): the compose tests that need them will skip"

# The decode kernels (worker/model/csrc) compile once, here, one library per instruction
# set; a worker only loads them, and never compiles. Without a C++ compiler the
# worker runs without them, slower, and says so.
BUILD_DECODE_KERNELS := $(BIN)/python -m worker.model.kernels \
	|| echo "the decode kernels were not built (see above): decode will run slower"

# Serving needs the frontend's and the worker's packages alone; everything else
# (the tests', the checks', the benchmarks' tools) comes on top of them.
$(SERVE_STAMP): pyproject.toml $(wildcard worker/model/csrc/*)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[frontend,worker]'
	@$(BUILD_DECODE_KERNELS)
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

serve: $(SERVE_STAMP)
	$(BIN)/minibatch-serve

test: $(STAMP) check
	@$(DOCKER_TOOLS)
	$(BIN)/python -m pytest

check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# The compose file's images on a machine that reaches no image registry (README,
# docker compose up): the base image from Debian packages, then both images from
# their Dockerfiles, torch from this machine's pip. Root, debootstrap, a Docker engine.
offline-base-image:
	deploy/offline-base-image.sh

offline-images: $(STAMP)
	PYTHON=$(BIN)/python deploy/offline-images.sh

# Short versions of the main benchmarks (the ceiling, the engine sweep, the two
# paths' throughput and latency, HTTP and ZMQ load) on the synthetic model, one
# after another (a few minutes on 2 cores); JSON and plots land in bench/results/.
# The others (docs/performance.md's tools) run on their own.
bench: $(STAMP)
	$(BIN)/python -m bench.ceiling --steps 4 --profile-steps 3
	$(BIN)/python -m bench.engine_sweep --short
	$(BIN)/python -m bench.compare_paths --capacity 8 --requests 32 --rounds 1
	$(BIN)/python -m bench.path_latency --requests 10
	$(BIN)/python -m bench.http_load --mode open --rate 4 --requests 32
	$(BIN)/python -m bench.zmq_load --mode open --rate 4 --requests 32
	$(BIN)/python -m bench.chunked_prefill --runs 1 --stream-tokens 60

# guidellm and lm-eval-harness against a local stack (bench/clients.py). They need
# hundreds of MB of their own dependencies, so they get their own virtualenv,
# with the same pinned CPU torch, and stay out of `make test`.
EVALS := .venv-evals
evals: $(STAMP)
	test -x $(EVALS)/bin/python || $(PYTHON) -m venv $(EVALS)
	$(EVALS)/bin/python -m pip install --quiet "torch==2.13.0" "transformers>=5.0,<6" \
		"guidellm==0.8.1" "lm-eval[api,hf]==0.4.13"
	$(BIN)/python -m bench.clients

clean:
	rm -rf $(VENV) $(EVALS) .pytest_cache .mypy_cache .ruff_cache *.egg-info
