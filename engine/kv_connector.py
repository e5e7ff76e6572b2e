"""Where KV enters and leaves an engine: the engine-level KV connector interface.

A prefill worker's engine *saves* a prompt's KV (hands the blocks each step
completed to a connector, which moves them somewhere); a decode worker's
engine *loads* it (reserves the prompt's blocks, and a connector writes the
KV into them from outside). The engine calls the connector at the points it
owns and never learns how the bytes travel; the connector never reaches into
the engine: it sees block ids, token ranges and the KV cache tensor it was
given, and reports back through :meth:`KVConnectorBase.get_finished`. The
shape follows vLLM's ``KVConnectorBase_V1``, with a scheduler side and a
worker side, in one object here because one engine runs in one process.

Scheduler side (called on the engine thread while it plans requests):

- :meth:`~KVConnectorBase.get_num_matched_tokens`: how many leading prompt
  tokens an external source already holds for a request the engine would
  otherwise compute (a saving request too). The engine reserves blocks for
  them and loads them first (the request waits in ``WAITING_FOR_REMOTE_KVS``
  meanwhile), then computes the rest; a saving request then saves the whole
  prompt from its first block, loaded prefix included.
- :meth:`~KVConnectorBase.request_finished`: a request with a transfer
  ended (finished, aborted, failed); the connector stops writing into or
  reading from its blocks, and says whether a read is still in flight, in
  which case the engine keeps the blocks until the connector reports it done.

Worker side:

- :meth:`~KVConnectorBase.register_kv_cache`: the cache tensor, once.
- :meth:`~KVConnectorBase.start_load`: a request's blocks are reserved;
  write its prompt's KV into them (asynchronously).
- :meth:`~KVConnectorBase.save`: the blocks one step completed, in order;
  the last save of a request carries its first sampled token.
- :meth:`~KVConnectorBase.get_finished`: loads and saves finished or failed
  since the last call. The connector calls the ``wakeup`` it was given
  (:meth:`~KVConnectorBase.set_wakeup`) when it has something to report, so
  an idle engine loop polls at once instead of sleeping.

What the engine does with the reports: a finished load moves the request to
the waiting queue (with the first token when the KV carried one, else the
last prompt token is recomputed for its logits); a failed load applies the
request's :class:`KVLoadFailurePolicy` (recompute the prompt here, or fail
the request with the reason); a finished or failed save frees the blocks the
finished request kept.

How the next connectors use it:

- **LMCache** (prefix reuse across the cluster,
  ``prefill_service/lmcache_sender.py`` and ``decode_service/lmcache_receiver.py``):
  on a prefill worker, ``get_num_matched_tokens`` returns the prefix LMCache
  holds (looked up by token chunks before the request reached the engine);
  ``start_load`` retrieves those chunks into the reserved blocks; the last
  ``save`` stores the chunks LMCache lacks. On a decode worker,
  ``start_load`` waits until LMCache holds the whole prompt, then retrieves
  it; ``request_finished`` drops what it still waits for.
- **A layer-wise sender** (KV leaves while the forward pass still runs):
  ``save`` gets the same block ranges; a connector that sends per layer
  registers the cache once and, in a later extension of this interface,
  gets a per-layer hook from the model runner (``wait_for_layer_load`` /
  ``save_kv_layer`` in vLLM's terms). The scheduler side is unchanged.

The p2p and Redis connectors plug in through the workers' adapters,
``prefill_service/sender.py`` (saves) and ``decode_service/receiver.py``
(loads), which hold the per-request transfer ids and destinations the
engine never sees.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class KVLoadFailurePolicy(enum.Enum):
    """What the engine does when a request's KV cannot be loaded (late, refused, lost)."""

    # Compute the prompt here, in the blocks it holds (after the prefix this engine had cached).
    RECOMPUTE = "recompute"
    # Finish the request with FINISHED_ERROR and the reason.
    FAIL = "fail"


