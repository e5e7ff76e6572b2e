"""KV transfer throughput through each connector, beside its raw ceiling, in the same run.

For prompts of ``--tokens`` (default 512, 1024, 2048, 4096) of the default
model's KV shape (30 layers, 3 KV heads, head size 64, float32, block 16:
46,080 bytes a token), a sender process hands one payload per transfer to a
connector and this process receives it. Measured from the start of ``send``
(sender side) to the return of the receiver's ``on_payload`` (CLOCK_MONOTONIC
is shared by both processes), so it includes gathering, the checksum on both
sides, the wire and verification. Beside each connector, the raw ceiling on
the same bytes between the same two processes:

* ``p2p``  vs a bare Gloo ``send``/``recv`` of the same tensor on a two-rank group;
* ``redis`` vs redis-py ``SET`` of the same pieces (one per layer, pipelined) then ``GET`` of them.

Connector and ceiling transfers alternate (so the machine's drifts hit both
alike); medians over ``--repeats``; the target is each connector at >= 80% of its
ceiling. A private redis-server on a free port is started and stopped here.

Usage::

    python benchmarks/kv_transfer.py
    python benchmarks/kv_transfer.py --tokens 1024 4096 --repeats 7 --json kv.json
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

import torch
import torch.distributed as dist
from tqdm import tqdm

from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.base import KVLayout
from splitserve.launcher import LocalCluster

LAYOUT = KVLayout(num_layers=30, num_kv_heads=3, head_size=64, dtype=torch.float32, block_size=16)
TARGET = 0.8

SENDER = r"""
import json, sys, time
from datetime import timedelta
import redis, torch, torch.distributed as dist
from splitserve.kvtransfer import create_connector
from splitserve.kvtransfer.base import BlockSource, KVEndpointInfo, KVLayout, TransferHeader, payload_bytes
layout = KVLayout(30, 3, 64, torch.float32, 16)
connectors = {}
cache = torch.randn(30, 2, 3, 260, 16, 64)
raw_group = None
for line in sys.stdin:
    command = json.loads(line)
    kind, num_blocks = command["kind"], command["num_blocks"]
    if kind == "raw_gloo_setup":
        host, port = command["address"].rsplit(":", 1)
        store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=30))
        raw_group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, timedelta(seconds=60))
        print(json.dumps({"ok": True}), flush=True); continue
    blocks = list(range(num_blocks))
    started = time.monotonic()
    if kind == "raw_gloo":
        tensor = cache[:, :, :, :num_blocks].contiguous()
        started = time.monotonic()
        raw_group.send([tensor], 1, 0).wait()
    elif kind == "raw_redis_set":
        data = payload_bytes(cache[:, :, :, :num_blocks].contiguous())
        client = redis.Redis.from_url(command["address"])
        piece = len(data) // 30  # one piece per layer, as the connector writes them
        started = time.monotonic()
        pipe = client.pipeline(transaction=False)
        for index, offset in enumerate(range(0, len(data), piece)):
            pipe.set(f"raw:{index}", data[offset:offset + piece], px=60000)
        pipe.execute()
    else:
        connector = connectors.setdefault(kind, create_connector(kind, "bench-sender", "bench", layout,
                                          **({"url": command["address"]} if kind == "redis" else {})))
        payload = BlockSource(cache, blocks)  # as the prefill worker sends: the connector gathers and checksums
        header = TransferHeader(command["transfer_id"], "bench", layout, 0, num_blocks * 16, num_blocks * 16,
                                payload.num_bytes, None, True, 1)
        destination = KVEndpointInfo(kind, command["address"], "bench-receiver", command.get("options", {}))
        connector.send(destination, header, payload)
    print(json.dumps({"started": started, "ended": time.monotonic()}), flush=True)
"""


class Sender:
    """The sending process, driven by JSON lines."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        text=True)

    def ask(self, **command) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("The sender process died.")
        return json.loads(line)

    def ask_async(self, **command):
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(self.ask(**command)))
        thread.start()
        return thread, result

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)


class ConnectorProbe:
    """A receiving connector in this process; ``once`` times one transfer from the sender process through it,
    from the sender's ``send`` start to the end of the receiver's callback."""

    def __init__(self, kind: str, sender: Sender, options: dict) -> None:
        self.kind, self.sender = kind, sender
        self.receiver = create_connector(kind, "bench-receiver", "bench", LAYOUT, **options)
        self.done = threading.Event()
        self.finished = 0.0
        self.count = 0
        self.receiver.start_receiving(self._on_payload, lambda transfer_id, error: print("error:", error, file=sys.stderr))
        self.endpoint = self.receiver.endpoint()

    def _on_payload(self, received) -> None:
        self.finished = time.monotonic()
        self.done.set()

    def once(self, num_blocks: int) -> float:
        self.done.clear()
        self.count += 1
        reply = self.sender.ask(kind=self.kind, num_blocks=num_blocks, transfer_id=f"t{self.count}",
                                address=self.endpoint.address, options=self.endpoint.options)
        if not self.done.wait(60):
            raise RuntimeError(f"{self.kind}: the payload did not arrive")
        return self.finished - reply["started"]

    def close(self) -> None:
        self.receiver.close()


