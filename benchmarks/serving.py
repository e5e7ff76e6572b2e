"""Online serving benchmark: disaggregated prefill/decode against colocated, same workload, same run.

A load generator sends requests with Poisson arrivals at ``--rate`` requests/s
to a local cluster started here (real processes, real gRPC, KV over
``--kv-transfer``) and records, per request, the time to first token (TTFT),
every inter-token latency (ITL: the gap between streamed chunks, spread over
the tokens of the chunk) and the end-to-end latency (E2E). Two workloads:

* ``short``: prompts of 64-512 random token ids, ``--output-len`` tokens each.
* ``long-mix``: the same, with ``--long-fraction`` of the prompts 1,000-2,000
  tokens long. Long prefills are where disaggregation pays: on a colocated
  worker they run in the same steps as the running decodes and stall them.

Setups, each started fresh:

* ``disaggregated``: router + 1 prefill worker + 1 decode worker, one torch
  thread each (the two cores split between the pools).
* ``colocated``: router + 1 colocated worker with two torch threads.

Prints TTFT / ITL / E2E at p50, p90, p99 and output throughput for each
(setup, workload), the ratio disaggregated / colocated of each, and writes a
PNG comparing the latency distributions (``--plot``).

Usage::

    python benchmarks/serving.py                       # defaults: 0.4 req/s, 32 requests per run
    python benchmarks/serving.py --rate 0.8 --num-requests 64 --plot serving.png --json serving.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from splitserve.launcher import LocalCluster

SPECIAL_ID_MARGIN = 100


@dataclass
class RequestRecord:
    prompt_len: int
    sent: float = 0.0
    first_token: float | None = None
    finished: float | None = None
    num_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class RunResult:
    setup: str
    workload: str
    ttft: list[float]
    itl: list[float]
    e2e: list[float]
    output_tokens_per_second: float
    num_errors: int

    def summary(self) -> dict:
        return {
            "setup": self.setup, "workload": self.workload,
            **{f"ttft_p{p}": percentile(self.ttft, p) for p in (50, 90, 99)},
            **{f"itl_p{p}": percentile(self.itl, p) for p in (50, 90, 99)},
            **{f"e2e_p{p}": percentile(self.e2e, p) for p in (50, 90, 99)},
            "output_tokens_per_second": self.output_tokens_per_second, "num_errors": self.num_errors,
        }


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[index]


def make_workload(name: str, args, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prompts = []
    for _ in range(args.num_requests):
        if name == "long-mix" and rng.random() < args.long_fraction:
            length = rng.randint(1000, 2000)
        else:
            length = rng.randint(64, 512)
        prompts.append([rng.randrange(SPECIAL_ID_MARGIN, vocab_size - SPECIAL_ID_MARGIN) for _ in range(length)])
    return prompts


def run_load(address: str, prompts: list[list[int]], args, label: str) -> list[RequestRecord]:
    """Send ``prompts`` with Poisson arrivals; one thread per request in flight."""
    rng = random.Random(args.seed + 1)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    records = [RequestRecord(len(prompt)) for prompt in prompts]
    progress = tqdm(total=len(prompts), desc=label, unit="req", file=sys.stderr)
    client = Client(address)

    def one(index: int) -> None:
        record = records[index]
        record.sent = time.perf_counter()
        last = record.sent
        try:
            for chunk in client.generate_stream(prompts[index], params, timeout=args.request_timeout):
                now = time.perf_counter()
                if chunk.token_ids:
                    if record.first_token is None:
                        record.first_token = now
                    else:
                        record.itls.extend([(now - last) / len(chunk.token_ids)] * len(chunk.token_ids))
                    last = now
                    record.num_tokens += len(chunk.token_ids)
            record.finished = time.perf_counter()
        except Exception as error:  # noqa: BLE001 - recorded and counted
            record.error = str(error)
        progress.update()

    threads = []
    for index in range(len(prompts)):
        thread = threading.Thread(target=one, args=(index,), daemon=True)
        thread.start()
        threads.append(thread)
        time.sleep(rng.expovariate(args.rate))
    for thread in threads:
        thread.join()
    progress.close()
    client.close()
    return records


def summarize(setup: str, workload: str, records: list[RequestRecord]) -> RunResult:
    done = [r for r in records if r.finished is not None and r.first_token is not None]
    span = max(r.finished for r in done) - min(r.sent for r in done) if done else float("nan")
    return RunResult(
        setup=setup, workload=workload,
        ttft=[r.first_token - r.sent for r in done],
        itl=[gap for r in done for gap in r.itls],
        e2e=[r.finished - r.sent for r in done],
        output_tokens_per_second=sum(r.num_tokens for r in done) / span if done else 0.0,
        num_errors=len(records) - len(done),
    )


def start_setup(setup: str, args) -> LocalCluster:
    common = ["--kv-cache-gb", str(args.kv_cache_gb), "--max-model-len", "4096"]
    threads = ["--threads", "1"] if setup == "disaggregated" else ["--threads", "2"]
    cluster = LocalCluster(kv_transfer=args.kv_transfer, worker_args=[*common, *threads],
                           router_args=["--max-model-len", "4096"])
    cluster.start_router()
    if setup == "disaggregated":
        cluster.start_workers("prefill", 1)
        cluster.start_workers("decode", 1)
    else:
        cluster.start_workers("both", 1)
    return cluster


def warm_up(address: str) -> None:
    with Client(address) as client:
        for length in (16, 600):
            list(client.generate_stream(list(range(1000, 1000 + length)), SamplingParams(max_tokens=4, temperature=0)))


def plot(results: list[RunResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    workloads = sorted({r.workload for r in results}, key=lambda w: w != "short")
    figure, axes = plt.subplots(len(workloads), 2, figsize=(11, 4 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        for column, (metric, title) in enumerate((("itl", "inter-token latency"), ("ttft", "time to first token"))):
            axis = axes[row][column]
            for result in (r for r in results if r.workload == workload):
                values = sorted(getattr(result, metric))
                if values:
                    fractions = [(i + 1) / len(values) for i in range(len(values))]
                    axis.plot([v * 1000 for v in values], fractions, label=result.setup)
            axis.set_xscale("log")
            # Labels at 1, 2 and 5 of each decade, as plain numbers; no crowded minor labels.
            axis.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
            axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            axis.set_xlabel(f"{title} (ms, log scale)")
            axis.set_ylabel("fraction of samples")
            axis.set_title(f"{workload}: {title} (CDF)")
            axis.grid(True, alpha=0.3)
            axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=0.4, help="mean arrivals per second (default: %(default)s)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests per run (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=48, help="output tokens per request (default: %(default)s)")
    parser.add_argument("--long-fraction", type=float, default=0.25,
                        help="share of 1,000-2,000-token prompts in long-mix (default: %(default)s)")
    parser.add_argument("--workloads", default="short,long-mix", help="comma-separated (default: %(default)s)")
    parser.add_argument("--setups", default="disaggregated,colocated", help="comma-separated (default: %(default)s)")
    parser.add_argument("--kv-transfer", choices=("p2p", "redis"), default="p2p", help="(default: %(default)s)")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache per worker (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds (default: %(default)s)")
    parser.add_argument("--plot", metavar="PNG", help="write the latency CDFs here")
    parser.add_argument("--json", metavar="FILE", help="write the summaries here")
    args = parser.parse_args(argv)
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before a run of many minutes, not after it)
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e '.[bench]'")

    from transformers import AutoConfig

    from splitserve.engine.model_store import resolve_model

    vocab_size = AutoConfig.from_pretrained(str(resolve_model(None))).vocab_size
    results: list[RunResult] = []
    for setup in args.setups.split(","):
        print(f"[bench] starting the {setup} cluster...", file=sys.stderr, flush=True)
        cluster = start_setup(setup, args)
        try:
            warm_up(cluster.router.address)
            for workload in args.workloads.split(","):
                prompts = make_workload(workload, args, vocab_size)
                records = run_load(cluster.router.address, prompts, args, f"{setup}/{workload}")
                results.append(summarize(setup, workload, records))
        finally:
            cluster.stop()
    print_table(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": [r.summary() for r in results]}, handle, indent=2)
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0


def print_table(results: list[RunResult]) -> None:
    print(f"{'setup':<14} {'workload':<9} {'TTFT p50/p90/p99 (ms)':>24} {'ITL p50/p90/p99 (ms)':>22} "
          f"{'E2E p50/p99 (s)':>16} {'tok/s':>7} {'errors':>6}")
    for r in results:
        s = r.summary()
        print(f"{r.setup:<14} {r.workload:<9} "
              f"{s['ttft_p50']*1e3:>7.0f}/{s['ttft_p90']*1e3:>7.0f}/{s['ttft_p99']*1e3:>7.0f} "
              f"{s['itl_p50']*1e3:>6.0f}/{s['itl_p90']*1e3:>6.0f}/{s['itl_p99']*1e3:>7.0f} "
              f"{s['e2e_p50']:>7.1f}/{s['e2e_p99']:>7.1f} {r.output_tokens_per_second:>7.1f} {r.num_errors:>6}")
    by_key = {(r.setup, r.workload): r.summary() for r in results}
    for workload in sorted({r.workload for r in results}):
        disaggregated, colocated = by_key.get(("disaggregated", workload)), by_key.get(("colocated", workload))
        if disaggregated and colocated:
            print(f"{workload}: disaggregated / colocated  ITL p99 {disaggregated['itl_p99'] / colocated['itl_p99']:.2f}x  "
                  f"TTFT p99 {disaggregated['ttft_p99'] / colocated['ttft_p99']:.2f}x  "
                  f"throughput {disaggregated['output_tokens_per_second'] / colocated['output_tokens_per_second']:.2f}x")


if __name__ == "__main__":
    sys.exit(main())
