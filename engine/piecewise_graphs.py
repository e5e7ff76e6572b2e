"""Steps with prompt chunks replayed from CUDA graphs in pieces, attention run eagerly between them.

A decode-only step is captured whole (``cuda_graphs.py``). A step with prompt chunks cannot be: its attention
launches depend on the chunks' lengths and contexts, known on the host per step. Everything else in the forward
pass depends only on the number of tokens, so, as vLLM V1 does by default (its piecewise graphs, attention left
out of them), the forward pass of up to ``MAX_PIECEWISE_TOKENS`` tokens is captured once per padded token count
in L + 1 pieces for L layers: the embedding and the first layer up to its attention; each layer's output
projection, MLP and the next layer up to its attention; the last layer's rest and the final norm. At a step,
the pieces replay in order and attention runs eagerly between them on the step's real rows, reading the
queries, keys and values the piece before left in the graphs' memory and writing its output into one buffer the
next piece reads. A prefill step of SmolLM2's 30 layers then makes 31 graph launches and 30 attention calls
instead of about 300 kernel launches.

What makes a step replayable:

* the static buffers (token ids, positions) are padded to the captured size; padded rows compute on whatever
  those buffers and the attention buffer hold (every captured operation treats rows independently), attention
  takes only the real rows (no padded row writes KV) and no padded row is sampled;
* the capture splits at attention through ``AttentionMetadata.graph_break``, which ends one graph and begins
  the next; every piece of every size is captured into one memory pool, in the order they replay (sizes never
  interleave, so a smaller size reuses what a larger one freed).

Without ``capture`` (a CPU, in tests) :meth:`PiecewiseGraphs.run` runs the same padded forward pass with the
same split eagerly: everything but the capture itself, checked token for token on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention import AttentionMetadata, paged_attention_triton

# Captured token counts: multiples of 16 up to 256, then of 128, up to this many (or the step budget). Larger
# steps run eagerly: there the GPU's work outweighs the launches for all but the smallest models.
MAX_PIECEWISE_TOKENS = 2048
_SMALL_STEP, _SMALL_LIMIT, _LARGE_STEP = 16, 256, 128


def piecewise_sizes(max_num_batched_tokens: int) -> list[int]:
    """The padded token counts captured for an engine whose steps take at most ``max_num_batched_tokens``: the
    largest is the first that holds them all, up to MAX_PIECEWISE_TOKENS (16, 32, ... 256, 384, ... 2,048)."""
    limit = min(max_num_batched_tokens, MAX_PIECEWISE_TOKENS)
    sizes, size = [], 0
    while size < limit:
        size += _SMALL_STEP if size < _SMALL_LIMIT else _LARGE_STEP
        sizes.append(size)
    return sizes


@dataclass
class _Pieces:
    """One captured size: its graphs (one more than the attention sites between them), each site's query, key,
    value, KV cache views and scale, and the last graph's output (hidden states of every padded row)."""

    graphs: list
    sites: list[tuple]
    output: torch.Tensor


class PiecewiseGraphs:
    """Static input buffers, the pieces captured per padded token count, and the step that fills and replays them.

    Args:
        model: the engine's model (``forward(input_ids, positions, kv_caches, metadata)``).
        kv_caches: its per-layer caches.
        num_heads, head_dim: the model's query heads and head size (the attention buffer's shape).
        dtype: the model's activations' dtype.
        max_num_batched_tokens: the engine's step budget (the sizes captured: ``piecewise_sizes``).
        device: where the buffers live (the model's device).
        capture: record CUDA graphs (a CUDA device); False runs the padded, split forward eagerly (CPU tests).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], num_heads: int, head_dim: int, dtype: torch.dtype,
                 max_num_batched_tokens: int, device: str, capture: bool) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.sizes = piecewise_sizes(max_num_batched_tokens)
        self.captured = capture
        self.num_steps = 0  # steps run through the static buffers
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        # Every layer's attention writes here and the next piece reads it (one layer at a time, in order).
        self.attention_out = torch.zeros(largest, num_heads, head_dim, dtype=dtype, device=device)
        self._pieces: dict[int, _Pieces] = {}
        if capture:
            self._capture_all()

    def can_run(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` tokens fits a captured size."""
        return 0 < num_tokens <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """One step (its flattened token ids and positions, on the device, and its attention metadata): copy it
        into the static buffers, padded, and replay its size's pieces with attention between them (or run the
        padded, split forward pass eagerly, without capture).

        Returns: hidden states [tokens, hidden_size] (a view of the last piece's output: valid until the next run).
        """
        num_tokens = input_ids.numel()
        size = next(size for size in self.sizes if size >= num_tokens)
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(positions)
        self.num_steps += 1

        def attend(query, key, value, key_cache, value_cache, scale) -> torch.Tensor:
            paged_attention_triton(query[:num_tokens], key[:num_tokens], value[:num_tokens], key_cache, value_cache,
                                   metadata, scale, out=self.attention_out[:num_tokens])
            return self.attention_out[: query.shape[0]]

        if not self.captured:
            return self._forward(size, attend)[:num_tokens]
        pieces = self._pieces[size]
        for graph, site in zip(pieces.graphs, [*pieces.sites, None]):
            graph.replay()
            if site is not None:
                attend(*site)
        return pieces.output[:num_tokens]

    def _forward(self, size: int, graph_break) -> torch.Tensor:
        """The padded forward pass of ``size`` rows over the static buffers, ``graph_break`` called at each
        layer's attention: hidden states [size, hidden_size]."""
        device = self.input_ids.device
        metadata = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
                                     use_triton_kernels=True, graph_break=graph_break)
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, metadata)

    def _capture_all(self) -> None:
        """Capture every size, largest first, all in one memory pool. Each size runs once eagerly first (attention
        skipped: its buffer read as it is), so that Triton compiles its kernels outside the capture."""
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._forward(size, lambda query, *_rest: self.attention_out[: query.shape[0]])
                torch.cuda.synchronize()
                recorder = _Recorder(pool, self.attention_out)
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    recorder.begin()
                    output = self._forward(size, recorder.graph_break)
                    recorder.end()
                torch.cuda.current_stream().wait_stream(stream)
                self._pieces[size] = _Pieces(recorder.graphs, recorder.sites, output)
        torch.cuda.synchronize()


class _Recorder:
    """Captures one size's forward pass as consecutive graphs, ending one and beginning the next at each
    attention site (recorded: its query, key, value, cache views and scale)."""

    def __init__(self, pool, attention_out: torch.Tensor) -> None:
        self.pool = pool
        self.attention_out = attention_out
        self.graphs: list = []
        self.sites: list[tuple] = []
        self._graph = None

    def begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(self.pool)

    def end(self) -> None:
        self._graph.capture_end()
        self.graphs.append(self._graph)

    def graph_break(self, query, key, value, key_cache, value_cache, scale) -> torch.Tensor:
        self.end()
        self.sites.append((query, key, value, key_cache, value_cache, scale))
        self.begin()
        return self.attention_out[: query.shape[0]]
