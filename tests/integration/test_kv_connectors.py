"""The engine-level KV connectors of the workers (prefill: KVSender, decode: KVReceiver) over a real transport
(the redis connector and a redis-server of the test's own): what they report to the engine, and that nothing
lands in a request's blocks once the engine has let them go."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from splitserve.decode_service.receiver import KVReceiver
from splitserve.engine.kv_connector import KVConnectorEvents, KVLoad, KVSave
from splitserve.kvtransfer import create_connector
from splitserve.prefill_service.sender import KVSender
from splitserve.rpc.counters import Counters
from tests.kv_helpers import FINGERPRINT, LAYOUT, SHAPE

pytestmark = pytest.mark.timeout(120)

class Engine:
    """What the engine gives a connector: a cache, a wakeup, and polling of its reports."""

    def __init__(self, connector, seed: int | None) -> None:
        self.cache = torch.randn(SHAPE, generator=torch.Generator().manual_seed(seed)) if seed else torch.zeros(SHAPE)
        self.connector = connector
        self.woken = threading.Event()
        self.events = KVConnectorEvents()
        connector.register_kv_cache(self.cache)
        connector.set_wakeup(self.woken.set)

    def wait_for(self, predicate, timeout: float = 30.0) -> KVConnectorEvents:
        """Poll as the engine loop does (after each wakeup) until ``predicate(events so far)``."""
        deadline = time.monotonic() + timeout
        while not predicate(self.events):
            assert self.woken.wait(max(deadline - time.monotonic(), 0)), f"no report in time: {self.events}"
            self.woken.clear()
            new = self.connector.get_finished()
            self.events.finished_loads.update(new.finished_loads)
            self.events.failed_loads.update(new.failed_loads)
            self.events.finished_saves |= new.finished_saves
            self.events.failed_saves.update(new.failed_saves)
        return self.events


@pytest.fixture
def pair(redis_url):
    out = create_connector("redis", "prefill-c", FINGERPRINT, LAYOUT, url=redis_url)
    into = create_connector("redis", "decode-c", FINGERPRINT, LAYOUT, url=redis_url)
    counters = Counters()
    receiver = KVReceiver(into, counters)
    prefill, decode = Engine(KVSender(out), seed=7), Engine(receiver, seed=None)
    receiver.start()
    yield prefill, decode, counters
    receiver.stop()
    out.close()
    into.close()


def test_saved_blocks_land_in_the_reserved_blocks_and_both_sides_report(pair):
    prefill, decode, counters = pair
    receiver, sender = decode.connector, prefill.connector
    receiver.expect("req", "t-ok", num_prompt_tokens=11, timeout_seconds=30)
    receiver.start_load(KVLoad("req", block_ids=(10, 2, 5), num_computed_tokens=0, num_external_tokens=11,
                               num_prompt_tokens=11))
    transfer = sender.expect("req", "t-ok", receiver.transport.endpoint(), num_prompt_tokens=11)
    # Two steps' worth, as the engine hands them out: two full blocks, then the rest with the first token.
    sender.save(KVSave("req", (3, 7), first_token_position=0, num_tokens=8, num_prompt_tokens=11))
    sender.save(KVSave("req", (1,), first_token_position=8, num_tokens=3, num_prompt_tokens=11, is_last=True,
                       first_token_id=99))
    assert decode.wait_for(lambda e: e.finished_loads).finished_loads == {"req": 99}
    assert torch.equal(decode.cache[[10, 2, 5]], prefill.cache[[3, 7, 1]])
    untouched = [block for block in range(16) if block not in (10, 2, 5)]
    assert not decode.cache[untouched].any()
    assert prefill.wait_for(lambda e: e.finished_saves).finished_saves == {"req"}
    assert transfer.succeeded and transfer.num_sends == 2 and transfer.num_sent_blocks == 3
    assert counters.num_kv_transfers_received == 1 and counters.num_kv_payloads_refused == 0
    # Both sides forgot the request: the engine's request_finished finds nothing left to stop.
    assert receiver.request_finished("req") is False and sender.request_finished("req") is False


def test_a_late_transfer_is_reported_failed_and_its_payload_later_dropped(pair):
    prefill, decode, _ = pair
    receiver, sender = decode.connector, prefill.connector
    receiver.expect("late", "t-late", num_prompt_tokens=8, timeout_seconds=0.2)
    receiver.start_load(KVLoad("late", (4, 6), 0, 8, 8))
    failed = decode.wait_for(lambda e: e.failed_loads).failed_loads
    assert list(failed) == ["late"] and "did not arrive within" in failed["late"]
    # The sender comes too late: its payload finds no open transfer and the blocks stay as they were.
    sender.expect("late", "t-late", receiver.transport.endpoint(), 8)
    sender.save(KVSave("late", (0, 1), 0, 8, 8, is_last=True, first_token_id=5))
    prefill.wait_for(lambda e: e.finished_saves)
    time.sleep(0.3)
    assert not decode.cache.any()
    assert not receiver.get_finished()


def test_nothing_lands_after_the_engine_let_the_request_go(pair):
    prefill, decode, _ = pair
    receiver, sender = decode.connector, prefill.connector
    receiver.expect("gone", "t-gone", 8, timeout_seconds=30)
    receiver.start_load(KVLoad("gone", (8, 9), 0, 8, 8))
    assert receiver.request_finished("gone") is False  # the engine aborts it before freeing its blocks
    sender.expect("gone", "t-gone", receiver.transport.endpoint(), 8)
    sender.save(KVSave("gone", (0, 1), 0, 8, 8, is_last=True, first_token_id=5))
    prefill.wait_for(lambda e: e.finished_saves)
    time.sleep(0.3)
    assert not decode.cache.any()
    assert not receiver.get_finished()  # no report for a request the engine already ended


def test_a_payload_out_of_order_fails_the_load_with_the_reason(pair):
    prefill, decode, counters = pair
    receiver, sender = decode.connector, prefill.connector
    receiver.expect("odd", "t-odd", 12, timeout_seconds=30)
    receiver.start_load(KVLoad("odd", (1, 2, 3), 0, 12, 12))
    sender.expect("odd", "t-odd", receiver.transport.endpoint(), 12)
    sender.save(KVSave("odd", (5,), 4, 4, 12))  # skips tokens 0..4
    failed = decode.wait_for(lambda e: e.failed_loads).failed_loads
    assert "starts at token 4; the next expected is 0" in failed["odd"]
    assert counters.num_kv_payloads_refused == 1
    assert not decode.cache.any()


def test_a_load_nobody_announced_fails_at_once(pair):
    _, decode, _ = pair
    decode.connector.start_load(KVLoad("stranger", (1,), 0, 4, 4))
    failed = decode.wait_for(lambda e: e.failed_loads).failed_loads
    assert "no transfer was announced" in failed["stranger"]


def test_a_sender_cancelled_while_idle_sends_nothing_more(pair):
    prefill, decode, _ = pair
    receiver, sender = decode.connector, prefill.connector
    receiver.expect("halt", "t-halt", 8, timeout_seconds=30)
    receiver.start_load(KVLoad("halt", (4, 6), 0, 8, 8))
    transfer = sender.expect("halt", "t-halt", receiver.transport.endpoint(), 8)
    assert sender.request_finished("halt") is False  # nothing in flight: the engine may free the blocks now
    sender.save(KVSave("halt", (0, 1), 0, 8, 8, is_last=True, first_token_id=5))
    assert transfer.wait(5) and not transfer.succeeded
    time.sleep(0.3)
    assert not sender.get_finished() and not decode.cache.any()
    with pytest.raises(ValueError, match="already in use"):
        receiver.expect("other", "t-halt", 8, timeout_seconds=30)


def test_a_connector_asked_for_the_other_direction_reports_a_failure(pair):
    prefill, decode, _ = pair
    decode.connector.save(KVSave("wrong-way", (1,), 0, 4, 4, is_last=True, first_token_id=1))
    assert "saves no KV" in decode.wait_for(lambda e: e.failed_saves).failed_saves["wrong-way"]
    prefill.connector.start_load(KVLoad("wrong-way", (1,), 0, 4, 4))
    assert "loads no KV" in prefill.wait_for(lambda e: e.failed_loads).failed_loads["wrong-way"]
