"""Structured outputs in the engine: one llguidance matcher per constrained request, and the token masks.

A request with ``sampling_params.structured_outputs`` gets a :class:`GrammarMatcher`
when it is added (a bad grammar refuses the request then, with llguidance's
reason). At each step the sampler asks every constrained row's matcher which
tokens may come next (:func:`fill_token_bitmask`) and sets the others' logits
to -inf (:func:`apply_token_bitmask`), after the logit bias, penalties and the
min_tokens mask, as vLLM masks before sampling; log probabilities stay the
model's own. The engine then feeds the sampled token to the matcher
(:meth:`GrammarMatcher.accept`): once the grammar is complete the request
finishes (``stop``), and a token the grammar refuses (one sampled elsewhere,
e.g. a remote prefill's without the mask) ends it with an error.

An engine started with a reasoning parser (``reasoning_parser``, vLLM's ``--reasoning-parser``) holds each
grammar back while the request is in its think block, as vLLM does: no mask, and the tokens go past the grammar,
until the one that ends ``</think>``; the grammar takes the tokens after it. A prompt that closed its block
already (``splitserve/common/reasoning.py``) starts under its grammar.

llguidance computes a mask lazily over the tokenizer's trie, in tens of
microseconds for most JSON states; its parser limits bound the work a hostile
grammar can ask for per step, and error messages never quote the grammar.
"""

from __future__ import annotations

import copy
import threading

import torch

from splitserve.common.errors import InvalidRequest
from splitserve.common.reasoning import ThinkEndWatch, check_reasoning_parser, reasoning_ended, think_tag_ids
from splitserve.common.structured_outputs import StructuredOutputsParams, parser_limits, short_message

