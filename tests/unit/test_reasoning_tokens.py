"""Where a think block ends, in token ids: the prompt's state (vLLM's rule, read from the end) and the watch over
generated tokens, with one-token tags (reasoning models) and tags of several tokens (SmolLM2's ``</think>``)."""

from __future__ import annotations

import random

import pytest

from splitserve.common.reasoning import (
    ReasoningTokenCount,
    ThinkEndWatch,
    check_reasoning_parser,
    reasoning_ended,
    think_tag_ids,
)

# (start, end) tags: one token each, as in Qwen3's vocabulary, and several, as SmolLM2 spells them.
ONE_TOKEN = ((7,), (8,))
SEVERAL = ((30, 31, 32), (30, 40, 31, 32))  # they share their first and last two ids


@pytest.mark.parametrize("tags", [ONE_TOKEN, SEVERAL], ids=["one-token tags", "tags of several tokens"])
@pytest.mark.parametrize("parts, ended", [
    ([], False),
    (["text"], False),  # no tag: a reasoning model starts in its block
    (["start", "text"], False),
    (["start", "text", "end", "text"], True),
    (["start", "end"], True),  # Qwen3's template, enable_thinking false: an empty block
    (["end"], True),
    (["start", "text", "end", "text", "start", "text"], False),  # a later turn opened another
    (["start", "end", "start", "end", "text"], True),
    (["end", "start"], False),
])
def test_the_last_tag_in_the_prompt_says_whether_the_block_ended(tags, parts, ended):
    start, end = tags
    pieces = {"start": list(start), "end": list(end), "text": [1, 2, 3]}
    token_ids = [token for part in parts for token in pieces[part]]
    assert reasoning_ended(token_ids, start, end) is ended


def test_part_of_a_tag_is_no_tag():
    start, end = SEVERAL
    assert not reasoning_ended([1, *start, 5, *end[1:]], start, end)  # the end tag without its first token
    assert not reasoning_ended([1, *start, 5, *end[:-1], 9], start, end)
    assert reasoning_ended([*start, *end[:-1], *end], start, end)  # a broken tag, then a whole one


@pytest.mark.parametrize("tags", [ONE_TOKEN, SEVERAL], ids=["one-token tags", "tags of several tokens"])
def test_the_watch_fires_on_the_token_that_completes_the_end_tag_and_then_never(tags):
    start, end = tags
    rng = random.Random(0)
    for _ in range(50):
        before = [rng.choice([1, 2, *end[:-1]]) for _ in range(rng.randrange(0, 12))]
        # The thought must not complete the tag by chance; when it would, start over.
        if any(before[i:i + len(end)] == list(end) for i in range(len(before))):
            continue
        generated = [*before, *end, *rng.choices([1, 2, *end], k=6)]
        watch = ThinkEndWatch(end, ended=False)
        fired = [position for position, token in enumerate(generated) if watch.feed(token)]
        assert fired == [len(before) + len(end) - 1]
        assert watch.ended


def test_a_watch_that_starts_ended_never_fires():
    watch = ThinkEndWatch(ONE_TOKEN[1], ended=True)
    assert not any(watch.feed(token) for token in [8, 8, 1])
    assert watch.ended


def test_a_parser_name_is_checked():
    check_reasoning_parser(None)
    check_reasoning_parser("qwen3")
    with pytest.raises(ValueError, match="reasoning_parser must be one of deepseek_r1, qwen3"):
        check_reasoning_parser("granite")


def test_the_flag_reaches_every_workers_engine_through_up():
    from splitserve.cli import build_parser, engine_options
    from splitserve.cli_serve import _engine_flags

    parser = build_parser()
    up = parser.parse_args(["up", "--reasoning-parser", "qwen3", "--dtype", "float32"])
    flags = _engine_flags(up, "/m")
    assert flags[flags.index("--reasoning-parser") + 1] == "qwen3"
    worker = parser.parse_args(["decode", *flags])
    assert engine_options(worker)["reasoning_parser"] == "qwen3"
    assert "--reasoning-parser" not in _engine_flags(parser.parse_args(["up", "--dtype", "float32"]), "/m")
    assert engine_options(parser.parse_args(["generate", "hello"]))["reasoning_parser"] is None


