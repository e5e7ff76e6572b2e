"""Fault injection in the prefill worker's KV sender, for the fault-injection tests only.

``SPLITSERVE_INJECT_KV_FAULTS`` (read once when the worker starts, into its
``WorkerConfig.kv_faults``) turns it on, e.g. ``corrupt=0.5,foreign=0,fail=0.2,seed=7``.
Before each payload goes to the transport, one draw per fault kind decides
what happens to it (the first kind drawn wins, in this order):

- ``fail``: nothing is sent and the send raises ``KVTransferError``, as a
  broken connection would;
- ``foreign``: the header names another model's fingerprint;
- ``corrupt``: the payload's first block is sent on its own with the checksum
  of its true bytes and one byte flipped after that checksum was taken, then
  the rest as usual.

The receiving side is not touched: it must refuse what it is sent (checksum and
fingerprint checks in ``kvtransfer/header.py``), and the request must still end
right. Never turn this on in production; the worker logs a WARNING when it is on.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import random
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

KV_FAULTS_ENV = "SPLITSERVE_INJECT_KV_FAULTS"

# The spec's keys -> KVFaults' probability fields.
_PROBABILITY_KEYS = {"corrupt": "corrupt_probability", "foreign": "foreign_probability", "fail": "fail_probability"}


class KVFault(enum.Enum):
    """What is done to one payload."""

    FAIL_SEND = "fail"
    FOREIGN_MODEL = "foreign"
    CORRUPT_PAYLOAD = "corrupt"


@dataclass(frozen=True)
class KVFaults:
    """How often each fault hits a payload (probabilities in [0, 1]), and the seed of the draws.

    Attributes:
        corrupt_probability: a payload arrives with a byte flipped after its checksum was computed.
        foreign_probability: a payload's header names another model's fingerprint.
        fail_probability: a send fails with ``KVTransferError`` before any byte of it leaves.
        seed: seed of the draws (the sequence of faults is reproducible for one order of sends).
    """

    corrupt_probability: float = 0.0
    foreign_probability: float = 0.0
    fail_probability: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in _PROBABILITY_KEYS.values():
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}.")

    @classmethod
    def parse(cls, spec: str) -> KVFaults:
        """Parse ``corrupt=P,foreign=P,fail=P,seed=N`` (every key optional, in any order).

        Raises:
            ValueError: a key that is not one of these, or a value that is not a number in range.
        """
        values: dict[str, float | int] = {}
        for item in spec.split(","):
            item = item.strip()
            if not item:
                continue
            key, separator, value = item.partition("=")
            key = key.strip()
            if not separator or key not in (*_PROBABILITY_KEYS, "seed"):
                raise ValueError(f"{KV_FAULTS_ENV}: {item[:40]!r} is not one of corrupt=P, foreign=P, fail=P, seed=N.")
            try:
                values[_PROBABILITY_KEYS.get(key, key)] = int(value) if key == "seed" else float(value)
            except ValueError:
                raise ValueError(f"{KV_FAULTS_ENV}: the value of {key} is not a number.") from None
        return cls(**values)

    @classmethod
    def from_environment(cls, environ) -> KVFaults | None:
        """The faults ``environ`` asks for (``KV_FAULTS_ENV``), or None when it asks for none."""
        spec = environ.get(KV_FAULTS_ENV, "").strip()
        if not spec:
            return None
        faults = cls.parse(spec)
        return faults if faults.enabled else None

    @property
    def enabled(self) -> bool:
        return any(getattr(self, name) > 0 for name in _PROBABILITY_KEYS.values())

    def describe(self) -> str:
        return (f"corrupt={self.corrupt_probability:g}, foreign={self.foreign_probability:g}, "
                f"fail={self.fail_probability:g}, seed={self.seed}")


class KVFaultInjector:
    """Draws the fault of each payload a prefill worker sends (thread-safe; one per worker)."""

    def __init__(self, faults: KVFaults) -> None:
        self.faults = faults
        self._random = random.Random(faults.seed)
        self._lock = threading.Lock()
        self.num_injected = {fault: 0 for fault in KVFault}

    def draw(self) -> KVFault | None:
        """The fault for the next payload, or None to send it untouched."""
        probabilities = ((KVFault.FAIL_SEND, self.faults.fail_probability),
                         (KVFault.FOREIGN_MODEL, self.faults.foreign_probability),
                         (KVFault.CORRUPT_PAYLOAD, self.faults.corrupt_probability))
        with self._lock:
            for fault, probability in probabilities:
                if probability > 0 and self._random.random() < probability:
                    self.num_injected[fault] += 1
                    return fault
        return None


def foreign_fingerprint(model_fingerprint: str) -> str:
    """A fingerprint no worker of this model has."""
    return f"injected-foreign-model-{model_fingerprint}"[:128]


def send_corrupted(transport, destination, header, payload) -> None:
    """Send ``payload`` (a ``BlockSource``) as ``header`` says, its first block corrupted.

    The first block goes alone, gathered into a host copy (the cache is not touched), with the XXH3-64 of its true
    bytes in its header and then its first byte flipped; the rest of the blocks, if any, follow as one payload.
    """
    from splitserve.kvtransfer.blocks import BlockSource, checksum, gather_blocks, payload_bytes

    block_size = header.layout.block_size
    first = gather_blocks(payload.kv_cache, payload.block_ids[:1])  # [1, layers, 2, kv_heads, block_size, head]
    first = first.cpu()  # from a CUDA cache too: its checksum is taken, and its byte flipped, on the host
    data = payload_bytes(first)
    true_checksum = checksum(data)
    data[0] ^= 0xFF  # after the checksum: the receiver's check must catch it
    only_block = payload.num_blocks == 1
    first_header = dataclasses.replace(
        header, num_tokens=min(block_size, header.num_tokens), payload_num_bytes=len(data), checksum=true_checksum,
        is_last=header.is_last and only_block, first_token_id=header.first_token_id if only_block else None,
    )
    transport.send(destination, first_header, first)
    if only_block:
        return
    rest = BlockSource(payload.kv_cache, payload.block_ids[1:])
    rest_header = dataclasses.replace(
        header, first_token_position=header.first_token_position + block_size,
        num_tokens=header.num_tokens - block_size, payload_num_bytes=rest.num_bytes, checksum=None,
    )
    transport.send(destination, rest_header, rest)
