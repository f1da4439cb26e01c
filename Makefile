# The two commands of README.md. Everything else is CMake.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

FUZZ_BUILD ?= build-fuzz
FUZZ_SECONDS ?= 60

.PHONY: demo test build setup clean gpu-build fuzz-smoke

setup:
	@bash scripts/setup

$(BUILD)/build.ninja:
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(CMAKE_FLAGS)

build: setup $(BUILD)/build.ninja
	cmake --build $(BUILD) -j $(JOBS)

# Builds and runs every test that needs no GPU.
test: build
	cd $(BUILD) && ctest -LE gpu --output-on-failure -j $(JOBS)

# Installs what is missing, builds, runs the main job on the embedded default.
demo: build
	@bash scripts/demo $(BUILD)

# Builds the libFuzzer harnesses of fuzz/ with clang, ASan and UBSan (installing clang if missing)
# and runs each for FUZZ_SECONDS; fails when one finds a crash (docs/fuzzing.md).
fuzz-smoke:
	@bash fuzz/run $(FUZZ_BUILD) $(FUZZ_SECONDS)

clean:
	rm -rf $(BUILD)
