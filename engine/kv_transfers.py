"""The engine's side of KV transfers: which requests load or save KV, how far they got, and what to tell
the connector after each step.

:class:`KVTransfers` is owned by the :class:`~splitserve.engine.llm_engine.LLMEngine` and runs on its
thread. It turns scheduler facts (a request's blocks, its computed tokens, its first token) into the
typed calls of :mod:`splitserve.engine.kv_connector`, and keeps what the engine needs to act on the
connector's reports (each load's start time and failure policy). Without a connector, the same
requests still wait for remote KV or keep their blocks, and the caller drives them by hand
(``finish_remote_kv``, ``release_kv``), as the offline tests do.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from splitserve.common.errors import InvalidRequest
from splitserve.common.log_fields import request_log
from splitserve.engine.kv_connector import (
    KVConnectorBase,
    KVLoad,
    KVLoadFailurePolicy,
    KVLoadOutcome,
    KVSave,
    KVTransferParams,
)
from splitserve.engine.request import Request, RequestStatus

logger = logging.getLogger(__name__)


@dataclass
class LoadState:
    """A request whose leading prompt tokens come from outside."""

    num_external_tokens: int
    on_failure: KVLoadFailurePolicy
    started: float
    # Leading tokens this engine's prefix cache held: not loaded.
    num_computed_tokens: int = 0
    outcome: KVLoadOutcome | None = None
    seconds: float = 0.0

    @property
    def num_loaded_tokens(self) -> int:
        """Tokens the connector wrote into the request's blocks (0 unless the load was received)."""
        if self.outcome != KVLoadOutcome.RECEIVED:
            return 0
        return max(self.num_external_tokens - self.num_computed_tokens, 0)


@dataclass
class SaveState:
    """A request whose prompt KV goes out; ``num_saved_tokens`` are handed to the connector already."""

    num_prompt_tokens: int
    num_saved_tokens: int


class KVTransfers:
    """Loads and saves of one engine's requests.

    Args:
        block_size: tokens per KV block.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.connector: KVConnectorBase | None = None
        self.loads: dict[str, LoadState] = {}
        self.saves: dict[str, SaveState] = {}

    def check(self, params: KVTransferParams, num_prompt_tokens: int) -> None:
        """Raises InvalidRequest when ``params`` do not fit the prompt."""
        skip = params.num_skip_tokens
        if skip and (skip % self.block_size or skip >= num_prompt_tokens):
            raise InvalidRequest(f"num_skip_tokens ({skip}) must be a multiple of the block size ({self.block_size}) "
                             f"and shorter than the prompt ({num_prompt_tokens} tokens).")

    def num_external_tokens(self, request: Request, params: KVTransferParams | None) -> int:
        """How many leading prompt tokens come from outside: all of them for a remote prefill, else what the
        connector holds (LMCache: a stored prefix; a saving request then loads it first and saves the whole
        prompt), at most the prompt; nothing from the connector for a request that wants prompt logprobs."""
        if params is not None and params.load:
            return request.num_prompt_tokens
        if self.connector is None or request.wants_prompt_logprobs:
            return 0
        matched = self.connector.get_num_matched_tokens(request.request_id, request.prompt_token_ids)
        return min(max(matched, 0), request.num_prompt_tokens)

    # ---- a request enters ----------------------------------------------------------------

    def start(self, request: Request, params: KVTransferParams | None, num_external_tokens: int,
              block_ids: list[int]) -> None:
        """Track a request the scheduler has taken; a load begins now if its blocks are reserved."""
        policy = params.on_load_failure if params is not None else KVLoadFailurePolicy.RECOMPUTE
        if params is not None and params.save:
            self.saves[request.request_id] = SaveState(request.num_prompt_tokens, params.num_skip_tokens)
        if not num_external_tokens or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return
        num_cached = max(request.num_cached_tokens, 0)
        self.loads[request.request_id] = LoadState(num_external_tokens, policy, time.monotonic(), num_cached)
        request_log(logger, request.request_id).debug(
            "WAITING -> WAITING_FOR_REMOTE_KVS (%d prompt tokens to load, %d cached here)",
            num_external_tokens, num_cached)
        if self.connector is not None:
            self.connector.start_load(KVLoad(
                request_id=request.request_id, block_ids=tuple(block_ids), num_computed_tokens=num_cached,
                num_external_tokens=num_external_tokens, num_prompt_tokens=request.num_prompt_tokens,
            ))

    # ---- a request ends -------------------------------------------------------------------

    def keeps_blocks(self, request: Request, finished_normally: bool) -> bool:
        """A request ends: tell the connector; True if its blocks must outlive it (saves still to send or in
        flight)."""
        request_id = request.request_id
        load = self.loads.get(request_id)
        if load is not None and load.outcome is None:
            self.end_load(request_id, KVLoadOutcome.CANCELLED)
        save = self.saves.get(request_id)
        if save is None:
            if load is not None and self.connector is not None:
                self.connector.request_finished(request_id)
            return False
        if finished_normally:
            return True  # the last save goes out after this step; the blocks wait for it
        del self.saves[request_id]
        return self.connector is not None and self.connector.request_finished(request_id)

    def end_load(self, request_id: str, outcome: KVLoadOutcome) -> LoadState | None:
        load = self.loads.get(request_id)
        if load is not None and load.outcome is None:
            load.outcome = outcome
            load.seconds = time.monotonic() - load.started
        return load

    def forget_load(self, request_id: str) -> None:
        """Its last output is out: nothing more to report about its load."""
        self.loads.pop(request_id, None)

    def end_save(self, request_id: str) -> None:
        """Its blocks are released: nothing more to save."""
        self.saves.pop(request_id, None)

    # ---- after a step ----------------------------------------------------------------------

    def save_completed(self, requests: dict[str, Request], held: dict[str, Request],
                       block_ids_of) -> None:
        """Hand the connector the blocks each saving request completed: full blocks of a prompt still being
        computed, and the rest (with the first token) of one that finished."""
        if self.connector is None:
            return
        for request_id, save in list(self.saves.items()):
            if save.num_saved_tokens >= save.num_prompt_tokens:
                continue
            request = held.get(request_id)
            if request is not None:
                if request.output_token_ids:
                    self._save(request_id, save, save.num_prompt_tokens, block_ids_of(request_id),
                               request.output_token_ids[0])
                continue
            request = requests.get(request_id)
            if request is None:
                continue
            # Full blocks only; a prompt computed whole in this step goes with its first token.
            end = min(request.num_computed_tokens, save.num_prompt_tokens) // self.block_size * self.block_size
            if save.num_saved_tokens < end < save.num_prompt_tokens:
                self._save(request_id, save, end, block_ids_of(request_id), None)

    def _save(self, request_id: str, save: SaveState, end: int, block_ids: list[int],
              first_token_id: int | None) -> None:
        start = save.num_saved_tokens
        first_block, end_block = start // self.block_size, -(-end // self.block_size)
        is_last = end == save.num_prompt_tokens
        save.num_saved_tokens = end
        self.connector.save(KVSave(
            request_id=request_id, block_ids=tuple(block_ids[first_block:end_block]), first_token_position=start,
            num_tokens=end - start, num_prompt_tokens=save.num_prompt_tokens, is_last=is_last,
            first_token_id=first_token_id if is_last else None,
        ))
