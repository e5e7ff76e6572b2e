"""Start and stop the processes of a local cluster: router, workers, and a private redis-server.

Used by ``splitserve up``, the integration tests and the serving benchmark.
Every process is a child of this one, started with its own flags; each prints
``READY <address> ...`` on stdout when it serves, and logs to its own file.
Only processes started here are ever signalled, by their PID.

On Linux every child gets SIGTERM from the kernel when its parent dies, SIGKILL
included (``PR_SET_PDEATHSIG``). The kernel ties that to the *thread* that
forked the child, so start a cluster from a thread that outlives it: ``splitserve
up`` starts it from its main thread.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.common.errors import SplitserveError
from splitserve.rpc.auth import API_KEYS_ENV, CLUSTER_TOKEN_ENV
from splitserve.rpc.tls import TLSConfig

logger = logging.getLogger(__name__)

# Worker role -> its subcommand.
_COMMANDS = {"prefill": "prefill", "decode": "decode", "both": "colocated"}
# The --kv-transfer connectors whose workers meet in a Redis (--kv-address is its URL).
_REDIS_TRANSFERS = ("redis", "lmcache")
# Log lines of a starting child that its starter shows the user (``LocalCluster.progress``): the slow first start.
_PROGRESS_MARKERS = ("Compiling the C++ CPU kernels", "C++ CPU kernels compiled")


def visible_gpus(environ: dict[str, str], device_count: int) -> list[str]:
    """The GPUs this process may hand its workers, as ``CUDA_VISIBLE_DEVICES`` entries: the ones that variable
    already lists (indices or UUIDs, in its order), else every device torch counts (0, 1, ...)."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [entry.strip() for entry in listed.split(",") if entry.strip()][:device_count]
    return [str(index) for index in range(device_count)]


def place_on_gpus(roles: list[str], gpus: list[str], pairs_over_p2p: bool) -> list[str]:
    """One ``CUDA_VISIBLE_DEVICES`` value per worker of ``roles`` (prefill, decode, both), in start order.

    Workers take the GPUs in turn. Where prefill and decode workers pair over p2p (NCCL between CUDA caches on
    two GPUs, CUDA IPC between two on one) and two or more GPUs are visible, the GPUs are first divided between
    the two pools in proportion to their sizes (each pool at least one), and each pool takes its own in turn: no
    prefill worker shares a GPU with a decode worker, so every pair moves its blocks GPU to GPU over NCCL, while
    workers of one pool may share theirs. On one GPU every worker shares it, and pairs copy their blocks within
    it (CUDA IPC; ``kvtransfer/p2p_mapped.py``).

    Raises:
        ValueError: no GPU to place on.
    """
    if not gpus:
        raise ValueError("The workers run on CUDA, but no GPU is visible to place them on.")
    num_prefill, num_decode = roles.count("prefill"), roles.count("decode")
    if not (pairs_over_p2p and num_prefill and num_decode and len(gpus) > 1):  # no pair to keep apart
        return [gpus[index % len(gpus)] for index in range(len(roles))]
    share = min(len(gpus) - 1, max(1, round(len(gpus) * num_prefill / max(1, num_prefill + num_decode))))
    pools = {"prefill": gpus[:share], "decode": gpus[share:]}
    taken = {"prefill": 0, "decode": 0}
    placed = []
    for role in roles:
        pool = pools[role]
        placed.append(pool[taken[role] % len(pool)])
        taken[role] += 1
    return placed


def gpu_memory_shares(placed: list[str], utilization: float) -> list[float]:
    """Each worker's share of its GPU's memory (its ``--gpu-memory-utilization``), for workers placed on ``placed``
    (:func:`place_on_gpus`): ``utilization`` divided evenly among the workers on one GPU, so that together they
    take no more than it (each engine sizes its KV cache from its own share)."""
    return [utilization / placed.count(gpu) for gpu in placed]


