"""Beam search on a decode worker (DecodeRequest.beam_search): ``LLM.beam_search``'s search, stepped through the
worker's engine loop.

The request's prompt runs first as a one-token request that keeps its blocks (its KV received from the prefill
worker, or computed here). Each step then asks the engine for one token of every live beam, in one batch, with
the top candidates' log probabilities: each beam a one-token request forking the KV of the request it grew from
(the prompt's at the first step), holding its blocks until the next step's requests have forked them
(``engine.beam_search.beam_forks``). So the prompt is computed, or sent, once, and a step computes one token a
beam, without a call leaving the worker; the gateway's ``use_beam_search`` asks for it in one router call.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from splitserve.common.errors import Cancelled
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.types import FinishReason
from splitserve.engine.beam_search import beam_forks
from splitserve.engine.engine_loop import EngineLoop
from splitserve.rpc.errors import ServiceError


class LoopBeamSteps:
    """The steps of one beam search through an :class:`EngineLoop`, called from the request's own thread.

    Args:
        loop: the worker's engine loop.
        request_id: the search's request id; a step's requests are ``request_id/b<number>``.
        root_id: the request holding the prompt's KV (finished, ``keep_kv``), which the first step forks.
        prompt: the prompt's token ids.
        candidates: log probabilities asked for at each step (``beam_candidates``).
        options: ``EngineLoop.submit``'s priority, lora_request and cache_salt for each step's requests.
    """

    def __init__(self, loop: EngineLoop, request_id: str, root_id: str, prompt: list[int], candidates: int,
                 options: dict[str, Any]) -> None:
        self.loop, self.request_id, self.options = loop, request_id, options
        self.params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=candidates, ignore_eos=True)
        self.held: dict[tuple[int, ...], str] = {tuple(prompt[:-1]): root_id}  # by tokens: what a step forks
        self.to_release: list[str] = [root_id]  # every request that may hold blocks
        self._numbers = itertools.count()
        self._current: list[str] = []  # the requests of the step under way
        self._cancelled = False
        self._lock = threading.Lock()

    def __call__(self, sequences: list[list[int]]) -> list[dict[int, float]]:
        streams = []
        with self._lock:
            if self._cancelled:
                raise Cancelled(f"The beam search {self.request_id} was aborted.")
            try:
                for tokens, fork in zip(sequences, beam_forks(sequences, self.held)):
                    request_id = f"{self.request_id}/b{next(self._numbers)}"
                    self.to_release.append(request_id)
                    streams.append(self.loop.submit(request_id, None, self.params, tokens, kv_fork=fork,
                                                    keep_kv=True, **self.options))
            finally:
                self._current = [stream.request_id for stream in streams]
                if len(streams) < len(sequences):  # refused: the step's queued requests end now, holding nothing
                    self._abort_current()
        outputs = [list(stream)[-1] for stream in streams]
        previous, self.held = list(self.held.values()), {}
        self.loop.post(lambda engine: [engine.release_kv(request_id) for request_id in previous])
        for output in outputs:
            completion = output.outputs[0]
            if completion.finish_reason == FinishReason.ABORT:
                raise Cancelled(f"The beam search {self.request_id} was aborted.")
            if completion.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP):
                raise ServiceError(f"A step of the beam search failed: {completion.stop_reason}")
        self.held = {tuple(output.prompt_token_ids): output.request_id for output in outputs}
        return [output.outputs[0].logprobs[0] for output in outputs]

    def cancel(self) -> None:
        """Abort the step under way and any later one (the caller went away); callable from any thread."""
        with self._lock:
            self._cancelled = True
            self._abort_current()

    def release(self) -> None:
        """Free every block the search's requests hold (after the search, or when it failed): the step under way
        aborted first, so that none of its requests finishes holding blocks after the release."""
        with self._lock:
            self._abort_current()
            to_release, self.to_release, self.held = self.to_release, [], {}
        self.loop.post(lambda engine: [engine.release_kv(request_id) for request_id in to_release])

    def _abort_current(self) -> None:
        for request_id in self._current:
            self.loop.abort(request_id)
