# The two commands: `make run` and `make test`. See README.md.
.PHONY: run test stop clean-state build bench fuzz

run:
	@bash scripts/run.sh

test:
	@bash scripts/test.sh

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
