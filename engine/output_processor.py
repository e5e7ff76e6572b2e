"""From engine requests to ``RequestOutput`` objects: incremental text, stop strings, logprobs, metrics.

The engine hands each request here when it is added (:meth:`OutputProcessor.add`), reports each new
token (:meth:`OutputProcessor.update_text`, which says whether a stop string matched), builds an output
whenever a request got a token or finished (:meth:`OutputProcessor.make_output`), and forgets a
request once its last output is out.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.kv_transfers import LoadState
from splitserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from splitserve.engine.request import Request


class OutputProcessor:
    """Detokenizers and prompt texts of one engine's unfinished requests.

    Args:
        tokenizer: the model's tokenizer.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self._prompts: dict[str, str | None] = {}

    def add(self, request: Request, prompt: str | None) -> None:
        """Start tracking a request's text (``prompt`` is its text, None for token ids)."""
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params)
        self._prompts[request.request_id] = prompt

    def update_text(self, request: Request, token_id: int) -> str | None:
        """Detokenize a new token; returns the stop string it completed, if any."""
        return self._detokenizers[request.request_id].update([token_id])

    def forget(self, request_id: str) -> None:
        self._detokenizers.pop(request_id, None)
        self._prompts.pop(request_id, None)

    def make_output(self, request: Request, delta_token_ids: list[int] | None = None,
                    load: LoadState | None = None) -> RequestOutput:
        """The request's output now: its whole text and tokens, what is new since the last output, and its
        metrics (with how its KV load ended, when ``load`` is given)."""
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
            kv_load_outcome=load.outcome if load is not None else None,
            kv_load_seconds=load.seconds if load is not None else 0.0,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=self._prompts.get(request.request_id),
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=metrics,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_loaded_tokens=load.num_loaded_tokens if load is not None else 0,
            # The request's own list: appended to only while its prompt is computed, so never copied.
            prompt_logprobs=request.prompt_logprobs if request.sampling_params.prompt_logprobs is not None else None,
            prompt_ranks=request.prompt_ranks if request.sampling_params.prompt_logprobs is not None else None,
        )
