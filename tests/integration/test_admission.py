"""A worker's own admission answers overload, not gRPC: a real server, sized as workers are, over real sockets.

A worker refuses a request beyond ``--max-queued-requests`` with RESOURCE_EXHAUSTED
and a sentence naming the flag. Its gRPC server must hold more concurrent calls
than that limit; otherwise the calls beyond the server's own limit wait for a
thread (or are refused by gRPC) before the worker's admission ever sees them.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from splitserve.rpc.worker import AdmissionLimit
from splitserve.serve import start_worker_server
from splitserve.v1 import worker_pb2, worker_pb2_grpc

# Above the 64 threads the worker servers had: the calls beyond them waited for a thread until their deadline.
MAX_QUEUED_REQUESTS = 80


class HeldDecodeWorker(worker_pb2_grpc.DecodeWorkerServicer):
    """Admits as a decode worker does, acknowledges, then holds each stream until ``release`` is set."""

    def __init__(self, max_queued_requests: int) -> None:
        self.admission = AdmissionLimit(max_queued_requests)
        self.release = threading.Event()

    def Decode(self, request, context):
        self.admission.enter("decode-test")
        try:
            yield worker_pb2.DecodeResponse(request_id=request.request_id,
                                            state=worker_pb2.REQUEST_STATE_WAITING_FOR_REMOTE_KVS)
            self.release.wait(30)
        finally:
            self.admission.leave()

    def GetStatus(self, request, context):
        return worker_pb2.GetWorkerStatusResponse(model_fingerprint="m")


@pytest.fixture
def held_worker():
    servicer = HeldDecodeWorker(MAX_QUEUED_REQUESTS)
    server = start_worker_server(
        "127.0.0.1:0", [(worker_pb2_grpc.add_DecodeWorkerServicer_to_server, servicer, "splitserve.v1.DecodeWorker")],
        max_queued_requests=MAX_QUEUED_REQUESTS,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield servicer, worker_pb2_grpc.DecodeWorkerStub(channel)
    servicer.release.set()
    channel.close()
    server.stop(0)


def test_a_call_beyond_the_admission_limit_gets_resource_exhausted_from_admission(held_worker):
    servicer, stub = held_worker
    held = [stub.Decode(worker_pb2.DecodeRequest(request_id=f"r{index}"), timeout=30)
            for index in range(MAX_QUEUED_REQUESTS)]
    try:
        assert [next(call).request_id for call in held] == [f"r{index}" for index in range(MAX_QUEUED_REQUESTS)]
        assert servicer.admission.num_in_flight == MAX_QUEUED_REQUESTS

        with pytest.raises(grpc.RpcError) as refused:
            next(stub.Decode(worker_pb2.DecodeRequest(request_id="one-too-many"), timeout=5))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert refused.value.details() == (
            f"Worker decode-test has {MAX_QUEUED_REQUESTS} requests in flight, its limit "
            f"(--max-queued-requests {MAX_QUEUED_REQUESTS}); retry later."
        )
        # Status polls still answer while admission is full.
        assert stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=5).model_fingerprint == "m"
    finally:
        servicer.release.set()
        for call in held:
            call.cancel()
