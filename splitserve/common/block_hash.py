"""The chained hash of a full KV block, equal in every process of a cluster.

``hash(block i) = SHA-256(hash(block i-1) || token ids of block i)``, the token
ids as 64-bit integers (``array("q")``), so a prefill worker, a decode worker and
the router (prefix-aware routing) agree on it without sharing state. A request
that runs a LoRA adapter chains its first block from the adapter's own root
(:func:`lora_root_hash`), as vLLM puts the adapter in its block hashes: its KV
differs from the base model's for the same tokens.
"""

from __future__ import annotations

import hashlib
from array import array

_ROOT_HASH = b"splitserve-kv-v1"


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """The chained hash of one full block.

    Args:
        parent_hash: the previous block's hash (None for a prompt's first block).
        token_ids: the block's token ids.
    Returns:
        32 bytes.
    """
    digest = hashlib.sha256(parent_hash if parent_hash is not None else _ROOT_HASH)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def lora_root_hash(lora_name: str) -> bytes:
    """The hash a LoRA adapter's requests chain their first block from (``parent_hash`` of
    :func:`hash_block_tokens`): by the adapter's name, which every worker of a cluster serves it under."""
    return hashlib.sha256(_ROOT_HASH + b"/lora/" + lora_name.encode()).digest()
