"""Which package may import which: the layering that keeps the router torch-free and the engine gRPC-free.

    splitserve.common  <-  engine  <-  kvtransfer, prefill_service, decode_service, splitserve.rpc.worker
    splitserve.common  <-  router  (+ splitserve.rpc, the protos; never the engine, never torch)

The static checks read every import statement with ``ast``, those inside
functions included; the runtime check imports the router in a fresh process.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

ENGINE_MUST_NOT_IMPORT = ("grpc", "splitserve.v1", "splitserve.router", "splitserve.rpc",
                          "splitserve.prefill_service", "splitserve.decode_service", "splitserve.kvtransfer")
ROUTER_MUST_NOT_IMPORT = ("torch", "splitserve.engine", "splitserve.kvtransfer")
# The shared package is the bottom layer: no heavy or transport dependency, nothing of the layers above it.
COMMON_MUST_NOT_IMPORT = (*ROUTER_MUST_NOT_IMPORT, "grpc", "google.protobuf", "splitserve.v1", "transformers",
                          "splitserve.router", "splitserve.rpc", "splitserve.prefill_service",
                          "splitserve.decode_service")


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file; ``from a import b`` counts as ``a`` and ``a.b``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def violations(folder: str, forbidden: tuple[str, ...]) -> list[str]:
    """``file:line imports module`` for every import under ``folder`` of a forbidden module or its submodules."""
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/"
    found = {}  # one report per import statement
    for path in files:
        for line, module in imports_of(path):
            if any(module == name or module.startswith(name + ".") for name in forbidden):
                found.setdefault((str(path.relative_to(REPO)), line), module)
    return [f"{path}:{line} imports {module}" for (path, line), module in sorted(found.items())]


def test_the_engine_imports_no_grpc_protos_services_or_transports():
    found = violations("engine", ENGINE_MUST_NOT_IMPORT)
    assert not found, "engine/ must stay usable offline, without gRPC or KV transports:\n" + "\n".join(found)


@pytest.mark.parametrize("folder, forbidden", [("router", ROUTER_MUST_NOT_IMPORT),
                                               ("splitserve/common", COMMON_MUST_NOT_IMPORT)])
def test_the_router_and_the_shared_package_import_no_model_code(folder, forbidden):
    found = violations(folder, forbidden)
    assert not found, f"{folder}/ must not import {', '.join(forbidden)}:\n" + "\n".join(found)


# LMCache is an optional extra: only its connector modules import it (they say how to install it).
LMCACHE_MODULES = ("kvtransfer/lmcache_connector.py", "kvtransfer/lmcache_gpu_connector.py",
                   "kvtransfer/lmcache_redis.py")


def test_only_the_lmcache_connector_imports_lmcache():
    found = [violation for folder in ("splitserve", "engine", "kvtransfer", "router", "prefill_service",
                                      "decode_service", "benchmarks")
             for violation in violations(folder, ("lmcache",))
             if violation.split(":")[0] not in LMCACHE_MODULES]
    assert not found, "only kvtransfer/lmcache_*.py may import lmcache (an optional extra):\n" + "\n".join(found)


# Triton is an optional extra too: only the Triton kernel modules import it (lazily, on first use).
TRITON_MODULES = tuple(f"splitserve/kernels/triton_{name}.py" for name in ("attention", "ops", "aot"))


def test_only_the_triton_kernels_import_triton():
    found = [violation for folder in ("splitserve", "engine", "kvtransfer", "router", "prefill_service",
                                      "decode_service")
             for violation in violations(folder, ("triton",))
             if violation.split(":")[0] not in TRITON_MODULES]
    assert not found, "only splitserve/kernels/triton_*.py may import triton (an optional extra):\n" + "\n".join(found)


def test_the_checks_see_imports_inside_functions(tmp_path):
    module = tmp_path / "module.py"
    module.write_text("import os\n\ndef f():\n    from splitserve.engine.scheduler import Scheduler\n    import grpc\n")
    assert imports_of(module) == [(1, "os"), (4, "splitserve.engine.scheduler"),
                                  (4, "splitserve.engine.scheduler.Scheduler"), (5, "grpc")]


_ROUTER_PROCESS = """
import json, sys
import splitserve.router.server, splitserve.router.servicer
from splitserve.router.frontend import Frontend

frontend = Frontend(sys.argv[1])
assert frontend.tokenizer.encode("The capital of France is")
heavy = [name for name in ("torch", "splitserve.engine", "splitserve.kvtransfer") if name in sys.modules]
print(json.dumps({"heavy_modules": heavy}))
"""


def test_the_router_process_never_imports_torch(model_dir):
    """The router's modules, and a Frontend for the default model, in a fresh process."""
    result = subprocess.run([sys.executable, "-c", _ROUTER_PROCESS, str(model_dir)], capture_output=True, text=True,
                            timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "torch" not in report["heavy_modules"], f"the router imported torch: {report}"
    assert report["heavy_modules"] == [], f"the router imported model code: {report}"


# Top-level names some distributions ship by mistake and nothing imports (cufile-python installs ``tests``).
SHADOWING_ALLOWED = frozenset({"tests"})


def shadowing(folder: Path, provided: dict[str, list[str]]) -> list[str]:
    """``name (distributions)`` for each module or package directly in ``folder`` that takes the import name of a
    module another installed distribution provides (``provided``: importlib.metadata.packages_distributions())."""
    names = {path.stem for path in folder.glob("*.py")}
    names |= {path.parent.name for path in folder.glob("*/__init__.py")}
    return [f"{name} ({', '.join(sorted(set(provided[name])))})" for name in sorted(names - SHADOWING_ALLOWED)
            if set(provided.get(name, ())) - {"splitserve"}]


def test_no_folder_or_benchmark_shadows_an_installed_module():
    """The checkout's root (first on sys.path under pytest and ``python -m``) and benchmarks/ (a script's own
    folder, first on its sys.path) hold no module an installed distribution provides: a top-level kernels/ once
    hid Hugging Face's ``kernels``, which transformers 5.25 imports while it loads a model."""
    provided = importlib.metadata.packages_distributions()
    found = shadowing(REPO, provided) + shadowing(REPO / "benchmarks", provided)
    assert not found, "these names hide installed modules of the same name; rename them:\n" + "\n".join(found)


def test_the_shadowing_check_sees_a_package_and_a_script(tmp_path):
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    (tmp_path / "yaml.py").write_text("")
    (tmp_path / "splitserve_only.py").write_text("")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "__init__.py").write_text("")
    provided = {"kernels": ["kernels"], "yaml": ["PyYAML"], "splitserve_only": ["splitserve"], "tests": ["x"]}
    assert shadowing(tmp_path, provided) == ["kernels (kernels)", "yaml (PyYAML)"]
