"""What the engine hands back per request: vLLM-shaped ``RequestOutput`` objects."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    # The whole generated text so far (stop strings excluded).
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # Per generated token {token_id: logprob}, when SamplingParams.logprobs was set.
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None = None
    # The stop string or stop token id that finished the request, or an error message.
    stop_reason: int | str | None = None
    # Text and token ids added since the previous output of this request (for streaming).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    # time.monotonic() seconds.
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    # Requests whose prompt KV came from outside: how its load ended (a KVLoadOutcome), and the seconds
    # from reserving its blocks to that end.
    kv_load_outcome: Any = None
    kv_load_seconds: float = 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Prompt tokens served from the prefix cache.
    num_cached_tokens: int = 0
    # Prompt tokens whose KV a connector loaded into the request's blocks (a remote prefill's whole prompt, or
    # a prefix LMCache held), not counting num_cached_tokens; 0 when the load failed or nothing was loaded.
    num_loaded_tokens: int = 0
    # With SamplingParams.prompt_logprobs, per prompt token: None for the first (nothing predicts it), then
    # {token_id: logprob} for that token and the top alternatives at its position, as vLLM's prompt_logprobs.
    # Whole once the prompt is computed (a request's first token comes with it).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Beside prompt_logprobs, each prompt token's rank at its position (1: the most likely; vLLM's Logprob.rank),
    # None for the first.
    prompt_ranks: list[int | None] | None = None
    # An embedding request's embedding (LLM.embed; engine/pooling.py), once its prompt is computed.
    embedding: list[float] | None = None
