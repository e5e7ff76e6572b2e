"""LLMEngine: the step API that the offline LLM and both worker kinds drive.

``add_request`` -> ``step`` (repeatedly) -> ``RequestOutput`` deltas, plus
``abort_request``. KV crosses the engine's edge through a KV connector
(:mod:`splitserve.engine.kv_connector`, attached with ``attach_kv_connector``):
requests added with ``KVTransferParams(load=True)`` wait for theirs, those
with ``KVTransferParams(save=True)`` hand theirs out step by step. Without a
connector, ``finish_remote_kv`` and ``release_kv`` drive the same requests by
hand. One engine is driven by one thread.

This module is the engine's whole public surface (requests in, steps,
outputs, the KV hooks), under 500 lines; what each step does lives in the
scheduler, the model runner, :mod:`~splitserve.engine.kv_transfers` and
:mod:`~splitserve.engine.output_processor`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.common.block_hash import check_cache_salt, request_root_hash
from splitserve.common.errors import InvalidRequest
from splitserve.common.load import WorkerLoad
from splitserve.common.log_fields import request_log
from splitserve.common.model_info import ModelConfig
from splitserve.common.prompt import validate_prompt_token_ids
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache_manager import KVCacheManager
from splitserve.engine.kv_connector import KVConnectorBase, KVLoadFailurePolicy, KVLoadOutcome, KVTransferParams
from splitserve.engine.kv_transfers import KVTransfers
from splitserve.engine.logits_processors import BadWordBans, bad_words_token_ids
from splitserve.engine.lora import LoRARequest
from splitserve.engine.model_runner import ModelRunner, SampledToken
from splitserve.engine.model_store import load_tokenizer, resolve_model
from splitserve.engine.models.rotary_embedding import long_rope_context
from splitserve.engine.output_processor import OutputProcessor
from splitserve.engine.outputs import RequestOutput
from splitserve.engine.pooling import PoolingParams
from splitserve.engine.request import KVFork, Request, RequestStatus
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.structured_output import StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    """Counters since the engine started."""

    num_steps: int = 0
    # Tokens that went through a forward pass (prompt chunks, recomputes and decodes).
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_finished_requests: int = 0
    # Speculative decoding: drafts verified, and those accepted (each saved a step of its request).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # LoRA adapters (enable_lora): per adapter name, its requests (running, waiting) as the latest step began.
    lora_requests: dict[str, tuple[int, int]] = field(default_factory=dict)


class LLMEngine:
    """One model, one KV cache, one scheduler.

    Args:
        config: validated engine configuration; ``config.model`` None means the default model.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_dir: Path = resolve_model(config.model)
        self.model_config = ModelConfig.from_model_dir(self.model_dir)
        self.max_model_len = config.resolve_max_model_len(self.model_config.max_model_len)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.model_runner = ModelRunner(config, str(self.model_dir), self.model_config, self.max_model_len)
        # A LongRoPE model's original context, when the engine's is longer: a request longer than it rotates with the
        # long factors throughout (Request.rotate_long, here for a prompt, in the scheduler for one that grows past
        # it); None otherwise.
        self.long_rope_context = (long_rope_context(self.model_config)
                                  if self.model_runner.model.model.rotary.long_offset else None)
        config.check_fits(self.max_model_len, self.model_runner.num_blocks)
        self.kv_cache = KVCacheManager(self.model_runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv_cache, config.max_num_seqs, config.max_num_batched_tokens, config.enable_chunked_prefill,
            config.scheduling_policy,
            *self._speculation(config),
            max_loras=config.max_loras, long_rope_context=self.long_rope_context,
        )
        self._arrivals = itertools.count()
        self.output_processor = OutputProcessor(self.tokenizer)
        # Outputs of requests finished outside step() (aborts), reported by the next step.
        self._pending_outputs: list[RequestOutput] = []
        self._request_counter = itertools.count()
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids)
        self.stats = EngineStats()
        self.kv_transfers = KVTransfers(config.block_size)
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids,
                                                    config.reasoning_parser)

    @staticmethod
    def _speculation(config: EngineConfig) -> tuple:
        """The scheduler's proposer and the batch size at which it stops drafting (None, None: no speculation)."""
        speculative = config.speculative_config
        if speculative is None:
            return None, None
        return speculative.propose, speculative.disable_by_batch_size

    def attach_kv_connector(self, connector: KVConnectorBase) -> None:
        """KV of requests with ``KVTransferParams`` now moves through ``connector`` (before serving starts)."""
        connector.register_kv_cache(self.kv_cache_tensor)
        self.kv_transfers.connector = connector

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
        kv_transfer: KVTransferParams | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        cache_salt: str | None = None,
        kv_fork: KVFork | None = None,
        keep_kv: bool = False,
    ) -> Request:
        """Validate and queue a request (text ``prompt`` or ``prompt_token_ids``).

        With ``kv_transfer.load`` its prompt blocks are reserved and it waits in
        ``WAITING_FOR_REMOTE_KVS`` until the connector reports the KV in place
        (or :meth:`finish_remote_kv` / :meth:`recompute_remote_kv` by hand). With
        ``kv_transfer.save`` (prefill role) the connector gets its blocks as steps
        complete them, and they outlive the request until the last save is done
        (or :meth:`release_kv` by hand).

        ``priority`` orders it under the priority scheduling policy (lower first); other policies take 0 only.
        ``lora_request`` runs it with that LoRA adapter (``enable_lora`` engines; loaded now if it is not).
        ``pooling_params`` makes it an embedding request (engine/pooling.py): once its prompt is computed it
        finishes with its embedding (``RequestOutput.embedding``) and no token; ``sampling_params`` is then unused.
        ``cache_salt`` (vLLM's) keeps its prompt's blocks in the prefix cache apart: only requests with the same
        salt (and adapter) find them, and it finds only theirs.
        ``keep_kv`` holds its blocks when it finishes normally (stopped or at its length), until
        :meth:`release_kv`, for later requests whose ``kv_fork`` names it: those take its KV instead of computing
        it (request.KVFork; beam search steps this way, ``LLM.beam_search``).

        Raises:
            ValueError: empty or too long prompt, token ids out of range (the prompt's or logit_bias's), bad
                params, prompt_logprobs with a remote prefill's KV or more of them than one response holds, a
                priority the scheduling policy does not take, a LoRA adapter that cannot be served here.
            KVCacheFullError: no room to reserve the blocks of KV that comes from outside.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        cache_salt = check_cache_salt(cache_salt)
        if pooling_params is not None:
            if not isinstance(pooling_params, PoolingParams):
                raise ValueError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}.")
            pooling_params.check(self.model_config.hidden_size)
            if kv_transfer is not None:
                raise InvalidRequest("An embedding request computes its prompt here: it takes no kv_transfer.")
            params = SamplingParams(max_tokens=1)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        if params.n != 1:
            raise InvalidRequest(f"n={params.n}: an engine request is one completion; LLM.generate and EngineLoop "
                                 "sample n from one prompt (engine/parallel_sampling.py: a request for each, "
                                 "forking the first one's KV).")
        params.check_vocabulary(self.model_config.vocab_size)
        token_ids = self.prompt_token_ids_of(prompt, prompt_token_ids, params)
        params.check_prompt_length(len(token_ids))
        room = self.max_model_len - len(token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            max_output_tokens=room if params.max_tokens is None else min(params.max_tokens, room),
            priority=self.check_priority(priority), arrival_number=next(self._arrivals),
            pooling_params=pooling_params,
        )
        if kv_fork is not None and not isinstance(kv_fork, KVFork):
            raise ValueError(f"kv_fork must be a KVFork, got {type(kv_fork).__name__}.")
        request.kv_fork, request.keep_kv = kv_fork, bool(keep_kv)
        if kv_transfer is not None:
            if keep_kv and kv_transfer.save:
                raise InvalidRequest("keep_kv holds a request's blocks for forks; a request whose KV is saved "
                                     "hands them to its connector.")
            self.kv_transfers.check(kv_transfer, len(token_ids))
            if kv_transfer.load and params.prompt_logprobs is not None:
                raise InvalidRequest("prompt_logprobs needs the prompt computed here, and this request's prompt KV "
                                     "comes from a remote prefill (kv_transfer.load): ask the prefill for them.")
        if params.structured_outputs is not None:
            request.grammar = self.structured_outputs.matcher(params.structured_outputs, token_ids)
        if params.bad_words:
            request.bad_word_bans = BadWordBans(bad_words_token_ids(self.tokenizer, params.bad_words))
        if lora_request is not None:
            self._acquire_lora(request, lora_request)
        # The root the router's prefix-aware keys chain from too (block_hash.request_root_hash).
        lora_name = request.lora_request.lora_name if request.lora_request is not None else None
        request.block_hash_root = request_root_hash(lora_name, cache_salt, long_rope=False)
        if self.long_rope_context is not None and len(token_ids) > self.long_rope_context:
            request.rotate_long()
        try:
            num_external_tokens = self.kv_transfers.num_external_tokens(request, kv_transfer)
            self.scheduler.add_request(request, num_external_tokens)
        except Exception:
            self._release_lora(request)
            raise
        self.kv_transfers.start(request, kv_transfer, num_external_tokens, self.block_ids(request_id))
        self.output_processor.add(request, prompt)
        return request

    def _acquire_lora(self, request: Request, lora_request: LoRARequest) -> None:
        lora = self.model_runner.lora
        if lora is None:
            raise InvalidRequest(f"This engine serves no LoRA adapters (asked for {lora_request.lora_name[:64]!r}); "
                                 "start it with enable_lora (--enable-lora).")
        lora.acquire(lora_request)
        request.lora_request = lora_request

    def _release_lora(self, request: Request) -> None:
        if request.lora_request is not None:
            self.model_runner.lora.release(request.lora_request)  # once: a request finishes once
            self.stats.lora_requests = self.scheduler.lora_requests()  # finished between steps too (aborts)

    def check_priority(self, priority: int) -> int:
        """A request's priority: any integer under the priority policy, 0 otherwise (as vLLM refuses others)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequest(f"priority must be an integer, got {type(priority).__name__}.")
        if priority and self.config.scheduling_policy != "priority":
            raise InvalidRequest(f"priority {priority} needs the priority scheduling policy (--scheduling-policy "
                                 "priority); this engine serves requests first come, first served.")
        return priority

    def prompt_token_ids_of(self, prompt: str | None, prompt_token_ids: list[int] | None,
                            params: SamplingParams | None = None) -> list[int]:
        """The validated token ids of a prompt (text is tokenized), cut to ``params.truncate_prompt_tokens`` when
        set. Raises ValueError with the reason."""
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("A prompt must be a string or a list of token ids.")
            prompt_token_ids = self.tokenize(prompt)
        if params is not None:
            prompt_token_ids = params.truncated(list(prompt_token_ids), self.max_model_len)
        return validate_prompt_token_ids(prompt_token_ids, self.model_config.vocab_size, self.max_model_len)

    def abort_request(self, request_id: str) -> bool:
        """Finish a request now, in whatever state it is; its blocks return to the pool.

        Returns False if no such request is unfinished. Its final output comes from the next step().
        """
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return self._cancel_held(request_id)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        self._pending_outputs.append(self._make_output(request))
        self._forget(request_id)
        return True

    def _cancel_held(self, request_id: str) -> bool:
        """A finished request whose blocks wait for its last save: stop the save; the blocks go now, or when
        the connector reports the read in flight over. False if it holds no blocks."""
        request = self.scheduler.held.get(request_id)
        if request is None:
            return False
        self.kv_transfers.end_save(request_id)
        connector = self.kv_transfers.connector
        if connector is None or not connector.request_finished(request_id):
            self.release_kv(request_id)
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
        """Free the blocks a finished request kept (saving, or keep_kv); False if it holds none."""
        self.kv_transfers.end_save(request_id)
        return self.scheduler.release_held(request_id)

    def finish_remote_kv(self, request_id: str, first_token_id: int | None = None) -> None:
        """The prompt's KV has been written into the request's blocks from outside.

        Args:
            first_token_id: the first generated token, when the prefill side sampled
                it; otherwise the last prompt token is recomputed here for its logits.
        """
        request = self._waiting_for_remote_kv(request_id)
        load = self.kv_transfers.end_load(request_id, KVLoadOutcome.RECEIVED)
        num_external = load.num_external_tokens if load is not None else request.num_prompt_tokens
        request_log(logger, request_id).debug("WAITING_FOR_REMOTE_KVS -> WAITING (KV of %d prompt tokens in place)",
                                              num_external)
        if first_token_id is None or num_external < request.num_prompt_tokens:
            self.scheduler.finish_remote_kv(request_id, min(num_external, request.num_prompt_tokens - 1))
            return
        self.scheduler.finish_remote_kv(request_id, request.num_prompt_tokens)
        # A seeded request continues its random stream where the prefill side left it.
        self.model_runner.sampler.skip_first_draw(request)
        # Reported by the next step(), like any other token (its text is part of the stream).
        self._pending_outputs.append(self._accept_tokens([SampledToken(request, int(first_token_id), None)]))

    def recompute_remote_kv(self, request_id: str) -> None:
        """Give up waiting for a request's remote KV: its prompt is computed here, in the blocks it holds
        (after the prefix this worker had cached, whose shared blocks are left as they are)."""
        request = self._waiting_for_remote_kv(request_id)
        self.kv_transfers.end_load(request_id, KVLoadOutcome.RECOMPUTED)
        request_log(logger, request_id).debug("WAITING_FOR_REMOTE_KVS -> WAITING (recomputing its prompt)")
        self.scheduler.finish_remote_kv(request_id, max(request.num_cached_tokens, 0))

    def update_from_kv_connector(self) -> None:
        """Act on the connector's reports: loaded requests join the queue, failed loads apply their policy,
        saved requests free their blocks. Called by :meth:`step` and by the loop when the connector wakes it."""
        if self.kv_transfers.connector is None:
            return
        events = self.kv_transfers.connector.get_finished()
        for request_id, first_token_id in events.finished_loads.items():
            if self._is_waiting_for_remote_kv(request_id):
                self.finish_remote_kv(request_id, first_token_id)
        for request_id, reason in events.failed_loads.items():
            load = self.kv_transfers.loads.get(request_id)
            if load is None or not self._is_waiting_for_remote_kv(request_id):
                continue  # ended meanwhile (aborted): nothing to apply
            if load.on_failure == KVLoadFailurePolicy.FAIL:
                self.kv_transfers.end_load(request_id, KVLoadOutcome.FAILED)
                message = f"The prompt's KV could not be loaded ({reason}); --kv-load-failure is fail."
                request_log(logger, request_id).warning("%s", message)
                self.fail_request(request_id, message)
                for fork_id in self._forks_waiting_for(request_id):  # its other completions: no prompt to fork
                    self.fail_request(fork_id, message)
            else:
                request_log(logger, request_id).warning("%s; recomputing the prompt locally", reason)
                self.recompute_remote_kv(request_id)
        for request_id in events.finished_saves:
            self.release_kv(request_id)
        for request_id, reason in events.failed_saves.items():
            request_log(logger, request_id).warning("Its KV could not be saved: %s", reason)
            self.release_kv(request_id)

    def _forks_waiting_for(self, request_id: str) -> list[str]:
        """The queued requests that would fork the request's KV and have not started (parallel sampling's other
        completions)."""
        return [request.request_id for request in self.scheduler.requests.values()
                if request.kv_fork is not None and request.kv_fork.parent_id == request_id
                and request.status == RequestStatus.WAITING and not self.kv_cache.block_ids(request.request_id)]

    def _is_waiting_for_remote_kv(self, request_id: str) -> bool:
        request = self.scheduler.requests.get(request_id)
        return request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

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

    def reset_prefix_cache(self) -> bool:
        """Forget every block the prefix cache holds (vLLM's): later prompts compute what earlier ones left.
        Blocks in use keep their contents for their requests. Always True (vLLM's returns False while blocks are
        in use; here that needs no refusal)."""
        self.kv_cache.pool.reset_prefix_cache()
        return True

    def set_keep_kv(self, request_id: str, keep: bool) -> bool:
        """Change whether an unfinished request's blocks are held when it finishes (``add_request``'s
        ``keep_kv``); False if no such request is unfinished."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return False
        request.keep_kv = keep
        return True

    def started_or_finished(self, request_id: str) -> bool:
        """Whether the request holds KV blocks (it has started), or is no longer unfinished."""
        return bool(self.kv_cache.block_ids(request_id)) or request_id not in self.scheduler.requests

    def block_ids(self, request_id: str) -> list[int]:
        """The KV blocks the request holds, in token order."""
        return list(self.kv_cache.block_ids(request_id))

    def load(self) -> WorkerLoad:
        """A snapshot of the queues and KV usage (for load reports)."""
        scheduler = self.scheduler
        queued = scheduler.waiting
        return WorkerLoad(
            num_running_requests=len(scheduler.running),
            num_waiting_requests=len(queued),
            num_waiting_for_remote_kvs_requests=len(scheduler.waiting_for_remote_kvs),
            num_queued_prefill_tokens=sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in queued)
            + sum(max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in scheduler.running),
            num_total_kv_blocks=self.kv_cache.num_blocks,
            num_free_kv_blocks=self.kv_cache.free_block_count,
        )

    @property
    def kv_cache_tensor(self):
        """The KV cache, ``[num_blocks, layers, 2, kv_heads, block_size, head_size]`` (what connectors read and write)."""
        return self.model_runner.kv_cache

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
        self.update_from_kv_connector()
        outputs, self._pending_outputs = self._pending_outputs, []
        scheduled = self.scheduler.schedule()
        if self.model_runner.lora is not None:  # replaced whole: a metrics scrape reads it from another thread
            self.stats.lora_requests = self.scheduler.lora_requests()
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
        for item in scheduled.scheduled:
            if item.spec_token_ids:
                self.stats.num_draft_tokens += len(item.spec_token_ids)
                self.stats.num_accepted_tokens += len(item.spec_token_ids) - item.num_rejected
        start = 0
        for end in range(1, len(sampled) + 1):  # one output per request: its tokens are consecutive
            if end == len(sampled) or sampled[end].request is not sampled[start].request:
                outputs.append(self._accept_tokens(sampled[start:end]))
                start = end
        for item in scheduled.scheduled:  # embedding requests whose prompt is done: their embedding ends them
            request = item.request
            if request.embedding is not None and not request.is_finished:
                self._finish(request, RequestStatus.FINISHED_STOPPED)
                outputs.append(self._make_output(request))
                self._forget(request.request_id)
        scheduler = self.scheduler
        self.kv_transfers.save_completed(scheduler.requests, scheduler.held, self.kv_cache.block_ids)
        return outputs

    def _accept_tokens(self, tokens: list[SampledToken]) -> RequestOutput:
        """Append one request's new tokens (several when it verified drafts) in order, up to the first that
        finishes it; its output carries them all."""
        request = tokens[0].request
        delta = []
        for token in tokens:
            delta.append(token.token_id)
            status = self._accept_token(token)
            if status is not None:
                self._finish(request, status)
                break
        output = self._make_output(request, delta_token_ids=delta)
        if request.is_finished:
            self._forget(request.request_id)
        return output

    def _accept_token(self, token: SampledToken) -> RequestStatus | None:
        """Append a token to its request; the finished status it calls for, if any."""
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
        if request.grammar is not None:
            status = self._advance_grammar(request, token.token_id, status)
        stop_string = self.output_processor.update_text(request, token.token_id)
        if stop_string is not None and status != RequestStatus.FINISHED_ERROR:
            status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = stop_string
        return status

    @staticmethod
    def _advance_grammar(request: Request, token_id: int, status: RequestStatus | None) -> RequestStatus | None:
        """Feed the token to the request's grammar; the status it calls for: an error when the grammar refuses it
        (a token sampled without its mask), stopped once the output is complete, else ``status``."""
        if not request.grammar.accept(token_id):
            request.stop_reason = (f"token {token_id} does not follow the requested structure "
                                   f"({request.grammar.error or 'refused'}).")
            return RequestStatus.FINISHED_ERROR
        if request.grammar.is_complete:
            return RequestStatus.FINISHED_STOPPED
        return status

    def _finish(self, request: Request, status: RequestStatus) -> None:
        normal = status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
        hold = self.kv_transfers.keeps_blocks(request, normal) or (normal and request.keep_kv)
        if logger.isEnabledFor(logging.DEBUG):
            request_log(logger, request.request_id).debug("%s -> %s", request.status.name, status.name)
        self.scheduler.finish_request(request, status, hold_blocks=hold)
        self._release_lora(request)
        self.stats.num_finished_requests += 1
        request.finished_time = time.monotonic()

    def _forget(self, request_id: str) -> None:
        self.kv_transfers.forget_load(request_id)
        self.output_processor.forget(request_id)

    def _make_output(self, request: Request, delta_token_ids: list[int] | None = None) -> RequestOutput:
        load = self.kv_transfers.loads.get(request.request_id)
        output = self.output_processor.make_output(request, delta_token_ids, load)
        output.embedding = request.embedding
        return output
