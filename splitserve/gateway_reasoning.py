"""Reasoning parsers for chat answers: a model's ``<think> ... </think>`` block apart from its answer.

As vLLM's ``--reasoning-parser``: the gateway started with ``--reasoning-parser NAME`` gives a chat answer's
message the thought as ``reasoning`` (vLLM's field name since it renamed ``reasoning_content``; null when there is
none) and the rest as ``content``; streamed, each delta carries the reasoning part, the content part or both.
Only chat answers are split (vLLM's ``/v1/completions`` is left alone too), and tool calls are read out of the
content part only.

- ``deepseek_r1``: everything before ``</think>`` is reasoning, whether or not the text opens with ``<think>``
  (DeepSeek-R1's template writes ``<think>`` into the prompt); an answer whose ``</think>`` never comes is all
  reasoning.
- ``qwen3``: the same, unless the request's ``chat_template_kwargs`` turn thinking off (``enable_thinking``
  false: Qwen3's template then writes an empty think block into the prompt), when the whole text is content, as
  vLLM's current qwen3 parser reads it (its older one took reasoning only from a text opening with ``<think>``).

The parsers read decoded text, not token ids, so a tag may arrive split across deltas: :meth:`ThinkTagParser.feed`
holds back a tail that could still be the start of a tag until the next text settles it, and
:meth:`ThinkTagParser.finish` releases what is left. The text around the tags is kept as it is (the newlines
after ``</think>`` stay at the start of the content, as vLLM keeps them), so reasoning + content, tags aside, is
the answer's text, and a stream's deltas add up to the whole answer's split however the text is cut.

The usage's ``reasoning_tokens`` are counted in token ids (:class:`ReasoningReplies` feeds each choice's to a
``splitserve.common.reasoning.ReasoningTokenCount``), in the tags' spelling the router reports.
"""

from __future__ import annotations

import enum

from splitserve.common.reasoning import THINK_END, THINK_START, ReasoningTokenCount

START_TAG, END_TAG = THINK_START, THINK_END


class _Phase(enum.Enum):
    OPENING = enum.auto()  # the first characters: is it <think>?
    REASONING = enum.auto()
    CONTENT = enum.auto()


class ThinkTagParser:
    """One answer's text, fed as it is generated, split into reasoning and content.

    Args:
        chat_template_kwargs: the request's (vLLM's ``chat_template_kwargs``), for parsers that read them
            (:meth:`thinking`).
    """

    name = ""

    def __init__(self, chat_template_kwargs: dict | None = None) -> None:
        self._phase = _Phase.OPENING if self.thinking(chat_template_kwargs or {}) else _Phase.CONTENT
        self._held = ""  # text not released yet: a possible tag's first characters
        self.has_reasoning = False  # a think block was opened (the whole answer's reasoning is not null)

    def feed(self, text: str) -> tuple[str, str]:
        """The (reasoning, content) that ``text``, the answer's next piece, releases; a possible tag's first
        characters are held until later text (or :meth:`finish`) settles them."""
        self._held += text
        reasoning = content = ""
        if self._phase is _Phase.OPENING:
            if len(self._held) < len(START_TAG) and START_TAG.startswith(self._held):
                return "", ""  # the text so far could still open with <think>
            self._open()
        if self._phase is _Phase.REASONING:
            before, tag, after = self._held.partition(END_TAG)
            if not tag:
                keep = _partial_tag_length(before, END_TAG)
                self._held = before[len(before) - keep:]
                return before[:len(before) - keep], ""
            reasoning, self._held = before, after
            self._phase = _Phase.CONTENT
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """The (reasoning, content) left at the answer's end: the held characters, which no tag followed."""
        if self._phase is _Phase.OPENING:
            self._open()
        held, self._held = self._held, ""
        return (held, "") if self._phase is _Phase.REASONING else ("", held)

    @staticmethod
    def thinking(chat_template_kwargs: dict) -> bool:
        """Whether an answer to a request rendered with ``chat_template_kwargs`` starts in its think block."""
        return True

    def _open(self) -> None:
        """Leave the opening: the text is reasoning until ``</think>``; a ``<think>`` there is dropped."""
        if self._held.startswith(START_TAG):
            self._held = self._held[len(START_TAG):]
        self._phase, self.has_reasoning = _Phase.REASONING, True

    @classmethod
    def split(cls, text: str, chat_template_kwargs: dict | None = None) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning, content): reasoning None when no think block was opened, content None
        when nothing follows it (as vLLM writes them)."""
        parser = cls(chat_template_kwargs)
        reasoning, content = parser.feed(text)
        last_reasoning, last_content = parser.finish()
        return (reasoning + last_reasoning if parser.has_reasoning else None), (content + last_content) or None


class DeepSeekR1ReasoningParser(ThinkTagParser):
    """DeepSeek-R1 and its distills: reasoning until ``</think>``, with or without ``<think>`` first."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ThinkTagParser):
    """Qwen3: reasoning until ``</think>`` as DeepSeek-R1's, unless the request turned thinking off."""

    name = "qwen3"

    @staticmethod
    def thinking(chat_template_kwargs: dict) -> bool:
        return bool(chat_template_kwargs.get("enable_thinking", True))


