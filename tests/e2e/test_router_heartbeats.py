"""The router's request work never stalls workers' heartbeats.

A flood of the most expensive calls a client can make at once (Tokenize of text at the size limit, and
generation calls over the router's in-flight limit) runs against a router whose workers must heartbeat every
0.5 s and are declared unreachable after 1 s of silence: the workers stay SERVING throughout, the calls over
the limits are refused with RESOURCE_EXHAUSTED, and a request afterwards completes.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from splitserve.v1 import inference_pb2, inference_pb2_grpc
from tests.cluster_helpers import start_cluster

pytestmark = pytest.mark.timeout(300)

FLOOD_SECONDS = 8.0
NUM_FLOOD_THREADS = 24


def test_a_flood_of_request_work_does_not_stall_heartbeats(tmp_path):
    cluster = start_cluster("p2p", tmp_path, prefill=0, decode=1,
                            router_args=["--max-in-flight-requests", "2", "--max-model-len", "2048"])
    try:
        with Client(cluster.router.address) as client:
            info = client.stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=30)
            text = "word " * (info.max_model_len * 2)  # under the byte-size check, so it is tokenized whole
            stop = time.monotonic() + FLOOD_SECONDS
            outcomes: dict[str, int] = {}
            lock = threading.Lock()

            def flood(index: int) -> None:
                with grpc.insecure_channel(cluster.router.address) as channel:
                    stub = inference_pb2_grpc.InferenceStub(channel)
                    while time.monotonic() < stop:
                        try:
                            if index % 3:
                                stub.Tokenize(inference_pb2.TokenizeRequest(text=text), timeout=30)
                            else:
                                for _ in stub.GenerateStream(inference_pb2.GenerateRequest(
                                        text="Hello", sampling_params=inference_pb2.SamplingParams(max_tokens=64)),
                                        timeout=30):
                                    pass
                            code = "OK"
                        except grpc.RpcError as error:
                            code = error.code().name
                        with lock:
                            outcomes[code] = outcomes.get(code, 0) + 1

            threads = [threading.Thread(target=flood, args=(index,)) for index in range(NUM_FLOOD_THREADS)]
            for thread in threads:
                thread.start()
            states, longest_silence = set(), 0.0
            while time.monotonic() < stop:
                try:
                    status = client.cluster_status()
                except grpc.RpcError as error:  # a status call may itself be refused under the flood
                    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    continue
                for pool in status.pools:
                    for worker in pool.workers:
                        states.add(worker.state)
                        longest_silence = max(longest_silence, worker.seconds_since_heartbeat)
                time.sleep(0.1)
            for thread in threads:
                thread.join(60)
        assert set(outcomes) == {"OK", "RESOURCE_EXHAUSTED"}, outcomes
        assert states == {inference_pb2.WORKER_STATE_SERVING}, (states, longest_silence)
        with Client(cluster.router.address) as client:
            response = client.generate("Hello", SamplingParams(temperature=0.0, max_tokens=4), timeout=60)
            assert response.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    finally:
        cluster.stop()
