"""Where `splitserve up` puts its workers when they run on CUDA (splitserve/launcher.py: visible_gpus, place_on_gpus),
and how many torch threads each gets (threads_per_worker). Pure functions: checked here for any number of GPUs and
CPUs, none of which this machine needs."""

from __future__ import annotations

import pytest

from splitserve.kvtransfer.p2p_channels import same_gpu
from splitserve.launcher import place_on_gpus, threads_per_worker, visible_gpus


def test_the_visible_gpus_are_those_cuda_visible_devices_lists_else_every_one_counted():
    assert visible_gpus({}, 3) == ["0", "1", "2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}, 2) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "GPU-a1,GPU-b2"}, 2) == ["GPU-a1", "GPU-b2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, 0) == []


def test_without_p2p_pairs_workers_take_the_gpus_in_turn():
    assert place_on_gpus(["both"] * 3, ["0", "1"], pairs_over_p2p=False) == ["0", "1", "0"]
    assert place_on_gpus(["prefill", "decode"], ["7"], pairs_over_p2p=False) == ["7", "7"]  # lmcache: may share


@pytest.mark.parametrize(("prefill", "decode", "gpus", "expected"), [
    (1, 1, 2, ["0", "1"]),
    (1, 1, 4, ["0", "2"]),  # each pool gets half of the GPUs; a worker uses the first of its pool's
    (1, 3, 4, ["0", "1", "2", "3"]),
    (2, 2, 2, ["0", "0", "1", "1"]),
    (3, 1, 8, ["0", "1", "2", "6"]),
    (1, 7, 2, ["0", "1", "1", "1", "1", "1", "1", "1"]),
])
def test_p2p_pairs_on_two_or_more_gpus_never_share_one(prefill, decode, gpus, expected):
    roles = ["prefill"] * prefill + ["decode"] * decode
    placed = place_on_gpus(roles, [str(index) for index in range(gpus)], pairs_over_p2p=True)
    assert len(placed) == len(roles)
    prefill_gpus, decode_gpus = set(placed[:prefill]), set(placed[prefill:])
    assert not prefill_gpus & decode_gpus
    assert placed == expected


def test_on_one_gpu_p2p_pairs_share_it():
    # Their blocks are copied within the GPU (CUDA IPC), where NCCL would refuse two ranks on one device.
    assert place_on_gpus(["prefill", "decode", "decode"], ["GPU-a1"], pairs_over_p2p=True) == ["GPU-a1"] * 3
    with pytest.raises(ValueError, match="no GPU is visible"):
        place_on_gpus(["decode"], [], pairs_over_p2p=False)


def test_a_pool_alone_needs_no_second_gpu():
    assert place_on_gpus(["decode", "decode"], ["0"], pairs_over_p2p=True) == ["0", "0"]


def test_a_p2p_pair_on_one_gpu_is_told_from_its_uuids():
    # The p2p connector publishes each end's GPU UUID before building its data plane: CUDA IPC on one GPU, NCCL on
    # two (tests/integration/test_kvtransfer_cuda.py runs the exchange on a GPU).
    assert same_gpu("GPU-1111", "GPU-1111")
    assert not same_gpu("GPU-1111", "GPU-2222")
    assert not same_gpu("", "")  # a torch that reports no UUID: NCCL decides


@pytest.mark.parametrize(("workers", "cpus", "expected"), [
    (2, 2, 1),  # a prefill and a decode worker on two cores: one thread each, not two that spin on each other
    (1, 2, 2),
    (2, 16, 8),
    (3, 16, 5),
    (5, 2, 1),  # more workers than CPUs: still one thread each
])
def test_local_workers_share_out_the_cpus(workers, cpus, expected):
    assert threads_per_worker(workers, cpus) == expected


def test_threads_per_worker_counts_the_cpus_this_process_may_use():
    import os

    assert threads_per_worker(1) == len(os.sched_getaffinity(0))
