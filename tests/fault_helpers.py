"""What the fault-injection tests (tests/faults) check after every fault, and the load they run during it.

After a fault, every request must have ended one of two ways:

- complete (``FINISH_REASON_STOP`` or ``_LENGTH``) and token-identical to the same prompt's undisturbed greedy run;
- a documented ending with a sentence: a status code of ``DOCUMENTED_STATUS_CODES`` with details, or a last
  message with ``FINISH_REASON_ERROR`` and an ``error_message`` (or ``FINISH_REASON_ABORT`` where the test aborted
  it), the tokens before it a prefix of the undisturbed run's.

A request that hung past its deadline, ended another way, or streamed a wrong token is *lost*. Then the cluster
must settle: every worker's KV blocks free, the router's in-flight count of every worker zero, no key of ours
without a TTL in Redis, and after ``stop()`` no process the cluster started (or any process of their sessions).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from splitserve.v1 import inference_pb2
from tests.cluster_helpers import wait_until, worker_status

# Before any token: the codes inference.proto documents for a request that could not run (with a sentence).
DOCUMENTED_STATUS_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED})
COMPLETE = (inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH)
# Our keys in Redis (the redis connector's default prefix, and anything else of ours under it).
REDIS_KEY_PATTERN = "splitserve:*"


@dataclass
class Outcome:
    """How one request ended, as its client saw it."""

    label: str
    prompt_index: int
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    # The last message's finish reason (None: the call ended with a status code, or never ended).
    finish_reason: int | None = None
    error_message: str = ""
    status: grpc.StatusCode | None = None
    details: str = ""
    ended: bool = False
    # The client cancelled the call itself (so CANCELLED is its own doing).
    cancelled_by_client: bool = False
    # Abort was called for it (so FINISH_REASON_ABORT is expected).
    aborted_by_test: bool = False

    @property
    def completed(self) -> bool:
        return self.finish_reason in COMPLETE

    def describe(self) -> str:
        if not self.ended:
            return f"{self.label}: never ended"
        if self.status is not None:
            return f"{self.label}: {self.status.name} ({self.details[:200]!r}) after {len(self.token_ids)} tokens"
        name = inference_pb2.FinishReason.Name(self.finish_reason) if self.finish_reason is not None else "none"
        return f"{self.label}: {name} after {len(self.token_ids)} tokens {self.error_message[:200]!r}"


def stream_request(address: str, prompt, prompt_index: int, max_tokens: int, timeout: float, label: str = "",
                   request_id: str | None = None, on_token: Callable[[Outcome, grpc.Future], None] | None = None,
                   ) -> Outcome:
    """Run one greedy streaming request on its own channel; returns how it ended (never raises for the call).

    ``on_token(outcome, call)`` runs after each message with tokens (it may cancel ``call``).
    """
    request_id = request_id or f"fault-{uuid.uuid4().hex[:12]}"
    outcome = Outcome(label or request_id, prompt_index, request_id)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with Client(address) as client:
        call = client.generate_stream(prompt, params, request_id=request_id, timeout=timeout)
        try:
            for chunk in call:
                outcome.token_ids.extend(chunk.token_ids)
                if chunk.finish_reason != inference_pb2.FINISH_REASON_UNSPECIFIED:
                    outcome.finish_reason = chunk.finish_reason
                    outcome.error_message = chunk.error_message
                if chunk.token_ids and on_token is not None:
                    on_token(outcome, call)
        except grpc.RpcError as error:
            outcome.status, outcome.details = error.code(), error.details() or ""
        outcome.ended = True
    return outcome


class Load:
    """A few streaming requests on threads, each prompt by index into ``prompts``; join() returns their outcomes."""

    def __init__(self, address: str, prompts: list, indexes: list[int], max_tokens: int, timeout: float = 90.0,
                 label: str = "request", on_token=None) -> None:
        self.timeout = timeout
        self.outcomes: list[Outcome] = []
        self._threads = []
        for number, index in enumerate(indexes):
            outcome_label = f"{label} {number} (prompt {index})"
            thread = threading.Thread(target=self._run, daemon=True, name=f"load-{number}",
                                      args=(address, prompts[index], index, max_tokens, outcome_label, on_token))
            self._threads.append(thread)

    def _run(self, address, prompt, index, max_tokens, label, on_token) -> None:
        try:
            outcome = stream_request(address, prompt, index, max_tokens, self.timeout, label, on_token=on_token)
        except Exception as error:  # the client itself failed: recorded as never ended, with the error
            outcome = Outcome(label, index, "", details=f"client error: {error!r}")
        self.outcomes.append(outcome)

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def join(self) -> list[Outcome]:
        """Wait for every request (bounded by their deadline and a margin); a thread still running is a hang."""
        deadline = time.monotonic() + self.timeout + 30
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0.1))
        hung = [thread.name for thread in self._threads if thread.is_alive()]
        assert not hung, f"requests still running {self.timeout + 30:.0f} s after they started: {hung}"
        return list(self.outcomes)


@dataclass
class Tally:
    """How the requests of one fault ended."""

    completed: int = 0
    documented: Counter = field(default_factory=Counter)  # ending -> count
    lost: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return self.completed + sum(self.documented.values()) + len(self.lost)


def tally(outcomes: list[Outcome], expected: dict[int, list[int]], allow: frozenset[str] = frozenset()) -> Tally:
    """Classify every outcome (see the module docstring); ``allow`` names documented endings beyond the statuses:
    "error" (FINISH_REASON_ERROR with a sentence), "abort" (FINISH_REASON_ABORT, only where the test aborted)."""
    result = Tally()
    for outcome in outcomes:
        want = expected[outcome.prompt_index]
        problem = _problem(outcome, want, allow)
        if problem:
            result.lost.append(f"{outcome.describe()}: {problem}")
        elif outcome.completed:
            result.completed += 1
        else:
            ending = outcome.status.name if outcome.status is not None else inference_pb2.FinishReason.Name(
                outcome.finish_reason)
            result.documented[ending] += 1
    return result


def _problem(outcome: Outcome, want: list[int], allow: frozenset[str]) -> str:
    """Why the outcome is lost, or "" when it is fine."""
    if not outcome.ended:
        return "the call never ended"
    if outcome.token_ids != want[: len(outcome.token_ids)]:
        return f"wrong tokens: {outcome.token_ids} is not a prefix of the undisturbed run's {want}"
    if outcome.status is not None:
        if outcome.status not in DOCUMENTED_STATUS_CODES:
            return f"status {outcome.status.name} is not one a request is documented to end with"
        if outcome.status == grpc.StatusCode.CANCELLED and not outcome.cancelled_by_client:
            return "CANCELLED although the client did not cancel"
        if not outcome.details.strip():
            return "a status without a sentence"
        return ""
    if outcome.finish_reason is None:
        return "the stream ended without a finish reason"
    if outcome.completed:
        return "" if outcome.token_ids == want else f"completed with {outcome.token_ids}, expected {want}"
    if outcome.finish_reason == inference_pb2.FINISH_REASON_ERROR and "error" in allow:
        return "" if outcome.error_message.strip() else "FINISH_REASON_ERROR without a sentence"
    if outcome.finish_reason == inference_pb2.FINISH_REASON_ABORT and "abort" in allow and outcome.aborted_by_test:
        return ""
    return f"finish reason {inference_pb2.FinishReason.Name(outcome.finish_reason)} is not allowed here"


def assert_nothing_lost(outcomes: list[Outcome], expected: dict[int, list[int]], allow: frozenset[str] = frozenset(),
                        at_least_completed: int = 0) -> Tally:
    """Every request complete and right, or ended as documented; returns the tally (printed for the report)."""
    result = tally(outcomes, expected, allow)
    print(f"\n{result.total} requests: {result.completed} completed, documented endings "
          f"{dict(result.documented)}, lost {len(result.lost)}")
    assert not result.lost, "lost requests:\n" + "\n".join(result.lost)
    if result.completed < at_least_completed:
        endings = "\n".join(outcome.describe() for outcome in outcomes if not outcome.completed)
        raise AssertionError(f"only {result.completed} requests completed, {at_least_completed} expected:\n{endings}")
    return result


# ---- the cluster settles ------------------------------------------------------------------------


def cluster_workers(client: Client) -> list[inference_pb2.WorkerStatus]:
    return [worker for pool in client.cluster_status().pools for worker in pool.workers]


def _settled(client: Client, num_workers: int | None) -> str:
    """"" when every worker's blocks are free and the router has no call open on it; else what is not."""
    workers = cluster_workers(client)
    if num_workers is not None and len(workers) != num_workers:
        return f"{len(workers)} workers in the cluster status, expected {num_workers}"
    for worker in workers:
        load = worker.load
        if not load.num_total_kv_blocks or load.num_free_kv_blocks != load.num_total_kv_blocks:
            return f"{worker.worker_id}: {load.num_free_kv_blocks} of {load.num_total_kv_blocks} KV blocks free"
        if worker.num_router_in_flight_requests:
            return f"{worker.worker_id}: the router has {worker.num_router_in_flight_requests} calls open on it"
    return ""