BITS_PER_WORD = 32


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, and the tokens taken so far.

    Args:
        matcher: the request's llguidance.LLMatcher.
        think_end: with a reasoning parser, the watch for the end of the request's think block; the grammar
            constrains nothing before it (:attr:`active`). None: the grammar takes every token.
    """

    def __init__(self, matcher, think_end: ThinkEndWatch | None = None) -> None:
        self._matcher = matcher
        self._think_end = think_end
        self.active = think_end is None or think_end.ended  # whether the grammar masks the next token

    def fill_bitmask(self, words: torch.Tensor) -> None:
        """Write the allowed next tokens into ``words``: [num_words] int32, contiguous, on the host; bit j of
        word w allows token 32 w + j."""
        self._matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())

    def accept(self, token_id: int) -> bool:
        """Feed the sampled token to the grammar; False when the grammar refuses it (the matcher is then in error
        for good: :attr:`error` says why). Before the think block ends the token goes to the watch instead: the
        one that ends ``</think>`` makes the grammar active from the next token on."""
        if not self.active:
            self.active = self._think_end.feed(token_id)
            return True
        return self._matcher.consume_token(token_id)

    def draftable(self, drafts: list[int]) -> list[int]:
        """The leading ``drafts`` a speculative step may verify: in the think block those that cannot end it
        (:meth:`thought_drafts`); under the grammar, those it takes one after another (llguidance's
        ``validate_tokens``, which changes nothing), each row then masked as one step at a time would mask it
        (:meth:`draft_bitmask`)."""
        if not self.active:
            return self.thought_drafts(drafts)
        return drafts[:self._matcher.validate_tokens(drafts)] if drafts else drafts

    def draft_bitmask(self, drafts: list[int], num_words: int) -> torch.Tensor:
        """The allowed tokens at each row of a speculative step: [len(drafts) + 1, num_words] int32, row i those
        the grammar takes after drafts 0..i-1 (which :meth:`draftable` kept). The matcher is left as it was (the
        drafts are consumed, then rolled back); a row after a draft it would not take allows every token, as
        ``fill_token_bitmask`` does for a matcher in error (nothing after a refused draft is accepted)."""
        bitmask = torch.full((len(drafts) + 1, num_words), -1, dtype=torch.int32)
        consumed = 0
        try:
            for row in range(len(drafts) + 1):
                bitmask[row] = 0
                self.fill_bitmask(bitmask[row])
                if row == len(drafts) or self._matcher.try_consume_tokens([drafts[row]]) != 1:
                    break
                consumed += 1
        finally:
            if consumed:
                self._matcher.rollback(consumed)
        bitmask[~bitmask.any(dim=1)] = -1
        return bitmask

    def thought_drafts(self, drafts: list[int]) -> list[int]:
        """The leading ``drafts`` of a request in its think block that cannot end it: those before the first that
        could complete ``</think>``. A step that verifies drafts masks none of its tokens, so the block must end
        on the step's own sampled token at the latest, and the grammar take over from the next step."""
        last = self._think_end.last_token
        return drafts[:drafts.index(last)] if last in drafts else drafts

    @property
    def is_complete(self) -> bool:
        """The grammar takes no more tokens: the output is whole."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        """Why the grammar refused a token or could not go on; empty while it can."""
        return short_message(self._matcher.get_error())


class StructuredOutputs:
    """An engine's grammar builder: llguidance's view of the tokenizer (built by :meth:`warm_up` or on the first
    constrained request, about 0.3 s for SmolLM2's 49,152 tokens) and a matcher per request.

    Args:
        tokenizer: the engine's Hugging Face tokenizer; it must have a fast (tokenizers) backend.
        vocab_size: the model's logits width (the masks cover it).
        eos_token_ids: the ids that end a request; the grammar allows them where the output may end.
        reasoning_parser: a reasoning parser's name (``splitserve.common.reasoning.REASONING_PARSER_NAMES``):
            grammars wait for the end of the think block. None: they constrain every token.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 reasoning_parser: str | None = None) -> None:
        check_reasoning_parser(reasoning_parser)
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._think_tags = None if reasoning_parser is None else think_tag_ids(tokenizer)

    def matcher(self, params: StructuredOutputsParams, prompt_token_ids: list[int]) -> GrammarMatcher:
        """A new request's matcher, past the prompt's last ``params.num_resumed_tokens`` tokens.

        Raises:
            InvalidRequest: the grammar does not build, or refuses the resumed tokens.
        """
        from llguidance import LLMatcher

        matcher = LLMatcher(self._llguidance_tokenizer(), params.to_grammar(), log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise InvalidRequest(f"structured outputs: the {params.kind} is not valid: {short_message(matcher.get_error())}")
        resumed = params.num_resumed_tokens
        if resumed > len(prompt_token_ids):
            raise InvalidRequest(f"structured outputs: num_resumed_tokens ({resumed}) exceeds the prompt's "
                                 f"{len(prompt_token_ids)} tokens.")
        cut = len(prompt_token_ids) - resumed  # before it the prompt; after it tokens generated under the structure
        prompt, generated = prompt_token_ids[:cut], prompt_token_ids[cut:]
        think_end = None
        if self._think_tags is not None:
            start, end = self._think_tags
            think_end = ThinkEndWatch(end, reasoning_ended(prompt, start, end))
        grammar = GrammarMatcher(matcher, think_end)
        for token_id in generated:
            if not grammar.accept(token_id):
                raise InvalidRequest(f"structured outputs: the prompt's last {resumed} tokens do not follow the "
                                     f"{params.kind}: {grammar.error}")
        return grammar

    def warm_up(self) -> bool:
        """Build llguidance's tokenizer now (a worker does it before it serves), so that the first constrained
        request does not stall every running one while the engine's loop builds it; False when the tokenizer has
        no fast backend (constrained requests are then refused one by one)."""
        try:
            self._llguidance_tokenizer()
        except InvalidRequest:
            return False
        return True

    def _llguidance_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                from llguidance import LLTokenizer

                backend = getattr(self._tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise InvalidRequest("structured outputs need a fast tokenizer (a tokenizer.json); this "
                                         "model's has none.")
                backend = copy.copy(backend)  # padding and truncation off on a copy, not on the engine's
                backend.no_padding()
                backend.no_truncation()
                self._ll_tokenizer = LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                 eos_token=self._eos_token_ids)
            return self._ll_tokenizer


def fill_token_bitmask(matchers: list[GrammarMatcher], num_words: int) -> torch.Tensor:
    """The allowed next tokens of each matcher: [len(matchers), num_words] int32 on the host.

    A matcher that allows nothing (it fell into an error, e.g. a step over its parser limits) gets every token:
    the row is sampled as if unconstrained and the engine's :meth:`GrammarMatcher.accept` refuses the token,
    ending that request with the matcher's error; a row of -inf logits would make the sampler's probabilities
    NaN and fail the whole batch's step.
    """
    bitmask = torch.zeros(len(matchers), num_words, dtype=torch.int32)
    for row, matcher in enumerate(matchers):
        matcher.fill_bitmask(bitmask[row])
    bitmask[~bitmask.any(dim=1)] = -1
    return bitmask


def apply_token_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor, kernels=None) -> torch.Tensor:
    """Set to -inf the logits of the tokens ``bitmask`` does not allow, on ``rows``.

    Args:
        logits: [num_rows, vocab] float; not modified.
        rows: the constrained rows, one per bitmask row.
        bitmask: [len(rows), num_words] int32; bit j of word w allows token 32 w + j. Tokens past
            32 num_words are not allowed.
        kernels: the C++ CPU kernels (``splitserve.kernels.cpu_ops``, loaded), for float32 logits on the host:
            their ``apply_token_bitmask_`` (0.3 against 5-10 ms for 32 of SmolLM2's rows on two Zen 5 cores).
            None: the torch reference below.

    Returns:
        A new [num_rows, vocab] tensor (the input itself when ``rows`` is empty).
    """
    if not rows:
        return logits
    if (kernels is not None and logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.dim() == 2
            and logits.stride(1) == 1):
        result = logits.clone()
        kernels.apply_token_bitmask_(result, torch.tensor(rows, dtype=torch.long), bitmask.contiguous())
        return result
    vocab_size, device = logits.shape[-1], logits.device
    # The words go to the logits' device and are expanded there: on a GPU 4 bytes a 32 tokens cross the bus, not
    # one byte a token (6 KB against 49 KB a row of SmolLM2's vocabulary).
    shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=device)
    allowed = ((bitmask.to(device).unsqueeze(-1) >> shifts) & 1).bool().flatten(1)  # [len(rows), 32 num_words]
    if allowed.shape[1] < vocab_size:
        allowed = torch.nn.functional.pad(allowed, (0, vocab_size - allowed.shape[1]), value=False)
    allowed = allowed[:, :vocab_size]
    index = torch.tensor(rows, device=device)
    result = logits.clone()
    result[index] = result[index].masked_fill(~allowed, float("-inf"))
    return result
