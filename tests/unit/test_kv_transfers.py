"""The engine's side of the KV connector interface, without a model: exact block ranges handed to a connector
step by step, the scheduler's reservation of external tokens, and who keeps a finished request's blocks."""

from __future__ import annotations

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.kv_connector import (
    KVConnectorBase,
    KVConnectorEvents,
    KVLoad,
    KVLoadOutcome,
    KVSave,
    KVTransferParams,
)
from splitserve.engine.kv_transfers import KVTransfers
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.scheduler import Scheduler

BLOCK = 4


class RecordingConnector(KVConnectorBase):
    """A connector that keeps what the engine told it, and reports what the test says."""

    def __init__(self, matched: int = 0, reading: bool = False) -> None:
        self.loads: list[KVLoad] = []
        self.saves: list[KVSave] = []
        self.finished: list[str] = []
        self.matched, self.reading = matched, reading
        self.events = KVConnectorEvents()

    def register_kv_cache(self, kv_cache) -> None:
        pass

    def get_num_matched_tokens(self, request_id, prompt_token_ids) -> int:
        return self.matched

    def request_finished(self, request_id: str) -> bool:
        self.finished.append(request_id)
        return self.reading

    def start_load(self, load: KVLoad) -> None:
        self.loads.append(load)

    def save(self, save: KVSave) -> None:
        self.saves.append(save)

    def get_finished(self) -> KVConnectorEvents:
        events, self.events = self.events, KVConnectorEvents()
        return events


def setup(connector: RecordingConnector, num_blocks: int = 16):
    scheduler = Scheduler(KVCacheManager(num_blocks, BLOCK), max_num_seqs=4, max_num_batched_tokens=8)
    transfers = KVTransfers(BLOCK)
    transfers.connector = connector
    return scheduler, transfers


def add(scheduler, transfers, request_id: str, num_tokens: int, params: KVTransferParams | None) -> Request:
    request = Request(request_id, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=1))
    if params is not None:
        transfers.check(params, num_tokens)
    num_external = transfers.num_external_tokens(request, params)
    scheduler.add_request(request, num_external)
    transfers.start(request, params, num_external, scheduler.kv_cache.block_ids(request_id))
    return request


def step(scheduler, transfers) -> None:
    scheduler.update_after_step(scheduler.schedule())
    transfers.save_completed(scheduler.requests, scheduler.held, scheduler.kv_cache.block_ids)


def test_saves_go_out_block_by_block_as_steps_complete_them():
    connector = RecordingConnector()
    scheduler, transfers = setup(connector)
    request = add(scheduler, transfers, "p", 18, KVTransferParams(save=True))
    step(scheduler, transfers)  # 8 tokens computed: two full blocks
    step(scheduler, transfers)  # 16
    assert [(s.block_ids, s.first_token_position, s.num_tokens, s.is_last) for s in connector.saves] == [
        ((0, 1), 0, 8, False), ((2, 3), 8, 8, False)]
    step(scheduler, transfers)  # the last 2 tokens: sampled, the request stops (max_tokens=1)
    request.append_output_token(42)
    assert transfers.keeps_blocks(request, finished_normally=True)
    scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH, hold_blocks=True)
    transfers.save_completed(scheduler.requests, scheduler.held, scheduler.kv_cache.block_ids)
    last = connector.saves[-1]
    assert (last.block_ids, last.first_token_position, last.num_tokens, last.is_last, last.first_token_id) == (
        (4,), 16, 2, True, 42)
    assert scheduler.kv_cache.block_ids("p") == [0, 1, 2, 3, 4]  # held for the save in flight
    step(scheduler, transfers)
    assert len(connector.saves) == 3  # nothing is saved twice
    assert connector.finished == []  # a normal finish does not cancel the transfer


