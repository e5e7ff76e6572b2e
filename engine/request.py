"""A request as the engine tracks it, and the states it moves through.

States are ordered so that "finished" is one comparison (everything after
``PREEMPTED``), as in vLLM V1::

    WAITING_FOR_REMOTE_KVS --kv arrived--> WAITING --scheduled--> RUNNING
    RUNNING --> FINISHED_STOPPED | FINISHED_LENGTH | FINISHED_ABORTED | FINISHED_ERROR
    RUNNING --out of blocks--> PREEMPTED --> (front of the queue, recomputed)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from splitserve.common.block_hash import long_rope_root_hash
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.types import FinishReason


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Blocks reserved; the prompt's KV is being written in from outside (a
    # prefill worker). Skipped by the scheduler until the engine is told it arrived.
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything below is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def finish_reason(status: RequestStatus) -> FinishReason | None:
        """The finish reason of a finished status; None while the request runs."""
        return _FINISH_REASONS.get(status)


@dataclass(frozen=True)
class KVFork:
    """A request continues a finished one's KV (beam search, ``LLM.beam_search``): its tokens start with the
    ``parent_id`` request's computed ones, whose blocks that request holds (``keep_kv``) until released. When the
    request is scheduled, it shares the parent's full blocks and gets a copy of the parent's last, partial block
    (``take_tail``: takes that block itself, without a copy, when no other request will fork from the parent's
    tail; a later fork then shares only the full blocks and computes the rest). A parent released or not holding
    those tokens: the request is computed as any other (the prefix cache still applies)."""

    parent_id: str
    take_tail: bool = False


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass
class Request:
    """One generation request inside the engine.

    ``all_token_ids`` is the prompt followed by every generated token; the KV
    cache holds ``num_computed_tokens`` of them.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    # Generation stops at this many output tokens (max_tokens capped by the
    # model's length limit); set by the engine.
    max_output_tokens: int = 16
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    # The priority scheduling policy's order: lower first (vLLM's), ties by arrival_number, which the engine
    # numbers requests by as they are added (arrival times may tie).
    priority: int = 0
    arrival_number: int = 0

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when the request was first scheduled.
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    # Chained hashes of the request's full blocks, in order (see kv_cache_manager).
    block_hashes: list[bytes] = field(default_factory=list)
    # With a LoRA adapter (engine/lora.py): its LoRARequest, and the hash its first block chains from (its KV is the
    # adapter's: no other adapter's request may share it; a cache salt is mixed in after it,
    # block_hash.salted_root_hash); None: the base model without a salt, chaining from the common root.
    lora_request: Any = None
    block_hash_root: bytes | None = None
    # A LongRoPE model's request longer than the original context (``rotate_long``): every position rotates with the
    # long factors (RotaryEmbedding.long_offset), its blocks chained from their own root.
    long_rope: bool = False
    # The token id or stop string that finished it; an error message for FINISHED_ERROR.
    stop_reason: int | str | None = None
    # Per-request random generator (a numpy.random.Generator on PCG64, all 64 bits of the seed), owned by the sampler.
    generator: Any = None
    # Per generated token: {token_id: logprob} when logprobs were asked for.
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # With sampling_params.prompt_logprobs, per prompt position computed so far: None for the first token
    # (nothing predicts it), then {token_id: logprob} for the prompt's token and the top alternatives there.
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    # Beside it, each prompt token's rank at its position (1: the most likely), None for the first.
    prompt_ranks: list[int | None] = field(default_factory=list)
    # With sampling_params.structured_outputs: its grammar's state (a structured_output.GrammarMatcher), owned by
    # the engine (which feeds it each token) and read by the sampler (which masks what it cannot take next).
    grammar: Any = None
    # sampling_params.bad_words as the tokens they ban (a logits_processors.BadWordBans), set by the engine when the
    # request is added; None without bad words.
    bad_word_bans: Any = None
    # With sampling_params.allowed_token_ids: a [vocab] bool tensor of the tokens outside them, built by the sampler
    # on the request's first step (logits_processors.apply_allowed_token_ids).
    allowed_token_mask: Any = None
    # An embedding request (LLM.embed; engine.pooling.PoolingParams): its prompt's pooled hidden state, set by the
    # model runner when the prompt's last token is computed, where a generation request samples its first token.
    pooling_params: Any = None
    embedding: list[float] | None = None
    # Beam search (KVFork): the finished request whose KV this one continues, and whether this one's blocks are held
    # when it finishes normally (until LLMEngine.release_kv), for requests that continue it.
    kv_fork: KVFork | None = None
    keep_kv: bool = False
    # Sum of the generated tokens' logprobs, kept as they arrive.
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        if self.sampling_params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs, self.prompt_ranks = [None], [None]

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were asked for and some are not computed yet: the prompt's KV must then be
        computed here, not taken from the prefix cache or a connector."""
        return self.sampling_params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def generated_token_ids(self) -> list[int]:
        """What penalties and bad words look at: a continuation's resumed prompt tokens (the prompt's last
        ``sampling_params.num_resumed_tokens``, generated before under the same parameters), then the output."""
        resumed = self.sampling_params.num_resumed_tokens
        if not resumed:
            return self.output_token_ids
        return self.prompt_token_ids[len(self.prompt_token_ids) - resumed:] + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    @property
    def finish_reason(self) -> FinishReason | None:
        return RequestStatus.finish_reason(self.status)

    def rotate_long(self) -> None:
        """Rotate every position with a LongRoPE model's long factors from now on (the request is longer than the
        original context): its blocks chain from a root of their own (``block_hash.long_rope_root_hash``), their
        hashes computed again; KV computed before must be computed again (the scheduler preempts it)."""
        self.long_rope, self.block_hash_root = True, long_rope_root_hash(self.block_hash_root)
        self.block_hashes = []

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()

    def check_stop_token(self) -> RequestStatus | None:
        """The finished status the last generated token calls for, if any.

        Stop strings are matched on text by the detokenizer, not here.
        """
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
