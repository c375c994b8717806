# fusetrain's interface: build, test, train, bench, gpu-check. Each target
# installs what is missing first (scripts/install-deps.sh is idempotent).
# TORCH_VERSION=2.11.0 make test: another supported torch
# (python/fusetrain/_torch_versions.py) in a venv and build tree of its own,
# .venv-torch2.11.0/ and build-torch2.11.0/; the default ones are untouched.
DEFAULT_TORCH := $(shell sed -n 's/^DEFAULT = "\([0-9.]*\)".*/\1/p' python/fusetrain/_torch_versions.py)
TORCH_VERSION ?= $(DEFAULT_TORCH)
ifeq ($(TORCH_VERSION),$(DEFAULT_TORCH))
VENV ?= .venv
BUILD ?= build
else
VENV ?= .venv-torch$(TORCH_VERSION)
BUILD ?= build-torch$(TORCH_VERSION)
PACKAGE_ROOT := $(BUILD)/python
endif
PACKAGE_ROOT ?= python
export TORCH_VERSION VENV
PYTHON ?= $(CURDIR)/$(VENV)/bin/python
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: deps configure build test test-quick kernel-mutants train bench docs reference gpu-check gpu-deps clean format

deps:
	@scripts/install-deps.sh

# Afresh when PYTHON or its torch is not the one $(BUILD) was configured for.
configure: deps
	@scripts/configure.sh $(PYTHON) $(BUILD) $(CMAKE_ARGS)

build: deps configure
	cmake --build $(BUILD) -j $(JOBS)
	@scripts/install-python.sh $(PYTHON) $(BUILD) $(PACKAGE_ROOT)

test: build
	@scripts/run-tests.sh $(PYTHON) $(BUILD)

# The build, the C++ and kernel tests, and a pytest selection that reaches
# every module (tests/python/quick.txt): CI's leg on the oldest torch.
test-quick: build
	@scripts/run-tests.sh $(PYTHON) $(BUILD) quick

# Planted bugs in copies of the kernels that the kernel tests must catch
# (tests/kernel_mutants.txt): 7 to 12 minutes, so not part of test.
kernel-mutants: build
	JOBS=$(JOBS) scripts/kernel-mutants.sh $(BUILD)

train: build
	FUSETRAIN_PYTHON=$(PYTHON) $(BUILD)/fusetrain train --config configs/fashion_mnist.yaml

bench: build
	$(PYTHON) bench/run.py

# The documentation site (docs/, Sphinx + MyST) into $(BUILD)/docs/html, warnings
# as errors. The reference pages are generated from the built package, the
# trainer's --print-schema and the C++ headers, so it needs the build first.
docs: build
	FUSETRAIN_BUILD_DIR=$(abspath $(BUILD)) $(PYTHON) -m sphinx -W --keep-going -q -b html docs $(BUILD)/docs/html

# The committed reference pages, docs/reference/{config,cpp,python}.md, rewritten
# from the build's `fusetrain train --print-schema`, the C++ headers and the
# package's docstrings (docs/_ext/fusetrain_docs.py; --check only reports).
# tests/python/test_docs.py fails while they differ from what this writes.
reference: build
	FUSETRAIN_BUILD_DIR=$(abspath $(BUILD)) $(PYTHON) docs/_ext/fusetrain_docs.py

# On the GPU box (torch, nvcc, cmake there; no apt): PYTHON=python3 is its torch.
gpu-check:
	PYTHON=$${PYTHON:-python3} scripts/gpu_check.sh

# Here, before a device run: stage the Debian headers/libs the box lacks.
gpu-deps:
	scripts/stage-gpu-deps.sh

format:
	clang-format -i $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'trainer/*.cpp' 'tests/cpp/*.cpp')

clean:
	rm -rf $(BUILD)
