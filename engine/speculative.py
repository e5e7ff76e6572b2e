"""Speculative decoding by n-gram prompt lookup, as vLLM's ``--speculative-config '{"method": "ngram", ...}'``.

A running request's next tokens are guessed from its own text: the longest suffix of its tokens (between
``prompt_lookup_min`` and ``prompt_lookup_max`` long) that occurred earlier in the prompt or the output is looked
up, and the ``num_speculative_tokens`` tokens that followed its first occurrence there are the drafts (the
earliest, as vLLM's proposer takes: the most tokens follow it). One step then computes the
request's last token and its drafts together, as a prompt chunk over the paged cache, with logits at every row.
Row i holds the model's distribution after draft i - 1. A greedy request accepts drafts while each equals its
row's argmax, and the first argmax that differs (or the one after the last draft) is the step's own token, so
greedy output is the same as without speculation. A sampling request samples its rows in order, one uniform number
a row as one step at a time would, and accepts each draft its row draws (a draft is accepted with the probability
its row gives it, as speculative sampling with a proposer certain of its drafts accepts it; every token keeps its
distribution): a seeded request's tokens are the ones it draws without speculation (``Sampler.verify_drafts``).
A step gives 1 to k + 1 tokens. The KV of rejected drafts is left in slots past ``num_computed_tokens``, to be overwritten.

Which requests speculate: all, each row processed as its own step would be (allowed tokens and a logit bias alike
on every row; bad words, penalties and min_tokens as if the drafts before the row were already output), with
logprobs when asked for. A request under structured outputs
drafts only what its grammar takes, and each of its rows is masked as that token's own step would be. The scheduler asks the proposer
for drafts when it schedules a request's decode (``Scheduler.proposer``) and trims them to the step's budget
and the request's remaining output tokens.

Nothing here imports torch: the lookup runs in numpy over the request's token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy
from numpy.lib.stride_tricks import sliding_window_view

from splitserve.engine.request import Request

SPECULATIVE_METHODS = ("ngram",)
# The most drafts a step may verify per request: each is a row of every layer's GEMMs and of the logits.
MAX_SPECULATIVE_TOKENS = 32
# The longest n-gram looked up (its search costs n comparisons per earlier token).
MAX_PROMPT_LOOKUP = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """What to speculate with.

    Attributes:
        method: "ngram" (prompt lookup), the only method: no draft model is loaded.
        num_speculative_tokens: drafts proposed per step and request, 1 to MAX_SPECULATIVE_TOKENS.
        prompt_lookup_min: the shortest suffix looked up (None: prompt_lookup_max, or 5 when both are None, as
            vLLM).
        prompt_lookup_max: the longest (None: prompt_lookup_min, or 5).
        disable_by_batch_size: no drafts in a step that starts with this many running requests or more (vLLM
            V0's key; V1 has none): where a step's rows are bound by arithmetic rather than by reading the weights,
            drafts cost about what they save (README, "Speculative decoding"). None: drafts at any batch size.
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)} (prompt lookup; "
                             f"draft models are not supported), got {self.method!r}.")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens (drafts per step, e.g. 4).")
        _require_int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            _require_int_in("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
            if value is not None:
                _require_int_in(name, value, 1, MAX_PROMPT_LOOKUP)
        if low is None and high is None:
            low = high = 5
        low = high if low is None else low
        high = low if high is None else high
        if low > high:
            raise ValueError(f"prompt_lookup_min ({low}) must be at most prompt_lookup_max ({high}).")
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)

    @classmethod
    def of(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """A config from itself, a dict of its fields (``LLM(speculative_config={...})``) or their JSON text
        (``--speculative-config``); None stays None.

        Raises:
            ValueError: not JSON, not an object, a field it does not know, or a bad value (a sentence each).
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON ({error.msg}, at character {error.pos}).") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}.")
        known = {field.name for field in fields(cls)}
        unknown = sorted(str(key)[:64] for key in value if key not in known)
        if unknown:
            raise ValueError(f"speculative_config does not take {', '.join(map(repr, unknown))}; it takes "
                             f"{', '.join(sorted(known))}.")
        return cls(**value)

    def to_json(self) -> str:
        """Its fields as the JSON object :meth:`of` reads (what ``splitserve up`` passes on to its workers)."""
        return json.dumps({field.name: getattr(self, field.name) for field in fields(self)})

    def propose(self, request: Request, max_drafts: int) -> list[int]:
        """Drafts for ``request``'s next tokens: at most ``max_drafts`` (and num_speculative_tokens), none when its
        text holds no earlier occurrence of its suffix. Every request may speculate: each row of its step goes
        through what one step at a time would apply to it (``Sampler.verify_drafts``). A grammar masks each row as
        it would mask that token one step at a time: the request drafts only tokens its grammar takes
        (``GrammarMatcher.draftable``), and row i is masked after drafts 0..i-1 (``GrammarMatcher.draft_bitmask``,
        llguidance's rollback). In the think block it masks nothing: drafts stop short of any token that could end
        the block (``GrammarMatcher.thought_drafts``), so that the grammar starts after a step."""
        count = min(max_drafts, self.num_speculative_tokens)
        if count <= 0:
            return []
        drafts = propose_ngram(request.all_token_ids, self.prompt_lookup_min, self.prompt_lookup_max, count)
        if request.grammar is not None:  # drafts its grammar takes (or, in the think block, that cannot end it)
            drafts = request.grammar.draftable(drafts)
        return drafts


def propose_ngram(token_ids: list[int], min_n: int, max_n: int, count: int) -> list[int]:
    """The ``count`` tokens (fewer at the end of the text) that followed the first occurrence of the longest
    suffix of ``token_ids`` between ``min_n`` and ``max_n`` tokens long that occurred before; [] when none did."""
    num_tokens = len(token_ids)
    if num_tokens < min_n + 1:
        return []
    tokens = numpy.asarray(token_ids, dtype=numpy.int64)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        # windows[i] = tokens[i : i + n] for every start before the suffix's own (i < num_tokens - n)
        windows = sliding_window_view(tokens[:-1], n)  # [num_tokens - n, n]
        starts = numpy.flatnonzero((windows == tokens[-n:]).all(axis=1))
        if starts.size:
            follow = int(starts[0]) + n
            return tokens[follow : follow + count].tolist()
    return []


def accepted_tokens(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a verified step gives: ``targets`` (the greedy token at each of the ``len(drafts) + 1`` rows)
    up to and including the first that differs from its draft (all of them when every draft matched)."""
    for index, draft in enumerate(drafts):
        if targets[index] != draft:
            return targets[: index + 1]
    return targets[: len(drafts) + 1]


def _require_int_in(name: str, value: object, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {value!r}.")
