.PHONY: setup serve test lint bench

setup:
	./scripts/setup.sh

# Start the gateway on its embedded default: one local worker, SQLite store in ./data, a demo model.
serve: setup
	.venv/bin/loraplex serve --data-dir ./data

# Set everything up and run the whole test suite (what CI runs).
test: setup
	.venv/bin/python -m pytest -q -n 2 --dist loadgroup

lint: setup
	.venv/bin/ruff check .
	.venv/bin/mypy

bench: setup
	.venv/bin/python -m bench.engine_throughput
