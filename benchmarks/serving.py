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

Goodput, as DistServe defines it: requests per second that meet both latency
objectives, a TTFT of at most ``--slo-ttft`` seconds and a mean inter-token
latency (DistServe's time per output token: the request's ITLs averaged) of at
most ``--slo-itl`` seconds, over the run's span (first request sent to last
token). ``--rates`` sweeps the arrival rate, each setup and workload run fresh
at each rate, to find where disaggregation's goodput passes colocated's and
where it does not.

Prints TTFT / ITL / E2E at p50, p90, p99, output throughput, SLO attainment and
goodput for each (rate, setup, workload), the ratio disaggregated / colocated
of each, and writes PNGs: the latency distributions (``--plot``, the first
rate) and goodput against the rate (``--goodput-plot``).

Usage::

    python benchmarks/serving.py                       # defaults: 0.4 req/s, 32 requests per run
    python benchmarks/serving.py --rate 0.8 --num-requests 64 --plot serving.png --json serving.json
    python benchmarks/serving.py --rates 0.2,0.5,1 --workloads long-mix --goodput-plot goodput.png
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
    rate: float = 0.0
    num_requests: int = 0
    num_within_slo: int = 0
    goodput: float = 0.0  # requests/s meeting both objectives
    signals: dict = field(default_factory=dict)  # the autoscaling signals during the run (PoolSignals.summary)

    def summary(self) -> dict:
        return {
            "setup": self.setup, "workload": self.workload, "rate": self.rate,
            "num_requests": self.num_requests, "num_within_slo": self.num_within_slo, "goodput": self.goodput,
            "signals": self.signals,
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


def meets_slo(record: RequestRecord, slo_ttft: float, slo_itl: float) -> bool:
    """DistServe's test: the request finished, its TTFT is within ``slo_ttft`` and its mean inter-token
    latency (time per output token after the first) within ``slo_itl``."""
    if record.finished is None or record.first_token is None:
        return False
    mean_itl = sum(record.itls) / len(record.itls) if record.itls else 0.0
    return record.first_token - record.sent <= slo_ttft and mean_itl <= slo_itl


def summarize(setup: str, workload: str, records: list[RequestRecord], rate: float = 0.0,
              slo_ttft: float = float("inf"), slo_itl: float = float("inf")) -> RunResult:
    done = [r for r in records if r.finished is not None and r.first_token is not None]
    span = max(r.finished for r in done) - min(r.sent for r in records) if done else float("nan")
    within = sum(meets_slo(r, slo_ttft, slo_itl) for r in records)
    return RunResult(
        setup=setup, workload=workload,
        ttft=[r.first_token - r.sent for r in done],
        itl=[gap for r in done for gap in r.itls],
        e2e=[r.finished - r.sent for r in done],
        output_tokens_per_second=sum(r.num_tokens for r in done) / span if done else 0.0,
        num_errors=len(records) - len(done),
        rate=rate, num_requests=len(records), num_within_slo=within, goodput=within / span if done else 0.0,
    )


def start_setup(setup: str, args) -> LocalCluster:
    common = ["--kv-cache-gb", str(args.kv_cache_gb), "--max-model-len", "4096", "--metrics-port", "0"]
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


# The autoscaling signals of deploy/ (per worker, as the HPAs average them), sampled during each run.
SIGNALS = ("splitserve_worker_queued_prompt_tokens", "splitserve_worker_kv_block_usage_ratio",
           "splitserve_worker_requests_waiting")


class PoolSignals:
    """Samples every worker's autoscaling signals from its metrics endpoint twice a second while a run lasts,
    so the goodput figures come with the signal values they were reached at (deploy/README.md's targets)."""

    def __init__(self, cluster: LocalCluster) -> None:
        import re

        self._urls = {}
        for process in cluster.workers:
            found = re.search(r"Prometheus metrics on (\S+/metrics)", process.log())
            if found:
                self._urls[process.name.rstrip("0123456789")] = found.group(1)
        self._samples: dict[tuple[str, str], list[float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> PoolSignals:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        while not self._stop.wait(0.5):
            for role, url in self._urls.items():
                try:
                    with urllib.request.urlopen(url, timeout=2) as response:
                        text = response.read().decode()
                except OSError:
                    continue
                for family in text_string_to_metric_families(text):
                    if family.name in SIGNALS:
                        for sample in family.samples:
                            self._samples.setdefault((role, family.name), []).append(sample.value)

    def summary(self) -> dict:
        """{role: {signal: {"mean", "p90", "max"}}} over the run's samples."""
        result: dict = {}
        for (role, name), values in sorted(self._samples.items()):
            short = name.removeprefix("splitserve_worker_")
            result.setdefault(role, {})[short] = {"mean": sum(values) / len(values), "p90": percentile(values, 90),
                                                  "max": max(values)}
        return result


def warm_up(address: str) -> None:
    """Requests of the workloads' lengths, several at once, before any is timed: the first use of each KV block
    (the kernel zero-fills the cache's pages on first touch) and of each step shape is paid here."""
    with Client(address) as client:
        for lengths in ((16,), (600,), (2000, 1500, 512, 256)):
            calls = [client.generate_stream(list(range(1000 + i, 1000 + i + length)),
                                            SamplingParams(max_tokens=8, temperature=0)) for i, length in enumerate(lengths)]
            for call in calls:
                list(call)


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
    parser.add_argument("--rates", metavar="R1,R2,...",
                        help="sweep these arrival rates instead of --rate: every setup and workload at each")
    parser.add_argument("--slo-ttft", type=float, default=5.0, metavar="SECONDS",
                        help="goodput's time-to-first-token objective (default: %(default)s)")
    parser.add_argument("--slo-itl", type=float, default=0.15, metavar="SECONDS",
                        help="goodput's objective on a request's mean inter-token latency (default: %(default)s)")
    parser.add_argument("--goodput-plot", metavar="PNG", help="write goodput against the arrival rate here")
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
    if args.plot or args.goodput_plot:
        try:
            import matplotlib  # noqa: F401  (checked before a run of many minutes, not after it)
        except ImportError:
            parser.error("--plot needs matplotlib: pip install -e '.[bench]'")

    from transformers import AutoConfig

    from splitserve.engine.model_store import resolve_model

    vocab_size = AutoConfig.from_pretrained(str(resolve_model(None))).vocab_size
    rates = [float(rate) for rate in args.rates.split(",")] if args.rates else [args.rate]
    results: list[RunResult] = []
    for setup in args.setups.split(","):
        print(f"[bench] starting the {setup} cluster...", file=sys.stderr, flush=True)
        cluster = start_setup(setup, args)
        try:
            warm_up(cluster.router.address)
            for rate in rates:
                args.rate = rate
                for workload in args.workloads.split(","):
                    # Fresh prompts at each rate: a prompt seen before would be served from the prefix cache.
                    fresh = argparse.Namespace(**{**vars(args), "seed": args.seed + 1000 * rates.index(rate)})
                    prompts = make_workload(workload, fresh, vocab_size)
                    with PoolSignals(cluster) as signals:
                        records = run_load(cluster.router.address, prompts, args, f"{setup}/{workload}@{rate:g}/s")
                    result = summarize(setup, workload, records, rate, args.slo_ttft, args.slo_itl)
                    result.signals = signals.summary()
                    results.append(result)
        finally:
            cluster.stop()
        cluster.remove_log_dir()  # reached after a clean run only: a failed one keeps its logs
    print_table(results)
    print_goodput(results, args.slo_ttft, args.slo_itl)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": [r.summary() for r in results]}, handle, indent=2)
    if args.plot:
        plot([r for r in results if r.rate == rates[0]], args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    if args.goodput_plot:
        plot_goodput(results, args.goodput_plot, args.slo_ttft, args.slo_itl)
        print(f"goodput plot: {args.goodput_plot}", file=sys.stderr)
    return 0


def print_goodput(results: list[RunResult], slo_ttft: float, slo_itl: float) -> None:
    """Goodput per (workload, rate) for each setup, and disaggregated / colocated, with the verdict."""
    print(f"\ngoodput (requests/s within TTFT <= {slo_ttft:g} s and mean ITL <= {slo_itl * 1e3:g} ms):")
    by_key = {(r.workload, r.rate, r.setup): r for r in results}
    for workload, rate in sorted({(r.workload, r.rate) for r in results}):
        cells = []
        for setup in ("disaggregated", "colocated"):
            run = by_key.get((workload, rate, setup))
            if run is not None:
                cells.append(f"{setup} {run.goodput:.3f}/s ({run.num_within_slo}/{run.num_requests} within)")
        line = f"  {workload:<9} at {rate:g} req/s: " + ", ".join(cells)
        disaggregated, colocated = by_key.get((workload, rate, "disaggregated")), by_key.get((workload, rate, "colocated"))
        if disaggregated and colocated:
            if colocated.goodput > 0:
                ratio = disaggregated.goodput / colocated.goodput
                verdict = "disaggregation wins" if ratio > 1.05 else "colocated wins" if ratio < 0.95 else "even"
                line += f"; disaggregated / colocated {ratio:.2f}x: {verdict}"
            elif disaggregated.goodput > 0:
                line += "; only disaggregated meets the objectives"
        print(line)
        for setup in ("disaggregated", "colocated"):
            run = by_key.get((workload, rate, setup))
            if run is not None and run.signals:
                print(f"      {setup} signals per worker (mean/p90): " + "; ".join(
                    f"{role} {name} {v['mean']:.2f}/{v['p90']:.2f}" for role, values in run.signals.items()
                    for name, v in values.items()))


def plot_goodput(results: list[RunResult], path: str, slo_ttft: float, slo_itl: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r.workload for r in results}, key=lambda w: w != "short")
    figure, axes = plt.subplots(1, len(workloads), figsize=(5.5 * len(workloads), 4), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        for setup in sorted({r.setup for r in results}):
            runs = sorted((r for r in results if r.workload == workload and r.setup == setup), key=lambda r: r.rate)
            axis.plot([r.rate for r in runs], [r.goodput for r in runs], marker="o", label=setup)
        rates = sorted({r.rate for r in results})
        axis.plot(rates, rates, linestyle=":", color="gray", label="offered rate")
        axis.set_xlabel("arrival rate (requests/s)")
        axis.set_ylabel("goodput (requests/s within both objectives)")
        axis.set_title(f"{workload}: TTFT <= {slo_ttft:g} s, mean ITL <= {slo_itl * 1e3:g} ms")
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


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
