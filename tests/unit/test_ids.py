"""The id rule (request and transfer ids), and the router and workers refusing ids outside it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from splitserve.common.errors import InvalidRequest
from splitserve.common.ids import MAX_ID_LENGTH, MAX_WORKER_ID_LENGTH, check_id
from splitserve.v1 import inference_pb2, worker_pb2

BAD_IDS = ["", "a\nINFO forged log line", "x" * 129, "id with spaces", "caf\u00e9", "a/b"]


@pytest.mark.parametrize("value", ["a", "0f3c9e", "user-1.req_2:3", "abc#0123abcd", "x" * MAX_ID_LENGTH])
def test_ids_within_the_rule_are_kept(value):
    assert check_id(value, "request_id") == value


@pytest.mark.parametrize("value", BAD_IDS)
def test_ids_outside_the_rule_are_refused_with_a_sentence(value):
    with pytest.raises(InvalidRequest, match=r"^request_id .* is not a valid id: use 1 to 128 characters "
                                             r"from \[A-Za-z0-9\._:#-\]\.$"):
        check_id(value, "request_id")


def test_the_sentence_echoes_at_most_32_characters_of_the_value():
    with pytest.raises(InvalidRequest) as refused:
        check_id("y" * 40 + "\n" + "z" * 1_000_000, "transfer_id")
    assert str(refused.value) == (
        f"transfer_id {'y' * 32!r}... (1000041 characters) is not a valid id: "
        "use 1 to 128 characters from [A-Za-z0-9._:#-]."
    )


def test_workers_take_a_router_id_with_its_attempt_suffix():
    attempt_id = "x" * MAX_ID_LENGTH + "#0123abcd"
    assert check_id(attempt_id, "request_id", MAX_WORKER_ID_LENGTH) == attempt_id
    with pytest.raises(InvalidRequest):
        check_id(attempt_id + "0", "request_id", MAX_WORKER_ID_LENGTH)


# ---- the servicers refuse before doing anything (no dispatcher, engine or frontend needed) ----


def router():
    from splitserve.router.servicer import InferenceServicer

    return InferenceServicer(frontend=None, dispatcher=None, registry=None, max_in_flight_requests=1, block_size=16)


def prefill_worker():
    from splitserve.prefill_service.servicer import PrefillServicer

    return PrefillServicer(SimpleNamespace(config=SimpleNamespace(engine=SimpleNamespace(block_size=16))))


def decode_worker():
    from splitserve.decode_service.servicer import DecodeServicer

    return DecodeServicer(SimpleNamespace(loop=None, kv_connector=object(), worker_id="d1"))


@pytest.mark.parametrize("value", BAD_IDS)
def test_the_router_refuses_a_bad_request_id_and_abort_id(value):
    request = inference_pb2.GenerateRequest(request_id=value, text="hi")
    with pytest.raises(InvalidRequest, match="^request_id "):
        router().Generate(request, context=None)
    with pytest.raises(InvalidRequest, match="^request_id "):
        next(router().GenerateStream(request, context=None))
    with pytest.raises(InvalidRequest, match="^request_id "):
        router().Abort(inference_pb2.AbortRequest(request_id=value), context=None)


@pytest.mark.parametrize("value", [*BAD_IDS[:2], "x" * (MAX_WORKER_ID_LENGTH + 1), *BAD_IDS[3:]])
def test_the_workers_refuse_a_bad_request_id_transfer_id_and_abort_id(value):
    prompt = dict(prompt_token_ids=[1, 2, 3])
    for field, other in (("request_id", "transfer_id"), ("transfer_id", "request_id")):
        ids = {field: value, other: "r1#0123abcd"}
        with pytest.raises(InvalidRequest, match=f"^{field} "):
            prefill_worker().Prefill(worker_pb2.PrefillRequest(**ids, **prompt), context=None)
        with pytest.raises(InvalidRequest, match=f"^{field} "):
            next(decode_worker().Decode(worker_pb2.DecodeRequest(**ids, **prompt), context=None))
    with pytest.raises(InvalidRequest, match="^request_id "):
        prefill_worker().Abort(worker_pb2.AbortPrefillRequest(request_id=value), context=None)
    with pytest.raises(InvalidRequest, match="^request_id "):
        decode_worker().Abort(worker_pb2.AbortDecodeRequest(request_id=value), context=None)
