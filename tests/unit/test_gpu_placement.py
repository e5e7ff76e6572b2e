"""Where `splitserve up` puts its workers when they run on CUDA (splitserve/launcher.py: visible_gpus, place_on_gpus).
Pure functions: checked here for any number of GPUs, none of which this machine needs."""

from __future__ import annotations

import pytest

from splitserve.kvtransfer.p2p_channels import same_gpu_problem
from splitserve.launcher import place_on_gpus, visible_gpus


def test_the_visible_gpus_are_those_cuda_visible_devices_lists_else_every_one_counted():
    assert visible_gpus({}, 3) == ["0", "1", "2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}, 2) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}, 2) == ["GPU-a1", "GPU-b2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 0) == []


def test_without_nccl_pairs_workers_take_the_gpus_in_turn():
    assert place_on_gpus(["both"] * 3, ["0", "1"], pairs_over_nccl=False) == ["0", "1", "0"]
    assert place_on_gpus(["prefill", "decode"], ["7"], pairs_over_nccl=False) == ["7", "7"]  # lmcache: may share


@pytest.mark.parametrize(("prefill", "decode", "gpus", "expected"), [
    (1, 1, 2, ["0", "1"]),
    (1, 1, 4, ["0", "2"]),  # each pool gets half of the GPUs; a worker uses the first of its pool's
    (1, 3, 4, ["0", "1", "2", "3"]),
    (2, 2, 2, ["0", "0", "1", "1"]),
    (3, 1, 8, ["0", "1", "2", "6"]),
    (1, 7, 2, ["0", "1", "1", "1", "1", "1", "1", "1"]),
])
def test_nccl_pairs_never_share_a_gpu(prefill, decode, gpus, expected):
    roles = ["prefill"] * prefill + ["decode"] * decode
    placed = place_on_gpus(roles, [str(index) for index in range(gpus)], pairs_over_nccl=True)
    assert len(placed) == len(roles)
    prefill_gpus, decode_gpus = set(placed[:prefill]), set(placed[prefill:])
    assert not prefill_gpus & decode_gpus
    assert placed == expected


def test_nccl_pairs_on_one_gpu_are_refused_with_a_sentence():
    with pytest.raises(ValueError, match="cannot pair two workers on one GPU, and only one GPU is visible"):
        place_on_gpus(["prefill", "decode"], ["0"], pairs_over_nccl=True)
    with pytest.raises(ValueError, match="no GPU is visible"):
        place_on_gpus(["decode"], [], pairs_over_nccl=False)


def test_a_pool_alone_needs_no_second_gpu():
    assert place_on_gpus(["decode", "decode"], ["0"], pairs_over_nccl=True) == ["0", "0"]


def test_a_p2p_pair_on_one_gpu_is_named_in_a_sentence():
    # The p2p connector publishes each end's GPU UUID before NCCL is asked (tests/integration/test_kvtransfer_cuda.py
    # runs the exchange on a GPU).
    assert same_gpu_problem("GPU-1111", "GPU-2222") is None
    assert same_gpu_problem("", "") is None  # a torch that reports no UUID: not checked
    problem = same_gpu_problem("GPU-1111", "GPU-1111")
    assert "on one GPU (GPU-1111)" in problem and "--kv-transfer lmcache" in problem
