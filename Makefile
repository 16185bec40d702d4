# jflash developer commands.  `make demo` and `make test` work on a fresh
# machine: the first run creates .venv with Python 3.12 (found by
# tools/find_python.sh; override with `make PYTHON=/path/to/python3.12 ...`)
# and installs the project with the tested versions (constraints.txt); later
# runs reinstall only when pyproject.toml or constraints.txt changes.

SHELL := /bin/bash
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.jflash-installed
# tpu: libtpu, whose compiler the TPU compile tests run on this CPU.
EXTRAS := test,demo,tpu
# pytest-xdist workers for `make test` (override: make test PYTEST_WORKERS=0).
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=
DEMO_ARGS ?=

# libtpu (the tpu extra) is installed for the TPU compile tests; on a host
# without a TPU it is told a chip type instead of probing the host for one,
# which it would report on every start.
ifeq ($(wildcard /dev/accel* /dev/vfio/[0-9]*),)
  export TPU_ACCELERATOR_TYPE ?= v5litepod-4
  export TPU_WORKER_HOSTNAMES ?= localhost
endif

ifeq ($(PYTEST_WORKERS),0)
  XDIST :=
else
  XDIST := -n $(PYTEST_WORKERS)
endif

.PHONY: venv demo test test-lib test-tools test-gpu clean

venv: $(STAMP)

# The interpreter: created once.  A venv whose interpreter no longer runs (for
# example its base Python was removed) is rebuilt.
$(VPY):
	@set -e; \
	if [ -e "$(VENV)" ]; then echo "Removing broken $(VENV)"; rm -rf "$(VENV)"; fi; \
	py="$$(PYTHON='$(PYTHON)' sh tools/find_python.sh)"; \
	echo "Creating $(VENV) with $$py ($$("$$py" --version))"; \
	"$$py" -m venv "$(VENV)" || { rm -rf "$(VENV)"; exit 1; }

# The project and its extras at the tested versions: reinstalled when
# pyproject.toml or constraints.txt changes.
$(STAMP): pyproject.toml constraints.txt | $(VPY)
	@if ! "$(VPY)" -c 'import sys; sys.exit(sys.version_info < (3, 12))' \
	    2>/dev/null; then echo "$(VENV) does not run Python >= 3.12; run" \
	    "'make clean' and try again" >&2; exit 1; fi
	$(VPY) -m pip install --quiet --upgrade pip
	$(VPY) -m pip install --quiet -c constraints.txt -e '.[$(EXTRAS)]'
	@touch "$(STAMP)"

# Trains a small character-level transformer on the CPU (a few minutes) with
# jflash attention; writes demo_output/.
demo: $(STAMP)
	$(VPY) -m examples.train_lm $(DEMO_ARGS)

# The library's tests (tests/), then those of the benchmark harness and the
# developer tools (tests/tools/), each reported on its own; fails if either
# fails.  pytest's status 5 (nothing collected, e.g. a PYTEST_ARGS filter
# that matches only one of the two) is not a failure.
PYTEST := $(VPY) -m pytest -q $(XDIST) $(PYTEST_ARGS)
test: $(STAMP)
	@status=0; \
	echo "== library tests"; \
	$(PYTEST) --ignore=tests/tools tests || { [ $$? = 5 ] || status=1; }; \
	echo "== benchmark and tool tests"; \
	$(PYTEST) tests/tools || { [ $$? = 5 ] || status=1; }; \
	exit $$status

test-lib: $(STAMP)
	$(PYTEST) --ignore=tests/tools tests

test-tools: $(STAMP)
	$(PYTEST) tests/tools

# On a CUDA machine: only the GPU tests.  No .venv and no install: the GPU
# machines have no package registry, and their own python3 already holds jax
# with its CUDA plugin (use `make test-gpu PYTHON=...` to pick another).
test-gpu:
	$(or $(PYTHON),python3) -m pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) demo_output .pytest_cache build dist *.egg-info
	find . -name __pycache__ -type d -prune -not -path './.git/*' -exec rm -rf {} +
