"""Unit tests for incremental detokenization and stop strings, with the real
SmolLM2 tokenizer (byte-level BPE, where one character may span several tokens)."""

from __future__ import annotations

import random

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.detokenizer import IncrementalDetokenizer

CHAT_PROMPT = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
REPLACEMENT_CHARACTER = "\ufffd"


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Feed tokens one at a time; return every delta, the final flush last."""
    deltas = []
    for token_id in token_ids:
        detokenizer.update([token_id])
        deltas.append(detokenizer.get_next_output_text(finished=False, delta=True))
    deltas.append(detokenizer.get_next_output_text(finished=True, delta=True))
    return deltas


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return encode(tokenizer, CHAT_PROMPT)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! How are you?",
        "Emoji: 😀👍🏽🇫🇷 and 🤖.",
        "中文测试：你好世界，再见。日本語もね",
        "Accents: naïve café, Ångström, ½ ∑ 𝔘𝔫𝔦",
        "Special<|im_end|> tokens <reponame> in\n<|im_start|>the middle",
        "  leading spaces,\n\ttabs\n\nand newlines ",
    ],
)
def test_deltas_concatenate_to_the_full_decode(tokenizer, prompt_ids, text, skip_special_tokens):
    token_ids = encode(tokenizer, text)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas = stream(detokenizer, token_ids)
    expected = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    assert detokenizer.output_text == expected
    assert not any(REPLACEMENT_CHARACTER in delta for delta in deltas)


def test_special_tokens_are_skipped_or_kept(tokenizer, prompt_ids):
    token_ids = encode(tokenizer, "a<|im_end|>b")
    skipped = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(skip_special_tokens=True))
    kept = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(skip_special_tokens=False))
    skipped.update(token_ids)
    kept.update(token_ids)
    assert skipped.output_text == "ab"
    assert kept.output_text == "a<|im_end|>b"


def test_multi_token_character_appears_once_complete(tokenizer, prompt_ids):
    token_ids = encode(tokenizer, "Say 😀 now")
    assert len(token_ids) == 4  # "Say", " " + first bytes of 😀, its last byte, " now"
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams())
    texts = []
    for token_id in token_ids:
        detokenizer.update([token_id])
        texts.append(detokenizer.output_text)
    assert texts == ["Say", "Say", "Say 😀", "Say 😀 now"]


def test_first_token_keeps_its_leading_space(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Hello"), SamplingParams())
    detokenizer.update(encode(tokenizer, " world"))
    assert detokenizer.output_text == " world"


def test_empty_prompt_and_many_tokens_in_one_update(tokenizer):
    token_ids = encode(tokenizer, "Two 世界 at once 😀!")
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    assert detokenizer.update(token_ids) is None
    assert detokenizer.output_text == "Two 世界 at once 😀!"


def test_random_token_sequences_round_trip(tokenizer, prompt_ids):
    """Any ids, including lone bytes of multi-byte characters and special tokens."""
    vocab_size = len(tokenizer)
    byte_token_ids = [
        token_id for token_id in range(300) if tokenizer.decode([token_id]) == REPLACEMENT_CHARACTER
    ]
    assert len(byte_token_ids) > 50
    period = encode(tokenizer, ".")
    rng = random.Random(0)
    for trial in range(30):
        # Ends on a complete character, so nothing is left held back.
        token_ids = [
            rng.choice(byte_token_ids) if rng.random() < 0.4 else rng.randrange(vocab_size)
            for _ in range(25)
        ] + period
        skip_special_tokens = trial % 2 == 0
        params = SamplingParams(skip_special_tokens=skip_special_tokens)
        deltas = stream(IncrementalDetokenizer(tokenizer, prompt_ids, params), token_ids)
        assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


class RecordingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call gets."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decode_lengths: list[int] = []

    def decode(self, token_ids, **kwargs):
        self.decode_lengths.append(len(token_ids))
        return self.tokenizer.decode(token_ids, **kwargs)


def test_each_step_decodes_only_a_few_tokens(tokenizer, prompt_ids):
    token_ids = encode(tokenizer, "Long output with 中文 and emoji 😀 repeated. " * 20)
    recording = RecordingTokenizer(tokenizer)
    detokenizer = IncrementalDetokenizer(recording, prompt_ids, SamplingParams())
    deltas = stream(detokenizer, token_ids)
    assert "".join(deltas) == tokenizer.decode(token_ids)
    assert len(token_ids) > 200
    assert len(recording.decode_lengths) == 2 * len(token_ids)
    # The first step: 5 prompt tokens + 1; later: the last read tokens + an unfinished character.
    assert max(recording.decode_lengths) <= 6


# --- stop strings -----------------------------------------------------------


def test_stop_string_split_across_tokens_is_found_and_cut(tokenizer, prompt_ids):
    token_ids = encode(tokenizer, "The answer is 42. Then more")
    stop = "wer is 4"  # spans " answer", " is", " " and "4"
    assert not any(stop in tokenizer.decode([token_id]) for token_id in token_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=[stop]))
    results = [detokenizer.update([token_id]) for token_id in token_ids]
    assert results == [None, None, None, None, stop, None, None, None, None]
    assert detokenizer.output_text == "The ans"
    assert detokenizer.matched_stop == stop
    assert detokenizer.get_next_output_text(finished=True, delta=False) == "The ans"


def test_stop_string_made_of_multi_byte_characters(tokenizer, prompt_ids):
    token_ids = encode(tokenizer, "你好世界，再见")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["世界"]))
    matches = [detokenizer.update([token_id]) for token_id in token_ids]
    assert matches.index("世界") == 8  # the token that completes 界
    assert detokenizer.output_text == "你好"


def test_earliest_stop_string_wins(tokenizer, prompt_ids):
    detokenizer = IncrementalDetokenizer(
        tokenizer, prompt_ids, SamplingParams(stop=["Then", "42"])
    )
    assert detokenizer.update(encode(tokenizer, "The answer is 42. Then more")) == "42"
    assert detokenizer.output_text == "The answer is "


def test_stop_string_in_prompt_does_not_match(tokenizer):
    prompt_ids = encode(tokenizer, "Say STOP")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["STOP"]))
    assert detokenizer.update(encode(tokenizer, " and go")) is None
    assert detokenizer.output_text == " and go"


def test_streaming_holds_back_a_possible_stop_string(tokenizer, prompt_ids):
    token_ids = encode(tokenizer, "The END is near. THE END! more")
    stop = "END!"
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=[stop]))
    streamed = ""
    for token_id in token_ids:
        matched = detokenizer.update([token_id])
        streamed += detokenizer.get_next_output_text(finished=matched is not None, delta=True)
        if matched:
            break
        # Everything except the last len(stop) - 1 characters, never more.
        assert streamed == detokenizer.output_text[: max(len(detokenizer.output_text) - 3, 0)]
        assert detokenizer.get_next_output_text(finished=False, delta=False) == streamed
    assert matched == stop
    assert streamed == "The END is near. THE "
    assert detokenizer.get_next_output_text(finished=True, delta=True) == ""


def test_final_flush_returns_held_back_text(tokenizer, prompt_ids):
    token_ids = encode(tokenizer, "The END is near. THE END")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["END!"]))
    deltas = stream(detokenizer, token_ids)
    assert "".join(deltas[:-1]) == "The END is near. THE "
    assert deltas[-1] == "END"
    assert "".join(deltas) == "The END is near. THE END"


def test_stop_match_releases_held_back_text_before_finish(tokenizer, prompt_ids):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["END!", "near"]))
    assert detokenizer.update(encode(tokenizer, "The END is near")) == "near"
    assert detokenizer.get_next_output_text(finished=False, delta=True) == "The END is "
    assert detokenizer.update(encode(tokenizer, " more")) is None
    assert detokenizer.output_text == "The END is "


def test_include_stop_str_in_output_keeps_the_stop_string_and_holds_nothing_back(tokenizer, prompt_ids):
    """vLLM's include_stop_str_in_output: the text ends with the stop string (what follows it in its token is cut
    as before), and a stream holds no characters back: they stay in the text whatever comes."""
    token_ids = encode(tokenizer, "The answer is 42. Then more")
    params = SamplingParams(stop=["wer is 4", "Then"], include_stop_str_in_output=True)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    streamed = ""
    for token_id in token_ids:
        matched = detokenizer.update([token_id])
        streamed += detokenizer.get_next_output_text(finished=False, delta=True)
        assert streamed == detokenizer.output_text  # nothing held back
        if matched:
            break
    assert matched == "wer is 4" and detokenizer.output_text == "The answer is 4" == streamed
    assert detokenizer.update(encode(tokenizer, " Then")) is None and detokenizer.output_text == "The answer is 4"
    cut = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["swe"], include_stop_str_in_output=True))
    assert cut.update(encode(tokenizer, "The answer")) == "swe" and cut.output_text == "The answe"  # "r" is cut
