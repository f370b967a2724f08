# The README's two commands:
#   make run    install what is missing, build (Release), start kilnd on the default config
#   make test   install what is missing, build, run every unit and system test
#   make test-sanitize   ASan+UBSan and TSan builds (build-asan/, build-tsan/) of the scheduler,
#               server and models tests and kilnd, run there (docs/sanitizers.md)
BUILD      ?= build
# KILN_WERROR=ON|OFF: warnings as errors (CI sets ON). Unset: the build directory keeps what it
# was configured with (default OFF), so `make run` after `make test` does not rebuild everything.
KILN_WERROR ?=
JOBS       ?= $(shell nproc)
CMAKE_ARGS ?=
KILND_ARGS ?=
# test-sanitize: which builds (asan, tsan or both) and which tests (full, or ci: CI's subset).
SANITIZE     ?= asan tsan
SANITIZE_SET ?= full

.PHONY: all deps configure build run test test-sanitize bench format clean

all: build

deps:
	scripts/install-deps.sh

configure: deps
	cmake -S . -B $(BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release $(if $(KILN_WERROR),-DKILN_WERROR=$(KILN_WERROR)) $(CMAKE_ARGS)

build: configure
	cmake --build $(BUILD) -j $(JOBS)

run: build
	scripts/fetch-default-model.sh
	$(BUILD)/server/kilnd $(KILND_ARGS)

test: build
	cd $(BUILD) && ctest --output-on-failure --timeout 900 -j $(JOBS)

test-sanitize: deps
	scripts/fetch-default-model.sh >/dev/null
	JOBS=$(JOBS) KILN_SANITIZE_SET=$(SANITIZE_SET) tests/sanitize/run.sh $(SANITIZE)

bench: build
	@echo "benchmarks are in $(BUILD)/tests/bench/; see docs/performance.md"

format:
	git ls-files '*.cc' '*.h' | xargs clang-format -i

clean:
	rm -rf $(BUILD) build-asan build-tsan