def assert_settled(cluster, client: Client, num_workers: int | None = None, timeout: float = 30.0) -> None:
    """Wait until every worker in the cluster status has all its KV blocks free and the router's in-flight count
    of it is zero, and every live worker process itself says it holds no request. Both views are asked on each
    try: the cluster status carries each worker's last heartbeat, so it can read free while a worker still
    finishes the abort of a cancelled stream (seen once in a whole-suite run: the router's view settled, and
    the decode worker asked right after still ran one request)."""
    last = ["not checked"]

    def settled() -> bool:
        last[0] = _settled(client, num_workers) or _workers_idle(cluster)
        return not last[0]

    try:
        wait_until(settled, timeout, interval=0.3, message="the cluster settling")
    except AssertionError:
        raise AssertionError(f"the cluster did not settle within {timeout} s: {last[0]}") from None


def _workers_idle(cluster) -> str:
    """"" when every live worker process itself says it holds no request; else which one does."""
    for process in cluster.workers:
        if process.alive() and process.address:
            role = "prefill" if process.name.startswith("prefill") else "decode"
            load = worker_status(process.address, role).status.load
            if (load.num_running_requests, load.num_waiting_requests, load.num_waiting_for_remote_kvs_requests) != (0, 0, 0):
                return f"{process.name} still holds requests: {load}"
    return ""