class KVLoadOutcome(enum.Enum):
    """How a request's load ended (reported on its last output)."""

    RECEIVED = "received"
    RECOMPUTED = "recomputed"
    FAILED = "failed"
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class KVTransferParams:
    """How one request's prompt KV crosses the engine's edge (given to ``add_request``).

    Attributes:
        load: the whole prompt's KV comes from outside (decode role): its blocks are reserved at once
            and the request waits in ``WAITING_FOR_REMOTE_KVS``.
        save: the prompt's KV goes out as steps complete it (prefill role); the blocks outlive a request
            that stops or reaches its length until the connector reports the last save done.
        num_skip_tokens: save only: leading prompt tokens the destination holds already (a multiple of
            the block size, shorter than the prompt); their KV is not saved.
        on_load_failure: load only: what a failed load does.
    """

    load: bool = False
    save: bool = False
    num_skip_tokens: int = 0
    on_load_failure: KVLoadFailurePolicy = KVLoadFailurePolicy.RECOMPUTE

    def __post_init__(self) -> None:
        if self.load and self.save:
            raise ValueError("A request's KV is either loaded or saved, not both.")
        if self.num_skip_tokens < 0:
            raise ValueError(f"num_skip_tokens must be >= 0, got {self.num_skip_tokens}.")


@dataclass(frozen=True)
class KVLoad:
    """Load the KV of prompt tokens ``[num_computed_tokens, num_external_tokens)`` into ``block_ids``."""

    request_id: str
    # Every block of the request so far, in token order (block i holds tokens [i * block_size, ...)).
    block_ids: tuple[int, ...]
    # Leading tokens whose KV is in place already (this engine's prefix cache): not to be written.
    num_computed_tokens: int
    # Where the external KV ends (the whole prompt for a remote prefill).
    num_external_tokens: int
    num_prompt_tokens: int


@dataclass(frozen=True)
class KVSave:
    """Save the KV of prompt tokens ``[first_token_position, first_token_position + num_tokens)``."""

    request_id: str
    # The blocks holding those tokens, in order; the first starts at first_token_position.
    block_ids: tuple[int, ...]
    # A multiple of the block size.
    first_token_position: int
    num_tokens: int
    num_prompt_tokens: int
    # The request's last save: its tokens reach the prompt's end.
    is_last: bool = False
    # The first sampled token, on the last save only.
    first_token_id: int | None = None


@dataclass
class KVConnectorEvents:
    """What finished since the connector's last report (every map keyed by request id)."""

    # Loads whose KV is all in place -> the first token that came with it (None: recompute the last
    # prompt token for its logits).
    finished_loads: dict[str, int | None] = field(default_factory=dict)
    # Loads given up -> the reason, a sentence.
    failed_loads: dict[str, str] = field(default_factory=dict)
    # Requests whose saves all completed, or that no longer read their blocks after request_finished.
    finished_saves: set[str] = field(default_factory=set)
    # Saves that failed -> the reason; the blocks are no longer read.
    failed_saves: dict[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.finished_loads or self.failed_loads or self.finished_saves or self.failed_saves)


class KVConnectorBase(ABC):
    """The engine's view of a KV connector. Thread-safety: the engine calls every method from its one
    thread; implementations do their I/O on threads of their own and report through ``get_finished``."""

    _wakeup: Callable[[], None] | None = None

    # ---- wiring -------------------------------------------------------------------------

    @abstractmethod
    def register_kv_cache(self, kv_cache: torch.Tensor) -> None:
        """The engine's cache, ``[num_blocks, layers, 2, kv_heads, block_size, head_size]``, once at start."""

    def set_wakeup(self, wakeup: Callable[[], None]) -> None:
        """``wakeup()`` (callable from any thread) makes the engine poll ``get_finished`` soon."""
        self._wakeup = wakeup

    def wake_engine(self) -> None:
        if self._wakeup is not None:
            self._wakeup()

    # ---- scheduler side ---------------------------------------------------------------------

    def get_num_matched_tokens(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """Leading prompt tokens an external source holds, counted from the prompt's start; the engine loads
        only those past what its own prefix cache holds. Called on the engine thread as the request enters:
        an answer that needs I/O should be prepared before (the workers look up when the RPC arrives).
        Default: none."""
        return 0

    @abstractmethod
    def request_finished(self, request_id: str) -> bool:
        """A request with a transfer ended (in any way). Nothing may be written into its blocks after this
        returns. Returns True while a save still reads the blocks: the engine then keeps them until the
        request appears in ``finished_saves`` or ``failed_saves``."""

    # ---- worker side ------------------------------------------------------------------------

    @abstractmethod
    def start_load(self, load: KVLoad) -> None:
        """Begin writing a request's external KV into its reserved blocks; returns at once."""

    @abstractmethod
    def save(self, save: KVSave) -> None:
        """Begin saving blocks a step completed; returns at once. The blocks stay unchanged until the request's
        saves are reported finished or failed."""

    @abstractmethod
    def get_finished(self) -> KVConnectorEvents:
        """Loads and saves that ended since the last call (each reported once)."""
