"""Generates the gRPC stubs of ``protos/`` as part of every build.

Everything else about the package lives in ``pyproject.toml``. This file only
adds a ``build_protos`` step that runs, for both ``pip install .`` and
``pip install -e .``, the same command as ``make protos``::

    python -m grpc_tools.protoc -I protos --python_out=protos \
        --grpc_python_out=protos --pyi_out=protos protos/splitserve/v1/*.proto

The stubs are written next to the .proto files (``protos/splitserve/v1/``), so
an editable install imports them from the source tree and a wheel copies them
like any other module of ``splitserve.v1``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build
from setuptools.command.build_py import build_py

PROJECT_DIR = Path(__file__).resolve().parent
PROTO_ROOT = "protos"
PROTO_GLOB = "splitserve/v1/*.proto"


class build_protos(Command):
    """Compile protos/splitserve/v1/*.proto into Python stubs beside them."""

    description = "generate the Python gRPC stubs from protos/"
    user_options: list = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        proto_root = PROJECT_DIR / PROTO_ROOT
        proto_files = sorted(
            str(path.relative_to(PROJECT_DIR)) for path in proto_root.glob(PROTO_GLOB)
        )
        if not proto_files:
            raise RuntimeError(f"no .proto files match {proto_root / PROTO_GLOB}")
        command = [
            sys.executable, "-m", "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={PROTO_ROOT}",
            f"--grpc_python_out={PROTO_ROOT}",
            f"--pyi_out={PROTO_ROOT}",
            *proto_files,
        ]
        self.announce("generating gRPC stubs: " + " ".join(command), level=2)
        subprocess.run(command, check=True, cwd=PROJECT_DIR)
        # build_py lists package data lazily and may have done so before the
        # .pyi stubs existed: make it look again.
        self.get_finalized_command("build_py").__dict__.pop("data_files", None)


class build_py_with_protos(build_py):
    """build_py that makes sure the stubs exist before it copies modules."""

    def run(self) -> None:
        self.run_command("build_protos")
        super().run()


class build_with_protos(build):
    """build whose first step generates the stubs (the editable build runs
    these sub-commands too, with errors propagated, unlike a custom build_py)."""

    sub_commands = [("build_protos", None), *build.sub_commands]


setup(
    cmdclass={
        "build": build_with_protos,
        "build_protos": build_protos,
        "build_py": build_py_with_protos,
    }
)
