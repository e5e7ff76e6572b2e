"""Scores of text pairs by their embeddings, as vLLM scores pairs with an embedding model: the pairs a request
names (one text against each of several, or two lists pairwise) and their cosine similarities. ``LLM.score`` and
the gateway's ``/score`` and ``/rerank`` share them (the router never imports torch: plain Python)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def pair_up(firsts: Sequence, seconds: Sequence) -> list[tuple]:
    """The pairs to score: a single first against every second, or both lists pairwise.

    Raises:
        ValueError: either list is empty, or they differ in length and the first holds more than one.
    """
    if not firsts or not seconds:
        raise ValueError("Both sides of a score need at least one text.")
    if len(firsts) != 1 and len(firsts) != len(seconds):
        raise ValueError(f"The first side holds {len(firsts)} texts and the second {len(seconds)}: give one first "
                         f"text to score against every second one, or as many of each to score pairwise.")
    return list(zip(list(firsts) * len(seconds) if len(firsts) == 1 else firsts, seconds))


def cosine(first: Sequence[float], second: Sequence[float]) -> float:
    """The cosine similarity of two vectors, in float64 (0 where either is all zeros)."""
    dot = math.fsum(a * b for a, b in zip(first, second))
    norms = math.sqrt(math.fsum(a * a for a in first)) * math.sqrt(math.fsum(b * b for b in second))
    return dot / norms if norms else 0.0