def assert_redis_clean(redis_url: str) -> None:
    """Redis holds no key of ours without a TTL (a key with one goes away on its own)."""
    import redis

    server = redis.Redis.from_url(redis_url)
    try:
        lasting = [key for key in server.scan_iter(match=REDIS_KEY_PATTERN, count=1000) if server.ttl(key) == -1]
    finally:
        server.close()
    assert not lasting, f"keys of ours without a TTL left in Redis: {lasting[:10]}"


# ---- processes ------------------------------------------------------------------------------------


class ProcessLedger:
    """Every process a test's clusters started, so that none outlives them (the router or Redis may be replaced)."""

    def __init__(self) -> None:
        self.processes: dict[int, str] = {}

    def note(self, cluster) -> None:
        for process in cluster.processes():
            self.processes[process.pid] = process.name

    def assert_none_left(self, timeout: float = 20.0) -> None:
        """None of the noted processes, nor any process in one of their sessions, is alive."""
        deadline = time.monotonic() + timeout
        left = self._left()
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = self._left()
        assert not left, f"processes of ours still alive after stop(): {left}"

    def _left(self) -> dict[int, str]:
        left = {pid: name for pid, name in self.processes.items() if _alive(pid)}
        sessions = set(self.processes)  # each child leads its own session (start_new_session)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) not in left:
                try:
                    if os.getsid(int(entry.name)) in sessions and _alive(int(entry.name)):
                        left[int(entry.name)] = f"in the session of {self.processes[os.getsid(int(entry.name))]}"
                except (OSError, KeyError):
                    continue
        return left


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def resume_if_stopped(process) -> None:
    """SIGCONT a process this test stopped (harmless when it runs or is gone)."""
    if process.alive():
        try:
            os.kill(process.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
