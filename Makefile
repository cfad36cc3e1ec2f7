# ckptkit developer tasks.  `make demo` and `make test` build .venv/ on first use.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON      ?= python3
VENV        ?= .venv
# Install this CPU wheel before the project so `torch>=2.4` is already satisfied
# (a bare `torch` requirement would pull a multi-GB CUDA build).
TORCH_SPEC  ?= torch==2.13.0
PIP_FLAGS   ?= -q --disable-pip-version-check --no-input
PYTEST_ARGS ?=

BIN        := $(VENV)/bin
STAMP      := $(VENV)/.installed
LINT_PATHS := $(wildcard ckptkit tests benchmarks)
NOTEBOOKS  := $(wildcard notebooks/*.ipynb)
SAMPLE     := build/sample_ckpt
NB_OUT     := build/notebooks

.PHONY: help venv demo lint format test test-fast bench clean

help:
	@echo "make demo       build .venv, write + inspect a sample checkpoint, run notebooks to $(NB_OUT)/"
	@echo "make test       lint, then pytest tests/ and the notebooks (nbval): the full suite, as CI"
	@echo "make test-fast  lint, then pytest tests/ without notebooks, rank jobs, browser, slow"
	@echo "make lint       ruff check + ruff format --check"
	@echo "make format     ruff format + ruff check --fix"
	@echo "make bench      run benchmarks/bench_*.py"
	@echo "make venv       (re)build $(VENV) (TORCH_SPEC=$(TORCH_SPEC))"
	@echo "make clean      remove build/, dist/, $(VENV) and caches"

venv: $(STAMP)

# The project is the distribution torch-ckptkit (with every extra the tests use, and the tools:
# the `test` extra of pyproject.toml). A venv made before it had that name holds an editable
# `ckptkit` distribution of the same files: removed first (a no-op in a new venv).
# Installs a kernelspec named python3 inside the venv, so nbconvert/nbval run the
# notebooks (kernelspec python3) with this venv's interpreter.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install $(PIP_FLAGS) --upgrade pip
	$(BIN)/pip install $(PIP_FLAGS) '$(TORCH_SPEC)'
	$(BIN)/pip uninstall $(PIP_FLAGS) --yes ckptkit 2>/dev/null || true
	$(BIN)/pip install $(PIP_FLAGS) -e '.[test]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 --display-name 'Python 3 (ckptkit)'
	@$(BIN)/python -c 'import torch; print("torch", torch.__version__, "cuda:", torch.version.cuda)'
	touch $@

demo: $(STAMP)
	rm -rf $(SAMPLE)
	mkdir -p build
	$(BIN)/python -m ckptkit.examples $(SAMPLE) --world-size 2
	$(BIN)/ckptkit inspect $(SAMPLE)
ifneq ($(NOTEBOOKS),)
	mkdir -p $(NB_OUT)
	CKPTKIT_SAMPLES=$(abspath build/samples) $(BIN)/jupyter nbconvert --to html --execute \
		--ExecutePreprocessor.timeout=600 \
		--ExecutePreprocessor.kernel_name=python3 \
		--output-dir $(NB_OUT) $(NOTEBOOKS)
	@echo
	@echo "Sample checkpoint: $(abspath $(SAMPLE))"
	@echo "Executed notebooks (HTML) in $(abspath $(NB_OUT))/:"
	@for f in $(NB_OUT)/*.html; do echo "  $$PWD/$$f"; done
else
	@echo
	@echo "Sample checkpoint: $(abspath $(SAMPLE))"
	@echo "(no notebooks/*.ipynb to execute)"
endif

lint: $(STAMP)
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/ruff format --check $(LINT_PATHS)

format: $(STAMP)
	$(BIN)/ruff format $(LINT_PATHS)
	$(BIN)/ruff check --fix $(LINT_PATHS)

# One pytest run: tests/ as usual, plus every notebook via nbval (--nbval-lax: fail
# only on errors, don't compare outputs; --nbval-current-env: use this venv's python).
# Every notebook runs there once on the sample; tests/test_notebooks.py runs them on the other
# kinds of checkpoint. The full suite: CI runs this (.ci/run).
test: lint
	$(BIN)/python -m pytest tests $(if $(NOTEBOOKS),notebooks) \
		--nbval-lax --nbval-current-env --nbval-cell-timeout=600 $(PYTEST_ARGS)

# The fast lane: tests/ without the categories tests/conftest.py marks (CATEGORIES; see
# tests/README.md): no notebook kernels, no rank jobs, no browser, nothing slow. nbval is not
# loaded (it is not needed here, and importing it costs seconds).
FAST_MARKERS ?= not (notebooks or ranks or browser or slow)
test-fast: lint
	$(BIN)/python -m pytest tests -p no:nbval -m '$(FAST_MARKERS)' $(PYTEST_ARGS)

bench: $(STAMP)
	@if [ -f benchmarks/run_all.py ]; then \
		$(BIN)/python benchmarks/run_all.py; \
	else \
		for f in benchmarks/bench_*.py; do \
			[ -e "$$f" ] || { echo "no benchmarks/bench_*.py"; break; }; \
			echo "== $$f"; \
			$(BIN)/python "$$f"; \
		done; \
	fi

clean:
	rm -rf build dist $(VENV) .pytest_cache .ruff_cache .hypothesis *.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find . -name .ipynb_checkpoints -type d -prune -exec rm -rf {} +
