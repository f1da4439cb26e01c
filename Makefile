# The two commands of README.md. Everything else is CMake.
BUILD ?= build
JOBS ?= $(shell nproc)
CMAKE_FLAGS ?=

.PHONY: demo test build setup clean gpu-build

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

clean:
	rm -rf $(BUILD)