def threads_per_worker(num_workers: int, cpus: int | None = None) -> int:
    """Torch threads for each of ``num_workers`` workers sharing this machine: its ``cpus`` (default: those this
    process may run on) divided among them, at least 1. Each worker's OpenMP threads spin while they wait for
    each other, so workers whose threads outnumber the cores slow each other down: on 2 cores, a prefill and a
    decode worker of 2 threads each took 12 s to start and 22.7 s of CPU for `up --chat`, of 1 thread each 7 s
    and 10.8 s."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus // max(1, num_workers))


class ClusterStartError(SplitserveError):
    """A child exited, or stayed silent too long, before it served: the message says which, how, and its last error."""


class _PortTaken(Exception):
    """redis-server exited: its port was taken."""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _die_with_parent(command: list[str], python: str) -> list[str]:
    """``command`` started through ``splitserve.common.die_with_parent``, so that it gets SIGTERM when this
    process dies (Linux); ``command`` itself elsewhere (PR_SET_PDEATHSIG is Linux-only). No ``preexec_fn``:
    with one Python forks this process, and gRPC's fork handler can hang on a busy channel (see that module)."""
    if not sys.platform.startswith("linux"):
        logger.debug("Children are not tied to this process's life on %s (PR_SET_PDEATHSIG is Linux-only).",
                     sys.platform)
        return command
    return [python, "-m", "splitserve.common.die_with_parent", str(os.getpid()), *command]


