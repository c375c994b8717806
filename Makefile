# fusetrain's interface: build, test, train, bench, gpu-check. Each target
# installs what is missing first (scripts/install-deps.sh is idempotent).
PYTHON ?= $(CURDIR)/.venv/bin/python
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_ARGS ?=

.PHONY: deps configure build test test-cpp test-python train bench gpu-check clean format

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

train: build
	$(PYTHON) -m fusetrain.demo

bench: build
	$(PYTHON) bench/run.py

gpu-check:
	scripts/gpu_check.sh

format:
	clang-format -i $$(git ls-files 'csrc/*.h' 'csrc/*.cpp' 'csrc/*.cu' 'csrc/*.cuh' 'trainer/*.cpp' 'tests/cpp/*.cpp')

clean:
	rm -rf $(BUILD)
