"""Logits processors: the request's allowed tokens, bad words and logit bias, and what depends on what it has seen
(penalties, the min_tokens mask).

Steps 1 to 3 of the sampler (``engine/sampling.py``). Plain functions over
``[num_rows, vocab]`` tensors, tested on their own; neither modifies its input.
"""

from __future__ import annotations

import array
from collections import Counter
from itertools import chain

import torch

from splitserve.common.errors import InvalidRequest
from splitserve.engine.request import Request


def bad_words_token_ids(tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """The token sequences ``words`` (SamplingParams.bad_words) are banned as: each word, leading spaces dropped,
    tokenized alone (as at the start of a text) and after a space (as inside one: most tokenizers then fold the
    space into its first token). The spaced form is left out where it is the plain form behind a token of its
    own (the plain form already bans its end); vLLM leaves it out also where the space changes the number of
    tokens, which would let " word" through when the space splits "word" differently, so this keeps it.

    Raises:
        InvalidRequest: a word the tokenizer writes as no token at all.
    """
    sequences: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if not plain:
            raise InvalidRequest(f"The bad word {word[:64]!r} is no token at all in this model's vocabulary.")
        for sequence in (plain, spaced):
            if sequence and sequence not in sequences and sequence[1:] != plain:
                sequences.append(sequence)
    return sequences


class BadWordBans:
    """A request's bad words as the tokens they ban, indexed for each step's check: one-token words always, a
    longer word's last token where the output ends with the rest of it, looked up by the output's last token (so a
    step costs the words that could end there, not all of them).

    Args:
        sequences: the words' token sequences (:func:`bad_words_token_ids`).
    """

    def __init__(self, sequences: list[tuple[int, ...]]) -> None:
        self.sequences = [tuple(sequence) for sequence in sequences]
        self._always = [sequence[0] for sequence in self.sequences if len(sequence) == 1]
        self._by_previous: dict[int, list[tuple[int, ...]]] = {}
        for sequence in self.sequences:
            if len(sequence) > 1:
                self._by_previous.setdefault(sequence[-2], []).append(sequence)

    def banned(self, output: list[int]) -> list[int]:
        """The token ids banned after ``output`` (the request's generated tokens)."""
        tokens = list(self._always)
        for sequence in self._by_previous.get(output[-1], ()) if output else ():
            before = len(sequence) - 1
            if before <= len(output) and output[len(output) - before:] == list(sequence[:-1]):
                tokens.append(sequence[-1])
        return tokens


def apply_allowed_token_ids(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """-inf on every token outside each row's ``sampling_params.allowed_token_ids`` (rows without it unchanged).

    Args:
        logits: [num_rows, vocab] float32; not modified.
        requests: one per row.

    Returns:
        A new [num_rows, vocab] tensor (the input itself when no row limits its tokens).
    """
    rows = [row for row, request in enumerate(requests) if request.sampling_params.allowed_token_ids is not None]
    if not rows:
        return logits
    vocab_size = logits.shape[-1]
    banned = torch.stack([_banned_outside_allowed(requests[row], vocab_size) for row in rows])
    result = logits.clone()
    row_index = torch.tensor(rows, device=logits.device)
    result[row_index] = result[row_index].masked_fill(banned.to(logits.device), float("-inf"))
    return result


def _banned_outside_allowed(request: Request, vocab_size: int) -> torch.Tensor:
    """[vocab] bool: the tokens outside the request's allowed_token_ids, built on its first step and kept on the
    request (a list of many ids is not walked again on every step)."""
    mask = request.allowed_token_mask
    if mask is None or mask.shape[0] != vocab_size:
        mask = torch.ones(vocab_size, dtype=torch.bool)
        allowed = torch.tensor(request.sampling_params.allowed_token_ids, dtype=torch.long)
        mask[allowed[allowed < vocab_size]] = False
        request.allowed_token_mask = mask
    return mask


def apply_bad_words(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """-inf on each bad word's last token wherever the row's output ends with the rest of the word's tokens
    (``request.bad_word_bans``, a :class:`BadWordBans`; a one-token word is banned everywhere). A continuation's
    output starts with its resumed prompt tokens (``Request.generated_token_ids``).

    Args:
        logits: [num_rows, vocab] float32; not modified.
        requests: one per row.

    Returns:
        A new [num_rows, vocab] tensor (the input itself when nothing is banned on this step).
    """
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    token_ids: list[int] = []
    for row, request in enumerate(requests):
        if request.bad_word_bans is None:
            continue
        for token_id in request.bad_word_bans.banned(request.generated_token_ids):
            if 0 <= token_id < vocab_size:
                rows.append(row)
                token_ids.append(token_id)
    return _with_entries_masked(logits, rows, token_ids)


def _with_entries_masked(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> torch.Tensor:
    """A copy of ``logits`` with -inf at each (rows[i], token_ids[i]); ``logits`` itself when there are none."""
    if not rows:
        return logits
    result = logits.clone()
    result[torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device)] = float("-inf")
    return result


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Each row's ``sampling_params.logit_bias``, added to its tokens' logits (OpenAI's and vLLM's logit_bias).

    Token ids outside [0, vocab) are ignored (the router and the engine refuse them before a request runs).

    Args:
        logits: [num_rows, vocab] float32; not modified.
        requests: one per row.

    Returns:
        A new [num_rows, vocab] tensor (the input itself when no row has a bias).
    """
    vocab_size = logits.shape[-1]
    rows: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for row, request in enumerate(requests):
        for token_id, bias in request.sampling_params.logit_bias.items():
            if 0 <= token_id < vocab_size:
                rows.append(row)
                token_ids.append(token_id)
                biases.append(bias)
    if not rows:
        return logits
    result = logits.clone()
    index = (torch.tensor(rows, device=logits.device), torch.tensor(token_ids, device=logits.device))
    result.index_put_(index, torch.tensor(biases, dtype=result.dtype, device=logits.device), accumulate=True)
    return result


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Repetition, frequency and presence penalties, as vLLM defines them.

    On rows whose request has ``needs_penalties``: a token present in
    ``request.all_token_ids`` (prompt or output) has a positive logit divided by
    ``repetition_penalty``, a negative one multiplied by it; then every token in
    ``request.generated_token_ids`` (the output, after a continuation's resumed
    prompt tokens) loses ``frequency_penalty`` times its count plus
    ``presence_penalty``. Other rows and tokens are unchanged; token ids
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

    device = logits.device  # index and value tensors are built on the host, then moved there
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
    if bool((repetition != 1.0).any()):
        # One entry per (row, distinct token of prompt + output).
        seen = [list(set(requests[row].all_token_ids)) for row in penalized_rows]
        owners, token_ids, _ = _flatten_per_row(seen, None, vocab_size)  # [num_entries] each
        owners, token_ids, row_index, repetition = (t.to(device) for t in (owners, token_ids, row_index, repetition))
        index = (row_index[owners], token_ids)
        values = result[index]  # [num_entries]
        penalty = repetition[owners]  # [num_entries]
        result[index] = torch.where(values > 0, values / penalty, values * penalty)

    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)
    if bool((frequency != 0.0).any() or (presence != 0.0).any()):
        # One entry per (row, distinct output token).
        counters = [Counter(requests[row].generated_token_ids) for row in penalized_rows]
        owners, token_ids, counts = _flatten_per_row(
            [list(counter) for counter in counters],
            [list(counter.values()) for counter in counters],
            vocab_size,
        )
        owners, token_ids, counts = owners.to(device), token_ids.to(device), counts.to(device)
        row_index, frequency, presence = row_index.to(device), frequency.to(device), presence.to(device)
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
    return _with_entries_masked(logits, masked_rows, masked_token_ids)
