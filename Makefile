# Two commands set everything up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/ppiped demo

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/pytest -q

# Long measurements (JSON lines on stdout); each needs ../shared/data/ppipe beside the checkout.
bench: $(STAMP)
	$(PY) bench/planner.py
	$(PY) bench/dispatch.py --json
	$(PY) bench/figure6.py
	$(PY) bench/ingest.py

clean:
	rm -rf $(VENV) build *.egg-info
