"""KV transfer between prefill and decode workers: the contract and its connectors.

The contract: ``layout`` (``KVLayout``), ``header`` (``TransferHeader``, checksums, verification),
``blocks`` (gathering and scattering cache blocks), ``connector`` (the ``KVConnector`` interface),
``errors``. The connectors: ``p2p`` (with ``p2p_pairs``, ``p2p_wire``, ``p2p_receiver``, and its
authenticated rendezvous: ``rendezvous_protocol``, ``rendezvous_server``, ``rendezvous_client``) and
``redis_connector`` (with ``redis_access``: its user, password and TLS).
"""

from __future__ import annotations


def create_connector(name: str, worker_id: str, model_fingerprint: str, layout, **options):
    """A connector by its ``--kv-transfer`` name: "p2p" or "redis"."""
    if name == "p2p":
        from splitserve.kvtransfer.p2p import P2PConnector

        return P2PConnector(worker_id, model_fingerprint, layout, **options)
    if name == "redis":
        from splitserve.kvtransfer.redis_connector import RedisConnector

        return RedisConnector(worker_id, model_fingerprint, layout, **options)
    raise ValueError(f"Unknown KV connector {name!r}; choose p2p or redis.")
