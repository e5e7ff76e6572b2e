"""Requests that fork a prompt's KV on the decode worker, through a disaggregated cluster, against what they replace,
in the same run on the same cluster.

Two workloads (``--workload``, both by default), each on ``--num-prompts`` prompts of ``--prompt-len`` random token
ids (seeded; fresh ids for every form and repeat, so that no run finds another's blocks in a prefix cache), every
prompt's calls sent at once:

* ``n``: each prompt sampled ``--n`` times at temperature 0.8 for exactly ``--max-tokens`` tokens (``ignore_eos``).
  Forms: ``n``, one request for n completions (the router's ``SamplingParams.n``: one prefill, one KV transfer,
  the decode worker forking the prompt's KV for each completion), against ``separate``, n requests (what the
  gateway sent before the router took ``n``: each prefilled, its KV sent and its blocks reserved on the decode
  worker). Completion i is seeded seed + i in both (``tests/e2e/test_cluster.py`` checks that both draw the same
  tokens).
* ``beams``: each prompt searched with ``--beam-width`` beams for exactly ``--max-tokens`` tokens (``ignore_eos``).
  Forms: ``worker``, one request (the router's ``beam_search``: the search stepped on the decode worker, each
  beam forking the KV of the one it grew from), against ``stepped``, the search stepped here through the router
  as the gateway stepped it before (and as vLLM's OpenAI server steps its own through its engine): one greedy
  one-token ``Generate`` call a beam a step, side by side, with the candidates' log probabilities, the beams'
  KV shared through the workers' prefix caches in whole blocks. Whether both forms find the same beams is
  reported (they should: the same search on the same weights, float32), from an untimed stepped search of the
  last worker run's prompts.

The cluster: a router, one prefill and one decode worker (``--kv-transfer``, p2p by default; one torch thread
each), started here and stopped at the end. The forms of a workload take turns, the first alternating,
``--repeats`` times, after a warm-up of each; the medians are reported.

Reported per form: seconds for the workload (medians), output tokens a second (the returned completions' or
beams'), the KV transfers and megabytes the decode worker received (its counters) and the calls made, and the
ratio of the two forms (above 1: the forking form is faster).

Usage::

    python benchmarks/cluster_forks.py
    python benchmarks/cluster_forks.py --workload beams --beam-width 4 --max-tokens 16 --repeats 5 --json /tmp/b.json

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
from splitserve.engine.beam_search import (  # noqa: E402
    BeamSearchParams,
    beam_candidates,
    beam_search_steps,
    generated_tokens,
)
from splitserve.launcher import LocalCluster  # noqa: E402
from splitserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

TEMPERATURE = 0.8
FIRST_SEED = 1000
TOKEN_RANGE = (1000, 20000)  # ordinary vocabulary, clear of the special tokens at the start
WORKLOADS = {"n": ("n", "separate"), "beams": ("worker", "stepped")}  # the forking form first


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face Llama-family directory (default: SmolLM2-135M)")
    parser.add_argument("--workload", choices=("n", "beams", "both"), default="both",
                        help="what to time (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=4, help="prompts of each workload (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=500, help="tokens a prompt (default: %(default)s)")
    parser.add_argument("--n", type=int, default=8, help="completions a prompt, 2 to 64 (default: %(default)s)")
    parser.add_argument("--beam-width", type=int, default=4, help="beams a prompt, 1 to 10 (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens a completion or beam, exactly (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each form (default: %(default)s)")
    parser.add_argument("--kv-transfer", default="p2p", choices=("p2p", "redis"),
                        help="the cluster's KV connector (default: %(default)s)")
    parser.add_argument("--kv-cache-gb", type=float, default=2.0,
                        help="KV cache of each worker in GB (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the timings, transfers and calls to FILE as JSON")
    return parser


def decode_counters(cluster: LocalCluster):
    """The decode worker's counters (KV transfers and bytes received)."""
    import grpc

    worker = next(process for process in cluster.workers if process.name.startswith("decode"))
    with grpc.insecure_channel(worker.address) as channel:
        status = worker_pb2_grpc.DecodeWorkerStub(channel).GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=30)
    return status.counters


def streamed(client: Client, prompt: list[int], params: SamplingParams | None,
             beam: BeamSearchParams | None = None) -> list[list[int]]:
    """Every completion of one streamed request (a beam search's beams), in index order."""
    completions: dict[int, list[int]] = {}
    for chunk in client.generate_stream(prompt, params, timeout=600, beam_search=beam):
        completions.setdefault(chunk.index, []).extend(chunk.token_ids)
    return [completions[index] for index in sorted(completions)]


def side_by_side(function, items: list) -> list:
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(function, items))


def run_n(client: Client, form: str, prompts: list[list[int]], args) -> tuple[list, int]:
    """The n workload in ``form``: each call's completions, and the calls made."""
    params = SamplingParams(temperature=TEMPERATURE, max_tokens=args.max_tokens, ignore_eos=True)
    calls = []
    for number, prompt in enumerate(prompts):
        seed = FIRST_SEED + number * args.n
        if form == "n":
            calls.append((prompt, dataclasses.replace(params, n=args.n, seed=seed)))
        else:
            calls += [(prompt, dataclasses.replace(params, seed=seed + index)) for index in range(args.n)]
    results = side_by_side(lambda call: streamed(client, *call), calls)
    return [tokens for completions in results for tokens in completions], len(calls)


