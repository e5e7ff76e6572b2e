"""The chained hash of a full KV block, equal in every process of a cluster.

``hash(block i) = SHA-256(hash(block i-1) || token ids of block i)``, the token
ids as 64-bit integers (``array("q")``), so a prefill worker, a decode worker and
the router (prefix-aware routing) agree on it without sharing state. A request
that runs a LoRA adapter chains its first block from the adapter's own root
(:func:`lora_root_hash`), as vLLM puts the adapter in its block hashes: its KV
differs from the base model's for the same tokens. A request with a cache salt
(vLLM's ``cache_salt``) chains from a root mixed with it (:func:`salted_root_hash`):
only requests with the same salt find its blocks, so a tenant cannot learn from
prefix-cache hits what another one's prompts held. A LongRoPE model's request whose
prompt is longer than the original context chains from a root of its own
(:func:`long_rope_root_hash`): its keys are rotated with the long factors throughout.
"""

from __future__ import annotations

import hashlib
from array import array

from splitserve.common.errors import InvalidRequest

_ROOT_HASH = b"splitserve-kv-v1"
# vLLM recommends 43 characters (256 random bits in base64); anything longer than this is not a salt.
MAX_CACHE_SALT_CHARS = 256


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


def long_rope_root_hash(root: bytes | None) -> bytes:
    """The hash a request rotated with a LongRoPE model's long factors throughout (its prompt longer than the
    original context) chains its first block from: ``root`` (None: the base model's; an adapter's or a salted
    one) mixed with the rotation, since its keys differ from those of the same tokens in a shorter request."""
    return hashlib.sha256((root if root is not None else _ROOT_HASH) + b"/longrope").digest()


def request_root_hash(lora_name: str | None, cache_salt: str | None, long_rope: bool) -> bytes | None:
    """The hash a request's first block chains from, as the engine sets it (``LLMEngine.add_request``): its
    LoRA adapter's root (None: the base model's), mixed with its cache salt, then with LongRoPE's long rotation
    when its prompt is longer than the model's original context. The router's prefix-aware keys chain from it."""
    root = salted_root_hash(lora_root_hash(lora_name) if lora_name else None, cache_salt)
    return long_rope_root_hash(root) if long_rope else root


def check_cache_salt(salt) -> str | None:
    """A request's cache salt as given: None (no salt) or a string of 1 to :data:`MAX_CACHE_SALT_CHARS` characters.

    Raises:
        InvalidRequest: anything else (as vLLM refuses an empty salt).
    """
    if salt is None:
        return None
    if not isinstance(salt, str) or not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidRequest(f"cache_salt must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters (a secret of "
                             "the caller's, such as 32 random bytes in base64).")
    return salt


def salted_root_hash(root: bytes | None, salt: str | None) -> bytes | None:
    """The hash a request with cache salt ``salt`` chains its first block from: ``root`` (None: the base model's;
    a LoRA adapter's) mixed with the salt; ``root`` unchanged without a salt."""
    if salt is None:
        return root
    digest = hashlib.sha256(root if root is not None else _ROOT_HASH)
    digest.update(b"/salt/" + salt.encode("utf-8", "surrogatepass"))
    return digest.digest()

