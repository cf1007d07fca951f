# Two entry points, both from a fresh clone: `make lab` and `make test`.
# Everything lives in .venv beside the checkout; nothing is installed system-wide.
# On a machine with a card, `make gpu-check` checks it (see below).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: lab test lint clean wheelhouse gpu-check

# rfc3987-syntax comes with jsonschema's format-nongpl extra (Jupyter's event
# validation asks for it), and jsonschema imports it eagerly, for the "iri"
# formats that no schema here uses. On import it compiles 38 grammars: 1.2
# CPU-s in every process that imports jsonschema, which the suite starts by
# the dozen (each pytest process, through nbval; each Jupyter server; each Ray
# process). Without it jsonschema skips those two formats, and imports in 0.1 s.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]' jupyterlab
	$(BIN)/pip uninstall --quiet --yes rfc3987-syntax
	touch $(STAMP)

# Jupyter refuses to run as root unless told; a container's root user is common.
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP)
	$(BIN)/jupyter lab $(ROOT_FLAG) notebooks/

# The notebooks are tests too: nbval runs each and compares what it shows with
# the outputs stored in it, numbers that honestly vary sanitized away.
#
# Four workers keep a 2-core machine busy: each test also waits, on kernels,
# workers, servers and a browser, and the workers beyond two fill those waits
# (measured quiet: three workers kept the cores 1.77 of 2 busy, four 1.93, and
# ran the suite about 5 % sooner). `make test WORKERS=1` runs it on one.
# Tests that share a fixture wider than a test, and a notebook's cells, stay
# on one worker (tests/conftest.py, notebooks/conftest.py). It ends saying how
# long it took, and which ten tests took longest, so that whoever runs it
# knows what to expect.
#
# The suite starts about a thousand Pythons (kernels, workers, services, the
# command line), each importing the package, and pytest rewrites every test
# module in each of its workers. Where PYTHONDONTWRITEBYTECODE is set, as it
# is on these machines, none of them may keep what it compiled, and each
# compiles it all again: 0.12 CPU-s more for every kernel, 5 s more for every
# pytest process to collect the suite. The suite runs without it; what it
# writes is in __pycache__, which git ignores.
WORKERS ?= 4
PYTEST := $(BIN)/python -m pytest -n $(WORKERS) --dist loadgroup --durations=10 \
	tests --nbval notebooks --nbval-sanitize-with notebooks/sanitize.cfg
test: $(STAMP)
	@echo "$(PYTEST)"
	@start=$$(date +%s); \
	env -u PYTHONDONTWRITEBYTECODE $(PYTEST); \
	status=$$?; took=$$(( $$(date +%s) - start )); \
	echo "make test: $$((took / 60)) min $$((took % 60)) s on $(WORKERS) workers, exit $$status"; \
	exit $$status

# The real-card checks, on a machine that reaches no package registry: `make
# wheelhouse` where one is reachable (what a kernel needs and pytest, ~21 MB,
# checked under 60 MB; no Ray, no JupyterLab), carry wheelhouse/ over, then
# `make gpu-check` there. It installs from the folder alone into .gpu-venv,
# runs tests/test_gpu_real.py and bench/gpu_check.py, and ends with a line per
# check: passed, failed, or skipped saying what is missing (no card, no
# driver, no NVML). Needs only the NVIDIA driver on that machine. Compiled
# wheels are for one Python: make the folder with the card machine's
# version (`make wheelhouse PYTHON=python3.12`).
WHEELHOUSE ?= wheelhouse
GPU_VENV ?= .gpu-venv

wheelhouse:
	$(PYTHON) -m bench.wheelhouse download $(WHEELHOUSE)

gpu-check:
	$(PYTHON) -m bench.wheelhouse install $(WHEELHOUSE) $(GPU_VENV)
	$(GPU_VENV)/bin/python -m bench.gpu_check --with-tests

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(GPU_VENV)
