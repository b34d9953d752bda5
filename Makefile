# All set-up lives here so a fresh clone needs only `make demo` or `make test`.
# torch is installed first, pinned, so pip never pulls a CUDA build from the registry
# (TORCH_SPEC can name another build, see README "Install").
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

$(BIN)/ckpt: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $(BIN)/ckpt

setup: $(BIN)/ckpt

demo: setup
	$(BIN)/python scripts/demo.py

test: setup
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/python scripts/bench_convert.py

clean:
	rm -rf $(VENV) build *.egg-info
