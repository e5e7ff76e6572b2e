"""Priority scheduling through a cluster: workers started with ``--scheduling-policy priority`` start waiting
requests by their ``priority`` (lower first), as vLLM's policy does, and keep their outputs the greedy ones.

A router, one prefill and one decode worker that runs one request at a time (``--max-num-seqs 1``): while a long
request decodes, three short ones arrive with priorities 5, 1 and 3; their KV arrives and they wait on the decode
worker, which then runs them in priority order, not in arrival order. Embed calls, computed on the decode worker,
wait and start the same way.
"""

from __future__ import annotations

import threading
import time

import numpy
import pytest

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from tests.cluster_helpers import all_blocks_free, start_cluster, wait_until

pytestmark = pytest.mark.timeout(300)

PROMPT = "Write a long story about a lighthouse keeper."
SHORT = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    cluster = start_cluster("p2p", tmp_path_factory.mktemp("priority-logs"),
                            worker_args=["--scheduling-policy", "priority", "--max-num-seqs", "1"])
    yield cluster
    cluster.stop()


def _behind_a_long_request(cluster, call) -> tuple[list[int], dict[int, object]]:
    """``call(client, priority)`` with priorities 5, 1 and 3, arriving in that order while a long request holds the
    decode worker's one running place; returns the priorities in the order their calls finished, and each answer."""
    finished: list[int] = []
    answers: dict[int, object] = {}
    lock = threading.Lock()

    def run(priority: int) -> None:
        with Client(cluster.router.address) as client:
            answer = call(client, priority)
        with lock:
            finished.append(priority)
            answers[priority] = answer

    with Client(cluster.router.address) as client:
        blocker = client.generate_stream(PROMPT, SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True),
                                         timeout=120, priority=10)
        next(blocker)  # decoding: the decode worker's one running place is taken
        threads = []
        for priority in (5, 1, 3):  # arrive in this order while the blocker runs
            threads.append(threading.Thread(target=run, args=(priority,)))
            threads[-1].start()
            time.sleep(0.3)
        wait_until(lambda: _num_waiting(client) == 3, 30, message="the three requests wait on the decode worker")
        remaining = list(blocker)
        assert remaining[-1].usage.completion_tokens == 300  # never preempted: KV blocks did not run out
        for thread in threads:
            thread.join(120)
    return finished, answers


def test_waiting_requests_start_in_priority_order_with_their_greedy_outputs(cluster):
    finished, responses = _behind_a_long_request(
        cluster, lambda client, priority: client.generate(f"{PROMPT} Chapter {priority}:", SHORT, timeout=120,
                                                          priority=priority))
    assert finished == [1, 3, 5]
    with Client(cluster.router.address) as client:
        for priority, response in responses.items():  # the same greedy text as without priorities, one at a time
            expected = client.generate(f"{PROMPT} Chapter {priority}:", SHORT, timeout=120)
            assert response.text == expected.text
        wait_until(lambda: all_blocks_free(client), 20, message="every block freed")


def test_waiting_embeddings_start_in_priority_order_with_their_vectors(cluster):
    """Embed calls wait in the decode worker's queue as generations do, and start by their priority."""
    finished, vectors = _behind_a_long_request(
        cluster, lambda client, priority: client.embed(f"{PROMPT} Chapter {priority}:", timeout=120, priority=priority))
    assert finished == [1, 3, 5]
    with Client(cluster.router.address) as client:
        for priority, vector in vectors.items():  # the vector of the same prompt embedded alone
            expected = client.embed(f"{PROMPT} Chapter {priority}:", timeout=120)
            assert numpy.allclose(vector, expected, atol=1e-5)
        wait_until(lambda: all_blocks_free(client), 20, message="every block freed")


def _num_waiting(client: Client) -> int:
    """Requests waiting to start on any worker (their KV in place), as the workers last reported."""
    status = client.cluster_status()
    return sum(worker.load.num_waiting_requests for pool in status.pools for worker in pool.workers)


def test_the_command_line_sends_a_priority_and_an_fcfs_engine_refuses_one(cluster):
    import subprocess
    import sys

    prompt = f"{PROMPT} Chapter 9:"
    with Client(cluster.router.address) as client:
        expected = client.generate(prompt, SHORT, timeout=120).text
    remote = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--server", cluster.router.address,
                             "--priority", "-4", "--max-tokens", "4", prompt], capture_output=True, text=True,
                            timeout=120)
    assert remote.returncode == 0 and remote.stdout == expected, remote.stderr
    local = subprocess.run([sys.executable, "-m", "splitserve.cli", "generate", "--priority", "1", "--max-tokens", "2",
                            "--kv-cache-gb", "0.1", "--max-model-len", "512", prompt], capture_output=True, text=True,
                           timeout=300)
    assert local.returncode == 2 and "needs the priority scheduling policy" in local.stderr, local.stderr
