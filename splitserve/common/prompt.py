"""The one check of a prompt's token ids, run by the router at the door and by the engine.

Both sides hold the same model facts (vocabulary size from config.json, the
context limit), so a request the router accepts is one every worker accepts.
"""

from __future__ import annotations

from collections.abc import Iterable

from splitserve.common.errors import InvalidRequest


def validate_prompt_token_ids(token_ids: Iterable[int], vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt's token ids as a new list of ints, if the model can continue it.

    Args:
        token_ids: the tokenized prompt.
        vocab_size: ids must be in [0, vocab_size).
        max_model_len: the context limit; the prompt must leave room for one generated token.
    Raises:
        InvalidRequest: an empty prompt, an id outside the vocabulary, or a prompt of
            max_model_len tokens or more.
    """
    token_ids = [int(token_id) for token_id in token_ids]
    if not token_ids:
        raise InvalidRequest("The prompt is empty: give at least one token.")
    bad = next((token_id for token_id in token_ids if not 0 <= token_id < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"Prompt token id {bad} is outside the vocabulary [0, {vocab_size}).")
    if len(token_ids) >= max_model_len:
        raise InvalidRequest(
            f"The prompt has {len(token_ids)} tokens; max_model_len is {max_model_len}, "
            "which must leave room for at least one generated token."
        )
    return token_ids
