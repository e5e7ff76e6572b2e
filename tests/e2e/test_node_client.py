"""The Node.js client (clients/node), run by Node against a real cluster that requires an API key.

Its own tests (``node --test``) stream (n completions too), call, score and echo a prompt, shape a reply, carry tools and tool calls in
a chat, embed a prompt, refuse and cancel; its streaming example's greedy token ids are
compared here with the Python client's for the same request. The test command installs its npm packages.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from splitserve.client import Client
from splitserve.common.beam_search_params import BeamSearchParams
from splitserve.common.sampling_params import SamplingParams

NODE_CLIENT = Path(__file__).resolve().parents[2] / "clients" / "node"
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(request):
    """The e2e tier's shared cluster (tests/e2e/conftest.py), which requires an API key."""
    if shutil.which("node") is None:
        pytest.skip("node is not on the PATH: the Node.js client cannot run here")
    assert (NODE_CLIENT / "node_modules" / "@grpc" / "grpc-js").is_dir(), \
        "clients/node's packages are not installed: run `make install-test` (npm ci in clients/node)"
    return request.getfixturevalue("shared_cluster")


def _node(cluster, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPLITSERVE_ADDRESS": cluster.router.address, "SPLITSERVE_API_KEY": cluster.api_key}
    return subprocess.run(["node", *args], cwd=NODE_CLIENT, env=env, capture_output=True, text=True, timeout=240)


def test_the_node_clients_own_tests_pass_against_the_cluster(cluster):
    result = _node(cluster, "--test", "test/")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "# fail 0" in result.stdout and "# pass 9" in result.stdout, result.stdout[-2000:]


def test_the_streaming_example_gives_the_python_clients_tokens(cluster):
    prompt = "Water boils at"
    result = _node(cluster, "examples/stream.js", cluster.router.address, prompt, "20", "--json")
    assert result.returncode == 0, result.stderr
    streamed = json.loads(result.stdout)
    with Client(cluster.router.address, api_key=cluster.api_key) as client:
        expected = client.generate(prompt, SamplingParams(temperature=0, max_tokens=20))
    assert streamed["tokenIds"] == list(expected.token_ids) and streamed["text"] == expected.text
    assert streamed["finishReason"] == "FINISH_REASON_LENGTH"


_BEAMS = """
const { Client } = require('.');
(async () => {
  const [address, apiKey, prompt] = process.argv.slice(1);
  const client = new Client(address, { apiKey, timeoutSeconds: 120 });
  const beams = [];
  for await (const chunk of client.generateStream(prompt, { maxTokens: 6 }, { beamSearch: { beamWidth: 3 } })) {
    (beams[chunk.index] = beams[chunk.index] || []).push(...chunk.tokenIds);
  }
  client.close();
  console.log(JSON.stringify(beams));
})().catch((error) => { console.error(error.message); process.exit(1); });
"""


def test_a_beam_search_from_node_gives_the_python_clients_beams(cluster):
    """``beamSearch`` on generateStream: the stream's beamWidth completions, best first, the Python client's."""
    prompt = "The capital of France is"
    result = _node(cluster, "-e", _BEAMS, cluster.router.address, cluster.api_key, prompt)
    assert result.returncode == 0, result.stderr
    with Client(cluster.router.address, api_key=cluster.api_key) as client:
        expected = [[] for _ in range(3)]
        for chunk in client.generate_stream(prompt, beam_search=BeamSearchParams(beam_width=3, max_tokens=6)):
            expected[chunk.index].extend(chunk.token_ids)
    assert json.loads(result.stdout) == expected and all(expected)
