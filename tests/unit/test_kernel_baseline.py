"""benchmarks/kernel_baseline.py and cpu_ops.load_other: what they refuse before building anything."""

from __future__ import annotations

import pytest

from benchmarks.kernel_baseline import baseline_sources
from splitserve.kernels import cpu_ops


def test_a_revisions_kernel_sources_are_read_from_git():
    label, files = baseline_sources("HEAD")
    assert label.startswith("HEAD (") and set(cpu_ops._SOURCES) <= set(files)
    assert all(name.endswith((".cpp", ".h")) for name in files)


def test_a_revision_from_before_the_kernels_moved_into_splitserve_is_read_from_kernels():
    """7b3cc41 kept the sources in a top-level kernels/ (they moved into splitserve/kernels/ after it)."""
    label, files = baseline_sources("7b3cc41")
    assert label.startswith("7b3cc41 (") and set(cpu_ops._SOURCES) <= set(files)


def test_a_folder_without_kernel_sources_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("no sources here")
    with pytest.raises(ValueError, match="holds no kernel sources"):
        baseline_sources(str(tmp_path))


def test_sources_missing_a_file_the_extension_is_built_from_are_refused(tmp_path):
    files = cpu_ops.source_files()
    del files["cpu_small_gemm.cpp"]
    with pytest.raises(ValueError, match="lack cpu_small_gemm.cpp"):
        cpu_ops.load_other(files, str(tmp_path))
    assert not (tmp_path / "kernels-other").exists()


@pytest.mark.parametrize("name", ["../escape.cpp", "sub/dir.h", "notes.txt"])
def test_source_names_that_are_not_plain_cpp_or_h_files_are_refused(tmp_path, name):
    files = {**cpu_ops.source_files(), name: b"// other\n"}
    with pytest.raises(ValueError, match="plain file names"):
        cpu_ops.load_other(files, str(tmp_path))
    assert not (tmp_path / "kernels-other").exists()
