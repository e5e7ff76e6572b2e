"""Reasoning models' think blocks: the parsers' names and tags, and where a block ends in token ids.

A reasoning model writes its thought between ``<think>`` and ``</think>`` before its answer. Two parts of
splitserve read that block, both as vLLM's ``--reasoning-parser`` does:

- the HTTP gateway splits an answer's text into ``reasoning`` and ``content`` (``splitserve/gateway_reasoning.py``);
- an engine started with a reasoning parser holds a request's structured output (its JSON schema, regex, choice
  or grammar) back until the think block ends, so that the model thinks freely and only its answer follows the
  structure (``engine/structured_output.py``).

The engine reads token ids: :func:`reasoning_ended` says whether a prompt leaves the model past its think block
(Qwen3's template with ``enable_thinking`` false writes an empty block into the prompt), and
:class:`ThinkEndWatch` finds the block's end in the tokens generated after it. The gateway counts an answer's
reasoning tokens for its usage (:class:`ReasoningTokenCount`) in the tags' token ids the router reports
(:func:`think_tag_ids`). Reasoning models have ``<think>``
and ``</think>`` as single tokens; a tokenizer without them is matched on the tags' own tokenization, which a
model may spell otherwise (SmolLM2 writes ``</think>`` as three tokens; tests use that).
"""

from __future__ import annotations

THINK_START = "<think>"
THINK_END = "</think>"

# The parsers vLLM names, by the tags they read. Both read <think> ... </think>; they differ in the gateway only
# (qwen3 reads the request's enable_thinking), never in token ids: the prompt says where the model starts.
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3")


def check_reasoning_parser(name: str | None) -> None:
    """Raise ValueError, with the valid names, unless ``name`` is None or a reasoning parser's name."""
    if name is not None and name not in REASONING_PARSER_NAMES:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSER_NAMES)} (or None), got "
                         f"{str(name)[:64]!r}.")


def think_tag_ids(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The token ids of ``<think>`` and ``</think>`` in ``tokenizer``'s vocabulary (one token each in reasoning
    models'; several in others, as the tokenizer spells each tag alone).

    Raises:
        ValueError: the tokenizer writes a tag as no token at all.
    """
    tags = []
    for tag in (THINK_START, THINK_END):
        ids = tuple(tokenizer.encode(tag, add_special_tokens=False))
        if not ids:
            raise ValueError(f"The tokenizer writes {tag} as no token at all: a reasoning parser cannot find it.")
        tags.append(ids)
    return tags[0], tags[1]


def _ends_with(token_ids: list[int], end: int, tag: tuple[int, ...]) -> bool:
    """Whether ``token_ids[:end]`` ends with ``tag``."""
    return end >= len(tag) and tuple(token_ids[end - len(tag):end]) == tag


def _last_tag_end(token_ids: list[int], backwards: list[int], tag: tuple[int, ...]) -> int:
    """Where the last ``tag`` in ``token_ids`` ends (0: nowhere); ``backwards`` is ``token_ids`` reversed, searched
    by ``list.index`` (a prompt of 100,000 tokens in well under a millisecond)."""
    found = 0
    while True:
        try:
            found = backwards.index(tag[-1], found)
        except ValueError:
            return 0
        position = len(token_ids) - found
        if _ends_with(token_ids, position, tag):
            return position
        found += 1


def reasoning_ended(token_ids: list[int], start: tuple[int, ...], end: tuple[int, ...]) -> bool:
    """Whether the text ``token_ids`` spell has closed its last think block: read from the end, an ``end`` tag
    comes before any ``start`` tag (vLLM's rule for its think-tag parsers). No tag at all: not ended, since a
    reasoning model starts in its block whether or not the prompt opens it (DeepSeek-R1's template writes
    ``<think>``, Qwen3's leaves it to the model)."""
    backwards = token_ids[::-1]
    return _last_tag_end(token_ids, backwards, end) > _last_tag_end(token_ids, backwards, start)


class ThinkEndWatch:
    """Watches a request's generated tokens, one at a time, for the end of its think block.

    Args:
        end: the token ids of ``</think>``.
        ended: whether the block had ended already (:func:`reasoning_ended` of the prompt).
    """

    def __init__(self, end: tuple[int, ...], ended: bool) -> None:
        self._end = end
        self._recent: list[int] = []  # the last len(end) tokens seen
        self.ended = ended

    @property
    def last_token(self) -> int:
        """The token that completes ``</think>``: no block ends on another."""
        return self._end[-1]

    def feed(self, token_id: int) -> bool:
        """Take the next generated token; True when it completes ``</think>``, the first time only."""
        if self.ended:
            return False
        self._recent.append(token_id)
        if len(self._recent) > len(self._end):
            del self._recent[0]
        self.ended = tuple(self._recent) == self._end
        return self.ended


class ReasoningTokenCount:
    """Counts one answer's reasoning tokens from its generated token ids, fed as they come: the tokens of its think
    block, tags left out, as the gateway's parsers split its text (``splitserve/gateway_reasoning.py``).

    An answer that starts in its think block (``thinking``) reasons until its first ``</think>``; a ``<think>``
    that opens it is a tag, not reasoning; a block that never ends makes every token reasoning. An answer that
    does not start in one (Qwen3 with thinking turned off) has none. vLLM's ``count_reasoning_tokens`` reads
    the same tags; it also takes a ``<think>`` found later as the block's start, where the parsers' text, and
    this count, keep what comes before it as reasoning.

    Args:
        start, end: the token ids of ``<think>`` and ``</think>`` (:func:`think_tag_ids`).
        thinking: whether the answer starts in its think block.
    """

    def __init__(self, start: tuple[int, ...], end: tuple[int, ...], thinking: bool = True) -> None:
        self._start, self._end, self._thinking = tuple(start), tuple(end), thinking
        self._opening: list[int] = []  # the first len(start) tokens: do they open with <think>?
        self._watch = ThinkEndWatch(self._end, ended=not thinking)
        self._reasoning = 0  # tokens before the block's end, tags included

    def feed(self, token_ids) -> None:
        """Take the answer's next generated tokens."""
        for token_id in token_ids:
            if len(self._opening) < len(self._start):
                self._opening.append(token_id)
            if self._watch.ended:
                return
            self._reasoning += 1
            if self._watch.feed(token_id):
                self._reasoning -= len(self._end)

    @property
    def count(self) -> int:
        """The reasoning tokens so far."""
        if not self._thinking:
            return 0
        opened = tuple(self._opening) == self._start
        return max(0, self._reasoning - (len(self._start) if opened else 0))
