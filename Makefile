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
test: $(STAMP)
	$(BIN)/python -m pytest tests --nbval notebooks --nbval-sanitize-with notebooks/sanitize.cfg

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
