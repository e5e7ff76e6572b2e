"""Log probabilities of a step's tokens, for the requests that ask for them.

They come from the raw logits (before penalties and temperature), as vLLM
returns them by default.
"""

from __future__ import annotations

import torch

from splitserve.engine.request import Request


def compute_logprobs(
    raw_logits: torch.Tensor, requests: list[Request], sampled_token_ids: list[int]
) -> list[dict[int, float] | None]:
    """Per row: None, or {token_id: logprob} for the request's top-N tokens plus
    the sampled one, from log_softmax of ``raw_logits`` ([num_rows, vocab]).

    The top-N come first, most likely first; the sampled token is added last
    when it is not among them. Changes nothing.
    """
    result: list[dict[int, float] | None] = [None] * len(requests)
    rows = [
        row for row, request in enumerate(requests) if request.sampling_params.logprobs is not None
    ]
    if not rows:
        return result
    # logprobs: [num_rows_asking, vocab]
    logprobs = torch.log_softmax(raw_logits[torch.tensor(rows)].float(), dim=-1)
    sampled = torch.tensor([sampled_token_ids[row] for row in rows], device=logprobs.device)
    sampled_logprobs = logprobs.gather(1, sampled[:, None]).squeeze(1).tolist()
    max_top = max(requests[row].sampling_params.logprobs for row in rows)
    top_values: list[list[float]] = [[] for _ in rows]
    top_token_ids: list[list[int]] = [[] for _ in rows]
    if max_top > 0:
        values, token_ids = logprobs.topk(max_top, dim=-1)  # [num_rows_asking, max_top]
        top_values, top_token_ids = values.tolist(), token_ids.tolist()
    for position, row in enumerate(rows):
        num_top = requests[row].sampling_params.logprobs
        row_logprobs = dict(zip(top_token_ids[position][:num_top], top_values[position][:num_top]))
        row_logprobs.setdefault(sampled_token_ids[row], sampled_logprobs[position])
        result[row] = row_logprobs
    return result