def raw_gloo_once(sender: Sender, num_blocks: int, group) -> float:
    """One bare Gloo send/recv of the same bytes between the same processes."""
    tensor = torch.empty(LAYOUT.payload_shape(num_blocks))
    thread, reply = sender.ask_async(kind="raw_gloo", num_blocks=num_blocks)
    group.recv([tensor], 0, 0).wait()
    received = time.monotonic()
    thread.join()
    return received - reply["started"]


def raw_redis_once(sender: Sender, num_blocks: int, client) -> float:
    """redis-py SET of the same pieces (sender process, pipelined) plus GET of them here."""
    num_pieces = LAYOUT.num_layers
    reply = sender.ask(kind="raw_redis_set", num_blocks=num_blocks, address=client.url)
    pipe = client.pipeline(transaction=False)
    for index in range(num_pieces):
        pipe.get(f"raw:{index}")
    started = time.monotonic()
    pieces = pipe.execute()  # the bytes as redis-py returns them: no joining, no checksum
    got = time.monotonic() - started
    assert sum(len(piece) for piece in pieces) == num_blocks * LAYOUT.block_num_bytes
    client.delete(*[f"raw:{index}" for index in range(num_pieces)])
    return reply["ended"] - reply["started"] + got


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                        help="prompt lengths (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5, help="timed transfers per point (default: %(default)s)")
    parser.add_argument("--connectors", nargs="+", default=["p2p", "redis"], choices=["p2p", "redis"],
                        help="(default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="write the results here")
    args = parser.parse_args(argv)

    launcher = LocalCluster(log_dir=tempfile.mkdtemp(prefix="kv-bench-"))
    url = launcher.start_redis() if "redis" in args.connectors else None
    sender = Sender()
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    setup = threading.Thread(target=sender.ask, kwargs=dict(kind="raw_gloo_setup", num_blocks=0,
                                                            address=f"127.0.0.1:{store.port}"))
    setup.start()
    group = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 1, 2, timedelta(seconds=60))
    setup.join()
    rows = []
    points = [(kind, tokens) for tokens in args.tokens for kind in args.connectors]
    probes = {}
    redis_client = None
    if url is not None:
        import redis

        redis_client = redis.Redis.from_url(url)
        redis_client.url = url
    try:
        for kind in args.connectors:
            probes[kind] = ConnectorProbe(kind, sender, {"url": url} if kind == "redis" else {})
        for kind, tokens in tqdm(points, desc="kv transfer", unit="point", file=sys.stderr):
            num_blocks = -(-tokens // LAYOUT.block_size)
            megabytes = num_blocks * LAYOUT.block_num_bytes / 1e6
            ceiling_once = ((lambda: raw_gloo_once(sender, num_blocks, group)) if kind == "p2p"
                            else (lambda: raw_redis_once(sender, num_blocks, redis_client)))
            connector_seconds, ceiling_seconds = [], []
            for repeat in range(args.repeats + 1):  # interleaved, so drifts of the machine hit both alike
                connector = probes[kind].once(num_blocks)
                ceiling = ceiling_once()
                if repeat:  # the first warms buffers and connections
                    connector_seconds.append(connector)
                    ceiling_seconds.append(ceiling)
            connector, ceiling = statistics.median(connector_seconds), statistics.median(ceiling_seconds)
            rows.append({"connector": kind, "tokens": tokens, "megabytes": round(megabytes, 1),
                         "connector_mb_per_s": megabytes / connector, "ceiling_mb_per_s": megabytes / ceiling,
                         "ratio": ceiling / connector})
    finally:
        for probe in probes.values():
            probe.close()
        sender.close()
        if redis_client is not None:
            redis_client.close()
        if launcher.redis is not None:
            launcher.redis.stop(5)
    print(f"{'connector':<9} {'tokens':>6} {'MB':>7} {'connector MB/s':>15} {'ceiling MB/s':>13} {'ratio':>6}  target >= {TARGET}")
    for row in rows:
        verdict = "ok" if row["ratio"] >= TARGET else "MISS"
        print(f"{row['connector']:<9} {row['tokens']:>6} {row['megabytes']:>7.1f} {row['connector_mb_per_s']:>15.0f} "
              f"{row['ceiling_mb_per_s']:>13.0f} {row['ratio']:>6.2f}  {verdict}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "rows": rows}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
