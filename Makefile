# The two commands for a fresh machine:
#   make demo   installs what is missing, builds, runs `nanguard demo`
#   make test   installs what is missing, builds, runs every test
BUILD ?= build
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release
NANGUARD := $(BUILD)/tools/cli/nanguard
export OMP_NUM_THREADS ?= 2
# OpenMP workers that spin after each parallel region take the cores that
# OpenBLAS's own threads need for the next matmul: on 2 cores a training
# step runs 1.8x slower with the default policy (0.57 s -> 0.31 s, README).
export OMP_WAIT_POLICY ?= passive

.PHONY: all setup configure build demo test bench bench-census bench-tracer bench-data bench-guard bench-python bench-distributed clean

all: build

setup:
	@scripts/setup-deps

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS)

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD)

demo: build
	$(NANGUARD) demo

test: build
	ctest --test-dir $(BUILD) --output-on-failure --timeout 900

bench: bench-census bench-tracer bench-data bench-guard bench-python bench-distributed

bench-census: build
	$(BUILD)/bench/census_bench

bench-data: build
	$(BUILD)/bench/data_bench

bench-tracer: build
	$(BUILD)/bench/tracer_bench

bench-guard: build
	$(BUILD)/bench/guard_bench

# Consensus cost of the distributed guard on 2 ranks over loopback (Gloo).
bench-distributed: build
	$(BUILD)/bench/distributed_bench

# Debian's python3-torch runs in /usr/bin/python3 only (not a pyenv python3 on PATH).
bench-python: build
	PYTHONPATH=$(BUILD)/python /usr/bin/python3 python/bench/bench_overhead.py

clean:
	rm -rf $(BUILD)