REASONING_PARSERS: dict[str, type[ThinkTagParser]] = {
    parser.name: parser for parser in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def reasoning_parser(name: str) -> type[ThinkTagParser]:
    """The parser class registered as ``name``.

    Raises:
        ValueError: an unknown name, with the valid ones.
    """
    if name not in REASONING_PARSERS:
        raise ValueError(f"Unknown reasoning parser {name!r}: choose one of {', '.join(sorted(REASONING_PARSERS))}.")
    return REASONING_PARSERS[name]


class ReasoningReplies:
    """One chat request's choices split by a reasoning parser: whole answers, or each stream's parser by choice;
    and each choice's reasoning tokens counted for the usage.

    Args:
        parser: the reasoning parser's class.
        chat_template_kwargs: the request's, for parsers that read them (:meth:`ThinkTagParser.thinking`).
        think_tags: the token ids of ``<think>`` and ``</think>`` (the router's model info); None or an empty
            tag: no reasoning tokens are counted (a router from before it reported them).
    """

    def __init__(self, parser: type[ThinkTagParser], chat_template_kwargs: dict | None = None,
                 think_tags: tuple | None = None) -> None:
        self.parser, self.chat_template_kwargs = parser, chat_template_kwargs
        self._streams: dict[int, ThinkTagParser] = {}
        self._think_tags = think_tags if think_tags is not None and all(think_tags) else None
        self._counts: dict[int, ReasoningTokenCount] = {}

    def count(self, index: int, token_ids) -> None:
        """Take choice ``index``'s next generated token ids."""
        if self._think_tags is None:
            return
        counter = self._counts.get(index)
        if counter is None:
            start, end = self._think_tags
            thinking = self.parser.thinking(self.chat_template_kwargs or {})
            counter = self._counts[index] = ReasoningTokenCount(start, end, thinking)
        counter.feed(token_ids)

    @property
    def reasoning_tokens(self) -> int:
        """The reasoning tokens of every choice so far (usage's ``reasoning_tokens``)."""
        return sum(counter.count for counter in self._counts.values())

    def whole(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning, content)."""
        return self.parser.split(text, self.chat_template_kwargs)

    def delta(self, index: int, text: str, final: bool) -> tuple[str, str]:
        """Choice ``index``'s next (reasoning, content) for its next ``text``; ``final``: its last piece, which
        releases what was held."""
        stream = self._streams.get(index) or self._streams.setdefault(index, self.parser(self.chat_template_kwargs))
        reasoning, content = stream.feed(text)
        if final:
            last_reasoning, last_content = stream.finish()
            reasoning, content = reasoning + last_reasoning, content + last_content
        return reasoning, content


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag`` (0: none)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0
