"""Log probabilities of a step's tokens, for the requests that ask for them, and of prompt tokens.

They come from the raw logits (before penalties and temperature), as vLLM
returns them by default.
"""

from __future__ import annotations

import torch

from splitserve.engine.request import Request

# Prompt positions whose logits are turned into logprobs at once: bounds the float32 [rows, vocab] copies
# (256 rows of a 49,152-token vocabulary: 50 MB each) whatever the chunk's size.
PROMPT_ROWS_AT_ONCE = 256


def _chosen_and_top(logprobs: torch.Tensor, chosen: list[int], chosen_values: list[float],
                    num_tops: list[int]) -> list[dict[int, float]]:
    """Per row of ``logprobs`` ([rows, vocab], log-softmaxed): {token_id: logprob} for its ``num_tops[row]``
    most likely tokens, most likely first, then its ``chosen[row]`` token (logprob ``chosen_values[row]``) when
    not among them."""
    max_top = max(num_tops)
    top_values: list[list[float]] = [[] for _ in chosen]
    top_token_ids: list[list[int]] = [[] for _ in chosen]
    if max_top > 0:
        values, token_ids = logprobs.topk(max_top, dim=-1)  # [rows, max_top]
        top_values, top_token_ids = values.tolist(), token_ids.tolist()
    result = []
    for row, num_top in enumerate(num_tops):
        row_logprobs = dict(zip(top_token_ids[row][:num_top], top_values[row][:num_top]))
        row_logprobs.setdefault(chosen[row], chosen_values[row])
        result.append(row_logprobs)
    return result


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
    sampled = [sampled_token_ids[row] for row in rows]
    sampled_values = logprobs.gather(1, torch.tensor(sampled, device=logprobs.device)[:, None]).squeeze(1).tolist()
    entries = _chosen_and_top(logprobs, sampled, sampled_values,
                              [requests[row].sampling_params.logprobs for row in rows])
    for row, entry in zip(rows, entries):
        result[row] = entry
    return result


def record_prompt_logprobs(hidden: torch.Tensor, compute_logits, rows: list[tuple[Request, int, int]]) -> None:
    """Append to each request's ``prompt_logprobs`` the entries its computed prompt positions give, and to its
    ``prompt_ranks`` the prompt tokens' ranks there.

    Args:
        hidden: the step's final hidden states, one row per token of the step.
        compute_logits: the model's head, hidden rows -> raw logits.
        rows: (request, row of ``hidden``, its position), each request's positions ascending and starting
            at the first entry it lacks (``model_runner._prompt_rows``): the row at position p scores the
            prompt's token p + 1, its entry p + 1.
    """
    for start in range(0, len(rows), PROMPT_ROWS_AT_ONCE):
        part = rows[start:start + PROMPT_ROWS_AT_ONCE]
        row_index = torch.tensor([row for _, row, _ in part], dtype=torch.int64, device=hidden.device)
        logprobs = torch.log_softmax(compute_logits(hidden[row_index]).float(), dim=-1)
        chosen = [request.prompt_token_ids[position + 1] for request, _, position in part]
        chosen_column = logprobs.gather(1, torch.tensor(chosen, device=logprobs.device)[:, None])  # [rows, 1]
        # vLLM's rank: how many tokens are at least as likely as the prompt's (1: the most likely).
        ranks = (logprobs >= chosen_column).sum(dim=-1).tolist()
        entries = _chosen_and_top(logprobs, chosen, chosen_column.squeeze(1).tolist(),
                                  [request.sampling_params.prompt_logprobs for request, _, _ in part])
        for (request, _, position), entry, rank in zip(part, entries, ranks):
            assert len(request.prompt_logprobs) == position + 1, "prompt positions out of order"
            request.prompt_logprobs.append(entry)
            request.prompt_ranks.append(rank)
