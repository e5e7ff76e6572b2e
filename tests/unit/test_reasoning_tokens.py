"""Where a think block ends, in token ids: the prompt's state (vLLM's rule, read from the end) and the watch over
generated tokens, with one-token tags (reasoning models) and tags of several tokens (SmolLM2's ``</think>``)."""

from __future__ import annotations

import random

import pytest

from splitserve.common.reasoning import ThinkEndWatch, check_reasoning_parser, reasoning_ended

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
