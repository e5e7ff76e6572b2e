"""KV transfer throughput through each connector, beside its raw ceiling, in the same run.

For prompts of ``--tokens`` (default 512, 1024, 2048, 4096) of the default
model's KV shape (30 layers, 3 KV heads, head size 64, float32, block 16:
46,080 bytes a token, blocks scattered over a block-major cache), a sender
process sends one transfer (one ``send`` of a ``BlockSource``, as the prefill
worker does) and this process receives it. Timed from the start of ``send``
in the sender to the return of the receiver's ``on_payload`` for the last
payload (CLOCK_MONOTONIC is shared by both processes): reading the blocks,
the checksum on each side (``--checksums xxh3``, the default; ``none`` skips
both, to show what the wire protocol alone reaches), the wire and
verification.

Beside each connector, the raw ceiling on the same bytes between the same two
processes, with warm buffers on both sides (allocated once, as the connectors'
are), nothing gathered and nothing checksummed:

* ``p2p``:   one Gloo ``send``/``recv`` of the payload tensor on a two-rank group
             (the receive posted before the send starts);
* ``redis``: redis-py ``SET`` of the payload in pieces of the connector's size (one
             block each here, the blocks being scattered), pipelined, in the sender,
             then ``GET`` of them here.
* ``lmcache`` (needs ``pip install 'splitserve[lmcache]'``): two rows, store (until a reader's
             lookup sees it all in Redis) against a ``SET``, and retrieve against a ``GET``, of
             values of exactly LMCache's chunks (256 tokens, 11.8 MB), with the client options of
             our LMCache Redis adapter; and a line per row saying where its time goes
             (``benchmarks/lmcache_probe.py``).

With ``--device cuda`` both processes hold their caches on one GPU, and ``on_payload`` writes each
payload into scattered blocks of a cache here as a decode worker does (``write_to``). ``p2p``'s blocks
are copied within the GPU (CUDA IPC; no checksum, as on every CUDA plane; the mapped plane delivers the
sender's blocks themselves, so that copy is the transfer's only one), against the ceiling of one copy of
the whole payload (gathered once in the sender) out of the sender's memory, mapped in this process, into
a warm buffer here. ``redis`` copies the blocks into pinned host memory in the sender and out of its
pinned receive buffer into the cache here, against the same ceiling as between CPU caches (SET and GET
of the payload's bytes, already on the host): its ratio is what those two copies over PCIe cost.
``lmcache`` is not measured on CUDA.

Connector and ceiling transfers alternate (the connector first in one repeat, the
ceiling first in the next), so drifts of the (shared, 2-core) machine hit both
alike; the first pair of each point is a warm-up. Medians over ``--repeats``.
The target is each connector at >= 0.8 of its ceiling. Both processes run torch
on ``--torch-threads`` threads (1, as the workers here run with ``--threads 1``:
with two, on two cores shared with Redis and the other process, torch's copies
read 5 to 10 times slower; the ceilings use no torch). A private redis-server on
a free port is started and stopped here.

Usage::

    python benchmarks/kv_transfer.py
    python benchmarks/kv_transfer.py --tokens 1024 4096 --repeats 7 --json kv.json
    python benchmarks/kv_transfer.py --connectors p2p --checksums xxh3 none
    python benchmarks/kv_transfer.py --connectors redis lmcache
    python -m benchmarks.kv_transfer --connectors lmcache --tokens 1024 4096 --repeats 7
    python benchmarks/kv_transfer.py --device cuda           # p2p and redis, both ends on one GPU (needs one)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import CHECKSUM_NAME
from splitserve.kvtransfer.layout import KVLayout
from splitserve.launcher import LocalCluster

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_size=64, dtype=torch.float32, block_size=16)
CACHE_BLOCKS = 300
TARGET = 0.8
REPOSITORY = Path(__file__).resolve().parents[1]

SENDER = r"""
import json, sys, time
from datetime import timedelta
import redis, torch, torch.distributed as dist
from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.blocks import BlockSource, payload_bytes
from splitserve.kvtransfer.connector import KVEndpointInfo
from splitserve.kvtransfer.header import TransferHeader
from splitserve.kvtransfer.layout import KVLayout
layout = KVLayout(30, 3, 64, torch.float32, 16)
device = torch.device(sys.argv[2])
cache = torch.randn(int(sys.argv[1]), 30, 2, 3, 16, 64, device=device)  # block-major, as the engine allocates it
connectors, raw_group, raw_tensors, redis_clients, lmcache_store = {}, None, {}, {}, None
host_payloads = {}  # the raw Redis ceiling's payloads, on the host (copied out of a GPU once)

