"""Keep glibc's malloc from returning a step's large buffers to the OS, only to fault them in again next step.

A CPU forward pass allocates and frees activations of several MB each (a 2,048-token step's gate/up
output is 25 MB). glibc serves blocks that large with ``mmap`` until its adaptive threshold has risen
past them, and gives freed memory at the top of its heap back to the OS beyond a trim threshold; each
such buffer is then zero-filled page by page on first touch, every step (about 250-480 thousand page
faults per run of benchmarks/offline_throughput.py's workload, and 0.9-2 million in a process's first
run, measured on 2 cores). Fixing the mmap threshold at glibc's maximum and the trim threshold well
above a step's activations keeps them in the heap, reused; the process keeps its peak heap as a
tcmalloc-linked server does. vLLM's CPU guide asks for tcmalloc through ``LD_PRELOAD`` for the same
reason; this needs no preload.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h) and the values set.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's largest on 64-bit: bigger blocks are always mapped
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024


@functools.cache
def keep_freed_buffers_in_heap() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once). Returns whether both took effect;
    False where the C library is not glibc (musl, macOS), which is left as it is."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                    TRIM_THRESHOLD_BYTES))
    if not applied:
        logger.info("glibc's malloc thresholds could not be set; large buffers may be mapped anew each step.")
    return applied


def glibc_tunables() -> str:
    """The same settings as a ``GLIBC_TUNABLES`` value, for a process started beside the engine (a
    benchmark's peer) to run with what the engine sets in-process."""
    return f"glibc.malloc.mmap_threshold={MMAP_THRESHOLD_BYTES}:glibc.malloc.trim_threshold={TRIM_THRESHOLD_BYTES}"
