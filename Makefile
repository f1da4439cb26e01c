# The commands of README.md. Everything else is CMake.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=
BENCH_OUT ?= bench-out

FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60

.PHONY: demo test test-gpu bench build setup clean fuzz-smoke

setup:
	@bash scripts/setup

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# Builds and runs every test that needs no GPU.
test: build
	cd $(BUILD) && ctest -LE gpu --output-on-failure -j $(JOBS)

# On a GPU host (an H100/H200: sm_90a): builds with CUDA and runs every test labelled `gpu`, one at a
# time, then the Python module's tests on PyTorch CUDA tensors where PyTorch with CUDA is installed.
# Without a visible Hopper GPU it stops before building, saying why.
test-gpu:
	@bash scripts/gpu-host "make test-gpu"
	@$(MAKE) --no-print-directory build
	@bash scripts/test-gpu $(BUILD)

# On a GPU host: builds, runs every GPU benchmark (bench/gpu), writes their JSON, logs and plots
# into $(BENCH_OUT)/ and prints a summary. QUICK=1: each benchmark's short mode.
bench:
	@bash scripts/gpu-host "make bench"
	@$(MAKE) --no-print-directory build
	@bash scripts/bench $(BUILD) $(BENCH_OUT)

# Installs what is missing, builds, runs the main job on the embedded default.
demo: build
	@bash scripts/demo $(BUILD)

# Builds the libFuzzer harnesses of fuzz/ with clang, ASan and UBSan (installing clang if missing)
# and runs each for FUZZ_SECONDS; fails when one finds a crash (docs/fuzzing.md).
fuzz-smoke:
	@bash fuzz/run $(FUZZ_BUILD) $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD)
