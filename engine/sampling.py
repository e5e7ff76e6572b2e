"""The batched sampler: from one step's logits to one token id per request.

The order of operations follows vLLM:

1. ``allowed_token_ids`` and ``bad_words``: -inf on the tokens a row may not take (a bad word's last token
   where the output ends with the rest of the word); ``logit_bias``: each row's biases added to its tokens'
   logits;
2. penalties (repetition over prompt and output, presence and frequency over
   the output) on every row that asks for them;
3. ``min_tokens``: EOS and stop token ids are masked while a request is short;
   then structured outputs: each constrained row's grammar masks every token
   it cannot take next (``structured_output.py``);
4. greedy rows (temperature 0, or ``top_k == 1``) take the argmax;
5. random rows are divided by their temperature, filtered by top-k, then top-p,
   then min-p (the order of Hugging Face's logits warpers), turned into
   probabilities and sampled by inverting their cumulative distribution at one
   uniform number per row. A request with a seed draws that number from its
   own generator (PCG64, seeded with all 64 bits of the seed), exactly one per
   token (speculative steps too: ``verify_drafts``), so its tokens do not depend
   on the rest of the batch, its row or its drafts; a continuation
   (``num_resumed_tokens``, a migration's) starts past the draws of the tokens
   it resumes, so it draws what the undisturbed request would.

Log probabilities, when asked for, come from the raw logits (before the bias,
penalties and temperature), as vLLM returns them by default.

The transforms are plain functions over ``[num_rows, vocab]`` tensors, each
tested on its own and none modifying its input: steps 1 to 3 in
``logits_processors.py``, step 5's filters and draw in ``top_k_top_p.py``,
log probabilities in ``logprobs.py``. This module chooses the rows and the
random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy
import torch

from splitserve.common.sampling_params import GREEDY_EPSILON
from splitserve.engine.logits_processors import (
    apply_allowed_token_ids,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
)
from splitserve.engine.logprobs import compute_logprobs
from splitserve.engine.request import Request
from splitserve.engine.speculative import accepted_tokens
from splitserve.engine.structured_output import BITS_PER_WORD, apply_token_bitmask, fill_token_bitmask
from splitserve.engine.top_k_top_p import apply_temperature, apply_top_k_top_p_min_p, sample_from_probs


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
    request's first random step and advances by one number per token.
    """

    def __init__(self, seed: int = 0, kernels=None):
        """kernels: the C++ CPU kernels (``splitserve.kernels.cpu_ops``, loaded) to take greedy rows' argmax
        through, or None: torch."""
        self.generator = torch.Generator().manual_seed(seed)
        self.kernels = kernels

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [num_rows, vocab], any float dtype; row i belongs to requests[i].
            requests: the batch; only ``request.generator`` may be changed.

        Returns:
            The sampled token ids and, for requests that asked, their logprobs.
        """
        if _all_plain_greedy(requests):
            return SamplerOutput(greedy_token_ids(logits, self.kernels).tolist(), [None] * len(requests))

        raw_logits = logits.float()  # [num_rows, vocab]
        logits = self._apply_grammars(_processed(raw_logits, requests, requests), requests)

        greedy_rows = [row for row, request in enumerate(requests) if _is_greedy(request)]
        random_rows = [row for row, request in enumerate(requests) if not _is_greedy(request)]
        if not random_rows:
            sampled = greedy_token_ids(logits, self.kernels)  # [num_rows]
        elif not greedy_rows:
            sampled = self._sample_random(logits, requests)
        else:
            sampled = torch.empty(len(requests), dtype=torch.long, device=logits.device)
            greedy_index, random_index = torch.tensor(greedy_rows), torch.tensor(random_rows)
            sampled[greedy_index] = greedy_token_ids(logits[greedy_index], self.kernels)
            sampled[random_index] = self._sample_random(
                logits[random_index], [requests[row] for row in random_rows]
            )
        sampled_token_ids = sampled.tolist()
        return SamplerOutput(
            sampled_token_ids, compute_logprobs(raw_logits, requests, sampled_token_ids)
        )

    def _apply_grammars(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """-inf on each constrained row's tokens its grammar cannot take next ([num_rows, vocab]; a new tensor
        when some row is constrained). A grammar waiting out its request's think block constrains nothing yet."""
        rows = [row for row, request in enumerate(requests) if request.grammar is not None and request.grammar.active]
        if not rows:
            return logits
        num_words = -(-logits.shape[-1] // BITS_PER_WORD)  # the logits' width, in the bitmask's int32 words
        bitmask = fill_token_bitmask([requests[row].grammar for row in rows], num_words)
        return apply_token_bitmask(logits, rows, bitmask, self.kernels)

    def skip_first_draw(self, request: Request) -> None:
        """Advance a seeded request's generator past the draw its first token took elsewhere.

        A prefill worker samples the first token of a disaggregated request; the
        decode worker then continues the same random stream, so a seeded request
        gives the same tokens whether or not its prefill ran in another process.
        """
        if request.sampling_params.seed is None or _is_greedy(request):
            return
        _generator_of(request).random(dtype=numpy.float32)

    def verify_drafts(self, logits: torch.Tensor, request: Request, drafts: list[int]) -> list[int]:
        """The tokens a request's speculative step gives (``engine/speculative.py``): its drafts accepted in order,
        then one token of its own.

        logits: [len(drafts) + 1, vocab], row i the model's logits after the request's last token and drafts
        0..i-1. Each row goes through what one step at a time would apply to it: ``allowed_token_ids`` and the
        logit bias alike on every row; bad words, penalties and min_tokens as if drafts 0..i-1 were already its
        output (:class:`RowAfterDrafts`); its grammar, when it has one past its think block, masked as of drafts
        0..i-1 (``GrammarMatcher.draft_bitmask``). A greedy
        request accepts a draft while it equals the row's argmax, and the first argmax that differs is its own
        token. A sampling request samples its rows in order as one step at a time would (after temperature,
        top-k, top-p and min-p, one uniform number a row), accepting draft i while the token row i draws is the
        draft; the first token that differs, or the last row's, is its own. Each token is then the one sampling
        step by step draws from the same number, so it keeps its distribution, and a draft is accepted with the
        probability its row gives it, as speculative sampling with a proposer certain of its drafts accepts it.
        A request draws one number a token it gets, drafted or not: a seeded request's tokens are those it draws
        without speculation (up to the rounding of the logits), whatever drafts were proposed or the batch cut
        off, and a continuation (``num_resumed_tokens``) resumes its stream exactly after speculating steps.

        Returns: 1 to ``len(drafts) + 1`` token ids (their log probabilities: :meth:`draft_logprobs`).
        """
        rows = [request] * logits.shape[0]
        after_drafts = [RowAfterDrafts(request, drafts[:row]) for row in range(len(drafts) + 1)]
        logits = _processed(logits.float(), rows, after_drafts)  # [len(drafts) + 1, vocab]
        if request.grammar is not None and request.grammar.active:
            num_words = -(-logits.shape[-1] // BITS_PER_WORD)
            bitmask = request.grammar.draft_bitmask(drafts, num_words)
            logits = apply_token_bitmask(logits, list(range(len(drafts) + 1)), bitmask, self.kernels)
        if _is_greedy(request):
            return accepted_tokens(drafts, greedy_token_ids(logits, self.kernels).tolist())
        probs = self._random_probs(logits, rows)  # [len(drafts) + 1, vocab]
        tokens: list[int] = []
        for row in range(len(drafts) + 1):
            uniform = torch.tensor([self._uniform(request)])
            tokens.append(int(sample_from_probs(probs[row : row + 1], uniform)[0]))
            if row == len(drafts) or tokens[-1] != drafts[row]:
                return tokens
        raise AssertionError("unreachable: the last row always returns")

    @staticmethod
    def draft_logprobs(logits: torch.Tensor, request: Request, token_ids: list[int]) -> list[dict[int, float] | None]:
        """Per token of a speculative step (``verify_drafts``' tokens): None, or its {token_id: logprob} entry when
        the request asked for logprobs, from its row's raw logits as one step at a time gives it."""
        return compute_logprobs(logits[: len(token_ids)], [request] * len(token_ids), token_ids)

    def _uniform(self, request: Request) -> float:
        """One uniform number in [0, 1): from a seeded request's own generator, else from the sampler's."""
        if request.sampling_params.seed is None:
            return float(torch.rand(1, generator=self.generator)[0])
        return float(_generator_of(request).random(dtype=numpy.float32))

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Temperature, filters and one draw for each row that samples.

        logits: [num_random, vocab] float32, penalized. Returns [num_random] token ids.
        """
        return sample_from_probs(self._random_probs(logits, requests), self._uniform_numbers(requests))

    def _random_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each row's distribution after its temperature, top-k, top-p and min-p ([rows, vocab] float32)."""
        vocab_size = logits.shape[-1]
        params = [request.sampling_params for request in requests]
        device = logits.device  # the few per-row numbers go where the logits are (the engine's device)
        temperatures = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)

        logits = apply_temperature(logits, temperatures)
        logits = apply_top_k_top_p_min_p(logits, top_k, top_p, min_p)
        return logits.softmax(dim=-1)  # [rows, vocab]

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
            uniforms[row] = float(_generator_of(request).random(dtype=numpy.float32))
        if unseeded_rows:
            uniforms[torch.tensor(unseeded_rows)] = torch.rand(
                len(unseeded_rows), generator=self.generator
            )
        return uniforms


def _processed(logits: torch.Tensor, requests: list[Request], histories: list) -> torch.Tensor:
    """Steps 1 to 3 before the grammar, in vLLM's order: what depends on the parameters alone from ``requests``,
    what reads the tokens so far (bad words, penalties, min_tokens) from ``histories`` (the requests themselves,
    or a speculative step's :class:`RowAfterDrafts`). logits: [rows, vocab] float32, not modified."""
    logits = apply_allowed_token_ids(logits, requests)
    logits = apply_bad_words(logits, histories)
    logits = apply_logit_bias(logits, requests)
    logits = apply_penalties(logits, histories)
    return apply_min_tokens(logits, histories)


class RowAfterDrafts:
    """Row i of a request's speculative step, as the logits processors that read its tokens see it: the request
    with drafts 0..i-1 appended to its output (bad words, penalties and min_tokens apply to that row as they will
    one step at a time once those drafts are accepted). Read-only."""

    def __init__(self, request: Request, drafts: list[int]) -> None:
        self.request, self.drafts = request, drafts
        self.sampling_params = request.sampling_params
        self.eos_token_ids = request.eos_token_ids
        self.bad_word_bans = request.bad_word_bans

    @property
    def all_token_ids(self) -> list[int]:
        return self.request.all_token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def generated_token_ids(self) -> list[int]:
        return self.request.generated_token_ids + self.drafts


def _generator_of(request: Request) -> numpy.random.Generator:
    """A seeded request's generator, created the first time: its seed's stream, advanced past the draws of its
    ``num_resumed_tokens`` (a continuation's tokens generated before, one draw each), so that a migrated request
    draws the numbers the undisturbed one would have (one a token, speculating or not)."""
    if request.generator is None:
        request.generator = seeded_generator(request.sampling_params.seed)
        resumed = request.sampling_params.num_resumed_tokens
        if resumed:
            request.generator.random(resumed, dtype=numpy.float32)
    return request.generator


def seeded_generator(seed: int) -> numpy.random.Generator:
    """A seeded request's own random stream, from all 64 bits of its int64 seed.

    torch's CPU generator (MT19937) keeps only a seed's low 32 bits, so seeds 1
    and 2**32 + 1, or -1 and 2**63 - 1, would draw the same numbers. PCG64, seeded
    through numpy's SeedSequence, takes the whole value: a negative seed as its
    two's complement, so every int64 seed gives its own stream.
    """
    return numpy.random.Generator(numpy.random.PCG64(seed & 0xFFFF_FFFF_FFFF_FFFF))


def greedy_token_ids(logits: torch.Tensor, kernels=None) -> torch.Tensor:
    """Each row's argmax ([rows, vocab] -> [rows] int64): the first of tied maxima, as ``argmax`` (a NaN counts as
    the largest, as there). With ``kernels`` (the C++ CPU kernels) float32 CPU rows go through their
    ``argmax_rows``: 0.5-0.9 against 1.7-2.9 ms for 64 rows of SmolLM's 49,152 logits through ``max(dim)`` on two
    Emerald Rapids cores, where the logits of a decode step are 12.6 MB. Otherwise through ``max(dim)``, whose CPU
    kernel is vectorised where ``argmax``'s is not: 0.8 against 2.1 ms for those rows on two Sapphire Rapids
    cores, 1.1 against 5.1 in bfloat16."""
    if (kernels is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
            and logits.shape[1] > 0 and logits.stride(1) == 1):
        return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


def _all_plain_greedy(requests: list[Request]) -> bool:
    """True when every row is a bare argmax: no allowed tokens, bad words, logit bias, penalties, min_tokens mask,
    grammar or logprobs."""
    for request in requests:
        params = request.sampling_params
        if (
            (params.temperature >= GREEDY_EPSILON and params.top_k != 1)
            or params.logprobs is not None
            or params.needs_penalties
            or params.logit_bias
            or params.allowed_token_ids is not None
            or request.bad_word_bans is not None
            or (request.grammar is not None and request.grammar.active)
            or len(request.output_token_ids) < params.min_tokens
        ):
            return False
    return True


def _is_greedy(request: Request) -> bool:
    """Greedy rows take the argmax; top_k == 1 keeps only the argmax, so it is one."""
    params = request.sampling_params
    return params.is_greedy or params.top_k == 1
