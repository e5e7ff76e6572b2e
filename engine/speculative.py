"""Speculative decoding by n-gram prompt lookup, as vLLM's ``--speculative-config '{"method": "ngram", ...}'``.

A running request's next tokens are guessed from its own text: the longest suffix of its tokens (between
``prompt_lookup_min`` and ``prompt_lookup_max`` long) that occurred earlier in the prompt or the output is looked
up, and the ``num_speculative_tokens`` tokens that followed its first occurrence there are the drafts (the
earliest, as vLLM's proposer takes: the most tokens follow it). One step then computes the
request's last token and its drafts together, as a prompt chunk over the paged cache, with logits at every row.
Row i's greedy token is the model's token after draft i - 1; drafts are accepted while they equal it, and the
first token that differs (or the one after the last draft) is the step's own, so a step gives 1 to k + 1 tokens
and greedy output is the same as without speculation. The KV of rejected drafts is left in slots past
``num_computed_tokens``, to be overwritten.

Which requests speculate: plain greedy ones (temperature 0 or top_k 1, no logit bias, penalties, logprobs, grammar
or pending min_tokens), whose every row is a bare argmax; others decode a token a step beside them. vLLM samples
the drafts of random requests by rejection; that is not done here yet. The scheduler asks the proposer for
drafts when it schedules a request's decode (``Scheduler.proposer``) and trims them to the step's budget and the
request's remaining output tokens.

Nothing here imports torch: the lookup runs in numpy over the request's token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

import numpy
from numpy.lib.stride_tricks import sliding_window_view

from splitserve.common.sampling_params import GREEDY_EPSILON
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
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)} (prompt lookup; "
                             f"draft models are not supported), got {self.method!r}.")
        if self.num_speculative_tokens is None:
            raise ValueError("speculative_config needs num_speculative_tokens (drafts per step, e.g. 4).")
        _require_int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
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
        """Drafts for ``request``'s next tokens: at most ``max_drafts`` (and num_speculative_tokens), none when it
        may not speculate (:func:`may_speculate`) or its text holds no earlier occurrence of its suffix."""
        count = min(max_drafts, self.num_speculative_tokens)
        if count <= 0 or not may_speculate(request):
            return []
        return propose_ngram(request.all_token_ids, self.prompt_lookup_min, self.prompt_lookup_max, count)


def may_speculate(request: Request) -> bool:
    """Whether a request's next tokens may be verified several at a time: every row of it is a bare argmax
    (greedy, with no logit bias, penalties, logprobs, grammar or pending min_tokens), so the tokens accepted are
    the ones it would have decoded one by one."""
    params = request.sampling_params
    return ((params.temperature < GREEDY_EPSILON or params.top_k == 1)
            and params.logprobs is None and not params.needs_penalties and not params.logit_bias
            and request.grammar is None and request.num_output_tokens >= params.min_tokens)


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
