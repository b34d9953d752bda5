# All set-up lives here so a fresh clone needs only `make demo` or `make test`.
# torch is installed first, pinned, so pip never pulls a CUDA build from the registry
# (TORCH_SPEC can name another build, see README "Install").
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
# The LitGPT oracle tests need litgpt, whose huggingface-hub pin conflicts with the main test stack:
# they run in a venv of their own.
LIT_VENV ?= .venv-litgpt
LIT_BIN := $(LIT_VENV)/bin
# The serving formats' oracles (llm-compressor, mlx, mlx-lm) pin an older transformers: tests/serve has its own venv.
SERVE_VENV ?= .venv-serve
SERVE_BIN := $(SERVE_VENV)/bin
DEMO_ARGS ?=

.PHONY: setup setup-runtime setup-litgpt setup-serve demo test bench clean

# The runtime alone (what `pip install .` pulls) plus safetensors, the demo's independent reader: a minute or two.
$(VENV)/.runtime: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[demo]"
	touch $@

# Everything the tests compare against (several GB, llama-cpp-python compiled from its sdist: many minutes).
$(VENV)/.test: $(VENV)/.runtime
	$(BIN)/pip install -q -e ".[test]"
	# Oracles installed without their declared dependencies, which would pull another torch (auto-gptq, hqq) or
	# triton (autoawq) and which the tests do not need: GPTQ/AWQ packers and CPU dequantizers (imported by file)
	$(BIN)/pip install -q --no-deps "auto-gptq==0.7.1" "autoawq==0.2.9"
	# HQQ's quantizer (an sdist whose CUDA extension is skipped with DISABLE_CUDA=1) and ModelOpt's NVFP4 code
	DISABLE_CUDA=1 $(BIN)/pip install -q --no-deps "hqq==0.2.8.post1" "nvidia-modelopt==0.47.0"
	touch $@

setup-runtime: $(VENV)/.runtime
setup: $(VENV)/.test

$(LIT_BIN)/litgpt: pyproject.toml
	$(PY) -m venv $(LIT_VENV)
	$(LIT_BIN)/pip install -q "$(TORCH_SPEC)"
	$(LIT_BIN)/pip install -q -e ".[litgpt-test]"
	touch $(LIT_BIN)/litgpt

setup-litgpt: $(LIT_BIN)/litgpt

$(SERVE_VENV)/.serve: pyproject.toml
	$(PY) -m venv $(SERVE_VENV)
	$(SERVE_BIN)/pip install -q "$(TORCH_SPEC)"
	$(SERVE_BIN)/pip install -q -e ".[serve-test]"
	touch $@

setup-serve: $(SERVE_VENV)/.serve

# `make demo DEMO_ARGS="--keep DIR"` keeps the demo's files in DIR.
demo: setup-runtime
	$(BIN)/python scripts/demo.py $(DEMO_ARGS)

test: setup setup-litgpt setup-serve
	$(BIN)/python -m pytest --ignore=tests/litgpt --ignore=tests/serve
	$(LIT_BIN)/python -m pytest tests/litgpt
	$(SERVE_BIN)/python -m pytest tests/serve

bench: setup
	$(BIN)/python scripts/bench_convert.py

clean:
	rm -rf $(VENV) $(LIT_VENV) $(SERVE_VENV) build *.egg-info
