# The two commands for a fresh machine:
#   make demo   installs what is missing, builds, runs `nanguard demo`
#   make test   installs what is missing, builds, runs every test
BUILD ?= build
CMAKE_FLAGS ?= -DCMAKE_BUILD_TYPE=Release
NANGUARD := $(BUILD)/tools/cli/nanguard
# The Python environment with torch that nanguard builds against (this
# checkout's .venv over a shared one); `make setup` creates it
# (scripts/setup-python) and records its python here.
PYTHON_STAMP := $(BUILD)/.python
PYTHON = $(shell cat $(PYTHON_STAMP))
export OMP_NUM_THREADS ?= 2
# Chosen on LibTorch 1.13 + OpenBLAS, where spinning OpenMP workers took the
# cores OpenBLAS's own threads needed (a step 1.8x slower with the default
# policy). On torch 2.11 (MKL) the default policy is the faster one for the
# reference step (0.175 s against 0.218 s) but the census of 2^20 floats
# falls to 0.66 of x.sum(): docs/performance.md, "The OpenMP wait policy". Kept until decided.
export OMP_WAIT_POLICY ?= passive

.PHONY: all setup configure build demo test test-sanitize fuzz bench bench-census bench-tracer bench-data bench-guard bench-python bench-integrations bench-compile bench-distributed bench-faults clean

all: build

setup:
	@scripts/setup-deps
	@mkdir -p $(BUILD) && scripts/setup-python $(BUILD) > $(PYTHON_STAMP).new
	@cmp -s $(PYTHON_STAMP).new $(PYTHON_STAMP) && rm $(PYTHON_STAMP).new || mv $(PYTHON_STAMP).new $(PYTHON_STAMP)

# Configured again when the Python environment changes.
$(BUILD)/build.ninja: $(PYTHON_STAMP)
	cmake -S . -B $(BUILD) -G Ninja $(CMAKE_FLAGS) -DPython3_EXECUTABLE=$(PYTHON)

configure: setup $(BUILD)/build.ninja

build: configure
	cmake --build $(BUILD)

demo: build
	$(NANGUARD) demo

# Tests run TEST_JOBS at a time (a job per core); the ones that compile
# nanguard again (python_wheel, packaging_*) start first and one at a time
# (COST and RESOURCE_LOCK compiler), the others fill the cores around them.
TEST_JOBS ?= $(shell nproc)
test: build
	ctest --test-dir $(BUILD) -j$(TEST_JOBS) --output-on-failure --timeout 900

# Every test under AddressSanitizer (leaks included) and UndefinedBehavior-
# Sanitizer, in its own build tree: on 2 cores shared with other builds (load
# average 4), the first build took 73 minutes and the tests (ctest -j2) 17. The
# packaging test is left out (its consumer is built without the sanitizers);
# vptr and container-overflow checks are off (LibTorch is not built for
# them: vectors it fills would look overflowed).
SANITIZE := -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize=vptr
test-sanitize: setup
	cmake -S . -B build-sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE=$(PYTHON) \
	  -DNANGUARD_BUILD_BENCH=OFF -DNANGUARD_BUILD_PYTHON=OFF "-DCMAKE_CXX_FLAGS=$(SANITIZE)" \
	  "-DCMAKE_EXE_LINKER_FLAGS=$(SANITIZE)" "-DCMAKE_SHARED_LINKER_FLAGS=$(SANITIZE)"
	cmake --build build-sanitize
	ASAN_OPTIONS=detect_container_overflow=0 LSAN_OPTIONS=suppressions=$(CURDIR)/tests/sanitize/lsan.supp \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  ctest --test-dir build-sanitize -j2 -E packaging --output-on-failure --timeout 900

# The readers of user files (CSV, event log, bundle) under libFuzzer with
# AddressSanitizer (leaks included) and UndefinedBehaviorSanitizer, each for
# FUZZ_SECONDS (two at a time: 2 x FUZZ_SECONDS in all), in its own clang
# build tree (its first build: about 7 minutes on 2 shared cores). What a run
# finds goes to build-fuzz/findings/; kept in fuzz/regressions/, the test
# suite replays it.
FUZZ_SECONDS ?= 300
FUZZ_FLAGS := -fsanitize=fuzzer-no-link,address,undefined -fno-omit-frame-pointer -fno-sanitize=vptr
fuzz: setup
	@scripts/setup-deps fuzz
	cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython3_EXECUTABLE=$(PYTHON) \
	  -DCMAKE_CXX_COMPILER=clang++ -DNANGUARD_BUILD_FUZZ=ON -DNANGUARD_BUILD_TESTS=OFF -DNANGUARD_BUILD_CLI=OFF \
	  -DNANGUARD_BUILD_BENCH=OFF -DNANGUARD_BUILD_PYTHON=OFF "-DCMAKE_CXX_FLAGS=$(FUZZ_FLAGS)"
	cmake --build build-fuzz
	scripts/fuzz build-fuzz $(FUZZ_SECONDS)

bench: bench-census bench-tracer bench-data bench-guard bench-python bench-integrations bench-compile bench-distributed

bench-census: build
	$(BUILD)/bench/census_bench

# The CSV reader, statistics, firewall and isolation forest; then the CSV
# reader against pandas' (and pyarrow's, when installed) on the same file.
bench-data: build
	$(BUILD)/bench/data_bench
	PYTHONPATH=$(BUILD)/python $(PYTHON) python/bench/bench_csv.py

bench-tracer: build
	$(BUILD)/bench/tracer_bench

bench-guard: build
	$(BUILD)/bench/guard_bench

# Consensus cost of the distributed guard on 2 ranks over loopback (Gloo), and
# the Guard over DDP and FSDP2 against their plain steps (2 ranks).
bench-distributed: build
	$(BUILD)/bench/distributed_bench
	PYTHONPATH=$(BUILD)/python $(PYTHON) python/bench/bench_distributed.py

bench-python: build
	PYTHONPATH=$(BUILD)/python $(PYTHON) python/bench/bench_overhead.py

# The framework callbacks (nanguard.integrations) against the frameworks' own step.
bench-integrations: build
	PYTHONPATH=$(BUILD)/python $(PYTHON) python/bench/bench_integrations.py

# The fault campaign: planted faults on 2 Gloo ranks, what the guard detects
# and how it classifies them (docs/hardware-or-software.md).
bench-faults: build
	PYTHONPATH=$(BUILD)/python $(PYTHON) python/bench/bench_faults.py

# The guard over a torch.compile'd model against the compiled plain step.
bench-compile: build
	PYTHONPATH=$(BUILD)/python $(PYTHON) python/bench/bench_compile.py

clean:
	rm -rf $(BUILD)
