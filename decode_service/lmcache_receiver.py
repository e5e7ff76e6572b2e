"""The decode worker's LMCache receiver: the engine's KV connector on the loading side with ``--kv-transfer
lmcache``.

The prefill worker stores the whole prompt's KV in LMCache (Redis); nothing is sent to this worker. The
servicer announces each request whose prompt KV will be there (:meth:`LMCacheReceiver.expect`, with the
prompt's token ids and its KV timeout). The engine reserves the request's blocks and calls
:meth:`LMCacheReceiver.start_load` for the whole prompt; the worker's one poller thread waits until LMCache's
``lookup`` covers the prompt (its store returns before Redis has the data, and there is no flush to wait on),
retrieves the KV of the positions this worker does not cache into the reserved blocks, and reports the load
finished with no first token: the engine recomputes the last prompt token for its logits. A prompt LMCache does
not hold in full before the request's KV timeout, or a retrieve that comes back short (Redis down, keys
expired), is reported failed with a sentence, and the engine applies ``--kv-load-failure``. How loads are
watched and when blocks may be written: :mod:`splitserve.kvtransfer.lmcache_loads`.
"""

from __future__ import annotations

from splitserve.kvtransfer.lmcache_loads import LMCacheLoader


class LMCacheReceiver(LMCacheLoader):
    """Loads the prompts' KV of one decode worker's requests from LMCache into the blocks the engine reserved.

    Args:
        store: the worker's ``LMCacheKVStore`` (``splitserve.kvtransfer.lmcache_connector``); closed by the
            worker, not here.
        counters: the worker's Counters (``num_kv_transfers_received`` and ``num_kv_bytes`` per load).
    """
