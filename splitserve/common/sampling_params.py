"""SamplingParams: how one request's tokens are chosen and when it stops.

Field names and meanings follow vLLM's ``SamplingParams`` so that code written
for it reads the same here. Every value is checked when the object is built: a
bad value raises :class:`~splitserve.common.errors.InvalidRequest` (a
``ValueError``) naming the field and its allowed range. Float fields must be
finite: NaN and infinities are refused, whatever the range. Shared by the engine,
the router (which validates a request before routing it) and clients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitserve.common.errors import InvalidRequest
from splitserve.common.structured_outputs import StructuredOutputsParams

# Temperatures below this are treated as greedy (argmax), as in vLLM.
GREEDY_EPSILON = 1e-5
MAX_LOGPROBS = 20
# OpenAI's range for a logit bias, and the most entries one request may carry (each is work on every step).
MAX_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
# The most prompt log probabilities one request may ask for (prompt tokens x (prompt_logprobs + 1)): they travel
# in one gRPC message, of 64 MB at most, at some 17-40 bytes each. 8,192 tokens with 20 alternatives are 172,032.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 19
# The most allowed_token_ids one request may name (a vocabulary of 262,144 tokens is among the largest in use).
MAX_ALLOWED_TOKEN_IDS = 1 << 18
# The most bad_words one request may carry, and the longest: each is tokenized when the request is added and
# compared with the output's end on every step.
MAX_BAD_WORDS = 256
MAX_BAD_WORD_CHARACTERS = 256


@dataclass
class SamplingParams:
    """Sampling and stopping parameters for one request.

    Attributes:
        n: how many completions to generate for the prompt (vLLM's parallel sampling; ``LLM.generate`` only: the
            prompt is computed once and its KV forked for each). With a seed, completion i draws from seed + i.
        max_tokens: most tokens to generate (None: up to the model's length limit).
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_k: keep the k most likely tokens (-1 or 0: all).
        top_p: keep the smallest set of tokens whose probability reaches p (1: all).
        min_p: drop tokens whose probability is below min_p times the top one's.
        repetition_penalty: >1 discourages tokens already in the prompt or output
            (positive logits divided by it, negative ones multiplied).
        presence_penalty: subtracted once from the logit of every token already generated.
        frequency_penalty: subtracted per occurrence from the logit of generated tokens.
        seed: per-request 64-bit random seed, in [-2**63, 2**63 - 1], all 64 bits
            used; the same seed gives the same tokens whatever else is in the batch.
        stop: strings that end generation; the matched string is not in the output (unless
            ``include_stop_str_in_output``).
        include_stop_str_in_output: keep the stop string that matched at the end of the text (vLLM's).
        stop_token_ids: token ids that end generation (kept in the output ids).
        ignore_eos: keep generating after the end-of-sequence token.
        min_tokens: generate at least this many tokens before EOS or stop ids may end it.
        logprobs: also return the top-N log probabilities of each generated token.
        prompt_logprobs: also return, for every prompt token after the first, its log probability given
            the tokens before it and the top-N alternatives there (vLLM's prompt_logprobs; what scoring a
            text, as lm-evaluation-harness's loglikelihood does, needs). The prompt is then computed in
            full: its KV is not taken from the prefix cache or a KV connector.
        logit_bias: token id -> a value in [-100, 100] added to that token's logit before
            anything else (-100 all but bans the token, 100 all but forces it), as OpenAI's
            and vLLM's logit_bias; at most 1,024 entries. Log probabilities stay the raw
            model's, as vLLM returns them.
        skip_special_tokens: leave special tokens out of the text.
        allowed_token_ids: only these tokens may be generated (vLLM's; None: any). Every id must be in the
            vocabulary; at most 262,144 of them.
        truncate_prompt_tokens: keep only the prompt's last this-many tokens (vLLM's left truncation; -1: the
            model's context length, max_model_len); None: the whole prompt, refused when it does not fit.
        bad_words: words that must not be generated (vLLM's): each is tokenized as it is and after a space
            (the word's first token differs at the start of a text and inside it), and a word's last token is
            banned whenever the output ends with the rest of its tokens. At most 256 words of at most 256
            characters.
        num_resumed_tokens: the prompt's last this-many tokens were generated before under these parameters (a
            continuation, as the router's migration sends): presence and frequency penalties count them as
            generated tokens and bad words see them; max_tokens and min_tokens count only the new ones. At most
            the prompt's length (the engine checks).
        structured_outputs: the shape the output must take (a JSON schema, any JSON object, a regex, one of
            some strings, or a grammar), as vLLM's; a dict of StructuredOutputsParams' fields is taken too.
            Each step masks the tokens the shape cannot take next; the request stops once it is complete.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = field(default_factory=list)
    truncate_prompt_tokens: int | None = None
    num_resumed_tokens: int = 0
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(token_id) for token_id in (self.stop_token_ids or [])]
        if self.top_k == 0:
            self.top_k = -1
        if not isinstance(self.logit_bias, dict):
            raise InvalidRequest("logit_bias must map token ids to bias values.")
        self.logit_bias = dict(self.logit_bias)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if not isinstance(self.bad_words, (list, tuple)):
            raise InvalidRequest("bad_words must be a list of strings.")
        self.bad_words = list(self.bad_words)
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)):
                raise InvalidRequest("allowed_token_ids must be a list of token ids.")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            unknown = sorted(set(self.structured_outputs) - StructuredOutputsParams.FIELDS)
            if unknown:
                raise InvalidRequest(f"structured_outputs has no field {str(unknown[0])[:64]!r}; its fields are "
                                     f"{', '.join(sorted(StructuredOutputsParams.FIELDS))}.")
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequest("structured_outputs must be a StructuredOutputsParams.")
        self._validate()

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise InvalidRequest(f"n must be an integer >= 1, got {self.n!r}.")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidRequest(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}.")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequest(f"temperature must be a finite number >= 0, got {self.temperature!r}.")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (disabled) or an integer >= 1, got {self.top_k!r}.")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p!r}.")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequest(f"min_p must be in [0, 1], got {self.min_p!r}.")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequest(
                f"repetition_penalty must be a finite number > 0 (1 disables it), got {self.repetition_penalty!r}."
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {value!r}.")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise InvalidRequest(f"seed must be a 64-bit integer in [-2**63, 2**63 - 1], got {self.seed!r}.")
        if not _is_int(self.num_resumed_tokens) or self.num_resumed_tokens < 0:
            raise InvalidRequest(f"num_resumed_tokens must be an integer >= 0, got {self.num_resumed_tokens!r}.")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise InvalidRequest(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequest(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value!r}.")
        if any(not isinstance(text, str) or not text for text in self.stop):
            raise InvalidRequest("stop must be a list of non-empty strings.")
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise InvalidRequest("stop_token_ids must be non-negative token ids.")
        self._validate_logit_bias()
        self._validate_allowed_and_bad_words()

    def truncated(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """``token_ids`` cut to their last ``truncate_prompt_tokens`` (max_model_len for -1); as they are when
        that is None or they are no longer."""
        if self.truncate_prompt_tokens is None:
            return token_ids
        keep = max_model_len if self.truncate_prompt_tokens == -1 else self.truncate_prompt_tokens
        return token_ids[len(token_ids) - keep:] if len(token_ids) > keep else token_ids

    def _validate_allowed_and_bad_words(self) -> None:
        value = self.truncate_prompt_tokens
        if value is not None and (not _is_int(value) or (value < 1 and value != -1) or value >= 2**31):
            raise InvalidRequest(f"truncate_prompt_tokens must be -1 (the model's context length) or an integer "
                                 f">= 1, got {str(value)[:32]!r}.")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise InvalidRequest(f"include_stop_str_in_output must be true or false, got "
                                 f"{str(self.include_stop_str_in_output)[:32]!r}.")
        allowed = self.allowed_token_ids
        if allowed is not None:
            if not allowed:
                raise InvalidRequest("allowed_token_ids must name at least one token id (leave it out to allow all).")
            if len(allowed) > MAX_ALLOWED_TOKEN_IDS:
                raise InvalidRequest(f"allowed_token_ids has {len(allowed)} entries; at most {MAX_ALLOWED_TOKEN_IDS} "
                                     "are allowed.")
            bad = next((token_id for token_id in allowed if not _is_int(token_id) or token_id < 0), None)
            if bad is not None:
                raise InvalidRequest(f"allowed_token_ids must be non-negative token ids, got {str(bad)[:32]!r}.")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidRequest(f"bad_words has {len(self.bad_words)} words; at most {MAX_BAD_WORDS} are allowed.")
        for word in self.bad_words:
            if not isinstance(word, str) or not word.strip():
                raise InvalidRequest("bad_words must be a list of strings that are not empty or only spaces.")
            if len(word) > MAX_BAD_WORD_CHARACTERS:
                raise InvalidRequest(f"A bad word has {len(word)} characters; at most {MAX_BAD_WORD_CHARACTERS} are "
                                     "allowed.")

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequest(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} "
                                 "are allowed.")
        for token_id, bias in self.logit_bias.items():
            if not _is_int(token_id) or token_id < 0:
                raise InvalidRequest(f"logit_bias keys must be non-negative token ids, got {str(token_id)[:32]!r}.")
            if not _is_number(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequest(f"logit_bias values must be numbers in [-100, 100], got {str(bias)[:32]!r} "
                                     f"for token {token_id}.")

    def check_prompt_length(self, num_prompt_tokens: int) -> None:
        """Raises InvalidRequest when prompt_logprobs asks more of a prompt this long than one response holds, or
        num_resumed_tokens exceeds it."""
        if self.num_resumed_tokens > num_prompt_tokens:
            raise InvalidRequest(f"num_resumed_tokens ({self.num_resumed_tokens}) exceeds the prompt's "
                                 f"{num_prompt_tokens} tokens.")
        if self.prompt_logprobs is None:
            return
        entries = num_prompt_tokens * (self.prompt_logprobs + 1)
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise InvalidRequest(f"prompt_logprobs={self.prompt_logprobs} on a {num_prompt_tokens}-token prompt asks "
                                 f"for {entries} log probabilities; one response holds at most "
                                 f"{MAX_PROMPT_LOGPROB_ENTRIES}: ask for fewer alternatives or score a shorter prompt.")

    def check_vocabulary(self, vocab_size: int) -> None:
        """Raises InvalidRequest when a logit_bias or allowed_token_ids token id is outside the model's vocabulary
        [0, vocab_size)."""
        for name, token_ids in (("logit_bias", self.logit_bias), ("allowed_token_ids", self.allowed_token_ids or ())):
            bad = next((token_id for token_id in token_ids if token_id >= vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"{name} token id {bad} is outside the vocabulary [0, {vocab_size}).")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


def completion_seed(seed: int, index: int) -> int:
    """The seed of completion ``index`` of a request for several seeded ``seed``: seed + index wrapped into a
    signed 64-bit integer, as vLLM's parallel sampling seeds them (the engine's ``n``, and the router's when it
    continues one completion on its own)."""
    return (seed + index + 2**63) % 2**64 - 2**63


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite int or float (not a bool, NaN or an infinity)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))
