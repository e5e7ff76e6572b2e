"""Helpers for the integration tests that run a real cluster (router and workers as processes)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from splitserve.launcher import LocalCluster
from splitserve.rpc.tls import open_channel
from splitserve.v1 import worker_pb2, worker_pb2_grpc

# Small KV caches and one thread per worker: several workers share this machine's two cores. A 512-token
# step budget makes long prompts prefill in chunks, each shipped as its own KV payload.
WORKER_ARGS = ["--kv-cache-gb", "0.25", "--max-model-len", "2048", "--threads", "1", "--max-num-batched-tokens", "512"]
ROUTER_ARGS = ["--max-model-len", "2048", "--heartbeat-seconds", "0.5", "--lease-seconds", "3"]


def start_cluster(kv_transfer: str, log_dir, prefill: int = 1, decode: int = 1, router_args=(), worker_args=(),
                  credentials: bool = False, tls=None, redis_url: str | None = None):
    """A started cluster; ``credentials``: a generated cluster token and API key (``cluster.api_key``);
    ``tls``: a ``TLSConfig`` every process serves and calls with (``cluster.tls``; None: plaintext);
    ``redis_url``: a Redis shared with others (None: the redis and lmcache connectors start one of their own)."""
    cluster = LocalCluster(kv_transfer=kv_transfer, worker_args=[*WORKER_ARGS, *worker_args],
                           router_args=[*ROUTER_ARGS, *router_args], log_dir=log_dir, redis_url=redis_url,
                           generate_cluster_token=credentials, require_api_key=credentials, tls=tls)
    try:
        cluster.start_router()
        cluster.start_pools(prefill, decode)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def assert_secrets_kept(cluster: LocalCluster) -> None:
    """Neither the cluster's API key nor its cluster token is in any of its processes' logs or command lines, and
    no process logged that it is open to anyone (a cluster started with ``credentials``)."""
    for process in [cluster.router, *cluster.workers]:
        log = process.log()
        assert log, process.name
        assert cluster.api_key not in log and cluster.cluster_token not in log, process.name
        assert "open to anyone" not in log, process.name
        command_line = " ".join(process.popen.args)
        assert cluster.api_key not in command_line and cluster.cluster_token not in command_line, process.name


def assert_stopped_cleanly(cluster: LocalCluster) -> None:
    """After ``cluster.stop()``: each process drained and exited 0, with no traceback in its log (a sending
    worker's rendezvous server, built for its port and never started, once raised on close)."""
    for process in [cluster.router, *cluster.workers]:
        log = process.log()
        assert process.popen.returncode == 0 and "Traceback" not in log, (process.name, log[-2000:])


def stream_tokens(client: Client, prompt, max_tokens: int, **kwargs) -> tuple[list[int], str, object]:
    """Run one streaming request; returns (token ids, text, last chunk)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)
    token_ids, text, last = [], "", None
    for chunk in client.generate_stream(prompt, params, timeout=300):
        token_ids.extend(chunk.token_ids)
        text += chunk.text
        last = chunk
    return token_ids, text, last


def stream_completions(client: Client, prompt, params, **kwargs) -> list[tuple[list[int], str, list]]:
    """Run one streaming request for ``params.n`` completions (SamplingParams), or a beam search's
    ``params.beam_width`` (BeamSearchParams, given as ``beam_search`` too; ``logprobs_params`` then the
    SamplingParams of its logprobs); returns each completion's (token ids,
    text, its messages), in index order, checking that each has exactly one last message (with a finish reason)
    and it is its last."""
    completions: dict[int, tuple[list[int], list[str], list]] = {}
    sampling = params if isinstance(params, SamplingParams) else kwargs.pop("logprobs_params", None)
    for chunk in client.generate_stream(prompt, sampling, timeout=300, **kwargs):
        token_ids, texts, messages = completions.setdefault(chunk.index, ([], [], []))
        assert not (messages and messages[-1].finish_reason), f"completion {chunk.index} went on after its end"
        token_ids.extend(chunk.token_ids)
        texts.append(chunk.text)
        messages.append(chunk)
    count = params.n if isinstance(params, SamplingParams) else params.beam_width
    assert sorted(completions) == list(range(count))
    assert all(messages[-1].finish_reason for _, _, messages in completions.values())
    return [(token_ids, "".join(texts), messages) for token_ids, texts, messages in
            (completions[index] for index in range(count))]


def check_two_completions_take_one_transfer(cluster, prompt: list[int], max_tokens: int, expected: list[int]) -> None:
    """Two greedy completions of ``prompt`` (``max_tokens`` each) through ``cluster`` (no API key): each ``expected``
    (transformers'), the
    prompt's KV received once by the decode worker (forked there for the second), none recomputed or prefilled
    locally, and every KV block free afterwards."""
    decode = next(p for p in cluster.workers if p.name.startswith("decode"))
    before = worker_status(decode.address, "decode").counters
    with Client(cluster.router.address) as client:
        completions = stream_completions(client, prompt, SamplingParams(n=2, max_tokens=max_tokens, temperature=0.0))
        assert [token_ids for token_ids, _, _ in completions] == [expected] * 2
        after = worker_status(decode.address, "decode").counters
        assert after.num_kv_transfers_received - before.num_kv_transfers_received == 1
        assert after.num_local_prefills == before.num_local_prefills
        assert after.num_kv_recomputes == before.num_kv_recomputes
        wait_until(lambda: all_blocks_free(client), 20, message="all KV blocks free")


def worker_status(address: str, role: str, tls=None) -> worker_pb2.GetWorkerStatusResponse:
    """A worker's GetStatus; ``tls``: the ``TLSConfig`` to call it with (None: plaintext)."""
    with open_channel(address, tls) as channel:
        stub = (worker_pb2_grpc.PrefillWorkerStub if role == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(channel)
        return stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=30)


def wait_until(predicate, timeout: float, interval: float = 0.2, message: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"{message} did not hold within {timeout} s")


def all_blocks_free(client: Client) -> bool:
    """True when every worker in GetClusterStatus reports all its KV blocks free."""
    status = client.cluster_status()
    workers = [worker for pool in status.pools for worker in pool.workers]
    return bool(workers) and all(
        w.load.num_total_kv_blocks > 0 and w.load.num_free_kv_blocks == w.load.num_total_kv_blocks for w in workers
    )


@contextlib.contextmanager
def running_gateway(router_address: str, log_path: Path, *flags: str):
    """A ``splitserve gateway`` process in front of the router, on a free port, logging to ``log_path``; yields its
    base URL (``http://127.0.0.1:PORT``) and stops it (SIGTERM) on leaving."""
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "splitserve.cli", "gateway", "--router", router_address,
                                    "--port", "0", *flags], stdout=subprocess.PIPE, stderr=log, text=True)
        try:
            line = process.stdout.readline()
            assert line.startswith("READY http://127.0.0.1:"), line
            yield line.split()[1]
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
