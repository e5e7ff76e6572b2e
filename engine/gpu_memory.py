"""How large a KV cache an engine on a GPU allocates: what ``gpu_memory_utilization`` leaves (vLLM's rule).

An engine may take ``utilization`` of the GPU's memory in all. Its weights (everything its torch allocator
holds once the model is loaded) and the activations of its largest step come first; the KV cache gets the rest.
The weights are what loading the model added to the process's allocator (an earlier engine in the same
process is not counted as this one's). The activations are measured, not guessed: at start the model runner runs one step of
``max_num_batched_tokens`` prompt tokens and samples ``max_num_seqs`` rows through the sampler's most
expensive path (``ModelRunner.profile_step``), and the torch allocator's peak above what it held before is
the step's share. Every figure is the process's own (the allocator's counters), so engines starting side
by side on one GPU (``splitserve up`` gives each its share of ``gpu_memory_utilization``) do not count each
other's memory; the GPU's free memory is read only to refuse a cache that would not fit beside the others.

What the counters miss (the CUDA context, cuBLAS workspaces, NCCL buffers, captured CUDA graphs) lives in
the share left over, 10% at the default 0.9, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_GIB = 1024**3


def gpu_kv_cache_bytes(total: int, free: int, utilization: float, weight_bytes: int, activation_bytes: int) -> int:
    """The KV cache's bytes for an engine on a GPU of ``total`` bytes, ``free`` of them free now.

    Args:
        utilization: the share of ``total`` the engine may take in all, in (0, 1].
        weight_bytes: what the engine holds before its cache (its weights).
        activation_bytes: the peak its largest step allocates on top.

    Raises:
        ValueError: nothing left for a cache, or the cache would not fit in what other processes leave free
            (a sentence with the figures and what to change).
    """
    allowed = int(total * utilization)
    budget = allowed - weight_bytes - activation_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={utilization:g} gives this engine {allowed / _GIB:.2f} GiB of the GPU's "
            f"{total / _GIB:.2f} GiB, and its weights ({weight_bytes / _GIB:.2f} GiB) and its largest step's "
            f"activations ({activation_bytes / _GIB:.2f} GiB) leave nothing for the KV cache: raise "
            "gpu_memory_utilization, or lower max_num_batched_tokens."
        )
    if budget + activation_bytes > free:
        raise ValueError(
            f"The KV cache would take {budget / _GIB:.2f} GiB (gpu_memory_utilization={utilization:g} of "
            f"{total / _GIB:.2f} GiB, less weights and activations), but only {free / _GIB:.2f} GiB of the GPU is "
            f"free, {activation_bytes / _GIB:.2f} GiB of which the steps need: other processes (or other engines in "
            "this one) use the rest. "
            "Lower gpu_memory_utilization, or give the cache a size (kv_cache_memory_bytes, --kv-cache-gb)."
        )
    return budget


def measure_step_bytes(run_step: Callable[[], int]) -> int:
    """The CUDA memory one step allocates at its peak on top of what the process held before it, less the
    ``run_step()``'s own scratch KV cache (its return value, in bytes). Frees the allocator's cached blocks
    before and after, so that ``torch.cuda.mem_get_info`` shows what the process really holds."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    scratch_bytes = run_step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before - scratch_bytes
    torch.cuda.empty_cache()
    return max(0, peak)
