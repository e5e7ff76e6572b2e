"""The p2p connector between CUDA caches: NCCL carries the blocks between two GPUs, CUDA IPC within one, Gloo
the rest (``kvtransfer/p2p_channels.py``, ``kvtransfer/p2p_mapped.py``).

The protocols these tests share with the CPU path run in CI on CPU (tests/integration/test_kvtransfer.py, with
the blocks on a second Gloo group for NCCL's, out of shared memory for CUDA IPC's). These need CUDA: the NCCL
pair needs two GPUs (NCCL refuses two ranks on one device); the rest one. CI has none: each test says so in its
skip reason.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import BlockSource
from splitserve.kvtransfer.errors import KVVerificationError
from splitserve.kvtransfer.header import payload_tensor, verify
from splitserve.kvtransfer.p2p_mapped import MAX_MAPPED
from tests.kv_helpers import FINGERPRINT, LAYOUT, SHAPE, header_for, seeded_cache

pytestmark = pytest.mark.timeout(180)
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_one_gpu = pytest.mark.skipif(GPUS < 1, reason="no CUDA device here (torch.cuda.is_available() is False)")
needs_two_gpus = pytest.mark.skipif(GPUS < 2, reason=f"an NCCL pair needs two GPUs (NCCL refuses two ranks on one "
                                                     f"device); this machine has {GPUS}")

CUDA_SENDER = r"""
import sys, torch
from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import BlockSource
from splitserve.kvtransfer.connector import KVEndpointInfo
from splitserve.kvtransfer.header import TransferHeader
from splitserve.kvtransfer.layout import KVLayout
address, device, seed, transfer_id, gathered = sys.argv[1:6]
layout = KVLayout(4, 2, 8, torch.float32, 4)
cache = torch.randn((16, 4, 2, 2, 4, 8), generator=torch.Generator().manual_seed(int(seed))).to(device)
connector = create_connector("p2p", "prefill-cuda", "model-a", layout, device=device, chunk_bytes=layout.block_num_bytes)
destination = KVEndpointInfo("p2p", address, "receiver")
for blocks, position, num_tokens, last in (([3, 7], 0, 8, False), ([1], 8, 3, True)):
    header = TransferHeader(transfer_id, "model-a", layout, position, num_tokens, 11,
                            len(blocks) * layout.block_num_bytes, None, last, 99 if last else None)
    connector.send(destination, header, BlockSource(cache, blocks))
# Then payloads of their own (each a new allocation, as a gathered payload is), more than the receiver maps at once.
for index in range(int(gathered)):
    header = TransferHeader(f"{transfer_id}-{index}", "model-a", layout, 0, 4, 4, layout.block_num_bytes, None, True, 7)
    connector.send(destination, header, cache[index : index + 1].clone())
