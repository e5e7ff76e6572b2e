"""Parallel sampling (vLLM's ``n``): a prompt's completions as requests that compute the prompt once.

The first completion is an ordinary request (a remote prefill's KV included) that keeps its blocks when it
finishes (``keep_kv``); every other completion forks its KV (``request.KVFork``): it waits in the queue until
the first has computed the prompt, then shares its full blocks and copies the partial one, computing only the
prompt's last token again, for logits of its own. The first completion's hold is let go once every other has
started. ``LLM.generate`` and the service's ``EngineLoop`` both queue completions this way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from splitserve.common.sampling_params import SamplingParams, completion_seed
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import KVFork


def completion_params(params: SamplingParams) -> list[SamplingParams]:
    """The parameters of each of a prompt's ``params.n`` completions (one each): with a seed, completion i draws
    from seed + i (``completion_seed``)."""
    if params.n == 1:
        return [params]
    if params.seed is None:
        return [dataclasses.replace(params, n=1)] * params.n
    return [dataclasses.replace(params, n=1, seed=completion_seed(params.seed, index)) for index in range(params.n)]


class ParallelSamples:
    """The completions an engine runs for prompts with ``n`` > 1, and the first completions' holds to let go."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._holding: list[list[str]] = []  # groups whose first request may still hold blocks for the others

    def add(self, request_ids: list[str], prompt: str | None, params: SamplingParams, added: list[str],
            **options: Any) -> None:
        """Queue the ``params.n`` completions of one prompt as the requests ``request_ids`` (one each, the first
        completion's first), appending each id to ``added`` once it is queued (the caller aborts them if a later
        one is refused). ``options`` are ``LLMEngine.add_request``'s; a ``kv_transfer`` is the first
        completion's only: the others fork its KV."""
        if len(request_ids) != params.n:
            raise ValueError(f"{len(request_ids)} request ids for n={params.n} completions.")
        fork_options = {name: value for name, value in options.items() if name != "kv_transfer"}
        group: list[str] = []
        for index, (request_id, completion) in enumerate(zip(request_ids, completion_params(params))):
            if group:
                fork = KVFork(group[0], take_tail=index == params.n - 1)
                self.engine.add_request(request_id, prompt, completion, kv_fork=fork, **fork_options)
            else:
                self.engine.add_request(request_id, prompt, completion, keep_kv=params.n > 1, **options)
            group.append(request_id)
            added.append(request_id)
        if len(group) > 1:
            self._holding.append(group)

    def release_started(self) -> None:
        """After a step: let go of the first completion's blocks of every prompt whose other completions have all
        started (or ended); a first completion still running is told not to keep them."""
        if not self._holding:
            return
        still = []
        for group in self._holding:
            if all(self.engine.started_or_finished(request_id) for request_id in group[1:]):
                self.engine.set_keep_kv(group[0], False) or self.engine.release_kv(group[0])
            else:
                still.append(group)
        self._holding = still

    def release_all(self) -> None:
        """Let go of every first completion's blocks still held (the call ended, or failed)."""
        for group in self._holding:
            self.engine.set_keep_kv(group[0], False) or self.engine.release_kv(group[0])
        self._holding = []
