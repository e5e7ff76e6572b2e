"""The vLLM peer scripts the benchmarks run in vLLM's venv (CI has no vLLM, so they never run there): each is
valid Python whose names are all defined, and the command loop they share (offline_throughput.PEER_LOOP) answers
as PeerProcess expects: "ready" first, a reply a command (with its argument), a traceback for an unknown one."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from benchmarks.offline_throughput import PEER_LOOP

BENCHMARKS = ["offline_throughput", "beam_search", "parallel_sampling", "lora", "speculative", "structured_outputs",
              "prompt_scoring"]


def test_every_peer_script_is_python_with_every_name_defined(tmp_path):
    for name in BENCHMARKS:
        script = importlib.import_module(f"benchmarks.{name}").VLLM_PEER_SCRIPT
        compile(script, f"{name}_peer.py", "exec")
        assert "from peer_loop import serve" in script, name
        (tmp_path / f"{name}_peer.py").write_text(script)
    (tmp_path / "peer_loop.py").write_text(PEER_LOOP)
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--select", "F,E9", str(tmp_path)],
                          capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


@pytest.fixture
def peer(tmp_path):
    (tmp_path / "peer_loop.py").write_text(PEER_LOOP)
    (tmp_path / "peer.py").write_text(
        "from peer_loop import serve\n"
        "serve('@@m ', '9.9', {'echo': lambda argument: {'argument': argument}, 'count': lambda _: {'n': 3}})\n")

    def run(stdin: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(tmp_path / "peer.py")], input=stdin, capture_output=True,
                              text=True, cwd=tmp_path, timeout=60)
    return run


def test_the_loop_replies_ready_then_to_each_command_until_quit(peer):
    done = peer("echo [1, 2]\ncount\nquit\necho never\n")
    assert done.returncode == 0, done.stderr
    replies = [json.loads(line.removeprefix("@@m ")) for line in done.stdout.splitlines()]
    assert replies == [{"event": "ready", "vllm_version": "9.9"}, {"event": "echo", "argument": "[1, 2]"},
                       {"event": "count", "n": 3}]


def test_an_unknown_command_ends_the_peer_with_its_name(peer):
    failed = peer("count\nsing\ncount\n")
    assert failed.returncode != 0 and "unknown command 'sing'" in failed.stderr
    assert len(failed.stdout.splitlines()) == 2  # ready, count
