"""Loads the C++ paged decode attention kernel (``cpu_paged_attention.cpp``).

The source is compiled on first use with the machine's C++ compiler into the
cache folder the caller names (the engine passes splitserve's cache folder),
once per torch version and source change; later processes load the built library in milliseconds. When no
compiler is available the engine keeps the plain-torch path.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")


@functools.lru_cache(maxsize=None)
def load(cache_folder: str):
    """The compiled extension, built under ``cache_folder``/kernels, or None when it cannot be built here."""
    from torch.utils.cpp_extension import load as load_extension

    build_dir = Path(cache_folder) / "kernels" / f"torch-{torch.__version__}"
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        return load_extension(
            name="splitserve_cpu_paged_attention",
            sources=[str(_SOURCE)],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )
    except Exception as error:  # no compiler, no headers: the torch path still works
        logger.warning("C++ paged attention kernel unavailable (%s); using the torch implementation.", error)
        return None


def available(cache_folder: str) -> bool:
    """Whether the kernel is built (building it now if needed) under ``cache_folder``."""
    global _module
    _module = load(str(cache_folder))
    return _module is not None


_module = None


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """query: [requests, q_heads, head_dim]; caches: [kv_heads, num_blocks, block_size, head_dim];
    block_tables: [requests, max_blocks] int64; seq_lens: [requests] int64.

    Returns: [requests, q_heads, head_dim]. float32 only. Call :func:`available` first.
    """
    return _module.paged_decode_attention(query.contiguous(), key_cache, value_cache, block_tables, seq_lens, scale)
