"""Beam search's parameters (vLLM's ``BeamSearchParams``), apart from the search (``splitserve.engine.beam_search``),
so that the router, the gateway and clients check and send them without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.errors import InvalidRequest

# The most log probabilities a request may ask for (SamplingParams.logprobs), so beam_width <= 10 (a model with
# several end-of-sequence ids is asked for more candidates only as the limit allows).
MAX_CANDIDATES = 20


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams kept, ``max_tokens`` tokens at most, ``ignore_eos`` to grow
    beams through the end-of-sequence token, ``temperature`` of each step's sampling (the candidates come from the
    log probabilities, which the temperature leaves alone), ``length_penalty`` (``splitserve.engine.beam_search``
    says how beams are scored)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def check(self) -> None:
        """Raises InvalidRequest for a width outside 1..10, a max_tokens below 1, or a length_penalty that is not a
        number."""
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) \
                or not 1 <= self.beam_width <= MAX_CANDIDATES // 2:
            raise InvalidRequest(f"beam_width must be an integer from 1 to {MAX_CANDIDATES // 2}, got "
                                 f"{self.beam_width!r}.")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be a positive integer, got {self.max_tokens!r}.")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)):
            raise InvalidRequest(f"length_penalty must be a number, got {self.length_penalty!r}.")
