"""The e2e tier's shared cluster: one p2p cluster for the modules that only send it requests.

Starting a cluster (a router and two workers, each importing torch and transformers and loading the model) takes
7 to 10 s on this kind of machine; the access control, gateway, Node.js client, README, cluster embeddings and
deploy modules each started one alike. They share :func:`shared_cluster` now, started by the first of them and
stopped after the tier. Its modules neither stop, drain nor add workers, and leave every KV block free; what one
leaves behind is only the decode worker's prefix cache, so a test that counts cached tokens uses a prompt (or a
cache salt) of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cluster_helpers import assert_secrets_kept, assert_stopped_cleanly, start_cluster

# The ChatML template with tools (the gateway's tool-calling tests) renders every chat without tools as the
# model's own template does.
TOOLS_TEMPLATE = Path(__file__).resolve().parents[2] / "examples" / "chat-templates" / "chatml-tools.jinja"


@pytest.fixture(scope="package")
def shared_cluster(tmp_path_factory, model_dir):
    """A p2p cluster (one prefill and one decode worker, first come first served, no adapters) that requires the
    generated API key (``cluster.api_key``) and cluster token, with the tools chat template on its router and
    every process's Prometheus metrics on a port of its own; stopped after the e2e tier, when neither secret may
    be in any log and every process must have exited 0 without a traceback."""
    metrics = ["--metrics-port", "0"]
    cluster = start_cluster("p2p", tmp_path_factory.mktemp("shared-cluster"), credentials=True,
                            router_args=["--chat-template", str(TOOLS_TEMPLATE), *metrics], worker_args=metrics)
    yield cluster
    cluster.stop()
    # What test_access_control checked while it ran holds for the whole tier's traffic.
    assert_secrets_kept(cluster)
    assert_stopped_cleanly(cluster)
