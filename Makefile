# Two entry points for a fresh machine: `make demo` and `make test`.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.ortfx-installed

.PHONY: demo hf-demo convergence-demo test lint typecheck pytest bench clean

$(STAMP): pyproject.toml setup.py ortfx/_bridge.cpp
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "need $(PYTHON) (set PYTHON=...)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned, so nothing later can pull a CUDA build on a CPU machine.
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	# torchvision's CUDA-built extension does not load beside the CPU torch: tests/vision_libraries.py
	$(PY) tests/install_torchvision_hook.py
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m ortfx.demo

# A Hugging Face Llama (tiny config) training and generating through ortfx (docs/huggingface.md).
hf-demo: $(STAMP)
	$(PY) -m ortfx.hf_demo

# The convergence workflow (docs/convergence.md) on the demo model, with a planted divergence.
convergence-demo: $(STAMP)
	$(PY) -m ortfx.hooks.demo --overwrite

lint: $(STAMP)
	$(PY) -m ruff check ortfx tests property_tests bench conftest.py
	$(PY) -m ruff format --check ortfx tests property_tests bench conftest.py

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider tests property_tests

test: lint typecheck pytest

bench: $(STAMP)
	$(PY) -m bench.compare

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
