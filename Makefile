# Two commands on a fresh machine: `make run` starts the service, `make test` runs the suite.
# Both create the virtualenv and install the project on first use.
VENV   ?= .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
DATA   ?= ./data
STAMP  := $(VENV)/.installed
# Test processes: the suite is mostly single-threaded work, so two workers use CI's two cores.
# Files stay whole on one worker (--dist loadfile): a module's fixtures are built once.
WORKERS ?= 2

.PHONY: run test test-long check bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,lint]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvstore serve --host $(HOST) --port $(PORT) --data $(DATA)

test: $(STAMP)
	$(VENV)/bin/pytest -q -n $(WORKERS) --dist loadfile

# What CI checks before the tests: lint, formatting, types (pyright on every part, copied into
# build/typecheck as installed: .ci/typecheck), all with the versions pinned in pyproject's `lint` extra.
check: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	.ci/typecheck

# The long reliability runs (hundreds of crash trials per operation); see RELIABILITY.md.
test-long: $(STAMP)
	KVSTORE_LONG=1 $(VENV)/bin/pytest -q -n $(WORKERS) --dist loadfile

bench: $(STAMP)
	$(PY) bench/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build/typecheck
