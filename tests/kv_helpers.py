"""A small block-major KV cache and payload headers, shared by the KV transfer tests of every tier."""

from __future__ import annotations

import torch

from splitserve.kvtransfer.header import TransferHeader, payload_checksum
from splitserve.kvtransfer.layout import KVLayout

# 16 blocks, 4 layers, 2 KV heads, blocks of 4 tokens, head size 8.
SHAPE = (16, 4, 2, 2, 4, 8)
LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_size=8, dtype=torch.float32, block_size=4)
FINGERPRINT = "model-a"


def seeded_cache(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed))


def header_for(payload: torch.Tensor, transfer_id: str, position: int, num_tokens: int, num_prompt_tokens: int,
               is_last: bool, first_token_id=None, fingerprint=FINGERPRINT, layout=LAYOUT) -> TransferHeader:
    """The header the sender would put in front of ``payload`` (its checksum computed)."""
    return TransferHeader(transfer_id, fingerprint, layout, position, num_tokens, num_prompt_tokens,
                          payload.numel() * payload.element_size(), payload_checksum(payload), is_last, first_token_id)