@dataclass
class Process:
    """One child process of the cluster."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""
    worker_id: str = ""
    terminated: bool = False  # SIGTERM sent: it drains, and a second one would kill it mid-drain

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def exit_description(self) -> str:
        """How the process ended: "exit code N" or "signal SIGKILL"; "running" while it runs."""
        code = self.popen.poll()
        if code is None:
            return "running"
        if code < 0:
            try:
                return f"signal {signal.Signals(-code).name}"
            except ValueError:
                return f"signal {-code}"
        return f"exit code {code}"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def terminate(self) -> None:
        """SIGTERM once: the process drains and exits. A process restores SIGTERM's default action once it has
        begun to drain, so a second one would end the drain."""
        if not self.terminated and self.popen.poll() is None:
            self.terminated = True
            self.popen.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (unless sent already), then SIGKILL after ``timeout``; waits for the exit."""
        if self.popen.poll() is not None:
            return
        self.terminate()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)

    def kill(self) -> None:
        """SIGKILL at once (a crash, for failure tests)."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)


def _wait_ready(process: Process, timeout: float, progress: Callable[[str], None] | None = None) -> str:
    """Read the child's stdout until its READY line; returns the line.

    ``progress``: called with each new line of the child's log that starts a slow step (``_PROGRESS_MARKERS``).

    Raises:
        ClusterStartError: the child exited first (its last log line, usually its error, in one line), or
            ``timeout`` passed (the child is killed; the tail of its log follows).
    """
    lines: list[str] = []
    done = threading.Event()

    def read() -> None:
        for line in process.popen.stdout:
            if line.startswith("READY "):
                lines.append(line.strip())
                done.set()
                return
        done.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    shown = 0
    while not done.wait(min(0.5, max(deadline - time.monotonic(), 0))) and time.monotonic() < deadline:
        if progress is not None:
            shown = _show_progress(process, shown, progress)
    if progress is not None:
        _show_progress(process, shown, progress)
    if lines:
        return lines[0]
    if done.is_set():  # stdout closed: the child is exiting
        try:
            process.popen.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
        last = next((line.strip() for line in reversed(process.log().splitlines()) if line.strip()), "no log line")
        raise ClusterStartError(f"{process.name} exited before serving ({process.exit_description()}): {last} "
                                f"(its log: {process.log_path})")
    process.kill()
    tail = "\n".join(process.log().splitlines()[-30:])
    raise ClusterStartError(f"{process.name} did not become ready within {timeout:.0f} s. Its log "
                            f"({process.log_path}):\n{tail}")


def _show_progress(process: Process, shown: int, progress: Callable[[str], None]) -> int:
    """Pass on the child's log lines after the first ``shown`` that carry a progress marker, from the marker on
    (no timestamp or fields); returns how many lines the log has now."""
    log_lines = process.log().splitlines()
    for line in log_lines[shown:]:
        for marker in _PROGRESS_MARKERS:
            if marker in line:
                progress(f"{process.name}: {line[line.index(marker):]}")
                break
    return len(log_lines)


@dataclass
class LocalCluster:
    """A router and its workers as child processes.

    Args:
        kv_transfer: "p2p", "redis" or "lmcache".
        kv_checksum: "xxh3" or "none" (the workers' --kv-checksum).
        redis_url: Redis for the redis and lmcache connectors (None: start a private redis-server).
        worker_args: extra flags for every worker (engine options).
        router_args: extra flags for the router.
        log_dir: where each process logs (default: a new temporary folder, which :meth:`remove_log_dir` deletes;
            a folder given here is never deleted).
        python: the interpreter to run (default: this one).
        env: extra environment variables of every process.
        generate_cluster_token: generate a random cluster token (the attribute ``cluster_token``) and give it
            to the router and every worker through their environment (``SPLITSERVE_CLUSTER_TOKEN``, never
            their command lines, which ``ps`` shows); off: router-worker calls are open (``cluster_token`` None).
        require_api_key: generate a random API key (the attribute ``api_key``, for clients) that the router
            requires (``SPLITSERVE_API_KEYS`` in its environment); off: the public API is open (``api_key`` None).
        tls: run every channel on TLS: its files go to the router and every worker as ``--tls-cert``,
            ``--tls-key``, ``--tls-ca`` (``--tls-server-name``), so each serves and calls with them (mutual
            with a CA); clients of the cluster use the same configuration (``Client(address, tls=cluster.tls)``).
            None: plaintext.
        progress: called with each line of a starting child's log that says a slow step began or ended (the
            first start's kernel compile), so a caller can show it; None: not shown.
    """

    kv_transfer: str = "p2p"
    kv_checksum: str = "xxh3"
    redis_url: str | None = None
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    log_dir: Path | None = None
    host: str = "127.0.0.1"
    router_port: int = 0
    python: str = sys.executable
    ready_timeout: float = 300.0
    env: dict[str, str] = field(default_factory=dict, repr=False)
    generate_cluster_token: bool = False
    require_api_key: bool = False
    tls: TLSConfig | None = None
    progress: Callable[[str], None] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        # Secrets travel in the children's environment only; the flags above stay booleans in repr.
        self._secret_env: dict[str, str] = {}
        self.cluster_token: str | None = secrets.token_urlsafe(32) if self.generate_cluster_token else None
        if self.cluster_token:
            self._secret_env[CLUSTER_TOKEN_ENV] = self.cluster_token
        self.api_key: str | None = secrets.token_urlsafe(32) if self.require_api_key else None
        if self.api_key:
            self._secret_env[API_KEYS_ENV] = self.api_key
        self._owns_log_dir = self.log_dir is None
        self.log_dir = Path(self.log_dir or tempfile.mkdtemp(prefix="splitserve-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.router: Process | None = None
        self.workers: list[Process] = []
        self.redis: Process | None = None
        self.gateway: Process | None = None
        self._counter = 0

    # ---- processes -----------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None, secrets: bool = True) -> Process:
        """Start ``splitserve <args>``; ``secrets``: give it the cluster's token and API key (the router and the
        workers need them; the gateway does not)."""
        self._counter += 1
        log_path = self.log_dir / f"{self._counter:02d}-{name}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(env or {}),
               **(self._secret_env if secrets else {})}
        with open(log_path, "w") as log:
            popen = subprocess.Popen(
                _die_with_parent([self.python, "-m", "splitserve.cli", *args, *self._tls_flags()], self.python),
                stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True,
            )
        return Process(name, popen, log_path)

    def _tls_flags(self) -> list[str]:
        """The TLS flags of every child: file paths only (a key's content never leaves its file)."""
        if self.tls is None:
            return []
        flags = []
        for flag, value in (("--tls-cert", self.tls.cert_file), ("--tls-key", self.tls.key_file),
                            ("--tls-ca", self.tls.ca_file), ("--tls-server-name", self.tls.server_name)):
            if value:
                flags += [flag, value]
        return flags

    def start_redis(self, port: int | None = None) -> str:
        """Start a private redis-server on ``port`` (None: a free loopback port); returns its URL.

        A port found free may be taken before redis-server binds it (by an outgoing connection's ephemeral
        port); redis-server then exits saying so, and a port chosen here is chosen again, at most 3 times.
        """
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not on the PATH; install Redis or pass --redis-url.")
        for attempt in range(1 if port else 3):
            try:
                return self._start_redis(binary, port or free_port(self.host))
            except _PortTaken:
                if attempt == 2:
                    raise RuntimeError("redis-server found each of 3 free ports taken before it could bind it; "
                                       f"see {self.log_dir / '00-redis.log'}.") from None
        raise RuntimeError(f"redis-server could not bind port {port}: it is in use.")

    def _start_redis(self, binary: str, port: int) -> str:
        log_path = self.log_dir / "00-redis.log"
        with open(log_path, "w") as log:
            popen = subprocess.Popen(
                _die_with_parent([binary, "--port", str(port), "--bind", self.host, "--save", "", "--appendonly",
                                  "no"], self.python),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.redis = Process("redis", popen, log_path, address=f"{self.host}:{port}")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((self.host, port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return f"redis://{self.host}:{port}/0"
            except OSError:
                if popen.poll() is not None and "Address already in use" in log_path.read_text(errors="replace"):
                    raise _PortTaken() from None
                time.sleep(0.05)
        raise RuntimeError(f"redis-server did not start on port {port}; see {log_path}.")

    def start_router(self) -> str:
        """Start the router; returns its address once it serves.

        The router reads the model's tokenizer and config.json but never converts a model: without
        ``--model`` in ``router_args`` the default model is converted here first (once; a no-op after).
        """
        if "--model" not in self.router_args:
            from splitserve.engine.model_store import prepare_default_model

            prepare_default_model(self.env.get("SPLITSERVE_CACHE"))
        # Port 0: the router binds a free port itself and prints it (a port found free here could be taken
        # before the router bound it, as a redis-server's was).
        self.router = self._spawn("router", ["router", "--host", self.host, "--port", str(self.router_port),
                                             *self.router_args])
        line = _wait_ready(self.router, self.ready_timeout, self.progress)
        self.router.address = line.split()[1]
        return self.router.address

    def start_gateway(self, port: int = 0, extra_args: list[str] | None = None) -> str:
        """Start the OpenAI-compatible HTTP gateway (``splitserve gateway``, with ``extra_args``) on
        ``host``:``port`` (0: a free port) in front of the router; returns its base URL once it listens. It gets
        neither the cluster token nor the API key: it calls only the router, with each HTTP caller's own key."""
        if self.router is None:
            raise RuntimeError("Start the router first.")
        self.gateway = self._spawn("gateway", ["gateway", "--router", self.router.address, "--host", self.host,
                                               "--port", str(port), *(extra_args or [])], secrets=False)
        self.gateway.address = _wait_ready(self.gateway, self.ready_timeout, self.progress).split()[1]
        return self.gateway.address

    def start_workers(self, role: str, count: int = 1, extra_args: list[str] | None = None,
                      env: dict[str, str] | None = None, gpus: list[str] | None = None,
                      memory_shares: list[float] | None = None) -> list[Process]:
        """Start ``count`` workers of ``role`` (prefill, decode, both) registered with the router; waits until ready.

        ``env``: extra environment variables of these workers only (on top of the cluster's ``env``).
        ``gpus``: one ``CUDA_VISIBLE_DEVICES`` value per worker (:func:`place_on_gpus`); None leaves it alone.
        ``memory_shares``: one ``--gpu-memory-utilization`` per worker (:func:`gpu_memory_shares`); None passes none.
        """
        return self.await_workers(self.spawn_workers(role, count, extra_args, env, gpus, memory_shares))

    def start_pools(self, prefill: int, decode: int, gpus: list[str] | None = None,
                    memory_shares: list[float] | None = None) -> list[Process]:
        """Start ``prefill`` prefill and ``decode`` decode workers side by side (the decode pool does not wait
        for the prefill pool to load its model); waits until all are ready. ``gpus`` and ``memory_shares``:
        one per worker, the prefill workers' first (as :meth:`start_workers`)."""
        spawned = []
        for role, count, first in (("prefill", prefill, 0), ("decode", decode, prefill)):
            if count:
                spawned += self.spawn_workers(role, count, gpus=gpus and gpus[first:first + count],
                                              memory_shares=memory_shares and memory_shares[first:first + count])
        return self.await_workers(spawned)

    def spawn_workers(self, role: str, count: int = 1, extra_args: list[str] | None = None,
                      env: dict[str, str] | None = None, gpus: list[str] | None = None,
                      memory_shares: list[float] | None = None) -> list[Process]:
        """Launch ``count`` workers of ``role`` without waiting for them (:meth:`await_workers` does); they are
        in ``workers`` at once, so :meth:`stop` stops them whatever happens next."""
        for name, placements in (("GPU placements", gpus), ("memory shares", memory_shares)):
            if placements is not None and len(placements) != count:
                raise ValueError(f"{count} workers need {count} {name}, got {len(placements)}.")
        if self.router is None:
            raise RuntimeError("Start the router first.")
        uses_redis = self.kv_transfer in _REDIS_TRANSFERS and role != "both"
        if uses_redis and self.redis_url is None:
            self.redis_url = self.start_redis()
        started = []
        for index in range(count):
            args = [_COMMANDS[role], "--host", self.host, "--port", "0", "--router", self.router.address,
                    *self.worker_args, *(extra_args or [])]
            if role != "both":
                args += ["--kv-transfer", self.kv_transfer, "--kv-checksum", self.kv_checksum]
            if uses_redis:
                args += ["--kv-address", self.redis_url]
            if memory_shares is not None:
                args += ["--gpu-memory-utilization", f"{memory_shares[index]:.6g}"]
            worker_env = {**(env or {}), **({"CUDA_VISIBLE_DEVICES": gpus[index]} if gpus is not None else {})}
            process = self._spawn(f"{role}{len(self.workers)}", args, worker_env)
            self.workers.append(process)
            started.append(process)
        return started

    def await_workers(self, processes: list[Process]) -> list[Process]:
        """Wait until each of ``processes`` (from :meth:`spawn_workers`) is ready; sets its address and worker id.

        Raises:
            ClusterStartError: as :func:`_wait_ready` (a worker that exited or did not get ready in time).
        """
        for process in processes:
            line = _wait_ready(process, self.ready_timeout, self.progress).split()
            process.address, process.worker_id = line[1], line[3]
        return processes

    def processes(self) -> list[Process]:
        """Every process started so far: Redis, the router, the workers in start order, then the gateway."""
        return [p for p in (self.redis, self.router, *self.workers, self.gateway) if p is not None]

    def watch(self, stop: threading.Event, interval: float = 0.5) -> Process | None:
        """Poll every child each ``interval`` seconds (reaping any that exited) until ``stop`` is set.

        Returns:
            The first child found exited (it was not asked to stop), or None once ``stop`` is set.
        """
        while not stop.wait(interval):
            for process in self.processes():
                if not process.alive():
                    return process
        return None

    def stop(self) -> None:
        """Stop the gateway, the workers, then the router, then Redis; each SIGTERM first, SIGKILL if it hangs."""
        if self.gateway is not None:
            self.gateway.stop()
        for process in self.workers:  # all drain at once
            process.terminate()
        for process in self.workers:
            process.stop()
        if self.router is not None:
            self.router.stop()
        if self.redis is not None:
            self.redis.stop(5)

    def remove_log_dir(self) -> bool:
        """Delete the log folder if this cluster created it (no ``log_dir`` given); call after :meth:`stop`.

        Returns:
            Whether it was deleted; a folder the caller named is kept.
        """
        if not self._owns_log_dir:
            return False
        shutil.rmtree(self.log_dir, ignore_errors=True)
        return True

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
