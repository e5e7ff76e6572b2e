"""What a new user meets first (issue 18): a taken port, the first start's kernel compile, the log folders left behind.

Real processes and real sockets on loopback; no compile runs to its end here (it takes up to a minute):
the compile test stops the process once it has said that it compiles.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from splitserve.common.model_info import cache_dir
from splitserve.kernels import cpu_ops
from splitserve.launcher import ClusterStartError, LocalCluster, free_port

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def built_kernels() -> str:
    """splitserve's own cache folder, with the kernels built in it (up to a minute if no test built them yet)."""
    cache = str(cache_dir())
    assert cpu_ops.load(cache) is not None, "the C++ kernels must build on this machine"
    return cache


@pytest.fixture
def taken_port():
    """A loopback port another socket of this test listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    """Run the command line in its own session; on a timeout the whole session is killed (an `up` and its
    children alike), so nothing it started outlives the test."""
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, "-m", "splitserve.cli", *args], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})},
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"{args[0]} did not finish within {timeout:.0f} s:\n{stderr[-3000:]}")
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    return result, time.monotonic() - started


def _assert_one_line_about(stderr: str, port: int) -> None:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if f"127.0.0.1:{port}" in line and "the port is taken" in line]
    assert len(lines) == 1, stderr


def test_up_on_a_taken_port_says_so_in_one_line_at_once(taken_port, tmp_path, model_dir):
    result, seconds = _cli("up", "--port", str(taken_port), env={"TMPDIR": str(tmp_path)})
    assert result.returncode != 0
    _assert_one_line_about(result.stderr, taken_port)
    assert seconds < 30, seconds
    assert not list(tmp_path.glob("splitserve-cluster-*")), "a failed start before any process leaves no folder"


def test_router_alone_on_a_taken_port_says_so_in_one_line(taken_port, model_dir):
    result, _ = _cli("router", "--port", str(taken_port), "--model", str(model_dir))
    assert result.returncode == 1, result.stderr
    _assert_one_line_about(result.stderr, taken_port)


def test_worker_alone_on_a_taken_port_says_so_in_one_line(taken_port, model_dir):
    result, _ = _cli("colocated", "--port", str(taken_port), "--model", str(model_dir), "--kv-cache-gb", "0.05",
                     "--max-model-len", "256", "--threads", "1")
    assert result.returncode == 1, result.stderr
    _assert_one_line_about(result.stderr, taken_port)


def test_launcher_names_the_child_that_exited_and_why(taken_port, tmp_path, model_dir):
    cluster = LocalCluster(router_args=["--model", str(model_dir)], router_port=taken_port, log_dir=tmp_path,
                           ready_timeout=60)
    started = time.monotonic()
    with pytest.raises(ClusterStartError) as raised:
        cluster.start_router()
    assert time.monotonic() - started < 30, "an exited child is reported when it exits, not at the timeout"
    message = str(raised.value)
    assert "\n" not in message and "router exited before serving (exit code 1)" in message, message
    assert f"127.0.0.1:{taken_port}: the port is taken" in message, message
    cluster.stop()
    assert not cluster.remove_log_dir() and any(tmp_path.glob("*-router.log")), "a log_dir given is never deleted"


@pytest.mark.timeout(400)
def test_two_processes_preparing_the_model_side_by_side_convert_it_once(tmp_path, model_dir):
    """Processes started side by side on a fresh machine (workers, pytest's workers) each need the default model:
    one converts it, the other waits for it under the conversion lock and finds it ready (each used to convert,
    and the second to finish deleted the first's folder under its readers). The folder holds the model's tensors
    and no staging folder is left."""
    from safetensors.torch import load_file

    env = {**os.environ, "SPLITSERVE_CACHE": str(tmp_path)}
    processes = [subprocess.Popen([sys.executable, "-m", "splitserve.cli", "prepare-model"], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    results = [(process.communicate(timeout=360), process.returncode) for process in processes]
    assert [code for _, code in results] == [0, 0], [err for (_, err), _ in results]
    [folder] = {out.strip() for (out, _), _ in results}
    assert sum(err.count("Model ready: ") for (_, err), _ in results) == 1, [err[-300:] for (_, err), _ in results]
    assert Path(folder).parent.parent == tmp_path and sorted(p.name for p in Path(folder).parent.iterdir()) == [
        f".{Path(folder).name}.lock", Path(folder).name]
    converted, expected = load_file(Path(folder) / "model.safetensors"), load_file(model_dir / "model.safetensors")
    assert converted.keys() == expected.keys() and all(torch.equal(converted[k], expected[k]) for k in expected)


def test_a_cluster_deletes_only_the_log_folder_it_made(tmp_path):
    made = LocalCluster()
    assert made.log_dir.is_dir() and made.log_dir.name.startswith("splitserve-cluster-")
    assert made.remove_log_dir() and not made.log_dir.exists()
    given = LocalCluster(log_dir=tmp_path / "logs")
    assert not given.remove_log_dir() and given.log_dir.is_dir()


@pytest.mark.timeout(400)
def test_up_removes_its_log_folder_after_a_clean_run_and_keeps_it_after_a_failed_one(tmp_path, model_dir,
                                                                                  built_kernels):
    engine = ["--colocated", "1", "--threads-per-worker", "1", "--max-model-len", "256", "--port", "0"]
    clean_tmp, failed_tmp = tmp_path / "clean", tmp_path / "failed"
    clean_tmp.mkdir()
    failed_tmp.mkdir()
    # The demo's question (`make demo`): the reply ends where the model ends its turn, not at --max-tokens.
    result, _ = _cli("up", *engine, "--kv-cache-gb", "0.05", "--chat", "What is the capital of France?",
                     env={"TMPDIR": str(clean_tmp)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris.", result.stdout
    assert not list(clean_tmp.glob("splitserve-cluster-*")), result.stderr
    # A KV cache too small for one sequence: the worker exits at start, the folder stays and `up` says where.
    result, _ = _cli("up", *engine, "--kv-cache-gb", "0.0000001", env={"TMPDIR": str(failed_tmp)})
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    [kept] = failed_tmp.glob("splitserve-cluster-*")
    assert f"Logs kept in {kept}." in result.stderr, result.stderr


def test_needs_compile_only_without_a_library(tmp_path):
    assert cpu_ops.needs_compile(tmp_path)
    library = tmp_path / "splitserve_cpu_kernels.so"
    library.write_bytes(b"")
    assert not cpu_ops.needs_compile(tmp_path)
    os.utime(library, (0, 0))  # older than the sources: the folder's digest, not the times, says what it holds
    assert not cpu_ops.needs_compile(tmp_path)


def test_the_build_folder_follows_the_sources_not_the_checkout(tmp_path, monkeypatch):
    """Two checkouts of the same sources (a fresh clone, CI) share one build; an edited source gets its own."""
    monkeypatch.delenv(cpu_ops.MARCH_VARIABLE, raising=False)
    copy = tmp_path / "kernels"
    shutil.copytree(Path(cpu_ops.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    for path in copy.iterdir():
        os.utime(path, (0, 0))
    here = cpu_ops.build_folder("/cache")
    monkeypatch.setattr(cpu_ops, "_FOLDER", copy)
    assert cpu_ops.build_folder("/cache") == here
    source = copy / "cpu_fused_ops.cpp"
    source.write_text(source.read_text() + "\n// an edit\n")
    edited = cpu_ops.build_folder("/cache")
    assert edited != here and edited.parent == here.parent
    assert edited.name.startswith(f"torch-{torch.__version__}-")


def _first_lines_of_a_load(cache: Path, count: int) -> tuple[list[str], bool]:
    """The first `count` stderr lines of `cpu_ops.load(cache)` in a new process, and whether it was still running
    after them. The process runs in its own session and is killed with its compiler processes, not left
    compiling for a minute."""
    code = f"from splitserve.kernels import cpu_ops; cpu_ops.load({str(cache)!r})"
    process = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = [process.stderr.readline() for _ in range(count)]
        return lines, process.poll() is None
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)


def test_a_library_that_does_not_load_is_built_again(tmp_path):
    """A library cut short (a link killed mid-way) is compiled again, not loaded and not kept."""
    build = cpu_ops.build_folder(str(tmp_path))
    build.mkdir(parents=True)
    (build / "splitserve_cpu_kernels.so").write_bytes(b"not a library")
    (refused, announced), _ = _first_lines_of_a_load(tmp_path, 2)
    assert "do not load" in refused and "compiling them again" in refused, refused
    assert cpu_ops.COMPILE_MESSAGE in announced, announced


def test_a_compile_is_announced_before_it_starts(tmp_path):
    [first_line], running = _first_lines_of_a_load(tmp_path, 1)
    assert cpu_ops.COMPILE_MESSAGE in first_line, first_line
    assert running, "the line comes before the compile, not after it"


def _load_in_a_new_process(cache: str) -> subprocess.CompletedProcess:
    code = f"from splitserve.kernels import cpu_ops; assert cpu_ops.load({cache!r}) is not None"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(400)
def test_loading_the_built_kernels_says_nothing(built_kernels):
    result = _load_in_a_new_process(built_kernels)
    assert result.returncode == 0, result.stderr
    assert "Compiling" not in result.stderr and "compiled in" not in result.stderr, result.stderr


@pytest.mark.timeout(400)
def test_a_lock_left_by_a_killed_compile_is_removed_not_waited_on(built_kernels):
    stale = cpu_ops.build_folder(built_kernels) / "lock"  # torch's baton, as a compile killed mid-way leaves it
    stale.write_text("")
    try:
        result = _load_in_a_new_process(built_kernels)
    finally:
        stale.unlink(missing_ok=True)
    assert result.returncode == 0, result.stderr
    assert "Removing a stale build lock" in result.stderr, result.stderr


def test_generate_against_no_router_says_none_answers_and_how_to_start_one():
    result, _ = _cli("generate", "--server", f"127.0.0.1:{free_port()}", "Hello")
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert "No splitserve router answers at 127.0.0.1:" in line and "splitserve up" in line, line
    assert "failed to connect" not in line, "gRPC's own text is replaced by the sentence"


def test_up_with_redis_transfer_and_no_redis_server_says_so_before_starting(tmp_path, model_dir):
    # Only the interpreter's folder on the PATH: no redis-server on it.
    result, seconds = _cli("up", "--kv-transfer", "redis", "--port", "0",
                           env={"PATH": os.path.dirname(sys.executable), "TMPDIR": str(tmp_path)})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert "none is on the PATH" in line and "--redis-url" in line, line
    assert seconds < 30 and not list(tmp_path.glob("splitserve-cluster-*")), "nothing was started"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --gpus is valid here")
def test_up_with_gpus_where_workers_run_on_the_cpu_says_so_before_starting(tmp_path, model_dir):
    result, seconds = _cli("up", "--gpus", "0,1", "--port", "0", env={"TMPDIR": str(tmp_path)})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert "--gpus places workers on GPUs, but they run on the CPU here" in line, line
    assert seconds < 30 and not list(tmp_path.glob("splitserve-cluster-*")), "nothing was started"


def test_chat_template_and_tool_flags_that_cannot_work_are_said_before_starting(tmp_path, model_dir):
    """A --chat-template that is missing or does not render, and --enable-auto-tool-choice without what it needs,
    each end the command at once with one line (exit 2), nothing started."""
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in %}")
    cases = [
        (("router", "--port", "0", "--chat-template", str(broken)),
         "The chat template cannot render a user's message: "),
        (("up", "--port", "0", "--chat-template", str(tmp_path / "missing.jinja")), "Cannot read --chat-template"),
        (("up", "--port", "0", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
         "--enable-auto-tool-choice needs --tool-call-parser and --http-port"),
        (("gateway", "--router", "127.0.0.1:1", "--port", "0", "--enable-auto-tool-choice"),
         "--enable-auto-tool-choice needs --tool-call-parser"),
    ]
    for args, words in cases:
        result, seconds = _cli(*args, env={"TMPDIR": str(tmp_path)})
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        [line] = [line for line in result.stderr.splitlines() if line.strip()]
        assert words in line, line
        assert seconds < 30 and not list(tmp_path.glob("splitserve-cluster-*")), "nothing was started"
