# The two commands of the README: `make demo` and `make test`.
# Both create (or reuse) a virtual environment in .venv and install what they need.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-all lint bench clean

$(STAMP): requirements-test.txt requirements-dev.txt pyproject.toml
	@# PyTurboJPEG (an optional decoder) needs the system libturbojpeg: install it when we can.
	@if ! ldconfig -p 2>/dev/null | grep -q libturbojpeg; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get install -y -q libturbojpeg0 >/dev/null 2>&1 || \
	    { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libturbojpeg0 >/dev/null 2>&1; } || \
	    echo "note: could not install libturbojpeg0; the turbojpeg decoder will not be tested"; \
	  else echo "note: libturbojpeg is missing (apt-get install libturbojpeg0): the turbojpeg decoder will not be tested"; fi; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/lmdbfolder demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The long fault-injection soak and other slow tests.
test-all: $(STAMP)
	$(BIN)/python -m pytest -q --run-slow

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_pack.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache
