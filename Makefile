# The two set-up commands of the README. Both install through scripts/install.sh (one source of truth).
PY := .venv/bin/python
PYTEST_ARGS ?=
# Two workers: most tests wait on process start-up and sockets, so even a 2-core CI box runs the suite
# in about 0.6x the time of one worker.
TEST_WORKERS ?= 2

.PHONY: serve test install lint bench

install:
	bash scripts/install.sh

# Install and serve the embedded default (SmolLM2-135M-Instruct on the CPU) at 127.0.0.1:8000.
serve:
	bash scripts/install.sh
	.venv/bin/mleagle serve --config smollm2-135m

# Install runtime + test dependencies and run the whole suite (what CI runs).
test:
	bash scripts/install.sh test
	$(PY) -m ruff check .
	bash scripts/typecheck.sh
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

lint:
	$(PY) -m ruff check .
	bash scripts/typecheck.sh

bench:
	.venv/bin/mleagle bench --out results/bench_cpu.json
