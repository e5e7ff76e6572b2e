"""EngineLoop: one thread drives an LLMEngine; any thread submits requests and reads their outputs.

The engine itself is single-threaded. Services (the gRPC workers) handle each
call on its own thread, so they talk to the engine through this loop:
``submit`` returns a :class:`RequestStream` to iterate, ``abort`` and ``call``
run on the loop thread between steps. Nothing here knows about gRPC.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from splitserve.common.block_hash import check_cache_salt
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.kv_connector import KVTransferParams
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.lora import LoRARequest
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.parallel_sampling import ParallelSamples
from splitserve.engine.pooling import PoolingParams
from splitserve.engine.request import KVFork

logger = logging.getLogger(__name__)
_STOP = object()


@dataclass(frozen=True)
class Accepted:
    """What the engine reserved for a request when it took it."""

    # Leading prompt tokens already in this engine's prefix cache (remote KV: their KV need not be sent).
    num_cached_tokens: int


def completion_ids(request_id: str, n: int) -> list[str]:
    """The engine request ids of a request's ``n`` completions: its own, then ``request_id/1`` and on ("/" is in no
    client's id, so they meet no other request's)."""
    return [request_id] + [f"{request_id}/{index}" for index in range(1, n)]


class RequestStream:
    """The outputs of one request, in order, ending with the finished one; of a request for ``n`` completions,
    the outputs of all of them as they come (each completion's ``index`` set), ending with the last finished."""

    def __init__(self, request_id: str, num_completions: int = 1) -> None:
        self.request_id = request_id
        self.num_completions = num_completions
        self._outputs: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        # Set once the engine has taken the request: to an Accepted, or to the
        # exception that refused it (duplicate id, no room for remote KV).
        self.accepted: Future = Future()

    def wait_accepted(self, timeout: float | None = None) -> Accepted:
        """Block until the engine took the request; returns its blocks (reserved ones for
        remote KV, else none yet). Raises what refused it."""
        return self.accepted.result(timeout)

    def get_nowait(self) -> RequestOutput | None:
        """The next output if one is ready, else None; raises what the loop reported."""
        try:
            item = self._outputs.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def put(self, item: RequestOutput | BaseException) -> None:
        self._outputs.put(item)

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next output; raises what the loop reported (e.g. a refused request) or ``queue.Empty``."""
        item = self._outputs.get(timeout=timeout)
        if isinstance(item, BaseException):
            raise item
        return item

    def __iter__(self) -> Iterator[RequestOutput]:
        unfinished = self.num_completions
        while True:
            output = self.get()
            yield output
            unfinished -= output.finished
            if not unfinished:
                return


class EngineLoop:
    """Runs ``engine.step()`` on a background thread while requests are unfinished.

    A KV connector attached to the engine wakes the loop when it has news (a
    prompt's KV arrived, a save finished), so requests waiting for remote KV
    move on at once while the loop otherwise sleeps.

    Args:
        engine: the engine; after ``start()`` only the loop thread touches it.
        idle_wait_seconds: how long the idle loop sleeps between checks for commands.
    """

    def __init__(self, engine: LLMEngine, idle_wait_seconds: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_seconds = idle_wait_seconds
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # by engine request id: a request's n completions share one
        self._completions: dict[str, list[str]] = {}  # a request for n > 1 completions: its completions' ids
        self._index: dict[str, int] = {}  # a completion's index, by its engine request id (absent: 0)
        self._samples = ParallelSamples(engine)
        self._thread = threading.Thread(target=self._run, name="splitserve-engine", daemon=True)
        # The engine's load after the latest step (or command), readable from any thread without waiting.
        self.last_load = engine.load()

    def start(self) -> EngineLoop:
        connector = self.engine.kv_transfers.connector
        if connector is not None:
            connector.set_wakeup(self.wake)
        self._thread.start()
        return self

    def wake(self) -> None:
        """Make the loop poll the engine's KV connector now (callable from any thread)."""
        self._commands.put(("kv", None, None))

    def stop(self, timeout: float = 30.0) -> None:
        """Abort what is unfinished, end the thread, and wait for it."""
        if self._thread.is_alive():
            self._commands.put(_STOP)
            self._thread.join(timeout)

    def submit(
        self,
        request_id: str,
        prompt: str | None,
        sampling_params: SamplingParams,
        prompt_token_ids: list[int] | None = None,
        kv_transfer: KVTransferParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        cache_salt: str | None = None,
        kv_fork: KVFork | None = None,
        keep_kv: bool = False,
    ) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream.

        With ``sampling_params.n`` > 1 it is queued as n completions (engine/parallel_sampling.py: the first
        one's prompt, or its remote KV, computed once and forked by the others), engine requests
        ``request_id`` and ``request_id/1`` to ``request_id/{n-1}``, all on the one stream; ``abort(request_id)``
        aborts all of them.

        ``kv_transfer``, ``priority``, ``lora_request``, ``pooling_params`` (an embedding request, whose one
        output is the finished one with its ``embedding``), ``cache_salt``, ``kv_fork`` and ``keep_kv`` (a
        finished request's blocks held for forks until ``engine.release_kv``) are passed to
        ``LLMEngine.add_request``;
        ``stream.wait_accepted()`` says when the engine has taken it.

        Raises:
            ValueError: the prompt or parameters are invalid (checked here, in the
                caller's thread, so nothing reaches the engine).
        """
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError("sampling_params must be a SamplingParams.")
        token_ids = self.engine.prompt_token_ids_of(prompt, prompt_token_ids, sampling_params)
        check_cache_salt(cache_salt)
        stream = RequestStream(request_id, sampling_params.n)
        options = {"prompt_token_ids": token_ids, "kv_transfer": kv_transfer, "priority": priority,
                   "lora_request": lora_request, "pooling_params": pooling_params, "cache_salt": cache_salt}
        if kv_fork is not None or keep_kv:  # a request's own (n > 1 forks the first completion's itself)
            if sampling_params.n != 1:
                raise ValueError("kv_fork and keep_kv are a single completion's; n > 1 forks its first one's KV.")
            options.update(kv_fork=kv_fork, keep_kv=keep_kv)
        self._commands.put(("add", stream, (request_id, prompt, sampling_params, options)))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (every completion of it) at the next step boundary; its stream ends with an "abort"
        output."""
        self._commands.put(("abort", request_id, None))

    def call(self, function: Callable[[LLMEngine], Any], timeout: float | None = 30.0) -> Any:
        """Run ``function(engine)`` on the loop thread between steps and return its result."""
        return self.post(function).result(timeout)

    def post(self, function: Callable[[LLMEngine], Any]) -> Future:
        """Run ``function(engine)`` on the loop thread between steps; returns at once.

        The returned future holds its result or exception.
        """
        future: Future = Future()
        self._commands.put(("call", future, function))
        return future

    # ---- the loop thread -------------------------------------------------------

    def _run(self) -> None:
        while True:
            # Busy: take what commands are waiting and step. Idle (requests waiting for remote KV included,
            # which the KV connector's wakeup moves on): sleep until a command arrives, and poll the connector
            # each time the sleep ends without one, in case a report came without its wakeup.
            wait = 0 if self.engine.has_work() else self.idle_wait_seconds
            try:
                command = self._commands.get(timeout=wait)
            except queue.Empty:
                command = ("kv", None, None) if wait else None
            while command is not None:
                if command is _STOP:
                    self._abort_all()
                    return
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            # What the commands produced (a remote prefill's first token, aborts) goes out before the next
            # forward pass, not after it.
            self._deliver(self.engine.take_pending_outputs())
            if self.engine.has_work():
                self._step()
            self.last_load = self.engine.load()

    def _apply(self, command) -> None:
        kind, target, payload = command
        if kind == "add":
            request_id, prompt, params, options = payload
            request_ids = completion_ids(request_id, params.n)
            added: list[str] = []
            try:
                if params.n == 1:
                    self.engine.add_request(request_id, prompt, params, **options)
                else:
                    self._samples.add(request_ids, prompt, params, added, **options)
            except Exception as error:  # duplicate id, no room for remote KV: the caller hears of it
                for completion_id in added:  # no completion of a refused request stays queued
                    self.engine.abort_request(completion_id)
                target.accepted.set_exception(error)
                target.put(error)
                return
            for index, completion_id in enumerate(request_ids):
                self._streams[completion_id] = target
                if index:
                    self._index[completion_id] = index
            if params.n > 1:
                self._completions[request_id] = request_ids
            request = self.engine.scheduler.requests[request_id]
            target.accepted.set_result(Accepted(max(request.num_cached_tokens, 0)))
        elif kind == "abort":
            for request_id in self._completions.get(target, (target,)):
                self.engine.abort_request(request_id)
        elif kind == "kv":
            try:
                self.engine.update_from_kv_connector()
            except Exception:  # a bug; the loop goes on, and the next step polls again
                logger.exception("Applying the KV connector's reports failed")
        elif kind == "call":
            try:
                target.set_result(payload(self.engine))
            except Exception as error:
                target.set_exception(error)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as error:  # the engine already fails a broken step's requests; this is a bug
            logger.exception("Engine step failed")
            for stream in set(self._streams.values()):
                stream.put(error)
            self._streams.clear()
            self._completions.clear()
            self._index.clear()
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if stream.num_completions > 1:
                output.outputs[0].index = self._index.get(output.request_id, 0)
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]
                self._index.pop(output.request_id, None)
                if stream.request_id in self._completions and not any(
                        completion_id in self._streams for completion_id in self._completions[stream.request_id]):
                    del self._completions[stream.request_id]
        # A first completion's blocks, held for the others to fork, go once they have all started (or ended).
        self._samples.release_started()

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        for output in self.engine.step():
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.put(output)