def _count(tags, token_ids, thinking=True, pieces=1) -> int:
    """ReasoningTokenCount over ``token_ids`` fed in ``pieces`` pieces (split evenly)."""
    counter = ReasoningTokenCount(*tags, thinking=thinking)
    size = max(1, -(-len(token_ids) // pieces))
    for at in range(0, len(token_ids), size):
        counter.feed(token_ids[at:at + size])
    return counter.count


@pytest.mark.parametrize("tags", [ONE_TOKEN, SEVERAL], ids=["one-token tags", "tags of several tokens"])
@pytest.mark.parametrize("parts, reasoning", [
    ([], 0),
    (["text"], 3),  # no tag: the answer started in its block, which never ended
    (["start", "text"], 3),  # the opening <think> is a tag, not reasoning
    (["start", "text", "end", "text"], 3),
    (["text", "end", "text"], 3),  # DeepSeek-R1: the prompt opened the block
    (["start", "end", "text"], 0),
    (["end", "text"], 0),
    (["start", "text", "end", "text", "end"], 3),  # only the first </think> ends the block
])
def test_reasoning_tokens_are_the_think_blocks_tokens_without_its_tags(tags, parts, reasoning):
    start, end = tags
    pieces = {"start": list(start), "end": list(end), "text": [1, 2, 3]}
    token_ids = [token for part in parts for token in pieces[part]]
    for fed_in in (1, 2, len(token_ids) or 1):  # however the stream cuts them
        assert _count(tags, token_ids, pieces=fed_in) == reasoning
    assert _count(tags, token_ids, thinking=False) == 0  # Qwen3 with thinking off: no block at all


@pytest.mark.parametrize("tags", [ONE_TOKEN, SEVERAL], ids=["one-token tags", "tags of several tokens"])
def test_a_later_think_tag_is_reasoning_as_the_parsers_text_keeps_it(tags):
    start, end = tags
    token_ids = [1, 2, *start, 3, *end, 4]
    assert _count(tags, token_ids) == 3 + len(start)


def test_reasoning_tokens_match_the_text_parsers_split_token_by_token():
    """Random answers in SmolLM2's spelling of the tags, one token a step: the count is the number of tokens the
    parser's reasoning text is made of (every token here is one character)."""
    from splitserve.gateway_reasoning import DeepSeekR1ReasoningParser

    start, end = (10, 11, 12), (13, 14, 12)  # "<think>" as "<", "t", ">"; "</think>" as "</", "t", ">"
    characters = {10: "<", 11: "t", 12: ">", 13: "</", 14: "t", 1: "a", 2: "b"}
    rng = random.Random(1)
    for _ in range(200):
        token_ids = ([*start] if rng.random() < 0.5 else []) + rng.choices([1, 2, 11, 12], k=rng.randrange(8))
        if rng.random() < 0.7:
            token_ids += [*end, *rng.choices([1, 2, 13, 12], k=rng.randrange(5))]
        text = "".join(characters[token] for token in token_ids)
        text = text.replace("<t>", "<think>").replace("</t>", "</think>")  # the tags' text, spelled in full
        reasoning, _ = DeepSeekR1ReasoningParser.split(text)
        expected = len((reasoning or "").replace("<think>", "<t>"))  # back to one character a token
        assert _count((start, end), token_ids) == expected, token_ids


def test_the_tags_are_the_tokenizers_spelling_of_each_alone():
    class Tokenizer:
        def encode(self, text, add_special_tokens):
            assert add_special_tokens is False
            return [ord(character) for character in text] if text == "<think>" else []

    with pytest.raises(ValueError, match="writes </think> as no token at all"):
        think_tag_ids(Tokenizer())
    Tokenizer.encode = lambda self, text, add_special_tokens: [len(text)]
    assert think_tag_ids(Tokenizer()) == ((7,), (8,))
