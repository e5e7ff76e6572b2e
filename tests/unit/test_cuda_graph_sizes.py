"""The padded batch sizes the engine captures as CUDA graphs (engine/cuda_graphs.py): every decode batch up to
max_num_seqs has a size that holds it, and padding wastes at most 7 rows."""

from __future__ import annotations

import pytest

from splitserve.engine.cuda_graphs import capture_sizes


@pytest.mark.parametrize(("max_num_seqs", "sizes"), [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (4, [1, 2, 4]), (5, [1, 2, 4, 8]), (8, [1, 2, 4, 8]),
    (9, [1, 2, 4, 8, 16]), (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
])
def test_capture_sizes(max_num_seqs, sizes):
    assert capture_sizes(max_num_seqs) == sizes


def test_every_batch_pads_to_the_smallest_size_that_holds_it():
    sizes = capture_sizes(256)
    for batch in range(1, 257):
        size = next(size for size in sizes if size >= batch)
        assert size - batch <= 7
