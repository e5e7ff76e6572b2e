"""Request bytes that do not parse, sent to a real server: INVALID_ARGUMENT, not INTERNAL (a bug's status)."""

from __future__ import annotations

import grpc
import pytest

from splitserve.rpc.server import start_server
from splitserve.v1 import inference_pb2, inference_pb2_grpc

GARBAGE = b"\x0a\xff"  # field 1, said to be 255 bytes long, then nothing


class EchoInference(inference_pb2_grpc.InferenceServicer):
    """Answers Abort and GenerateStream with the id it was given."""

    def Abort(self, request, context):
        return inference_pb2.AbortResponse(found=request.request_id == "known")

    def GenerateStream(self, request, context):
        yield inference_pb2.GenerateStreamResponse(request_id=request.request_id)


@pytest.fixture(scope="module")
def channel():
    server = start_server("127.0.0.1:0", [
        (inference_pb2_grpc.add_InferenceServicer_to_server, EchoInference(), "splitserve.v1.Inference"),
    ])
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel
    server.stop(0)


def test_a_unary_call_with_garbage_bytes_is_invalid_argument(channel):
    call = channel.unary_unary("/splitserve.v1.Inference/Abort", request_serializer=None,
                               response_deserializer=None)
    with pytest.raises(grpc.RpcError) as refused:
        call(GARBAGE, timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("The request is not a valid AbortRequest: ")
    answer = call(inference_pb2.AbortRequest(request_id="known").SerializeToString(), timeout=10)
    assert inference_pb2.AbortResponse.FromString(answer).found


def test_a_streaming_call_with_garbage_bytes_is_invalid_argument(channel):
    call = channel.unary_stream("/splitserve.v1.Inference/GenerateStream", request_serializer=None,
                                response_deserializer=None)
    with pytest.raises(grpc.RpcError) as refused:
        list(call(GARBAGE, timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("The request is not a valid GenerateRequest: ")
    [answer] = call(inference_pb2.GenerateRequest(request_id="r1").SerializeToString(), timeout=10)
    assert inference_pb2.GenerateStreamResponse.FromString(answer).request_id == "r1"