def run_beams(client: Client, form: str, prompts: list[list[int]], args) -> tuple[list, int]:
    """The beams workload in ``form``: every prompt's beams' generated tokens, best first, and the calls made."""
    beam = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True)
    if form == "worker":
        results = side_by_side(lambda prompt: streamed(client, prompt, None, beam), prompts)
        return [tokens for beams in results for tokens in beams], len(prompts)
    eos = client.model_info().eos_token_ids
    step = SamplingParams(temperature=0.0, max_tokens=1, logprobs=beam_candidates(beam.beam_width, eos),
                          ignore_eos=True)

    def next_tokens(sequence: list[int]) -> dict[int, float]:
        position = client.generate(sequence, step, timeout=600).logprobs[0]
        return {entry.token_id: entry.logprob for entry in [position.sampled, *position.top]}

    steps, calls = beam_search_steps(prompts, beam, eos), 0
    try:
        sequences = next(steps)
        while True:
            calls += len(sequences)
            sequences = steps.send(side_by_side(next_tokens, sequences))
    except StopIteration as done:
        outputs = done.value
    return [generated_tokens(sequence, output.prompt_len, beam, eos) for output in outputs
            for sequence in output.sequences], calls


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 2 <= args.n <= 64:
        raise SystemExit("--n must be 2 to 64 (a router request's n)")
    if not 1 <= args.beam_width <= 10:
        raise SystemExit("--beam-width must be 1 to 10")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    workloads = list(WORKLOADS) if args.workload == "both" else [args.workload]
    runners = {"n": run_n, "beams": run_beams}
    model = ["--model", args.model] if args.model else []
    common = [*model, "--kv-cache-gb", str(args.kv_cache_gb), "--max-model-len", "4096", "--threads", "1"]
    cluster = LocalCluster(kv_transfer=args.kv_transfer, worker_args=common,
                           router_args=[*model, "--max-model-len", "4096"])
    print("starting a cluster (router, prefill, decode) ...", file=sys.stderr)
    report: dict = {"args": vars(args)}
    try:
        cluster.start_router()
        cluster.start_workers("prefill", 1)
        cluster.start_workers("decode", 1)
        with Client(cluster.router.address) as client:
            progress = tqdm(total=len(workloads) * 2 * (args.repeats + 1), desc="runs", unit="run", file=sys.stderr)
            for workload_number, workload in enumerate(workloads):
                forms, run = WORKLOADS[workload], runners[workload]
                seconds = {form: [] for form in forms}
                received = {form: [] for form in forms}
                calls, outputs = {}, {form: [] for form in forms}
                for repeat in range(-1, args.repeats):  # -1: the warm-up, not counted
                    rng = random.Random(repeat)
                    prompts = [[rng.randrange(*TOKEN_RANGE) for _ in range(args.prompt_len)]
                               for _ in range(args.num_prompts)]
                    marked = {}
                    for form in forms if repeat % 2 == 0 else tuple(reversed(forms)):
                        # Its own first token (outside the ids drawn): no prompt meets another run's blocks.
                        marker = TOKEN_RANGE[1] + 4 * (repeat + 1) + 2 * workload_number + forms.index(form)
                        marked[form] = [[marker] + prompt for prompt in prompts]
                        before = decode_counters(cluster)
                        start = time.perf_counter()
                        tokens, calls[form] = run(client, form, marked[form], args)
                        elapsed = time.perf_counter() - start
                        after = decode_counters(cluster)
                        if repeat >= 0:
                            seconds[form].append(elapsed)
                            received[form].append((after.num_kv_transfers_received - before.num_kv_transfers_received,
                                                   after.num_kv_bytes - before.num_kv_bytes))
                            outputs[form].append(tokens)
                        progress.update(1)
                report[workload] = {"seconds": seconds, "received": received, "calls": calls,
                                    "output_tokens": sum(len(tokens) for tokens in outputs[forms[0]][0])}
                if workload == "beams":  # the same search both ways, on the last worker run's prompts, untimed
                    stepped, _ = run_beams(client, "stepped", marked["worker"], args)
                    report[workload]["same_beams"] = stepped == outputs["worker"][-1]
            progress.close()
    finally:
        cluster.stop()
    for workload in workloads:
        forms, result = WORKLOADS[workload], report[workload]
        medians = {form: statistics.median(result["seconds"][form]) for form in forms}
        detail = f"n={args.n}" if workload == "n" else f"{args.beam_width} beams"
        print(f"\n{workload}: {args.num_prompts} prompts x {args.prompt_len} tokens, {detail}, {args.max_tokens} "
              f"tokens each, KV over {args.kv_transfer}, medians of {args.repeats}")
        print(f"{'form':<10} {'seconds':>8} {'tok/s':>8} {'transfers':>10} {'KV MB':>8} {'calls':>6}")
        for form in forms:
            transfers, num_bytes = result["received"][form][-1]
            print(f"{form:<10} {medians[form]:8.2f} {result['output_tokens'] / medians[form]:8.1f} {transfers:10d} "
                  f"{num_bytes / 1e6:8.1f} {result['calls'][form]:6d}")
        print(f"{forms[1]} / {forms[0]}: {medians[forms[1]] / medians[forms[0]]:.2f}x")
        if workload == "beams":
            print(f"the same beams both ways (the last run's prompts): {'yes' if result['same_beams'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as sink:
            json.dump(report, sink, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
