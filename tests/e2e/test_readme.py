"""The README's Python snippets, run as a user would paste them: each prints what the README says it prints."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
SNIPPET_ADDRESS = "127.0.0.1:50051"


def _snippet(starts_with: str) -> str:
    """The README's one ```python block whose code starts with ``starts_with``."""
    blocks = [block for block in re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
              if block.startswith(starts_with)]
    assert len(blocks) == 1, f"expected one README snippet starting with {starts_with!r}, found {len(blocks)}"
    return blocks[0]


def _run(code: str, api_key: str | None = None) -> subprocess.CompletedProcess:
    """``code`` in a Python of its own; ``api_key``: in its ``$SPLITSERVE_API_KEY``, where the Client finds it."""
    env = {**os.environ, "SPLITSERVE_API_KEY": api_key} if api_key else None
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env)


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """The e2e tier's shared cluster (tests/e2e/conftest.py); it requires an API key, which the snippets get as
    a user would give it, in ``$SPLITSERVE_API_KEY``."""
    return shared_cluster


def test_the_client_snippet_streams_and_prints_a_status_table(cluster):
    code = _snippet("from splitserve import Client")
    assert SNIPPET_ADDRESS in code
    result = _run(code.replace(SNIPPET_ADDRESS, cluster.router.address), cluster.api_key)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == " Paris.", result.stdout
    table = result.stdout.splitlines()[-3:]
    assert table[0].split()[:4] == ["pool", "worker", "address", "state"], result.stdout
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert set(rows) == {"prefill", "decode"}, result.stdout
    for process in cluster.workers:
        assert process.worker_id in result.stdout and process.address in result.stdout
    assert all(row[3] == "serving" for row in rows.values()), result.stdout


def test_the_llm_snippet_prints_the_answers_it_claims():
    code = _snippet("from splitserve import LLM, SamplingParams\n")
    claimed = re.search(r"print\(reply\[0\]\.outputs\[0\]\.text\)\s+# (.+)", code).group(1)
    result = _run(code.replace("LLM()", 'LLM(kv_cache_memory_bytes=2**28, max_model_len=1024)'))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == " Paris. stop", result.stdout
    assert lines[-1] == claimed, result.stdout


def test_the_structured_outputs_snippet_prints_the_json_it_claims():
    code = _snippet("from splitserve import LLM, SamplingParams, StructuredOutputsParams")
    claimed = re.search(r"print\(out\[0\]\.outputs\[0\]\.text\)\s+# (.+)", code).group(1)
    result = _run(code.replace("LLM()", 'LLM(kv_cache_memory_bytes=2**28, max_model_len=1024)'))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == claimed, result.stdout