def reply(**fields):
    print(json.dumps(fields), flush=True)

for line in sys.stdin:
    command = json.loads(line)
    kind = command["kind"]
    if kind == "setup":
        host, port = command["store"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=30))
        raw_group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, timedelta(seconds=60))
        torch.set_num_threads(command["torch_threads"])
        reply(ok=True)
        continue
    if kind == "lmcache_intervals":
        reply(intervals=lmcache_store.intervals())
        continue
    num_blocks = command["num_blocks"]
    # The blocks a prompt occupies: scattered over the cache, in no order.
    blocks = [(7 * index) % cache.shape[0] for index in range(num_blocks)]
    if kind in ("raw_gloo", "raw_redis", "raw_ipc_export") and num_blocks not in raw_tensors:
        raw_tensors[num_blocks] = cache[blocks].contiguous()  # the payload, gathered once (warm)
    if kind == "raw_ipc_export":  # the payload's CUDA IPC fields, for the receiver to map once
        from splitserve.kvtransfer.p2p_mapped import export_cuda
        fields = export_cuda(raw_tensors[num_blocks].untyped_storage())
        reply(fields=[field.hex() if isinstance(field, bytes) else ["int", int(field)] for field in fields])
        continue
    if kind == "lmcache_store":
        if lmcache_store is None:
            from benchmarks.lmcache_probe import SenderStore
            lmcache_store = SenderStore(command["url"], layout)
        reply(**lmcache_store.store_once(command["token_ids"], cache, blocks))
        continue
    if kind == "raw_redis":
        options = json.dumps(command["client_options"], sort_keys=True)
        if options not in redis_clients:
            redis_clients[options] = redis.Redis.from_url(command["redis_url"], **command["client_options"])
        redis_client = redis_clients[options]
        if num_blocks not in host_payloads:
            host_payloads[num_blocks] = raw_tensors[num_blocks].cpu()
    started = time.monotonic()
    if kind == "raw_ipc":
        torch.cuda.synchronize(device)  # the payload is ready: the receiver copies it out of this process
    elif kind == "raw_gloo":
        raw_group.send([raw_tensors[num_blocks]], 1, 0).wait()
    elif kind == "raw_redis":
        data, piece = payload_bytes(host_payloads[num_blocks]), command["piece_bytes"]
        pipeline = redis_client.pipeline(transaction=False)
        for index, offset in enumerate(range(0, len(data), piece)):
            pipeline.set(f"raw:{index}", data[offset:offset + piece], px=60000)
        pipeline.execute()
    else:
        connector = connectors.get((kind, command["checksum"]))
        if connector is None:
            options = {"url": command["address"]} if kind == "redis" else {}
            if device.type == "cuda":
                options["device"] = str(device)
            connector = connectors[kind, command["checksum"]] = create_connector(
                kind, "bench-sender", "bench", layout, checksum=command["checksum"], **options)
        header = TransferHeader(command["transfer_id"], "bench", layout, 0, num_blocks * 16, num_blocks * 16,
                                num_blocks * layout.block_num_bytes, None, True, 1)
        destination = KVEndpointInfo(kind, command["address"], "bench-receiver", command.get("options", {}))
        connector.send(destination, header, BlockSource(cache, blocks))
    reply(started=started, ended=time.monotonic())
for connector in connectors.values():
    connector.close()
if lmcache_store is not None:
    lmcache_store.close()
