"""``python -m splitserve.common.die_with_parent PARENT_PID COMMAND...``: run COMMAND so that it gets SIGTERM
when process PARENT_PID dies (Linux), by asking the kernel for that signal and then replacing this process
with COMMAND (the request survives ``exec``).

The launcher starts its children through this instead of a ``preexec_fn``: a ``preexec_fn`` makes Python
``fork()`` the launcher itself, which runs every ``pthread_atfork`` handler of the launcher's libraries, and
gRPC's waits for its own threads to be quiet; with a channel busy in another thread, that wait never ended
(a test's ``Popen`` hung for 20 minutes). Without one, Python starts the child with ``vfork``, which runs no
such handler, and the child sets up its own tie here.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def main(argv: list[str]) -> int:
    if len(argv) < 2 or not argv[0].isdigit():
        print("usage: python -m splitserve.common.die_with_parent PARENT_PID COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent_pid, command = int(argv[0]), argv[1:]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            print(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            return 1
    if os.getppid() != parent_pid:  # the parent died before the request: nobody is left to stop us
        return 1
    os.execvp(command[0], command)
    return 1  # not reached: execvp replaces this process or raises


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
