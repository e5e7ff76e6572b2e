"""Embeddings from the engine's model: a prompt's last token's final hidden state (after the model's last norm),
L2-normalized, as vLLM's pooling runner gives a decoder-only model's embedding (``LLM.embed``: last-token pooling,
``normalize`` on by default). Embedding models built on these architectures, such as Qwen3-Embedding (last-token
pooling of a Qwen3), are served so.

An embedding request runs through the scheduler as a generation request does (chunked prefill, prefix cache,
preemption), and where a generation request samples its first token it takes its embedding instead and finishes:
no token is generated, and its blocks are freed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.common.errors import InvalidRequest


@dataclass(frozen=True)
class PoolingParams:
    """How a prompt's hidden state becomes its embedding (vLLM's ``PoolingParams``).

    Args:
        normalize: scale the embedding to unit L2 norm (vLLM's default for embedding models).
        dimensions: keep only the first ``dimensions`` values (Matryoshka embeddings), before normalizing; None:
            all of the model's hidden size.
    """

    normalize: bool = True
    dimensions: int | None = None

    def check(self, hidden_size: int) -> None:
        """Raises InvalidRequest for dimensions outside 1..hidden_size."""
        if not isinstance(self.normalize, bool):
            raise InvalidRequest(f"PoolingParams.normalize must be a boolean, got {self.normalize!r}.")
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or not 1 <= self.dimensions <= hidden_size):
            raise InvalidRequest(f"PoolingParams.dimensions must be an integer from 1 to the model's hidden size "
                                 f"{hidden_size}, got {self.dimensions!r}.")


def pool(hidden: torch.Tensor, params: list[PoolingParams]) -> list[list[float]]:
    """hidden: [rows, hidden_size], each row a prompt's last token's final hidden state -> each row's embedding
    (float32, cut to its ``dimensions``, then normalized where asked), as lists of floats."""
    rows = hidden.float()
    embeddings = []
    for row, param in zip(rows, params):
        if param.dimensions is not None:
            row = row[: param.dimensions]
        if param.normalize:
            row = torch.nn.functional.normalize(row, dim=-1)
        embeddings.append(row.tolist())
    return embeddings


@dataclass
class EmbeddingOutput:
    """One prompt's embedding (vLLM's ``EmbeddingOutput``)."""

    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """What ``LLM.embed`` returns per prompt (vLLM's ``EmbeddingRequestOutput``)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's ``ScoringOutput``): the cosine similarity of its two embeddings."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What ``LLM.score`` returns per pair (vLLM's ``ScoringRequestOutput``): ``prompt_token_ids`` are the pair's
    two texts' tokens, one after the other."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
