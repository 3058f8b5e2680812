# The two commands: `make run` and `make test`. See README.md.
.PHONY: run test test-ha stop clean-state build bench fuzz

run:
	@bash scripts/run.sh

test:
	@bash scripts/test.sh

# The long high-availability test: not part of `make test` (docs/testing.md).
test-ha:
	@bash scripts/test-ha.sh

stop:
	@bash scripts/stop.sh

clean-state:
	@bash scripts/clean-state.sh

build:
	@bash scripts/deps
	@cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build build -j2

bench:
	@bash scripts/bench.sh

fuzz:
	@bash scripts/fuzz.sh
