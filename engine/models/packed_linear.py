"""``PackedLinear``: linear layers whose float32 weight oneDNN packed once, at load (x86 CPU builds).

``LlamaForCausalLM.pack_linear_weights`` swaps them in for the projections
after loading; ``engine/models/__init__.py`` decides whether to.
"""

from __future__ import annotations

import torch
from torch import nn


def can_pack_linear_weights(dtype: torch.dtype) -> bool:
    """Whether this torch build reorders float32 linear weights for oneDNN (x86 CPU builds do)."""
    return (dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class PackedLinear(nn.Module):
    """A float32 linear layer whose weight oneDNN reordered once, at load, into its own blocked layout.

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
        # An opaque oneDNN tensor, not a parameter: module-wide .to() / state_dict() do not apply to it.
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = linear.bias
        # The C++ small-batch GEMM and its copy of the weight (see use_kernels); None: oneDNN for every batch.
        self.small_gemm_kernels = None
        self.panels: torch.Tensor | None = None

    def use_kernels(self, kernels) -> None:
        """Run batches of up to ``kernels.SMALL_GEMM_MAX_ROWS`` rows through ``kernels.small_gemm`` when
        ``kernels`` is splitserve's C++ module and it was built with that GEMM (AVX-512, or AVX2 with FMA); otherwise, and for
        ``kernels`` None, oneDNN for every batch. Taking the small GEMM keeps a second copy of the weight,
        in its panel layout (for SmolLM2-135M, 425 MB beside oneDNN's)."""
        if kernels is not None and getattr(kernels, "small_gemm_supported", lambda: False)():
            if self.panels is None:
                self.panels = kernels.pack_panels(self.packed_weight.to_dense())
            self.small_gemm_kernels = kernels
        else:
            self.small_gemm_kernels, self.panels = None, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [rows, in_features] -> [rows, out_features]."""
        kernels = self.small_gemm_kernels
        if kernels is not None and x.shape[0] <= kernels.SMALL_GEMM_MAX_ROWS:
            return kernels.small_gemm(x, self.panels, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
