"""Incremental detokenization: token ids in, text out, one step at a time.

Decoding the whole output every step costs O(length) per token; decoding one
token alone breaks characters that span several byte-level tokens (an emoji is
often 2-3 tokens) and loses the leading-space context some tokenizers need.
So, as vLLM does, two windows of the token list are decoded each step:

    token ids:  ... | prefix_offset ... read_offset | ... newest
    prefix text = decode(ids[prefix_offset:read_offset])   (already emitted)
    full text   = decode(ids[prefix_offset:])

The new text is what ``full text`` has beyond ``prefix text``. It is emitted
only when it does not end in U+FFFD (an incomplete character); then the windows
slide forward (prefix_offset = read_offset, read_offset = newest + 1). Only the
tokens from prefix_offset on are kept. The first window holds the last few
prompt tokens, so the first generated token decodes as it would inside the
full sequence.

Stop strings are searched in the newly added text plus the ``len(stop) - 1``
characters before it, so a stop string split across tokens is found; the text
is cut before it, or after it with ``include_stop_str_in_output`` (vLLM's; no
text is then held back while streaming, as vLLM holds none).
"""

from __future__ import annotations

from typing import Any

from splitserve.common.sampling_params import SamplingParams

# Prompt tokens that seed the first decode window.
NUM_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text, and finds stop strings.

    A generated character that is still incomplete is held back until its last
    token arrives; if the request ends first, it is never emitted.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop_strings: list[str] = list(params.stop)
        self.include_stop_string = params.include_stop_str_in_output
        # Characters that may be the start of a stop string: held back while streaming (none when the stop string
        # stays in the text).
        self.stop_buffer_length = (0 if self.include_stop_string
                                   else max((len(stop) for stop in self.stop_strings), default=1) - 1)
        # The stop string that ended the text, once one matched.
        self.matched_stop: str | None = None
        # Tail of prompt + output, from prefix_offset on (so prefix_offset is 0 here).
        self._window_token_ids: list[int] = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        # Window tokens already turned into text.
        self._read_offset = len(self._window_token_ids)
        self._output_text = ""
        # Characters of the output text already returned by get_next_output_text(delta=True).
        self._num_streamed_characters = 0

    @property
    def output_text(self) -> str:
        """The text so far: complete characters only, cut before a matched stop string (after it with
        ``include_stop_str_in_output``)."""
        return self._output_text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated tokens and extend ``output_text``.

        Returns:
            The stop string that matched (``output_text`` is then cut before it, or after it),
            else None. Once a stop string matched, further calls change nothing
            and return None.
        """
        if self.matched_stop is not None:
            return None
        previous_length = len(self._output_text)
        new_texts = []
        for token_id in new_token_ids:
            self._window_token_ids.append(token_id)
            new_texts.append(self._decode_newest())
        self._output_text += "".join(new_texts)
        return self._cut_at_stop_string(previous_length)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text for streaming.

        Args:
            finished: the request is done; nothing is held back any more.
            delta: return only the text not returned by an earlier delta call
                (and record it as returned); else the whole text.

        While not finished (and no stop string matched), the last
        ``len(longest stop string) - 1`` characters are held back: they could
        still become the start of a stop string.
        """
        text_is_final = finished or self.matched_stop is not None
        held_back = 0 if text_is_final else self.stop_buffer_length
        num_available = max(len(self._output_text) - held_back, 0)
        if not delta:
            return self._output_text[:num_available]
        if num_available <= self._num_streamed_characters:
            return ""
        text = self._output_text[self._num_streamed_characters : num_available]
        self._num_streamed_characters = num_available
        return text

    def _decode_newest(self) -> str:
        """The text the newest token completes ("" while a character is incomplete);
        slides the windows forward when it returns text."""
        window = self._window_token_ids
        prefix_text = self._decode(window[: self._read_offset])
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHARACTER):
            return ""
        # Next step's prefix window is the tokens just read; drop what precedes it.
        del window[: self._read_offset]
        self._read_offset = len(window)
        return full_text[len(prefix_text) :]

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _cut_at_stop_string(self, previous_length: int) -> str | None:
        """Find the earliest stop string that ends in the new text; cut the text before it (after it with
        ``include_stop_str_in_output``)."""
        earliest_index = -1
        earliest_stop = None
        for stop in self.stop_strings:
            search_start = max(previous_length - len(stop) + 1, 0)
            index = self._output_text.find(stop, search_start)
            if index != -1 and (earliest_stop is None or index < earliest_index):
                earliest_index, earliest_stop = index, stop
        if earliest_stop is None:
            return None
        end = earliest_index + len(earliest_stop) if self.include_stop_string else earliest_index
        self._output_text = self._output_text[:end]
        self.matched_stop = earliest_stop
        return earliest_stop