"""


class Sender:
    """The sending process, driven by JSON lines on its stdin."""

    def __init__(self, num_cache_blocks: int, device: str = "cpu") -> None:
        self.process = subprocess.Popen([sys.executable, "-c", SENDER, str(num_cache_blocks), device], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, cwd=REPOSITORY)

    def ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("The sender process died.")
        return json.loads(line)

    def ask_in_background(self, **command) -> tuple[threading.Thread, dict]:
        reply: dict = {}
        thread = threading.Thread(target=lambda: reply.update(self.ask(**command)))
        thread.start()
        return thread, reply

    def close(self) -> None:
        self.process.stdin.close()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


class ConnectorProbe:
    """A receiving connector in this process; ``once`` times one transfer from the sender process."""

    def __init__(self, kind: str, checksum: str, sender: Sender, options: dict) -> None:
        self.kind, self.checksum, self.sender = kind, checksum, sender
        self.receiver = create_connector(kind, "bench-receiver", "bench", LAYOUT, checksum=checksum, **options)
        # On a GPU each payload lands in a cache here, as in a decode worker: blocks scattered, unlike the sender's.
        device = torch.device(options.get("device", "cpu"))
        self.cache = None if device.type == "cpu" else torch.empty(CACHE_BLOCKS, *LAYOUT.payload_shape(1)[1:],
                                                                   dtype=LAYOUT.dtype, device=device)
        self.done = threading.Event()
        self.finished = 0.0
        self.errors: list[str] = []
        self.count = 0
        self.receiver.start_receiving(self._on_payload, self._on_error)
        self.endpoint = self.receiver.endpoint()

    def _on_payload(self, received) -> None:
        if self.cache is not None:
            first = received.header.first_token_position // LAYOUT.block_size
            received.write_to(self.cache, [(11 * index + 1) % CACHE_BLOCKS
                                           for index in range(first, first + received.header.num_blocks)])
            torch.cuda.synchronize(self.cache.device)
        if received.header.is_last:
            self.finished = time.monotonic()
            self.done.set()

    def _on_error(self, transfer_id, error) -> None:
        self.errors.append(f"{transfer_id}: {error}")
        self.done.set()

    def once(self, num_blocks: int) -> float:
        self.done.clear()
        self.count += 1
        reply = self.sender.ask(kind=self.kind, checksum=self.checksum, num_blocks=num_blocks, transfer_id=f"t{self.count}",
                                address=self.endpoint.address, options=self.endpoint.options)
        if not self.done.wait(60) or self.errors:
            raise RuntimeError(f"{self.kind}: the payload did not arrive: {self.errors}")
        return self.finished - reply["started"]

    def close(self) -> None:
        self.receiver.close()


class GlooCeiling:
    """A bare Gloo send/recv of the payload tensor into a warm buffer here."""

    def __init__(self, sender: Sender, torch_threads: int) -> None:
        self.sender = sender
        store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
        thread, _ = sender.ask_in_background(kind="setup", store=f"127.0.0.1:{store.port}",
                                             torch_threads=torch_threads)
        self.group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, timedelta(seconds=60))
        thread.join()
        self.store = store
        self.buffers: dict[int, torch.Tensor] = {}

    def once(self, num_blocks: int) -> float:
        buffer = self.buffers.setdefault(num_blocks, torch.zeros(LAYOUT.payload_shape(num_blocks)))
        work = self.group.recv([buffer], 0, 0)  # posted before the send starts
        thread, reply = self.sender.ask_in_background(kind="raw_gloo", num_blocks=num_blocks)
        work.wait()
        received = time.monotonic()
        thread.join()
        return received - reply["started"]


class IpcCeiling:
    """On one GPU: the payload (gathered once in the sender, on the GPU) copied out of the sender's memory, mapped here
    over CUDA IPC, into a warm buffer here, in one copy: what the p2p connector's blocks come to on one GPU."""

    def __init__(self, sender: Sender, device: str) -> None:
        self.sender, self.device = sender, torch.device(device)
        self.mapped: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def once(self, num_blocks: int) -> float:
        from splitserve.kvtransfer.p2p_mapped import open_cuda

        if num_blocks not in self.mapped:
            fields = self.sender.ask(kind="raw_ipc_export", num_blocks=num_blocks)["fields"]
            storage = open_cuda(tuple(field[1] if isinstance(field, list) else bytes.fromhex(field)
                                       for field in fields), self.device)
            source = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage, 0, (storage.nbytes(),), (1,))
            self.mapped[num_blocks] = source, torch.empty_like(source)
        source, buffer = self.mapped[num_blocks]
        reply = self.sender.ask(kind="raw_ipc", num_blocks=num_blocks)
        buffer.copy_(source)
        torch.cuda.synchronize(self.device)
        return time.monotonic() - reply["started"]


