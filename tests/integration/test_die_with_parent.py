"""splitserve.common.die_with_parent: the launcher's children get SIGTERM when the launcher dies, set up
without a preexec_fn (which made Python fork the launcher, and gRPC's fork handler could hang there)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

SHIM = [sys.executable, "-m", "splitserve.common.die_with_parent"]


def test_it_runs_the_command_in_its_place_and_refuses_an_orphan_or_bad_usage():
    assert subprocess.run([*SHIM, str(os.getpid()), "sh", "-c", "exit 3"]).returncode == 3
    # Its parent is this process, not pid 1: as if the parent had died before the shim ran.
    assert subprocess.run([*SHIM, "1", "sh", "-c", "exit 0"]).returncode == 1
    usage = subprocess.run([*SHIM, "sh"], capture_output=True, text=True)
    assert usage.returncode == 2 and "usage:" in usage.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_parent(tmp_path):
    pid_file = tmp_path / "child.pid"
    # A parent that starts `sleep 60` through the shim, writes its pid, and is then killed.
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys, time
        child = subprocess.Popen({SHIM!r} + [str(os.getpid()), "sleep", "60"])
        time.sleep(1.0)
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(60)
    """)])
    deadline = time.monotonic() + 20
    while not (pid_file.exists() and pid_file.read_text()):
        assert time.monotonic() < deadline and parent.poll() is None
        time.sleep(0.05)
    child_pid = int(pid_file.read_text())
    assert "sleep" in open(f"/proc/{child_pid}/cmdline").read()  # exec'd in place of the shim
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{child_pid}") and open(f"/proc/{child_pid}/stat").read().split()[2] != "Z":
        assert time.monotonic() < deadline, "the child outlived its parent"
        time.sleep(0.05)
