"""`splitserve up` supervises its children: a crashed worker stops the cluster, and a killed launcher takes them along.

Real processes on loopback; the children are found through /proc (their parent pid), not through anything
`up` prints, so these tests fail on a launcher that does not supervise.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from splitserve.launcher import free_port, threads_per_worker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and PR_SET_PDEATHSIG are Linux's")

UP_ARGS = ["--prefill", "1", "--decode", "1", "--kv-cache-gb", "0.25", "--max-model-len", "512"]
READY_TIMEOUT = 240.0


def _children_of(parent_pid: int) -> dict[int, str]:
    """pid -> command line of every live process whose parent is ``parent_pid``."""
    children = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, ...
        if int(fields[1]) == parent_pid and fields[0] != "Z":
            children[int(entry.name)] = cmdline
    return children


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _kill_all(pids) -> None:
    for pid in pids:
        if _alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _start_up(tmp_path: Path, up_args: list[str] = UP_ARGS) -> tuple[subprocess.Popen, Path]:
    stderr_path = tmp_path / "up.stderr"
    with open(stderr_path, "w") as stderr:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "splitserve.cli", "up", "--port", str(free_port()), "--log-dir",
             str(tmp_path / "logs"), *up_args],
            stdout=subprocess.DEVNULL, stderr=stderr, text=True,
        )
    return launcher, stderr_path


def _wait_serving(launcher: subprocess.Popen, stderr_path: Path) -> dict[int, str]:
    """Wait for "splitserve is serving on"; returns the launcher's three children (router, prefill, decode; or
    router, a colocated worker and the gateway)."""
    deadline = time.monotonic() + READY_TIMEOUT
    while "splitserve is serving on" not in stderr_path.read_text():
        assert launcher.poll() is None, f"up exited early:\n{stderr_path.read_text()}"
        assert time.monotonic() < deadline, f"up did not serve in time:\n{stderr_path.read_text()}"
        time.sleep(0.2)
    children = _children_of(launcher.pid)
    assert len(children) == 3, children
    return children


def _wait_gone(pids, timeout: float) -> list[int]:
    """Wait up to ``timeout`` seconds; returns the pids still alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(pid) for pid in pids):
            return []
        time.sleep(0.1)
    return [pid for pid in pids if _alive(pid)]


def test_a_crashed_worker_stops_the_cluster_with_status_1(tmp_path, model_dir):
    launcher, stderr_path = _start_up(tmp_path)
    children: dict[int, str] = {}
    try:
        children = _wait_serving(launcher, stderr_path)
        decode_pid = next(pid for pid, cmdline in children.items() if " decode " in f" {cmdline} ")
        os.kill(decode_pid, signal.SIGKILL)
        try:
            status = launcher.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"up still runs 20 s after its decode worker died:\n{stderr_path.read_text()}")
        stderr = stderr_path.read_text()
        assert status == 1, stderr
        assert f"decode1 (pid {decode_pid}) exited unexpectedly (signal SIGKILL)" in stderr, stderr
        assert str(tmp_path / "logs") in stderr.split("exited unexpectedly", 1)[1], stderr
        assert _wait_gone(children, 5) == [], {pid: children[pid] for pid in children if _alive(pid)}
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(10)
        _kill_all(children)


def test_children_die_with_a_killed_launcher(tmp_path, model_dir):
    launcher, stderr_path = _start_up(tmp_path)
    children: dict[int, str] = {}
    try:
        children = _wait_serving(launcher, stderr_path)
        # Without --threads-per-worker the two workers share out the CPUs this process may run on.
        threads = threads_per_worker(2)
        workers = [cmdline for cmdline in children.values() if " prefill " in cmdline or " decode " in cmdline]
        assert len(workers) == 2 and all(f" --threads {threads} " in cmdline for cmdline in workers), workers
        assert f", {threads} torch thread{'s' if threads > 1 else ''} each" in stderr_path.read_text()
        launcher.kill()
        launcher.wait(10)
        left = _wait_gone(children, 15)
        assert left == [], {pid: children[pid] for pid in left}
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(10)
        _kill_all(children)


def test_up_serves_openai_http_through_a_supervised_gateway_that_holds_no_secret(tmp_path, model_dir):
    launcher, stderr_path = _start_up(tmp_path, ["--http-port", "0", "--colocated", "1", "--kv-cache-gb", "0.1",
                                                 "--max-model-len", "512"])
    children: dict[int, str] = {}
    try:
        children = _wait_serving(launcher, stderr_path)
        url = re.search(r"OpenAI-compatible HTTP on (http://127\.0\.0\.1:\d+/v1)", stderr_path.read_text()).group(1)
        reply = httpx.post(f"{url}/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0})
        assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == \
            "The capital of France is Paris.", reply.text
        [gateway_pid] = [pid for pid, cmdline in children.items() if " gateway " in cmdline]
        environment = Path(f"/proc/{gateway_pid}/environ").read_bytes().split(b"\0")
        assert not any(entry.startswith(b"SPLITSERVE_CLUSTER_TOKEN=") for entry in environment)
        # The gateway is supervised like the rest: killed, it stops the cluster with status 1.
        os.kill(gateway_pid, signal.SIGKILL)
        assert launcher.wait(20) == 1, stderr_path.read_text()
        assert f"gateway (pid {gateway_pid}) exited unexpectedly (signal SIGKILL)" in stderr_path.read_text()
        assert _wait_gone(children, 15) == [], {pid: children[pid] for pid in children if _alive(pid)}
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.wait(10)
        _kill_all(children)


def test_a_private_redis_whose_free_port_was_taken_starts_on_another(tmp_path, monkeypatch):
    """A port found free can be taken before redis-server binds it: the launcher then starts it on a fresh one;
    a port the caller chose is not changed."""
    import socket

    from splitserve import launcher

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        monkeypatch.setattr(launcher, "free_port", lambda host="127.0.0.1": next(ports, None) or free_port(host))
        cluster = launcher.LocalCluster(log_dir=tmp_path)
        url = cluster.start_redis()
        try:
            assert url.startswith("redis://127.0.0.1:") and not url.endswith(f":{busy}/0")
        finally:
            cluster.redis.stop(5)
        with pytest.raises(RuntimeError, match=f"could not bind port {busy}: it is in use"):
            launcher.LocalCluster(log_dir=tmp_path / "chosen").start_redis(busy)
