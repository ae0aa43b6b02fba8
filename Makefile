# moekit: the README's commands. Each sets up what it needs on a fresh Debian 12 machine.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
APT_PACKAGES := cmake ninja-build g++ libgtest-dev nlohmann-json3-dev libcli11-dev libfmt-dev libomp-dev gnuplot-nox \
                pkg-config python3 python3-venv python3-dev openmpi-bin libopenmpi-dev
# The Python tests' environment: a virtual environment with torch, transformers and pytest from PyPI, and
# moekit built into it by `pip install .` (CPU-only extension: the tests run on the CPU).
PYTHON ?= python3
VENV ?= $(BUILD)/venv
PY_PACKAGES := torch transformers safetensors pytest scikit-build-core nanobind
PIP_INSTALL_FLAGS ?= -C cmake.define.MOEKIT_CUDA=OFF

FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := safetensors config experts_case cli_parsers
FUZZ_APT_PACKAGES := clang libclang-rt-14-dev libomp-14-dev

.PHONY: all deps build test test-cpp test-python python-env python demo sanitize bench clean fuzz fuzz-deps

all: build

# Installs the Debian packages that are missing (needs root or sudo).
deps:
	@missing=""; for p in $(APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "moekit: installing$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: deps $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# The C++ suite (GoogleTest, the installed package's consumer, the CLI's output), then the Python suite.
test: test-cpp test-python

test-cpp: build
	cd $(BUILD) && ctest --output-on-failure -j $(JOBS)

# The virtual environment with the Python tests' dependencies (PyPI), made once.
$(VENV)/.deps: | deps
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q $(PY_PACKAGES)
	touch $@

python-env: $(VENV)/.deps

# moekit's Python package into that environment (incremental: the CMake build stays in $(BUILD)/python).
python: python-env
	CMAKE_BUILD_PARALLEL_LEVEL=$(JOBS) $(VENV)/bin/pip install -q --no-build-isolation \
	  -C build-dir=$(BUILD)/python $(PIP_INSTALL_FLAGS) .

test-python: python
	cd python/tests && $(abspath $(VENV))/bin/python -m pytest -q -rs

demo: build
	./scripts/demo.sh $(BUILD)

sanitize: deps
	cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=Debug -DMOEKIT_SANITIZE=ON -DMOEKIT_CUDA=OFF
	cmake --build build-sanitize -j $(JOBS)
	cd build-sanitize && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --output-on-failure -j $(JOBS)

bench: build
	$(BUILD)/bin/moekit bench --shape qwen3-30b-a3b --tokens 1,8,64 --backends all

# libFuzzer (clang, ASan + UBSan) on the safetensors reader, config parsing, the Experts case reader and
# the CLI's parsers: FUZZ_SECONDS each (default 60), from the seed corpora in fuzz/corpus; new inputs go
# to $(FUZZ_BUILD)/corpus, crashes to $(FUZZ_BUILD)/artifacts (and fail the target).
fuzz-deps: deps
	@missing=""; for p in $(FUZZ_APT_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "moekit: installing$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing; \
	fi

fuzz: fuzz-deps
	cmake -S . -B $(FUZZ_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_COMPILER=clang++ \
	  -DMOEKIT_FUZZ=ON -DMOEKIT_CUDA=OFF -DMOEKIT_TESTS=OFF
	cmake --build $(FUZZ_BUILD) -j $(JOBS) $(addprefix --target fuzz_,$(FUZZ_TARGETS))
	@for t in $(FUZZ_TARGETS); do \
	  mkdir -p $(FUZZ_BUILD)/corpus/$$t $(FUZZ_BUILD)/artifacts; \
	  echo "moekit: fuzzing $$t for $(FUZZ_SECONDS) s"; \
	  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  $(FUZZ_BUILD)/bin/fuzz_$$t $(FUZZ_BUILD)/corpus/$$t fuzz/corpus/$$t -max_total_time=$(FUZZ_SECONDS) \
	    -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=2048 -print_final_stats=1 \
	    -artifact_prefix=$(FUZZ_BUILD)/artifacts/$$t- 2>$(FUZZ_BUILD)/fuzz_$$t.log \
	    || { tail -40 $(FUZZ_BUILD)/fuzz_$$t.log; exit 1; }; \
	  grep -E "^(#[0-9]+.*DONE|stat::number_of_executed_units|stat::peak_rss_mb)" $(FUZZ_BUILD)/fuzz_$$t.log; \
	done

clean:
	rm -rf $(BUILD) build-sanitize $(FUZZ_BUILD)
