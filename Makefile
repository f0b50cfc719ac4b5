# Two commands on a fresh machine: `make run` starts the service, `make test` runs the suite.
# Both create the virtualenv on first use. `make run` installs the core alone (the store, the
# service, the command line: about 300 MB, no torch); `make test` adds the engine and the test
# and lint tools (several GB). Each says what it installs before it does.
VENV   ?= .venv
PY     := $(VENV)/bin/python
HOST   ?= 127.0.0.1
PORT   ?= 8000
DATA   ?= ./data
# What each install has put in the virtualenv, newer than pyproject.toml while it is current.
CORE   := $(VENV)/.installed-core
ALL    := $(VENV)/.installed-all
# setuptools notes on every editable install of a layout like this one (the top-level folders mapped
# into one package, which only its import finder can serve) that a folder named like the package in
# the working directory takes precedence: the checkout's kvstore/ folder does, for a `python` started
# in the checkout's root (a `kvstore` command never is; the docs work elsewhere). The note cannot be
# answered short of moving every part under kvstore/, so this one note is left out of the output.
PIP    := PYTHONWARNINGS="ignore:Editable installation:UserWarning" $(PY) -m pip --quiet
# Test processes: the suite is mostly single-threaded work, so two workers use CI's two cores.
# Files stay whole on one worker (--dist loadfile): a module's fixtures are built once.
WORKERS ?= 2

.PHONY: run test test-long check bench clean

$(PY):
	@echo "Creating the virtualenv $(VENV) (python3 -m venv)"
	@python3 -m venv $(VENV)
	@$(PIP) install --upgrade pip

$(CORE): pyproject.toml | $(PY)
	@echo "Installing kvstore into $(VENV): the store, the service and the command line (pip install -e .; about 300 MB, no engine)"
	@$(PIP) install -e .
	@touch $@

$(ALL): pyproject.toml | $(PY)
	@echo "Installing kvstore with the engine, test and lint tools into $(VENV) (pip install -e '.[test,lint]'; torch, transformers, triton, playwright ...: several GB)"
	@$(PIP) install -e '.[test,lint]'
	@touch $@ $(CORE)

run: $(CORE)
	@$(VENV)/bin/kvstore serve --host $(HOST) --port $(PORT) --data $(DATA)

test: $(ALL)
	$(VENV)/bin/pytest -q -n $(WORKERS) --dist loadfile

# What CI checks before the tests: lint, formatting, types (pyright on every part, copied into
# build/typecheck as installed: .ci/typecheck), all with the versions pinned in pyproject's `lint` extra.
check: $(ALL)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	.ci/typecheck

# The long reliability runs (hundreds of crash trials per operation); see RELIABILITY.md.
test-long: $(ALL)
	KVSTORE_LONG=1 $(VENV)/bin/pytest -q -n $(WORKERS) --dist loadfile

bench: $(ALL)
	$(PY) bench/run_all.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis build/typecheck
