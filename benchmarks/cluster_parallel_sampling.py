"""Parallel sampling through a disaggregated cluster: a request for ``n`` completions (the router's
``SamplingParams.n``: one prefill, one KV transfer, the decode worker forking the prompt's KV for each completion)
against the same completions asked as n separate requests (what the gateway sent before the router took ``n``:
each prefilled and its KV sent, the prefill worker's prefix cache sharing whole blocks), in the same run, on the
same cluster.

Workload: ``--num-prompts`` prompts of ``--prompt-len`` random token ids (seeded, fresh ids every run, so no
run finds another's prompt in a prefix cache), each sampled ``--n`` times at temperature 0.8 for exactly
``--max-tokens`` tokens (``ignore_eos``), every prompt's request(s) sent at once; completion i of a prompt is
seeded seed + i in both forms (``tests/e2e/test_cluster.py`` checks that both draw the same tokens). Each form
runs its own prompts (a first token of its own before the same random ids), so that neither finds the other's
blocks in a worker's prefix cache. The cluster: a router, one prefill and one decode worker (``--kv-transfer``, p2p by default; one torch
thread each), started here and stopped at the end. The forms take turns, the first alternating, ``--repeats``
times; the medians are reported.

Reported per form: seconds for the workload (medians), output tokens a second, KV transfers and megabytes the
decode worker received (from its counters), and the ratio separate / n (above 1: n is faster).

Usage::

    python benchmarks/cluster_parallel_sampling.py
    python benchmarks/cluster_parallel_sampling.py --n 4 --prompt-len 1000 --repeats 5 --json /tmp/n.json

Progress goes to stderr, the results table to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm import tqdm  # noqa: E402

from splitserve.client import Client  # noqa: E402
from splitserve.common.sampling_params import SamplingParams  # noqa: E402
from splitserve.launcher import LocalCluster  # noqa: E402
from splitserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

TEMPERATURE = 0.8
FIRST_SEED = 1000
TOKEN_RANGE = (1000, 20000)  # ordinary vocabulary, clear of the special tokens at the start
FORMS = ("n", "separate")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face Llama-family directory (default: SmolLM2-135M)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts sampled (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=500, help="tokens a prompt (default: %(default)s)")
    parser.add_argument("--n", type=int, default=8, help="completions a prompt, 2 to 64 (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens a completion, exactly (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each form (default: %(default)s)")
    parser.add_argument("--kv-transfer", default="p2p", choices=("p2p", "redis"),
                        help="the cluster's KV connector (default: %(default)s)")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0,
                        help="KV cache of each worker in GB (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the timings and KV received to FILE as JSON")
    return parser


def decode_counters(cluster: LocalCluster):
    """The decode worker's counters (KV transfers and bytes received)."""
    import grpc

    worker = next(process for process in cluster.workers if process.name.startswith("decode"))
    with grpc.insecure_channel(worker.address) as channel:
        status = worker_pb2_grpc.DecodeWorkerStub(channel).GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=30)
    return status.counters


def completions_of(client: Client, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """Every completion of one streamed request, in index order."""
    completions: dict[int, list[int]] = {}
    for chunk in client.generate_stream(prompt, params, timeout=600):
        completions.setdefault(chunk.index, []).extend(chunk.token_ids)
    return [completions[index] for index in sorted(completions)]


def run_form(client: Client, form: str, prompts: list[list[int]], args) -> tuple[float, list[list[list[int]]]]:
    """One run of the workload in ``form``: its seconds and each call's completions (checked complete)."""
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=args.max_tokens, ignore_eos=True)
    calls = []  # (prompt, params)
    for number, prompt in enumerate(prompts):
        seed = FIRST_SEED + number * args.n
        if form == "n":
            calls.append((prompt, dataclasses.replace(params, n=args.n, seed=seed)))
        else:
            calls += [(prompt, dataclasses.replace(params, seed=seed + index)) for index in range(args.n)]
    start = time.perf_counter()
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda call: completions_of(client, *call), calls))
    seconds = time.perf_counter() - start
    num_tokens = sum(len(tokens) for completions in results for tokens in completions)
    expected = len(prompts) * args.n * args.max_tokens
    if num_tokens != expected:
        raise RuntimeError(f"the {form} run generated {num_tokens} tokens, not {expected}")
    return seconds, results


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 2 <= args.n <= 64:
        raise SystemExit("--n must be 2 to 64 (a router request's n)")
    model = ["--model", args.model] if args.model else []
    common = [*model, "--kv-cache-gb", str(args.kv_cache_gb), "--max-model-len", "4096", "--threads", "1"]
    cluster = LocalCluster(kv_transfer=args.kv_transfer, worker_args=common,
                           router_args=[*model, "--max-model-len", "4096"])
    print("starting a cluster (router, prefill, decode) ...", file=sys.stderr)
    timings: dict[str, list[float]] = {form: [] for form in FORMS}
    received: dict[str, list[tuple[int, int]]] = {form: [] for form in FORMS}
    try:
        cluster.start_router()
        cluster.start_workers("prefill", 1)
        cluster.start_workers("decode", 1)
        with Client(cluster.router.address) as client:
            warm = [random.Random(-1).randrange(*TOKEN_RANGE) for _ in range(args.prompt_len)]
            for form in FORMS:  # a warm-up of each form (first compiles, thread pools)
                run_form(client, form, [warm], args)
            progress = tqdm(total=args.repeats * len(FORMS), desc="runs", unit="run", file=sys.stderr)
            for repeat in range(args.repeats):
                rng = random.Random(repeat)
                prompts = [[rng.randrange(*TOKEN_RANGE) for _ in range(args.prompt_len)]
                           for _ in range(args.num_prompts)]
                for form in FORMS if repeat % 2 == 0 else tuple(reversed(FORMS)):
                    # Its own first token (outside the ids drawn), so that no prompt meets a cached block.
                    marked = [[TOKEN_RANGE[1] + FORMS.index(form) + 2 * repeat] + prompt for prompt in prompts]
                    before = decode_counters(cluster)
                    seconds, _ = run_form(client, form, marked, args)
                    after = decode_counters(cluster)
                    timings[form].append(seconds)
                    received[form].append((after.num_kv_transfers_received - before.num_kv_transfers_received,
                                           after.num_kv_bytes - before.num_kv_bytes))
                    progress.update(1)
            progress.close()
    finally:
        cluster.stop()
    num_tokens = args.num_prompts * args.n * args.max_tokens
    medians = {form: statistics.median(timings[form]) for form in FORMS}
    print(f"\n{args.num_prompts} prompts x {args.prompt_len} tokens, n={args.n}, {args.max_tokens} tokens each, "
          f"KV over {args.kv_transfer}, medians of {args.repeats}")
    print(f"{'form':<10} {'seconds':>8} {'tok/s':>8} {'transfers':>10} {'KV MB':>8}")
    for form in FORMS:
        transfers, num_bytes = received[form][-1]
        print(f"{form:<10} {medians[form]:8.2f} {num_tokens / medians[form]:8.1f} {transfers:10d} "
              f"{num_bytes / 1e6:8.1f}")
    print(f"separate / n: {medians['separate'] / medians['n']:.2f}x")
    if args.json:
        with open(args.json, "w") as sink:
            json.dump({"args": vars(args), "seconds": timings, "received": received}, sink, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
