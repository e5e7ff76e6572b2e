"""LLMEngine: the step API that the offline LLM and both worker kinds drive.

``add_request`` -> ``step`` (repeatedly) -> ``RequestOutput`` deltas, plus
``abort_request`` and, for disaggregated decode, ``add_request(remote_kv=True)``
and ``finish_remote_kv``. One engine is driven by one thread.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

from splitserve.engine.config import EngineConfig
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.model_runner import ModelRunner, SampledToken
from splitserve.engine.model_store import resolve_model
from splitserve.engine.models import ModelConfig
from splitserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters since the engine started."""

    num_steps: int = 0
    # Tokens that went through a forward pass (prompt chunks, recomputes and decodes).
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_finished_requests: int = 0


@dataclass(frozen=True)
class EngineLoad:
    """What a worker reports to the router: queues and KV blocks right now."""

    num_running_requests: int
    num_waiting_requests: int
    num_waiting_for_remote_kvs_requests: int
    # Prompt tokens scheduled but not computed yet (the prefill backlog).
    num_queued_prefill_tokens: int
    num_total_kv_blocks: int
    # Evictable prefix-cache blocks count as free.
    num_free_kv_blocks: int


class LLMEngine:
    """One model, one KV cache, one scheduler.

    Args:
        config: validated engine configuration; ``config.model`` None means the default model.
    """

    def __init__(self, config: EngineConfig) -> None:
        from transformers import AutoTokenizer

        self.config = config
        self.model_dir: Path = resolve_model(config.model)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        self.max_model_len = config.resolve_max_model_len(self.model_config.max_model_len)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        self.model_runner = ModelRunner(config, str(self.model_dir), self.model_config, self.max_model_len)
        config.check_fits(self.max_model_len, self.model_runner.num_blocks)
        self.kv_cache = KVCacheManager(self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill
        )
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}
        # Outputs of requests finished outside step() (aborts), reported by the next step.
        self._pending_outputs: list[RequestOutput] = []
        self._request_counter = itertools.count()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.stats = EngineStats()

    # ---- requests ------------------------------------------------------------

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(
        self,
        request_id: str,
        prompt: str | None = None,
        sampling_params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        remote_kv: bool = False,
        hold_kv_on_finish: bool = False,
    ) -> Request:
        """Validate and queue a request (text ``prompt`` or ``prompt_token_ids``).

        With ``remote_kv`` its prompt blocks are reserved and it waits in
        ``WAITING_FOR_REMOTE_KVS`` until :meth:`finish_remote_kv` (or
        :meth:`recompute_remote_kv`). With ``hold_kv_on_finish`` (prefill role) its
        blocks outlive it until :meth:`release_kv`.

        Raises:
            ValueError: empty or too long prompt, token ids out of range, bad params.
            KVCacheFullError: (remote_kv only) no room to reserve the prompt's blocks.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        token_ids = self.prompt_token_ids_of(prompt, prompt_token_ids)
        room = self.max_model_len - len(token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_output_tokens=room if params.max_tokens is None else min(params.max_tokens, room),
            hold_kv_on_finish=hold_kv_on_finish,
        )
        self.scheduler.add_request(request, remote_kv=remote_kv)
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, token_ids, params)
        self._prompts[request_id] = prompt
        return request

    def prompt_token_ids_of(self, prompt: str | None, prompt_token_ids: list[int] | None) -> list[int]:
        """The validated token ids of a prompt (text is tokenized). Raises ValueError with the reason."""
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("A prompt must be a string or a list of token ids.")
            prompt_token_ids = self.tokenize(prompt)
        token_ids = [int(token_id) for token_id in prompt_token_ids]
        if not token_ids:
            raise ValueError("The prompt is empty: give at least one token.")
        vocab_size = self.model_config.vocab_size
        bad = next((token_id for token_id in token_ids if not 0 <= token_id < vocab_size), None)
        if bad is not None:
            raise ValueError(f"Prompt token id {bad} is outside the vocabulary [0, {vocab_size}).")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"The prompt has {len(token_ids)} tokens; max_model_len is {self.max_model_len}, "
                "which must leave room for at least one generated token."
            )
        return token_ids

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now, in whatever state it is; its blocks return to the pool.

        Returns False if no such request is unfinished. Its final output comes from the next step().
        """
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending_outputs.append(self._make_output(request))
        self._forget(request_id)
        return True

    def fail_request(self, request_id: str, message: str) -> bool:
        """Finish a request now with ``FINISHED_ERROR`` and ``message`` as its reason.

        Its blocks return to the pool; False if no such request is unfinished.
        Its final output comes from the next step().
        """
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        request.stop_reason = message
        self._finish(request, RequestStatus.FINISHED_ERROR)
        self._pending_outputs.append(self._make_output(request))
        self._forget(request_id)
        return True

    def release_kv(self, request_id: str) -> bool:
        """Free the blocks a finished ``hold_kv_on_finish`` request kept; False if it holds none."""
        return self.scheduler.release_held(request_id)

    def finish_remote_kv(self, request_id: str, first_token_id: int | None = None) -> None:
        """The prompt's KV has been written into the request's blocks from outside.

        Args:
            first_token_id: the first generated token, when the prefill side sampled
                it; otherwise the last prompt token is recomputed here for its logits.
        """
        request = self._waiting_for_remote_kv(request_id)
        if first_token_id is None:
            self.scheduler.finish_remote_kv(request_id, request.num_prompt_tokens - 1)
            return
        self.scheduler.finish_remote_kv(request_id, request.num_prompt_tokens)
        # A seeded request continues its random stream where the prefill side left it.
        self.model_runner.sampler.skip_first_draw(request)
        # Reported by the next step(), like any other token (its text is part of the stream).
        self._pending_outputs.append(self._accept_token(SampledToken(request, int(first_token_id), None)))

    def recompute_remote_kv(self, request_id: str) -> None:
        """Give up waiting for a request's remote KV: its prompt is computed here, in the blocks it holds
        (after the prefix this worker had cached, whose shared blocks are left as they are)."""
        request = self._waiting_for_remote_kv(request_id)
        self.scheduler.finish_remote_kv(request_id, max(request.num_cached_tokens, 0))

    def _waiting_for_remote_kv(self, request_id: str) -> Request:
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            raise KeyError(f"Request {request_id!r} is not waiting for remote KV.")
        return request

    def take_pending_outputs(self) -> list[RequestOutput]:
        """Outputs produced between steps (aborts, failures, a remote prefill's first token), without stepping."""
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._pending_outputs)

    def has_work(self) -> bool:
        """True when a step would compute or report something: requests waiting for remote KV do not count
        (they move only when told their KV arrived)."""
        scheduler = self.scheduler
        return scheduler.num_unfinished > len(scheduler.waiting_for_remote_kvs) or bool(self._pending_outputs)

    def block_ids(self, request_id: str) -> list[int]:
        """The KV blocks the request holds, in token order."""
        return list(self.kv_cache.block_ids(request_id))

    def load(self) -> EngineLoad:
        """A snapshot of the queues and KV usage (for load reports)."""
        scheduler = self.scheduler
        queued = scheduler.waiting
        return EngineLoad(
            num_running_requests=len(scheduler.running),
            num_waiting_requests=len(queued),
            num_waiting_for_remote_kvs_requests=len(scheduler.waiting_for_remote_kvs),
            num_queued_prefill_tokens=sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in queued)
            + sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in scheduler.running),
            num_total_kv_blocks=self.kv_cache.num_blocks,
            num_free_kv_blocks=self.kv_cache.free_block_count,
        )

    @property
    def free_block_count(self) -> int:
        return self.kv_cache.free_block_count

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.num_blocks

    # ---- one step ------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and run one forward pass.

        Returns:
            An output for every request that got a token or finished in this step
            (and for requests aborted since the previous step).
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return outputs
        now = time.monotonic()
        for item in scheduled.scheduled:
            if item.request.first_scheduled_time is None:
                item.request.first_scheduled_time = now
        try:
            sampled = self.model_runner.execute(scheduled, self.kv_cache.block_tables)
        except Exception as error:  # a failed step fails its requests, not the engine
            logger.exception("Step failed; finishing its %d requests with an error", len(scheduled.scheduled))
            for item in scheduled.scheduled:
                item.request.stop_reason = f"internal error: {error}"
                self._finish(item.request, RequestStatus.FINISHED_ERROR)
                outputs.append(self._make_output(item.request))
                self._forget(item.request.request_id)
            return outputs
        self.scheduler.update_after_step(scheduled)
        self.stats.num_steps += 1
        self.stats.num_computed_tokens += scheduled.num_batched_tokens
        for token in sampled:
            outputs.append(self._accept_token(token))
        return outputs

    def _accept_token(self, token: SampledToken) -> RequestOutput:
        request = token.request
        request.append_output_token(token.token_id)
        self.stats.num_generated_tokens += 1
        if token.logprobs is not None:
            request.logprobs.append(token.logprobs)
            request.cumulative_logprob += token.logprobs[token.token_id]
        elif request.sampling_params.logprobs is not None:
            # A first token sampled elsewhere (remote prefill): its logprobs travel with it there.
            request.logprobs.append({})
        status = request.check_stop_token()
        stop_string = self._detokenizers[request.request_id].update([token.token_id])
        if stop_string is not None:
            status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_string
        if status is not None:
            self._finish(request, status)
        output = self._make_output(request, delta_token_ids=[token.token_id])
        if request.is_finished:
            self._forget(request.request_id)
        return output

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_request(request, status)
        self.stats.num_finished_requests += 1
        request.finished_time = time.monotonic()

    def _forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._prompts.pop(request_id, None)

    def _make_output(self, request: Request, delta_token_ids: list[int] | None = None) -> RequestOutput:
        detokenizer = self._detokenizers[request.request_id]
        finished = request.is_finished
        logprobs = request.logprobs if request.sampling_params.logprobs is not None else None
        cumulative = request.cumulative_logprob if logprobs else None
        completion = CompletionOutput(
            index=0,
            text=detokenizer.output_text,
            token_ids=list(request.output_token_ids),
            cumulative_logprob=cumulative,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            delta_text=detokenizer.get_next_output_text(finished, delta=True),
            delta_token_ids=delta_token_ids or [],
        )
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
            num_preemptions=request.num_preemptions,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=self._prompts.get(request.request_id),
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=metrics,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )
