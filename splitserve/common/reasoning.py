"""Reasoning models' think blocks: the parsers' names and tags, and where a block ends in token ids.

A reasoning model writes its thought between ``<think>`` and ``</think>`` before its answer. Two parts of
splitserve read that block, both as vLLM's ``--reasoning-parser`` does:

- the HTTP gateway splits an answer's text into ``reasoning`` and ``content`` (``splitserve/gateway_reasoning.py``);
- an engine started with a reasoning parser holds a request's structured output (its JSON schema, regex, choice
  or grammar) back until the think block ends, so that the model thinks freely and only its answer follows the
  structure (``engine/structured_output.py``).

The engine reads token ids: :func:`reasoning_ended` says whether a prompt leaves the model past its think block
(Qwen3's template with ``enable_thinking`` false writes an empty block into the prompt), and
:class:`ThinkEndWatch` finds the block's end in the tokens generated after it. Reasoning models have ``<think>``
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