class RedisCeiling:
    """redis-py SET of the payload's pieces in the sender, then GET of them here (pipelined both), by
    clients built with ``client_options`` in both processes."""

    def __init__(self, sender: Sender, url: str, piece_bytes: int, client_options: dict | None = None) -> None:
        import redis

        self.sender, self.url, self.piece_bytes = sender, url, piece_bytes
        self.client_options = client_options or {}
        self.client = redis.Redis.from_url(url, **self.client_options)

    def once(self, num_blocks: int) -> float:
        set_seconds, get_seconds = self.set_then_get(num_blocks)
        return set_seconds + get_seconds

    def set_then_get(self, num_blocks: int) -> tuple[float, float]:
        """(SET seconds in the sender, GET seconds here) of one payload of ``num_blocks`` blocks."""
        num_bytes = num_blocks * LAYOUT.block_num_bytes
        num_pieces = -(-num_bytes // self.piece_bytes)
        reply = self.sender.ask(kind="raw_redis", num_blocks=num_blocks, piece_bytes=self.piece_bytes,
                                redis_url=self.url, client_options=self.client_options)
        pipeline = self.client.pipeline(transaction=False)
        for index in range(num_pieces):
            pipeline.get(f"raw:{index}")
        started = time.monotonic()
        pieces = pipeline.execute()
        got = time.monotonic() - started
        assert sum(len(piece) for piece in pieces) == num_bytes
        self.client.delete(*[f"raw:{index}" for index in range(num_pieces)])
        return reply["ended"] - reply["started"], got


def lmcache_rows(sender: Sender, url: str, args) -> list[dict]:
    """Medians of LMCache's store and retrieve against redis-py SET and GET of its chunks, per prompt length,
    with the medians of their stages."""
    try:
        from benchmarks.lmcache_probe import CHUNK_TOKENS, LMCacheProbe, ceiling_client_options
    except ImportError:  # run as a script: benchmarks/ is on the path
        from lmcache_probe import CHUNK_TOKENS, LMCacheProbe, ceiling_client_options

    probe, rows = LMCacheProbe(sender, url, LAYOUT, CACHE_BLOCKS), []
    # Values of exactly LMCache's chunks: CHUNK_TOKENS tokens each, the last one partial.
    chunk_bytes = CHUNK_TOKENS // LAYOUT.block_size * LAYOUT.block_num_bytes
    ceiling = RedisCeiling(sender, url, chunk_bytes, ceiling_client_options(url))
    try:
        with tqdm(total=len(args.tokens) * (args.repeats + 1), desc="lmcache", unit="pair", file=sys.stderr) as bar:
            for tokens in args.tokens:
                num_blocks = -(-tokens // LAYOUT.block_size)
                timings = {"store": ([], [], []), "retrieve": ([], [], [])}
                for repeat in range(args.repeats + 1):
                    if repeat % 2:
                        mine, (set_seconds, get_seconds) = probe.once(num_blocks), ceiling.set_then_get(num_blocks)
                    else:
                        (set_seconds, get_seconds), mine = ceiling.set_then_get(num_blocks), probe.once(num_blocks)
                    if repeat:  # the first warms buffers and connections
                        for step, raw in (("store", set_seconds), ("retrieve", get_seconds)):
                            timings[step][0].append(mine[step])
                            timings[step][1].append(raw)
                            timings[step][2].append(mine[f"{step}_stages"])
                    bar.update()
                megabytes = num_blocks * LAYOUT.block_num_bytes / 1e6
                for step, (mine, raw, stages) in timings.items():
                    connector, raw_median = statistics.median(mine), statistics.median(raw)
                    rows.append({"connector": f"lmcache-{step}", "checksum": "none", "tokens": tokens,
                                 "megabytes": round(megabytes, 1), "connector_ms": connector * 1e3,
                                 "ceiling_ms": raw_median * 1e3, "connector_mb_per_s": megabytes / connector,
                                 "ceiling_mb_per_s": megabytes / raw_median, "ratio": raw_median / connector,
                                 "stages_ms": {stage: statistics.median(s[stage] for s in stages) * 1e3
                                               for stage in stages[0]}})
    finally:
        probe.close()
    return rows


def print_stages(rows: list[dict]) -> None:
    """Where each lmcache row's time goes: medians per stage (they need not sum to the median total)."""
    print("where the lmcache time goes (medians, ms; stages: benchmarks/lmcache_probe.py):")
    for row in rows:
        if "stages_ms" in row:
            stages = " + ".join(f"{stage} {ms:.0f}" for stage, ms in row["stages_ms"].items())
            ceiling = "SET" if row["connector"].endswith("store") else "GET"
            print(f"  {row['connector']:<16} {row['tokens']:>5}: {row['connector_ms']:6.0f} = {stages}"
                  f"   (raw {ceiling} {row['ceiling_ms']:.0f})")


def checksums_of(kind: str, args) -> list[str]:
    """The --kv-checksum settings measured for ``kind``: p2p between CUDA caches takes none."""
    return ["none"] if kind == "p2p" and args.device == "cuda" else args.checksums


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="prompt lengths to transfer, one transfer each (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed transfers per point, for connector and ceiling alike (default: %(default)s)")
    parser.add_argument("--connectors", nargs="+", default=["p2p", "redis"], choices=["p2p", "redis", "lmcache"],
                        help="connectors to measure; lmcache needs the lmcache extra and gives two rows, store and "
                        "retrieve, each against its own redis-py ceiling (default: %(default)s)")
    parser.add_argument("--checksums", nargs="+", default=["xxh3"], choices=["xxh3", "none"],
                        help="the connectors' --kv-checksum settings to measure; none shows what the wire protocol "
                        "alone reaches (default: %(default)s)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads in both processes (default: %(default)s, as the workers here run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where both processes hold their caches; cuda: both on one GPU, p2p (the blocks copied "
                        "within it over CUDA IPC, no checksum) against one copy of the payload out of the sender's "
                        "mapped memory, and redis (through pinned host memory on each side) against Redis alone; "
                        "not lmcache (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the arguments and the rows to FILE as JSON")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch finds no CUDA device here")
        if "lmcache" in args.connectors:
            parser.error("--device cuda measures p2p and redis (not lmcache)")
    torch.set_num_threads(args.torch_threads)
    if max(args.tokens) > CACHE_BLOCKS * LAYOUT.block_size:
        parser.error(f"--tokens at most {CACHE_BLOCKS * LAYOUT.block_size}")

    launcher = LocalCluster(log_dir=tempfile.mkdtemp(prefix="kv-bench-"))
    url = launcher.start_redis() if {"redis", "lmcache"} & set(args.connectors) else None
    sender = Sender(CACHE_BLOCKS, args.device)
    probes, ceilings, rows = {}, {}, []
    try:
        gloo = GlooCeiling(sender, args.torch_threads) if args.device == "cpu" else IpcCeiling(sender, args.device)
        if "lmcache" in args.connectors:
            rows += lmcache_rows(sender, url, args)
        for kind in [kind for kind in args.connectors if kind != "lmcache"]:
            for checksum in checksums_of(kind, args):
                options = {"url": url, "device": args.device} if kind == "redis" else {"device": args.device}
                probes[kind, checksum] = ConnectorProbe(kind, checksum, sender, options)
            # The redis connector sets one piece per run of consecutive blocks; these blocks are scattered, so
            # one piece per block, and the ceiling sets pieces of that size.
            ceilings[kind] = gloo if kind == "p2p" else RedisCeiling(sender, url, LAYOUT.block_num_bytes)
        points = [(kind, checksum, tokens) for tokens in args.tokens for kind in args.connectors
                  for checksum in checksums_of(kind, args) if kind != "lmcache"]
        with tqdm(total=len(points) * (args.repeats + 1), desc="kv transfers", unit="pair", file=sys.stderr) as bar:
            for kind, checksum, tokens in points:
                num_blocks = -(-tokens // LAYOUT.block_size)
                connector_seconds, ceiling_seconds = [], []
                for repeat in range(args.repeats + 1):
                    connector, ceiling = probes[kind, checksum].once(num_blocks), ceilings[kind].once(num_blocks)
                    if repeat:  # the first warms buffers and connections
                        connector_seconds.append(connector)
                        ceiling_seconds.append(ceiling)
                    bar.update()
                megabytes = num_blocks * LAYOUT.block_num_bytes / 1e6
                connector, ceiling = statistics.median(connector_seconds), statistics.median(ceiling_seconds)
                rows.append({"connector": kind, "checksum": checksum, "tokens": tokens, "megabytes": round(megabytes, 1),
                             "connector_ms": connector * 1e3, "ceiling_ms": ceiling * 1e3,
                             "connector_mb_per_s": megabytes / connector, "ceiling_mb_per_s": megabytes / ceiling,
                             "ratio": ceiling / connector})
    finally:
        for probe in probes.values():
            probe.close()
        sender.close()
        if launcher.redis is not None:
            launcher.redis.stop(5)
    print(f"checksum xxh3: {CHECKSUM_NAME} of every payload, by the sender and the receiver; medians of {args.repeats}; "
          f"torch threads {args.torch_threads}; caches on {args.device}"
          + (f" ({torch.cuda.get_device_name()}, both processes on it)" if args.device == "cuda" else ""))
    print(f"{'connector':<16} {'checksum':<8} {'tokens':>6} {'MB':>6} {'connector MB/s':>15} {'ceiling MB/s':>13} "
          f"{'ratio':>6}  target >= {TARGET}")
    for row in rows:
        verdict = "ok" if row["ratio"] >= TARGET else "MISS"
        print(f"{row['connector']:<16} {row['checksum']:<8} {row['tokens']:>6} {row['megabytes']:>6.1f} "
              f"{row['connector_mb_per_s']:>15,.0f} "
              f"{row['ceiling_mb_per_s']:>13,.0f} {row['ratio']:>6.2f}  {verdict}")
    if "lmcache" in args.connectors:
        print_stages(rows)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "checksum": CHECKSUM_NAME, "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
