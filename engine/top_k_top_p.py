"""The random half of sampling: temperature, top-k, top-p and min-p filters, and the draw.

Rows are divided by their temperature, filtered by top-k, then top-p, then
min-p (the order of Hugging Face's logits warpers), and sampled by inverting
their cumulative distribution at one uniform number per row (the sampler,
``engine/sampling.py``, chooses those numbers). Plain functions over
``[num_rows, vocab]`` tensors, tested on their own; none modifies its input.
"""

from __future__ import annotations

import torch

# Top-p first looks for its cut-off among this many most likely tokens, and
# sorts the whole row only when they do not hold enough probability.
TOP_P_CANDIDATES = 1024


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
    targets = uniforms.to(device=probs.device, dtype=probs.dtype)[:, None] * totals  # [num_rows, 1]
    token_ids = torch.searchsorted(cumulative, targets, right=True)  # [num_rows, 1]
    last_likely_token_ids = torch.searchsorted(cumulative, totals)  # first to reach the total
    return torch.minimum(token_ids, last_likely_token_ids).squeeze(1)
