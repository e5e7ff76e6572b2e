"""The batched sampler: from one step's logits to one token id per request.

The order of operations follows vLLM:

1. penalties (repetition over prompt and output, presence and frequency over
   the output) on every row that asks for them;
2. ``min_tokens``: EOS and stop token ids are masked while a request is short;
3. greedy rows (temperature 0, or ``top_k == 1``) take the argmax;
4. random rows are divided by their temperature, filtered by top-k, then top-p,
   then min-p (the order of Hugging Face's logits warpers), turned into
   probabilities and sampled by inverting their cumulative distribution at one
   uniform number per row. A request with a seed draws that number from its
   own generator, exactly one per step, so its tokens do not depend on the
   rest of the batch or its row.

Log probabilities, when asked for, come from the raw logits (before penalties
and temperature), as vLLM returns them by default.

The transforms are plain functions over ``[num_rows, vocab]`` tensors so that
they can be tested on their own; none of them modifies its input.
"""

from __future__ import annotations

import array
from collections import Counter
from dataclasses import dataclass
from itertools import chain

import torch

from splitserve.engine.request import Request
from splitserve.engine.sampling_params import GREEDY_EPSILON

# Top-p first looks for its cut-off among this many most likely tokens, and
# sorts the whole row only when they do not hold enough probability.
TOP_P_CANDIDATES = 1024


@dataclass
class SamplerOutput:
    """What the sampler chose for one step, row by row."""

    # One token id per row, in the order of the requests.
    sampled_token_ids: list[int]
    # Per row: None unless the request asked for logprobs; else {token_id: logprob}
    # for the top-N tokens plus the sampled one, from log_softmax of the raw logits.
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Chooses the next token of every request in a batch.

    The only state it changes is random: its own generator (for requests
    without a seed) and ``request.generator``, which it creates on a seeded
    request's first random step and advances by one number per step.
    """

    def __init__(self, seed: int = 0):
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [num_rows, vocab], any float dtype; row i belongs to requests[i].
            requests: the batch; only ``request.generator`` may be changed.

        Returns:
            The sampled token ids and, for requests that asked, their logprobs.
        """
        if _all_plain_greedy(requests):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))

        raw_logits = logits.float()  # [num_rows, vocab]
        logits = apply_penalties(raw_logits, requests)
        logits = apply_min_tokens(logits, requests)

        greedy_rows = [row for row, request in enumerate(requests) if _is_greedy(request)]
        random_rows = [row for row, request in enumerate(requests) if not _is_greedy(request)]
        if not random_rows:
            sampled = logits.argmax(dim=-1)  # [num_rows]
        elif not greedy_rows:
            sampled = self._sample_random(logits, requests)
        else:
            sampled = torch.empty(len(requests), dtype=torch.long)
            greedy_index, random_index = torch.tensor(greedy_rows), torch.tensor(random_rows)
            sampled[greedy_index] = logits[greedy_index].argmax(dim=-1)
            sampled[random_index] = self._sample_random(
                logits[random_index], [requests[row] for row in random_rows]
            )
        sampled_token_ids = sampled.tolist()
        return SamplerOutput(
            sampled_token_ids, compute_logprobs(raw_logits, requests, sampled_token_ids)
        )

    def skip_first_draw(self, request: Request) -> None:
        """Advance a seeded request's generator past the draw its first token took elsewhere.

        A prefill worker samples the first token of a disaggregated request; the
        decode worker then continues the same random stream, so a seeded request
        gives the same tokens whether or not its prefill ran in another process.
        """
        if request.sampling_params.seed is None or _is_greedy(request):
            return
        if request.generator is None:
            request.generator = torch.Generator().manual_seed(request.sampling_params.seed)
        torch.empty(1, dtype=torch.float32).uniform_(generator=request.generator)

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, filters and one draw for each row that samples.

        logits: [num_random, vocab] float32, penalized. Returns [num_random] token ids.
        """
        vocab_size = logits.shape[-1]
        params = [request.sampling_params for request in requests]
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params])
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32)

        logits = apply_temperature(logits, temperatures)
        logits = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        probs = logits.softmax(dim=-1)  # [num_random, vocab]
        return sample_from_probs(probs, self._uniform_numbers(requests))

    def _uniform_numbers(self, requests: list[Request]) -> torch.Tensor:
        """One uniform number in [0, 1) per row, [num_random] float32: seeded rows
        from their own generator (created here the first time), the others from
        the sampler's."""
        uniforms = torch.empty(len(requests), dtype=torch.float32)
        unseeded_rows = []
        for row, request in enumerate(requests):
            seed = request.sampling_params.seed
            if seed is None:
                unseeded_rows.append(row)
                continue
            if request.generator is None:
                request.generator = torch.Generator().manual_seed(seed)
            uniforms[row : row + 1].uniform_(generator=request.generator)
        if unseeded_rows:
            uniforms[torch.tensor(unseeded_rows)] = torch.rand(
                len(unseeded_rows), generator=self.generator
            )
        return uniforms


