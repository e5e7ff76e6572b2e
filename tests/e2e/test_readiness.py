"""Readiness and liveness on grpc.health.v1, as the Kubernetes probes in deploy/ read them.

The router alone is alive ("" SERVING) but not ready (splitserve.v1.Inference NOT_SERVING: a request would get
UNAVAILABLE); it turns ready once a decode worker serves, and back when that worker drains away. A worker is
ready once it serves, and not ready (still alive) while it drains.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.launcher import LocalCluster
from tests.cluster_helpers import ROUTER_ARGS, WORKER_ARGS, wait_until

pytestmark = pytest.mark.timeout(300)
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=10).status


def test_the_router_is_ready_only_with_a_serving_decode_worker(tmp_path, model_dir):
    cluster = LocalCluster(worker_args=[*WORKER_ARGS, "--drain-timeout", "5"], router_args=ROUTER_ARGS,
                           log_dir=tmp_path)
    try:
        router = cluster.start_router()
        assert health(router) == SERVING
        assert health(router, "splitserve.v1.Inference") == NOT_SERVING
        cluster.start_workers("prefill", 1)
        assert health(router, "splitserve.v1.Inference") == NOT_SERVING, "a prefill worker alone serves nothing"
        [decode] = cluster.start_workers("decode", 1)
        assert health(decode.address, "splitserve.v1.DecodeWorker") == SERVING
        wait_until(lambda: health(router, "splitserve.v1.Inference") == SERVING, 10, message="router ready")
        decode.terminate()  # drains, deregisters, exits
        wait_until(lambda: health(router, "splitserve.v1.Inference") == NOT_SERVING, 20,
                   message="router not ready once its only decode worker left")
        assert health(router) == SERVING
        assert decode.popen.wait(30) == 0
    finally:
        cluster.stop()
