"""RMSNorm, optionally fused with the residual add: plain torch, or the C++ or Triton kernel it is the reference
of."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm, optionally after adding ``x`` into the residual stream (one pass in a kernel)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.kernels = None  # cpu_ops or triton_ops: set by LlamaForCausalLM.use_kernels

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [tokens, hidden]. Without ``residual``: returns norm(x). With it: ``residual + x`` becomes the
        new residual (a kernel adds in place) and returns (norm(residual + x), residual + x)."""
        if self.kernels is not None:
            if residual is None:
                return self.kernels.rms_norm(x, self.weight, self.eps)
            return self.kernels.add_rms_norm(x, residual, self.weight, self.eps), residual
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
