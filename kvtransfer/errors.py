"""The errors of KV transfer."""


class KVTransferError(Exception):
    """A transfer failed: unreachable peer, broken connection, or a refused payload."""


class KVVerificationError(KVTransferError):
    """A payload that does not fit this worker (version, fingerprint, layout, size or checksum)."""