def test_tokens_the_destination_holds_are_not_saved():
    connector = RecordingConnector()
    scheduler, transfers = setup(connector)
    with pytest.raises(ValueError, match="multiple of the block size"):
        add(scheduler, transfers, "bad", 18, KVTransferParams(save=True, num_skip_tokens=6))
    add(scheduler, transfers, "p", 18, KVTransferParams(save=True, num_skip_tokens=8))
    step(scheduler, transfers)
    assert connector.saves == []  # tokens 0..8: the destination has them
    step(scheduler, transfers)
    assert [(s.block_ids, s.first_token_position, s.num_tokens) for s in connector.saves] == [((2, 3), 8, 8)]


def test_an_aborted_save_keeps_its_blocks_only_while_a_read_is_in_flight():
    for reading in (False, True):
        connector = RecordingConnector(reading=reading)
        scheduler, transfers = setup(connector)
        request = add(scheduler, transfers, "p", 18, KVTransferParams(save=True))
        step(scheduler, transfers)
        assert transfers.keeps_blocks(request, finished_normally=False) is reading
        assert connector.finished == ["p"] and "p" not in transfers.saves


def test_a_load_reserves_the_prompt_and_starts_with_the_cached_prefix_in_place():
    connector = RecordingConnector()
    scheduler, transfers = setup(connector)
    request = add(scheduler, transfers, "d", 10, KVTransferParams(load=True))
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.loads == [KVLoad("d", (0, 1, 2), num_computed_tokens=0, num_external_tokens=10,
                                      num_prompt_tokens=10)]
    assert scheduler.schedule().is_empty  # nothing runs until the KV is in place
    # Aborted while loading: the connector is told before the blocks go back.
    assert transfers.keeps_blocks(request, finished_normally=False) is False
    assert connector.finished == ["d"]
    assert transfers.loads["d"].outcome.value == "cancelled"


def test_a_prefix_an_external_source_holds_is_loaded_then_the_rest_computed():
    connector = RecordingConnector(matched=8)  # e.g. LMCache holds the first two blocks
    scheduler, transfers = setup(connector)
    request = add(scheduler, transfers, "r", 14, None)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.loads == [KVLoad("r", (0, 1), 0, 8, 14)]  # blocks for the loaded tokens only
    scheduler.finish_remote_kv("r", 8)
    output = scheduler.schedule()
    assert [(item.request.request_id, item.num_new_tokens) for item in output.scheduled] == [("r", 6)]
    assert scheduler.kv_cache.block_ids("r") == [0, 1, 2, 3]


def test_a_saving_request_loads_a_matched_prefix_then_saves_the_whole_prompt_from_its_first_block():
    connector = RecordingConnector(matched=8)  # a prefill worker: LMCache holds the first two blocks
    scheduler, transfers = setup(connector)
    request = add(scheduler, transfers, "p", 14, KVTransferParams(save=True))
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.loads == [KVLoad("p", (0, 1), 0, 8, 14)]
    transfers.end_load("p", KVLoadOutcome.RECEIVED)
    scheduler.finish_remote_kv("p", 8)
    step(scheduler, transfers)  # the 6 tokens past the prefix: the prompt is computed, its first token sampled
    request.append_output_token(7)
    assert transfers.keeps_blocks(request, finished_normally=True)
    scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH, hold_blocks=True)
    transfers.save_completed(scheduler.requests, scheduler.held, scheduler.kv_cache.block_ids)
    # Saves from position 0: the loaded prefix's blocks too (LMCache keys chunks from the prompt's start).
    assert [(s.block_ids, s.first_token_position, s.num_tokens, s.is_last, s.first_token_id)
            for s in connector.saves] == [((0, 1, 2), 0, 12, False, None), ((3,), 12, 2, True, 7)]
    assert transfers.loads["p"].num_loaded_tokens == 8


def test_a_matched_prefix_is_capped_at_the_prompt():
    connector = RecordingConnector(matched=40)
    scheduler, transfers = setup(connector)
    request = Request("r", list(range(1, 15)), SamplingParams(max_tokens=1))
    assert transfers.num_external_tokens(request, None) == 14


def test_without_a_matched_prefix_a_request_is_queued_as_usual():
    connector = RecordingConnector(matched=0)
    scheduler, transfers = setup(connector)
    request = add(scheduler, transfers, "r", 14, None)
    assert request.status == RequestStatus.WAITING and connector.loads == []
