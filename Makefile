# fusetrain's interface: build, test, train, bench, gpu-check. Each target
# installs what is missing first (scripts/install-deps.sh is idempotent).
PYTHON ?= $(CURDIR)/.venv/bin/python
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: deps configure build test kernel-mutants train bench docs gpu-check gpu-deps clean format

deps:
	@scripts/install-deps.sh

$(BUILD)/build.ninja:
	@$(MAKE) --no-print-directory deps
	cmake -S . -B $(BUILD) -G Ninja -DPython3_EXECUTABLE=$(PYTHON) $(CMAKE_ARGS)

configure: $(BUILD)/build.ninja

build: deps configure
	cmake --build $(BUILD) -j $(JOBS)
	@scripts/install-python.sh $(PYTHON) $(BUILD)

test: build
	@scripts/run-tests.sh $(PYTHON) $(BUILD)

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
