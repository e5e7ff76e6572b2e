"""``PackedLinear``: linear layers whose weight oneDNN packed once, at load (x86 CPU builds; float32 or bfloat16).

``LlamaForCausalLM.pack_linear_weights`` swaps them in for the projections
after loading; ``engine/models/__init__.py`` decides whether to.
"""

from __future__ import annotations

import functools

import torch
from torch import nn


def can_pack_linear_weights(dtype: torch.dtype) -> bool:
    """Whether this torch build reorders linear weights of ``dtype`` for oneDNN (x86 CPU builds do, in float32
    and bfloat16).

    In bfloat16 oneDNN multiplies with the CPU's bfloat16 dot-product instructions where it has them
    (AVX512-BF16 or AMX) and accumulates in float32. 2-core AMD EPYC (Zen 4, AVX512-BF16), medians of 15:
    packed bfloat16 ran 340-410 GFLOP/s from 64 to 2,048 rows on the SmolLM2 projections, against 180-207
    for packed float32 and 256-383 for bfloat16 through ``F.linear``.
    """
    if not (dtype in (torch.float32, torch.bfloat16) and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype != torch.bfloat16 or _reorders_bfloat16()


@functools.cache
def _reorders_bfloat16() -> bool:
    """Whether oneDNN reorders bfloat16 weights on this CPU: it needs AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT,
    and refuses elsewhere (a Zen 3 has only AVX2), where bfloat16 projections stay in ``F.linear``. Tried once
    on a small weight, as the refusal is what says so."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), None)
    except RuntimeError:
        return False
    return True


class PackedLinear(nn.Module):
    """A linear layer whose weight oneDNN reordered once, at load, into its own blocked layout.

    On CPUs oneDNN's GEMM with a packed weight runs decode-sized batches (a few to a
    hundred rows) 1.3-2x faster than ``F.linear`` through MKL and large prompt chunks
    about as fast (``benchmarks/offline_throughput.py``); vLLM's CPU backend makes the
    same choice. Results differ from ``F.linear`` by float32 rounding only. The dense
    weight is dropped: the packed copy replaces it. With splitserve's C++ kernels,
    decode-sized batches go to their own GEMM instead (:meth:`use_kernels`).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dtype = linear.weight.dtype
        # An opaque oneDNN tensor, not a parameter: module-wide .to() / state_dict() do not apply to it.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias
        # The C++ small-batch GEMM (the module, the function's name in it, the most rows it takes) and its copy
        # of the weight (see use_kernels); None: oneDNN for every batch.
        self.small_gemm_kernels = None
        self.small_gemm_name, self.small_rows = "", 0
        self.panels: torch.Tensor | None = None

    def use_kernels(self, kernels) -> None:
        """Run small batches through splitserve's C++ small-batch GEMM when ``kernels`` is its C++ module
        and it was built with the GEMM for this weight's dtype: float32 batches of up to
        ``kernels.small_gemm_max_rows()`` rows in ``small_gemm`` (AVX-512, or AVX2 with FMA), bfloat16 ones of
        up to ``kernels.SMALL_GEMM_BFLOAT16_MAX_ROWS`` in ``small_gemm_bfloat16`` (AVX512-BF16); otherwise,
        and for ``kernels`` None, oneDNN for every batch. Taking a small GEMM keeps a second copy of the
        weight in its panel layout (for SmolLM2-135M, 425 MB beside oneDNN's in float32, 212 MB in
        bfloat16)."""
        self.small_gemm_kernels, self.panels = None, None
        if kernels is None:
            return
        if self.dtype == torch.float32 and getattr(kernels, "small_gemm_supported", lambda: False)():
            self.panels = kernels.pack_panels(self.packed_weight.to_dense())
            self.small_gemm_name, self.small_rows = "small_gemm", kernels.small_gemm_max_rows()
        elif (self.dtype == torch.bfloat16 and self.in_features % 2 == 0
                and getattr(kernels, "small_gemm_bfloat16_supported", lambda: False)()):
            self.panels = kernels.pack_panels_bfloat16(self.packed_weight.to_dense())
            self.small_gemm_name, self.small_rows = "small_gemm_bfloat16", kernels.SMALL_GEMM_BFLOAT16_MAX_ROWS
        else:
            return
        self.small_gemm_kernels = kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] -> [rows, out_features]."""
        if self.small_gemm_kernels is not None and x.shape[0] <= self.small_rows:
            return getattr(self.small_gemm_kernels, self.small_gemm_name)(x, self.panels, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
