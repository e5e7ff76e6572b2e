"""The C++ CPU kernels of another revision, or of a folder of edited sources, for a benchmark that times them
beside this tree's kernels in one process (``cpu_attention.py --baseline``).

Two builds timed in one process, alternating, see the same machine at the same moment. On the shared 2-core
hosts, separate processes of the same kernel read anything from 15 to 48 GB/s from one minute to the next,
while in one process a 10% difference showed in every case and every run.
"""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

from splitserve.common.model_info import cache_dir
from splitserve.kernels import cpu_ops

ROOT = Path(__file__).resolve().parent.parent
# Where a revision keeps the C++ sources: splitserve/kernels/ since 2026-12-03, kernels/ at the top before (a top-level
# kernels package shadowed Hugging Face's, which transformers 5.25 imports).
KERNEL_FOLDERS = ("splitserve/kernels/", "kernels/")


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, timeout=60)


def baseline_sources(spec: str) -> tuple[str, dict[str, bytes]]:
    """(a label, the kernel sources by name) of ``spec``: a folder of ``*.cpp`` and ``*.h`` files, or a git
    revision of this repository (its ``splitserve/kernels/`` folder, or ``kernels/`` before the move). Raises
    ValueError when it is neither, or holds no kernel sources."""
    folder = Path(spec).expanduser()
    if folder.is_dir():
        files, label = cpu_ops.source_files(folder), f"the sources in {folder}"
    else:
        found = _git("rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}")
        if found.returncode != 0:
            raise ValueError(f"{spec[:80]!r} is neither a folder nor a git revision of this repository")
        commit = found.stdout.decode().strip()
        listing = next((found for place in KERNEL_FOLDERS
                        if (found := _git("ls-tree", "--name-only", commit, place).stdout.decode().split())), [])
        files = {}
        for path in listing:
            if path.endswith((".cpp", ".h")):
                shown = _git("show", f"{commit}:{path}")
                if shown.returncode != 0:
                    raise ValueError(f"git could not read {path} at {commit[:10]}")
                files[Path(path).name] = shown.stdout
        label = f"{spec[:80]} ({commit[:10]})"
    if not files:
        raise ValueError(f"{label} holds no kernel sources (*.cpp, *.h)")
    return label, files


def load_baseline(spec: str, cache_folder: str) -> tuple[str, object]:
    """(a label, the built module) of ``spec`` (see :func:`baseline_sources`), built with this tree's flags;
    the loaded kernels themselves where the sources are this tree's. Raises ValueError or RuntimeError with a
    sentence."""
    label, files = baseline_sources(spec)
    if files == cpu_ops.source_files():
        label += ": the same sources as this tree (one build, timed twice)"
    return label, cpu_ops.load_other(files, cache_folder)


def baseline_of_arguments(parser: argparse.ArgumentParser, spec: str | None) -> tuple[str, object | None]:
    """A benchmark's ``--baseline``: (a label, the module), ("", None) without one. A spec that is neither a folder
    nor a revision ends the run with the parser's usage error (exit 2), sources that do not build with exit 1."""
    if spec is None:
        return "", None
    try:
        return load_baseline(spec, str(cache_dir()))
    except ValueError as error:
        parser.error(f"--baseline: {error}")
    except RuntimeError as error:
        parser.exit(1, f"--baseline: {error}\n")
