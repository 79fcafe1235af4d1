# What CI and the README run. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PREFECT_HOME ?= $(CURDIR)/.lowtide/prefect
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_LOGGING_LEVEL ?= WARNING

.PHONY: demo test lint format install clean bench-engine bench-pool bench-pool-sweep bench-pipeline bench-scale bench-quota serve

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lowtide demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

bench-engine: $(STAMP)
	$(PY) bench/bench_engine.py

ROWS ?= 100000
bench-pipeline: $(STAMP)
	$(PY) bench/bench_pipeline.py --rows $(ROWS)

# the whole `lowtide run` at ROWS rows beside the floor (needs ../shared/bench; skips without it)
bench-scale: $(STAMP)
	$(PY) bench/bench_scale.py --rows $(ROWS)

# the sample job in 100 shards against an OpenAI queue that holds three (a learned limit)
bench-quota: $(STAMP)
	$(PY) bench/bench_quota.py

# The feeder sweep (4/16/64 engines) prints its table first; bench_pool.py's line stays last.
FEEDERS ?= 1
bench-pool-sweep: $(STAMP)
	$(PY) bench/bench_pool_sweep.py --feeders $(FEEDERS)

REQUESTS ?= 20000
bench-pool: $(STAMP) bench-pool-sweep
	$(PY) bench/bench_pool.py --requests $(REQUESTS)

# A local Prefect server (SQLite, offline) with lowtide's deployments served: UI on :4200
serve: $(STAMP)
	bash deployments/serve.sh

clean:
	rm -rf .lowtide lowtide.duckdb
