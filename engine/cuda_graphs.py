"""Decode steps replayed from CUDA graphs: one launch for the whole forward pass instead of hundreds.

A decode step of a small model on a GPU is bound by launches, not by the GPU: SmolLM2's 30 layers make
about 300 kernel launches a step, each 5-20 us of Python and driver time when launched one by one
(``benchmarks/gpu_kernels.py --timing eager`` against ``graph`` on an H100: one request's paged decode
attention over 4k tokens took 23 us eager, 12.5 us replayed). As vLLM and SGLang do, the model's
forward pass for decode-only steps is captured once per padded batch size at start, over static
input buffers, and each later decode step copies its inputs into those buffers and replays the graph.

What makes a step replayable:

* every tensor's shape is fixed: the batch is padded to the next captured size, the block tables to
  the longest request the engine admits (``max_model_len``);
* padded rows change nothing: their slot is -1 (the KV write skips it), their context is one token
  read from whatever block their table row holds (always a valid block id), and their output is
  never sampled;
* the forward pass reads nothing back to the host (the Triton backend: its decode kernel takes its
  number of splits from the tables' fixed width, and reads context lengths on the GPU).

Only the Triton backend is captured (the torch reference builds a mask of the padded width per step).
Prefill and mixed steps, and decode batches larger than the largest captured size, run eagerly.

Without ``capture`` (a CPU, in tests) :class:`DecodeGraphs` runs the same padded forward pass over the
same static buffers eagerly: everything but the capture itself, checked token for token on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve.engine.attention import AttentionMetadata, DecodeGroup

# Captured batch sizes: 1, 2, 4, 8, then every multiple of 8 (vLLM's choice: padding wastes at most 7 rows).
_SMALL_SIZES = (1, 2, 4)
_SIZE_STEP = 8


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The padded decode batch sizes captured for an engine running at most ``max_num_seqs`` requests: the
    largest is the first that holds them all (4 for 3 or 4 requests, 8 for 5 to 8, 72 for 65 to 72)."""
    sizes: list[int] = []
    for size in _SMALL_SIZES:
        sizes.append(size)
        if size >= max_num_seqs:
            return sizes
    return sizes + list(range(_SIZE_STEP, -(-max_num_seqs // _SIZE_STEP) * _SIZE_STEP + 1, _SIZE_STEP))


@dataclass
class DecodeInputs:
    """One decode-only step, unpadded (host lists, in the step's row order)."""

    token_ids: list[int]  # [requests] the token each request feeds
    positions: list[int]  # [requests] its position (= tokens already in the cache)
    slots: list[int]  # [requests] where its key and value are written
    block_tables: list[list[int]]  # [requests][blocks] each request's blocks, at least positions // block_size + 1
    # [requests] each one's row of the rotary tables: its position, or past RotaryEmbedding.long_offset for a request
    # rotated with LongRoPE's long factors throughout
    rotary_positions: list[int] = field(default_factory=list)


class DecodeGraphs:
    """Static input buffers, one captured graph per padded batch size, and the step that fills and replays them.

    Args:
        model: the engine's model (``forward(input_ids, positions, kv_caches, metadata)``).
        kv_caches: its per-layer caches (the graphs write and read them in place).
        block_size: tokens per KV block.
        max_num_seqs: the engine's most running requests (the largest captured batch).
        max_model_len: the longest request (sets the block tables' fixed width).
        device: where the buffers live (the model's device).
        capture: record CUDA graphs (a CUDA device); False runs the padded forward eagerly (CPU tests).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, max_num_seqs: int,
                 max_model_len: int, device: str, capture: bool) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sizes = capture_sizes(max_num_seqs)
        self.captured = capture
        self.num_steps = 0  # decode steps run through the static buffers
        largest = self.sizes[-1]
        # fields: rows 0-3 are input ids, positions, slots and context lengths, each [largest] and contiguous
        # (the kernels read slots and lengths as flat arrays); tables: [largest, blocks of max_model_len].
        self.fields = torch.zeros(4, largest, dtype=torch.int64, device=device)
        self.fields[2] = -1
        self.fields[3] = 1
        self.tables = torch.zeros(largest, -(-max_model_len // block_size), dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def can_run(self, num_requests: int) -> bool:
        """Whether a decode-only step of ``num_requests`` requests fits a captured size."""
        return 0 < num_requests <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, step: DecodeInputs) -> torch.Tensor:
        """Copy the step into the static buffers, padded, and replay its size's graph (or run the padded
        forward pass eagerly, without capture).

        Returns: hidden states [requests, hidden_size] (a view of the graph's output: valid until the next run).
        """
        num_requests = len(step.token_ids)
        size = next(size for size in self.sizes if size >= num_requests)
        padding = size - num_requests
        fields = torch.tensor(
            [step.token_ids + [0] * padding, step.rotary_positions + [0] * padding, step.slots + [-1] * padding,
             [position + 1 for position in step.positions] + [1] * padding],
            dtype=torch.int64,
        )
        # Each request's blocks up to its new token's (a table may hold blocks allocated ahead).
        rows = [table[: position // self.block_size + 1] for table, position in zip(step.block_tables, step.positions)]
        width = max(len(row) for row in rows)
        tables = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int64)
        # Table columns past a request's blocks and the padded rows' tables stay as an earlier step left them:
        # they hold valid block ids, and the kernel reads no column past a request's context.
        self.fields[:, :size].copy_(fields)
        self.tables[:num_requests, :width].copy_(tables)
        self.num_steps += 1
        if self.captured:
            self.graphs[size].replay()
            return self.outputs[size][:num_requests]
        return self._forward(size)[:num_requests]

    def _forward(self, size: int) -> torch.Tensor:
        """The padded decode step of ``size`` rows over the static buffers: hidden states [size, hidden_size]."""
        input_ids, positions, slots, seq_lens = self.fields[:, :size]
        metadata = AttentionMetadata(
            slot_mapping=slots,
            decode_groups=[DecodeGroup(0, size, self.tables[:size], seq_lens, None)],
            use_triton_kernels=True,
        )
        return self.model(input_ids, positions, self.kv_caches, metadata)

    def _capture_all(self) -> None:
        """Capture every size, largest first, all in one memory pool (a smaller graph reuses the larger's
        memory). Each size runs once eagerly first, so Triton compiles its kernels outside the capture.
        The static buffers hold padding only (slots -1, one-token contexts): capture writes no KV."""
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._forward(size)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.outputs[size] = self._forward(size)
                self.graphs[size] = graph
        torch.cuda.synchronize()