def _all_plain_greedy(requests: list[Request]) -> bool:
    """True when every row is a bare argmax: no penalties, min_tokens mask or logprobs."""
    for request in requests:
        params = request.sampling_params
        if (
            (params.temperature >= GREEDY_EPSILON and params.top_k != 1)
            or params.logprobs is not None
            or params.needs_penalties
            or len(request.output_token_ids) < params.min_tokens
        ):
            return False
    return True


def _is_greedy(request: Request) -> bool:
    """Greedy rows take the argmax; top_k == 1 keeps only the argmax, so it is one."""
    params = request.sampling_params
    return params.is_greedy or params.top_k == 1


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition, frequency and presence penalties, as vLLM defines them.

    On rows whose request has ``needs_penalties``: a token present in
    ``request.all_token_ids`` (prompt or output) has a positive logit divided by
    ``repetition_penalty``, a negative one multiplied by it; then every token in
    ``request.output_token_ids`` loses ``frequency_penalty`` times its count
    plus ``presence_penalty``. Other rows and tokens are unchanged; token ids
    outside [0, vocab) are ignored. Only the penalized entries are touched, so
    the cost grows with the number of distinct tokens, not with the vocabulary.

    Args:
        logits: [num_rows, vocab] float32; not modified.
        requests: one per row.

    Returns:
        A new [num_rows, vocab] tensor (the input itself when no row has penalties).
    """
    penalized_rows = [
        row for row, request in enumerate(requests) if request.sampling_params.needs_penalties
    ]
    if not penalized_rows:
        return logits
    vocab_size = logits.shape[-1]
    params = [requests[row].sampling_params for row in penalized_rows]
    row_index = torch.tensor(penalized_rows)
    result = logits.clone()

    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
    if bool((repetition != 1.0).any()):
        # One entry per (row, distinct token of prompt + output).
        seen = [list(set(requests[row].all_token_ids)) for row in penalized_rows]
        owners, token_ids, _ = _flatten_per_row(seen, None, vocab_size)  # [num_entries] each
        index = (row_index[owners], token_ids)
        values = result[index]  # [num_entries]
        penalty = repetition[owners]  # [num_entries]
        result[index] = torch.where(values > 0, values / penalty, values * penalty)

    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
    if bool((frequency != 0.0).any() or (presence != 0.0).any()):
        # One entry per (row, distinct output token).
        counters = [Counter(requests[row].output_token_ids) for row in penalized_rows]
        owners, token_ids, counts = _flatten_per_row(
            [list(counter) for counter in counters],
            [list(counter.values()) for counter in counters],
            vocab_size,
        )
        subtracted = frequency[owners] * counts + presence[owners]  # [num_entries]
        result.index_put_((row_index[owners], token_ids), -subtracted, accumulate=True)
    return result


def _flatten_per_row(
    token_id_lists: list[list[int]], count_lists: list[list[int]] | None, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Flatten per-row token ids (and their counts) into [num_entries] tensors:
    the list each entry came from, the token id, and the count as float32.
    Token ids outside [0, vocab) are dropped."""
    lengths = torch.tensor([len(token_ids) for token_ids in token_id_lists])
    owners = torch.repeat_interleave(torch.arange(len(token_id_lists)), lengths)
    token_ids = _int64_tensor(list(chain.from_iterable(token_id_lists)))
    valid = (token_ids >= 0) & (token_ids < vocab_size)
    counts = None
    if count_lists is not None:
        counts = _int64_tensor(list(chain.from_iterable(count_lists)))[valid].float()
    return owners[valid], token_ids[valid], counts