print("SENT", flush=True)
connector.close()
"""


class DeviceInbox:
    """Writes each delivered payload into a CUDA cache, as the decode worker's receiver does (``write_to``: from a
    mapped peer's memory straight into the cache; from host bytes, redis's, in one copy)."""

    def __init__(self, device: str, payload_device: str | None = None) -> None:
        self.cache = torch.zeros(SHAPE, device=device)
        self.payload_device = torch.device(payload_device) if payload_device else self.cache.device
        self.blocks = [10, 2, 5]  # where the sent prompt's blocks land, in order (4 tokens a block)
        self.payloads, self.errors = [], []
        self.own = {}  # transfer id -> payload
        self.done = threading.Event()

    def on_payload(self, received) -> None:
        assert received.payload.device == self.payload_device
        if "-" in received.header.transfer_id:  # a payload of its own: kept
            self.own[received.header.transfer_id] = received.payload.clone()
            return
        first = received.header.first_token_position // LAYOUT.block_size
        received.write_to(self.cache, self.blocks[first : first + received.header.num_blocks])
        self.payloads.append(received.header)
        if received.header.is_last:
            self.done.set()

    def on_error(self, transfer_id, error) -> None:
        self.errors.append((transfer_id, error))
        self.done.set()


@needs_two_gpus
def test_nccl_pair_moves_blocks_gpu_to_gpu_bit_exact():
    receiver = create_connector("p2p", "receiver", FINGERPRINT, LAYOUT, device="cuda:0")
    assert receiver.endpoint().options == {"backend": "gloo+nccl"} and receiver.checksum_type == "none"
    inbox = DeviceInbox("cuda:0")
    receiver.start_receiving(inbox.on_payload, inbox.on_error)
    try:
        sender = subprocess.run([sys.executable, "-c", CUDA_SENDER, receiver.endpoint().address, "cuda:1", "31",
                                 "gpu", "0"], capture_output=True, text=True, timeout=150)
        assert "SENT" in sender.stdout, sender.stderr
        assert inbox.done.wait(30) and not inbox.errors, inbox.errors
        # Chunks of one block: three payloads, each landed in the decode cache's own blocks.
        assert [(h.first_token_position, h.num_tokens) for h in inbox.payloads] == [(0, 4), (4, 4), (8, 3)]
        expected = seeded_cache(31)[[3, 7, 1]]
        torch.cuda.synchronize()
        assert torch.equal(inbox.cache[[10, 2, 5]].cpu(), expected)
    finally:
        receiver.close()


@needs_one_gpu
def test_a_cuda_sender_and_a_cpu_receiver_are_refused_with_a_sentence():
    receiver = create_connector("p2p", "receiver", FINGERPRINT, LAYOUT)  # a CPU cache: plane "gloo"
    receiver.start_receiving(lambda received: None, lambda transfer_id, error: None)
    try:
        sender = subprocess.run([sys.executable, "-c", CUDA_SENDER, receiver.endpoint().address, "cuda:0", "32",
                                 "refused", "0"], capture_output=True, text=True, timeout=150)
        assert "SENT" not in sender.stdout
        assert "moves blocks over gloo, this worker over gloo+nccl" in sender.stderr, sender.stderr
    finally:
        receiver.close()


@needs_one_gpu
def test_a_pair_on_one_gpu_copies_the_blocks_within_it_bit_exact(caplog):
    # NCCL refuses two ranks on one GPU: the ends find they share it (their UUIDs) and the receiver copies each block
    # out of the sender's cache, mapped over CUDA IPC; payloads of their own are mapped too, a few at a time.
    receiver = create_connector("p2p", "receiver", FINGERPRINT, LAYOUT, device="cuda:0")
    inbox = DeviceInbox("cuda:0")
    receiver.start_receiving(inbox.on_payload, inbox.on_error)
    try:
        with caplog.at_level(logging.INFO, logger="splitserve.kvtransfer.p2p"):
            sender = subprocess.run([sys.executable, "-c", CUDA_SENDER, receiver.endpoint().address, "cuda:0", "34",
                                     "one", str(MAX_MAPPED + 3)], capture_output=True, text=True, timeout=150)
            assert "SENT" in sender.stdout, sender.stderr
            assert inbox.done.wait(30) and not inbox.errors, inbox.errors
        assert "ready (gloo+cuda-ipc)" in caplog.text
        # A mapped pair sends each payload as one chunk, delivered as the sender's blocks themselves (no ring).
        assert [(h.first_token_position, h.num_tokens) for h in inbox.payloads] == [(0, 8), (8, 3)]
        expected = seeded_cache(34)
        torch.cuda.synchronize()
        assert torch.equal(inbox.cache[[10, 2, 5]].cpu(), expected[[3, 7, 1]])
        assert sorted(inbox.own) == sorted(f"one-{index}" for index in range(MAX_MAPPED + 3))
        for index in range(MAX_MAPPED + 3):
            assert torch.equal(inbox.own[f"one-{index}"].cpu(), expected[index : index + 1])
    finally:
        receiver.close()


@needs_one_gpu
def test_payloads_on_a_gpu_are_verified_without_leaving_it():
    cache = seeded_cache(33).cuda()
    payload = cache[[3, 7]].contiguous()
    header = header_for(payload.cpu(), "t", 0, 8, 11, False)
    data = payload.view(-1).view(torch.uint8)
    verify(header, data, FINGERPRINT, LAYOUT, checksum_type="none")  # sizes, layout, fingerprint: on the host
    assert torch.equal(payload_tensor(header, data), payload)
    with pytest.raises(KVVerificationError, match="cannot be checksummed on the host"):
        verify(header, data, FINGERPRINT, LAYOUT, checksum_type="xxh3")
    with pytest.raises(KVVerificationError, match="header says"):
        verify(header, data[:-4], FINGERPRINT, LAYOUT, checksum_type="none")


@needs_one_gpu
def test_redis_moves_blocks_between_caches_on_a_gpu_through_pinned_host_memory(redis_url):
    # Redis holds host bytes: the sender copies its CUDA blocks out once (pinned), the receiver reads into a pinned
    # buffer and writes the cache in one copy. Checksums work as between CPU caches: they are taken on the host.
    import redis

    receiver = create_connector("redis", "decode-gpu", FINGERPRINT, LAYOUT, url=redis_url, device="cuda:0")
    sender = create_connector("redis", "prefill-gpu", FINGERPRINT, LAYOUT, url=redis_url, device="cuda:0")
    assert receiver.checksum_type == "xxh3"
    inbox = DeviceInbox("cuda:0", payload_device="cpu")
    receiver.start_receiving(inbox.on_payload, inbox.on_error)
    cache = seeded_cache(35).cuda()
    try:
        destination = receiver.endpoint()
        for blocks, position, num_tokens, last in (([3, 7], 0, 8, False), ([1], 8, 3, True)):
            header = header_for(cache[blocks].cpu(), "gpu", position, num_tokens, 11, last, 7 if last else None)
            header.checksum = None  # the connector takes it, as the prefill worker's sends leave it to
            sender.send(destination, header, BlockSource(cache, blocks))
        own = cache[[2]].clone()  # a gathered payload of its own, on the GPU
        sender.send(destination, header_for(own.cpu(), "own-1", 0, 4, 4, True, 9), own)
        assert inbox.done.wait(30) and not inbox.errors, inbox.errors
        deadline = time.monotonic() + 10
        while "own-1" not in inbox.own and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [(h.first_token_position, h.num_tokens) for h in inbox.payloads] == [(0, 8), (8, 3)]
        torch.cuda.synchronize()
        assert torch.equal(inbox.cache[[10, 2, 5]].cpu(), seeded_cache(35)[[3, 7, 1]])
        assert torch.equal(inbox.own["own-1"], seeded_cache(35)[[2]])
        server = redis.Redis.from_url(redis_url)
        assert server.dbsize() == 0  # every piece consumed, the inbox popped
        server.close()
    finally:
        sender.close()
        receiver.close()


BENCHMARK = [sys.executable, "benchmarks/kv_transfer.py", "--device", "cuda", "--tokens", "512", "2048", "--repeats", "1"]


@needs_one_gpu
def test_on_one_gpu_the_transfer_benchmark_times_p2p_and_redis_against_their_ceilings(tmp_path):
    result = subprocess.run([*BENCHMARK, "--json", str(tmp_path / "kv.json")], capture_output=True, text=True,
                            timeout=170)
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "kv.json").read_text())["rows"]
    assert [(row["connector"], row["checksum"], row["tokens"]) for row in rows] == [
        ("p2p", "none", 512), ("redis", "xxh3", 512), ("p2p", "none", 2048), ("redis", "xxh3", 2048)]
    assert all(row["connector_ms"] > 0 and row["ceiling_ms"] > 0 for row in rows)
    assert "caches on cuda" in result.stdout


def test_without_a_gpu_the_transfer_benchmark_refuses_cuda_in_one_line():
    # No GPU visible to the benchmark, on any machine.
    result = subprocess.run(BENCHMARK, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2 and "--device cuda: torch finds no CUDA device here" in result.stderr
