# Two entry points, both from a fresh clone: `make lab` and `make test`.
# Everything lives in .venv beside the checkout; nothing is installed system-wide.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: lab test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' jupyterlab
	touch $(STAMP)

# Jupyter refuses to run as root unless told; a container's root user is common.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_FLAG) notebooks/

# The notebooks are tests too: nbval runs each and compares what it shows with
# the outputs stored in it, numbers that honestly vary sanitized away.
#
# Three workers keep a 2-core machine busy: each test also waits, on kernels,
# workers, servers and a browser, and a third worker fills those waits (the
# cores measured 1.9 of 2 busy through a whole run; a fourth worker made it no
# faster). `make test WORKERS=1` runs it on one. Tests that share a fixture wider than
# a test, and a notebook's cells, stay on one worker (tests/conftest.py,
# notebooks/conftest.py). It ends saying how long it took, and which ten
# tests took longest, so that whoever runs it knows what to expect.
WORKERS ?= 3
PYTEST := $(BIN)/python -m pytest -n $(WORKERS) --dist loadgroup --durations=10 \
	tests --nbval notebooks --nbval-sanitize-with notebooks/sanitize.cfg
test: $(STAMP)
	@echo "$(PYTEST)"
	@start=$$(date +%s); \
	$(PYTEST); \
	status=$$?; took=$$(( $$(date +%s) - start )); \
	echo "make test: $$((took / 60)) min $$((took % 60)) s on $(WORKERS) workers, exit $$status"; \
	exit $$status

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