def _int64_tensor(values: list[int]) -> torch.Tensor:
    """torch.tensor(values) for a long list of ints, about ten times faster."""
    if not values:
        return torch.empty(0, dtype=torch.long)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Forbid ending too early: while ``len(request.output_token_ids) <
    params.min_tokens``, the logits of ``params.stop_token_ids`` and (unless
    ``ignore_eos``) of ``request.eos_token_ids`` become -inf.

    logits: [num_rows, vocab]; not modified. Returns a new tensor, or the input
    when no row is masked.
    """
    vocab_size = logits.shape[-1]
    masked_rows: list[int] = []
    masked_token_ids: list[int] = []
    for row, request in enumerate(requests):
        params = request.sampling_params
        if len(request.output_token_ids) >= params.min_tokens:
            continue
        blocked = set(params.stop_token_ids)
        if not params.ignore_eos:
            blocked |= request.eos_token_ids
        for token_id in sorted(blocked):
            if 0 <= token_id < vocab_size:
                masked_rows.append(row)
                masked_token_ids.append(token_id)
    if not masked_rows:
        return logits
    result = logits.clone()
    result[torch.tensor(masked_rows), torch.tensor(masked_token_ids)] = float("-inf")
    return result


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """logits: [num_rows, vocab]; temperatures: [num_rows], all > 0.

    Returns logits / t as a new tensor, or the input when every t is 1.
    """
    if bool((temperatures == 1.0).all()):
        return logits
    return logits / temperatures[:, None]


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Set every token outside a row's top-k, then top-p, then min-p set to -inf.

    Args:
        logits: [num_rows, vocab] float32 (already divided by temperature); not modified.
        top_k: [num_rows] int; keep the k highest logits (among equal logits the
            lower token id first, as argmax); k >= vocab disables it.
        top_p: [num_rows] float in (0, 1]; of the top-k tokens, keep the
            smallest most-likely set whose renormalized probability reaches p;
            1 disables it.
        min_p: [num_rows] float in [0, 1]; of what is left, drop tokens whose
            probability is below min_p times the most likely one's; 0 disables it.

    Returns:
        A new [num_rows, vocab] tensor, or the input when nothing is filtered.
        The most likely token is always kept.
    """
    vocab_size = logits.shape[-1]
    top_k_rows = (top_k < vocab_size).nonzero().flatten()
    if len(top_k_rows):
        keep = top_k_mask(_select_rows(logits, top_k_rows), top_k[top_k_rows])
        logits = _keep_only(logits, top_k_rows, keep)
    top_p_rows = (top_p < 1.0).nonzero().flatten()
    if len(top_p_rows):
        keep = top_p_mask(_select_rows(logits, top_p_rows).softmax(dim=-1), top_p[top_p_rows])
        logits = _keep_only(logits, top_p_rows, keep)
    if bool((min_p > 0.0).any()):
        probs = logits.softmax(dim=-1)  # [num_rows, vocab]
        threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values  # [num_rows, 1]
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def top_k_mask(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Which tokens are among each row's k highest: [num_rows, vocab] bool.

    logits: [num_rows, vocab]; top_k: [num_rows], each in [1, vocab]. Exactly k
    per row: tokens tied with the k-th value are taken lowest id first.
    """
    top_values = logits.topk(int(top_k.max()), dim=-1).values  # [num_rows, max_k], descending
    kth_value = top_values.gather(1, (top_k - 1)[:, None])  # [num_rows, 1]
    keep = logits >= kth_value  # [num_rows, vocab]
    if bool((torch.count_nonzero(keep, dim=-1) == top_k).all()):
        return keep
    # Some rows have more tokens tied with the k-th value than fit.
    above = logits > kth_value  # [num_rows, vocab]
    tied = keep & ~above
    num_tied_to_keep = top_k[:, None] - torch.count_nonzero(above, dim=-1)[:, None]  # [num_rows, 1]
    return above | (tied & (tied.cumsum(dim=-1) <= num_tied_to_keep))


def top_p_mask(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens form each row's top-p set: [num_rows, vocab] bool.

    probs: [num_rows, vocab], rows summing to 1; top_p: [num_rows] in (0, 1].
    A token is kept when the tokens ranked above it hold less than p, so the
    most likely token always is. Only the TOP_P_CANDIDATES most likely tokens
    are ranked unless they hold less than p; then the whole row is.
    """
    vocab_size = probs.shape[-1]
    keep, reached = _top_p_mask_among(probs, top_p, min(TOP_P_CANDIDATES, vocab_size))
    if not bool(reached.all()):
        short_rows = (~reached).nonzero().flatten()
        keep[short_rows] = _top_p_mask_among(probs[short_rows], top_p[short_rows], vocab_size)[0]
    return keep


def _top_p_mask_among(
    probs: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-p mask ranking only the num_candidates most likely tokens, and
    whether each row's candidates reached p ([num_rows] bool)."""
    # candidate_probs, candidate_token_ids: [num_rows, num_candidates], most likely first
    candidate_probs, candidate_token_ids = probs.topk(num_candidates, dim=-1)
    cumulative = candidate_probs.cumsum(dim=-1)
    # Probability of all better-ranked candidates; rank 0 sees exactly 0.
    keep_candidate = (cumulative - candidate_probs) < top_p[:, None]
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, candidate_token_ids, keep_candidate)
    return keep, cumulative[:, -1] >= top_p


def _select_rows(logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """logits[rows] ([len(rows), vocab]); the tensor itself when rows are all of them."""
    return logits if len(rows) == logits.shape[0] else logits[rows]


def _keep_only(logits: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """A copy of logits ([num_rows, vocab]) where row rows[i] is -inf outside keep[i]."""
    if len(rows) == logits.shape[0]:
        return logits.masked_fill(~keep, float("-inf"))
    result = logits.clone()
    result[rows] = logits[rows].masked_fill(~keep, float("-inf"))
    return result


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Invert each row's cumulative distribution at its uniform number.

    probs: [num_rows, vocab], non-negative (rows need not sum to 1); uniforms:
    [num_rows] in [0, 1). Returns [num_rows] token ids: the first token whose
    cumulative probability exceeds uniform * row total. A token of probability
    0 is never chosen, even when rounding puts the target at the total.
    """
    cumulative = probs.cumsum(dim=-1)  # [num_rows, vocab]
    totals = cumulative[:, -1:].contiguous()  # [num_rows, 1]
    targets = uniforms.to(probs.dtype)[:, None] * totals  # [num_rows, 1]
    token_ids = torch.searchsorted(cumulative, targets, right=True)  # [num_rows, 1]
    last_likely_token_ids = torch.searchsorted(cumulative, totals)  # first to reach the total
    return torch.minimum(token_ids, last_likely_token_ids).squeeze(1)


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
    sampled = torch.tensor([sampled_token_ids[row] for row in rows])
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
