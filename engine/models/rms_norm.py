"""RMSNorm, optionally fused with the residual add: plain torch, or the C++ kernel it is the reference of."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.kernels import cpu_ops


class RMSNorm(nn.Module):
    """RMSNorm, optionally after adding ``x`` into the residual stream (one pass in the C++ kernel)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.use_cpu_kernel = False  # set by LlamaForCausalLM.use_cpu_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [tokens, hidden]. Without ``residual``: returns norm(x). With it: ``residual + x`` becomes the
        new residual (the C++ kernel adds in place) and returns (norm(residual + x), residual + x)."""
        if self.use_cpu_kernel:
            if residual is None:
                return cpu_ops.rms_norm(x, self.weight, self.eps)
            return cpu_ops.add_rms_norm(x, residual, self.weight, self.eps), residual
        if residual is None:
            return self._normalize(x)
        residual = residual + x
        return self._normalize(residual), residual

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        # Computed in float32 whatever the dtype, as transformers does.
        if x.dtype != torch.float32:
            return self.weight * _rms_normalize(x.float(), self.eps).to(x.dtype)
        return self.weight * _rms_normalize(x, self.eps)


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
