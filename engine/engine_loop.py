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
from splitserve.engine.pooling import PoolingParams

logger = logging.getLogger(__name__)
_STOP = object()


@dataclass(frozen=True)
class Accepted:
    """What the engine reserved for a request when it took it."""

    # Leading prompt tokens already in this engine's prefix cache (remote KV: their KV need not be sent).
    num_cached_tokens: int


class RequestStream:
    """The outputs of one request, in order, ending with the finished one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
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
        while True:
            output = self.get()
            yield output
            if output.finished:
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
        self._streams: dict[str, RequestStream] = {}
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
    ) -> RequestStream:
        """Queue a request; its outputs arrive on the returned stream.

        ``kv_transfer``, ``priority``, ``lora_request``, ``pooling_params`` (an embedding request, whose one
        output is the finished one with its ``embedding``) and ``cache_salt`` are passed to
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
        stream = RequestStream(request_id)
        options = {"prompt_token_ids": token_ids, "kv_transfer": kv_transfer, "priority": priority,
                   "lora_request": lora_request, "pooling_params": pooling_params, "cache_salt": cache_salt}
        self._commands.put(("add", stream, (request_id, prompt, sampling_params, options)))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request at the next step boundary; its stream ends with an "abort" output."""
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
            try:
                self.engine.add_request(request_id, prompt, params, **options)
            except Exception as error:  # duplicate id, no room for remote KV: the caller hears of it
                target.accepted.set_exception(error)
                target.put(error)
                return
            self._streams[request_id] = target
            request = self.engine.scheduler.requests[request_id]
            target.accepted.set_result(Accepted(max(request.num_cached_tokens, 0)))
        elif kind == "abort":
            self.engine.abort_request(target)
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
            for stream in self._streams.values():
                stream.put(error)
            self._streams.clear()
            return
        self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _abort_all(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        for output in self.engine.step():
            stream = self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.put(output)
