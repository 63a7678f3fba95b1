# The commands of the README. Each creates (or reuses) the virtual environment .venv and
# installs what that command needs, in layers, saying what and why:
#   make demo  -> requirements-demo.txt: the runtime, PyTorch, the fast JPEG decoder
#   make test  -> requirements-test.txt: + pytest, Ray, torchdata, the other decoders, matplotlib
#   make lint  -> requirements-dev.txt:  + ruff, mypy
# System libraries are never installed behind your back: `make system-deps` does it, on request.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --disable-pip-version-check

.PHONY: demo test test-all lint bench system-deps clean

$(BIN)/python:
	@echo "==> creating the virtual environment $(VENV) with $(PYTHON)"
	$(PYTHON) -m venv $(VENV)

$(VENV)/.demo-installed: requirements-demo.txt pyproject.toml setup.py src/lmdbfolder/read/_crops.c src/lmdbfolder/torch/_photometric.c | $(BIN)/python
	@echo "==> installing what the demo needs into $(VENV) (requirements-demo.txt): lmdb, numpy, Pillow, tqdm"
	@echo "    (lmdbfolder's own dependencies), PyTorch 2.14.1 and torchvision 0.29.1 (the big download),"
	@echo "    simplejpeg (the fast JPEG decoder) and zlib-ng (fast checksums)"
	$(PIP) -r requirements-demo.txt
	@echo "==> installing lmdbfolder itself from this folder, editable (changes to src/ apply at once),"
	@echo "    compiling its optional crop-region decoder against the system libjpeg (skipped without it)"
	$(PIP) --no-deps --no-build-isolation -e .
	@$(BIN)/python -c "import lmdbfolder.read._crops" 2>/dev/null || { \
	  echo "note: the crop-region decoder was not built (no C compiler or no libjpeg headers): images are decoded"; \
	  echo "      whole, the same pixels a little slower; to build it: sudo apt-get install libjpeg-dev (or: make system-deps),"; \
	  echo "      then: rm $(VENV)/.demo-installed && make demo"; }
	@touch $@

$(VENV)/.test-installed: requirements-test.txt $(VENV)/.demo-installed
	@echo "==> installing what the tests need on top (requirements-test.txt): pytest, pytest-timeout and"
	@echo "    hypothesis; Ray and torchdata (sharded packs, distributed sampling); OpenCV and PyTurboJPEG"
	@echo "    (the other decoders under test); matplotlib (the bench chart); s3fs, moto and SeaweedFS"
	@echo "    (object storage, against two S3 servers on 127.0.0.1)"
	$(PIP) -r requirements-test.txt
	@if ! ldconfig -p 2>/dev/null | grep -q libturbojpeg; then \
	  echo "note: the system library libturbojpeg is missing, so the turbojpeg decoder's tests will be skipped;"; \
	  echo "      to run them, install it: sudo apt-get install libturbojpeg0 (or: make system-deps)"; \
	fi
	@touch $@

$(VENV)/.dev-installed: requirements-dev.txt $(VENV)/.test-installed
	@echo "==> installing the linters on top (requirements-dev.txt): ruff, mypy"
	$(PIP) -r requirements-dev.txt
	@touch $@

demo: $(VENV)/.demo-installed
	@echo "==> running \`lmdbfolder demo\`: generate 1,000 JPEGs, pack, verify, compare with ImageFolder, bench"
	$(BIN)/lmdbfolder demo

test: $(VENV)/.test-installed
	@echo "==> running the test suite: pytest on tests/ (about 1,650 tests; a line per test file, a dot per test)."
	@echo "    It takes about 11 min on the 2-core development VM, longer while other work runs (the longest test: 1-2 min);"
	@echo "    the longest tests (marked long) say so when they start, and the slowest five are listed at the end"
	$(BIN)/python -m pytest --durations=5

# The long fault-injection soak and other slow tests.
test-all: $(VENV)/.test-installed
	@echo "==> running the test suite with the slow tests (soak, full distributed matrix)"
	$(BIN)/python -m pytest -q --run-slow

lint: $(VENV)/.dev-installed
	@echo "==> ruff (lint and format) and mypy"
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks
	$(BIN)/mypy

bench: $(VENV)/.test-installed
	@echo "==> benchmarks/bench_pack.py: pack throughput against cat"
	$(BIN)/python benchmarks/bench_pack.py

# Opt-in: the system library PyTurboJPEG needs (Debian/Ubuntu), with apt-get, as root or through sudo.
system-deps:
	@echo "==> installing with apt-get: libturbojpeg0 (for the optional turbojpeg decoder) and libjpeg-dev"
	@echo "    (the headers the optional crop-region decoder is compiled against; reinstall lmdbfolder after)"
	@if [ "$$(id -u)" = 0 ]; then apt-get install -y libturbojpeg0 libjpeg-dev || { apt-get update && apt-get install -y libturbojpeg0 libjpeg-dev; }; \
	else sudo apt-get install -y libturbojpeg0 libjpeg-dev; fi

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache src/lmdbfolder/read/_crops*.so src/lmdbfolder/torch/_photometric*.so
