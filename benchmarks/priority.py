"""Priority scheduling: how long urgent requests wait behind a backlog, served by priority against first come,
first served, in the same run.

Workload (the same for both policies): ``--num-background`` background requests (priority 10, prompts of
``--background-prompt`` tokens, ``--background-tokens`` output tokens each, EOS ignored) arrive first, then
``--num-urgent`` urgent ones (priority 0, ``--urgent-prompt``-token prompts, ``--urgent-tokens`` out), all at
once, on one engine running at most ``--max-num-seqs`` requests at a time, greedy. First come, first served
starts the backlog first and the urgent requests wait for places; the priority policy starts the urgent ones
first. Prefix caching is off, so that every repeat computes every prompt. Reported: the urgent requests' time to first token (median and worst) under each policy and its ratio,
the background's, and the whole run's time (what priority costs the backlog, and whether it costs throughput).

Repeats alternate the two policies and reverse their order each repeat; medians over the repeats.

Usage::

    python benchmarks/priority.py
    python benchmarks/priority.py --repeats 5 --json out.json

Progress goes to stderr, the results table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.offline_throughput import log  # noqa: E402

POLICIES = ("fcfs", "priority")
BACKGROUND_PRIORITY, URGENT_PRIORITY = 10, 0


def run_once(engine, args: argparse.Namespace) -> dict:
    """One pass of the workload through ``engine``: each request's time to first token (seconds from when all
    were added) by kind, and the whole pass's seconds."""
    from splitserve.common.sampling_params import SamplingParams

    requests = []
    for index in range(args.num_background):
        requests.append(("background", [100 + index] * args.background_prompt, args.background_tokens,
                         BACKGROUND_PRIORITY))
    for index in range(args.num_urgent):
        requests.append(("urgent", [200 + index] * args.urgent_prompt, args.urgent_tokens, URGENT_PRIORITY))
    kinds = {}
    started = time.monotonic()
    for kind, token_ids, max_tokens, priority in requests:
        request_id = engine.next_request_id()
        kinds[request_id] = kind
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        engine.add_request(request_id, None, params, prompt_token_ids=token_ids,
                           priority=priority if engine.config.scheduling_policy == "priority" else 0)
    first_token: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.outputs[0].token_ids and output.request_id not in first_token:
                first_token[output.request_id] = time.monotonic() - started
    seconds = time.monotonic() - started
    by_kind: dict[str, list[float]] = {"background": [], "urgent": []}
    for request_id, kind in kinds.items():
        by_kind[kind].append(first_token[request_id])
    return {"seconds": seconds, "ttft": by_kind}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", help="local Hugging Face model directory (default: the converted default model)")
    parser.add_argument("--num-background", type=int, default=24, help="background requests, arriving first")
    parser.add_argument("--background-prompt", type=int, default=256, help="tokens in each background prompt")
    parser.add_argument("--background-tokens", type=int, default=48, help="output tokens of each background request")
    parser.add_argument("--num-urgent", type=int, default=4, help="urgent requests, arriving right after")
    parser.add_argument("--urgent-prompt", type=int, default=32, help="tokens in each urgent prompt")
    parser.add_argument("--urgent-tokens", type=int, default=8, help="output tokens of each urgent request")
    parser.add_argument("--max-num-seqs", type=int, default=8, help="requests each engine runs at once")
    parser.add_argument("--repeats", type=int, default=3, help="passes of the workload per policy")
    parser.add_argument("--json", metavar="OUT", help="write the raw timings to this file")
    args = parser.parse_args(argv)

    from splitserve.engine.llm import LLM

    engines = {}
    for policy in POLICIES:
        log(f"loading an engine that serves by {policy}")
        engines[policy] = LLM(args.model, max_num_seqs=args.max_num_seqs, scheduling_policy=policy,
                              kv_cache_memory_bytes=512 * 2**20, enable_prefix_caching=False,
                              max_model_len=max(args.background_prompt + args.background_tokens,
                                                args.urgent_prompt + args.urgent_tokens) + 16).engine
    for policy in POLICIES:  # warm-up: kernels loaded, first allocations made
        run_once(engines[policy], argparse.Namespace(**{**vars(args), "num_background": 2, "num_urgent": 1}))
    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    for repeat in range(args.repeats):
        order = POLICIES if repeat % 2 == 0 else POLICIES[::-1]
        for policy in order:
            result = run_once(engines[policy], args)
            runs[policy].append(result)
            log(f"repeat {repeat + 1}/{args.repeats}, {policy}: urgent ttft median "
                f"{statistics.median(result['ttft']['urgent']) * 1000:.0f} ms, whole run {result['seconds']:.2f} s")

    def median_of(policy: str, pick) -> float:
        return statistics.median(pick(run) for run in runs[policy])

    rows = []
    for label, pick in (
            ("urgent ttft, median (ms)", lambda run: statistics.median(run["ttft"]["urgent"]) * 1000),
            ("urgent ttft, worst (ms)", lambda run: max(run["ttft"]["urgent"]) * 1000),
            ("background ttft, median (ms)", lambda run: statistics.median(run["ttft"]["background"]) * 1000),
            ("whole run (s)", lambda run: run["seconds"])):
        fcfs, priority = median_of("fcfs", pick), median_of("priority", pick)
        rows.append((label, fcfs, priority, priority / fcfs))
    print(f"\nworkload: {args.num_background} background requests ({args.background_prompt}-token prompts, "
          f"{args.background_tokens} out, priority {BACKGROUND_PRIORITY}) then {args.num_urgent} urgent ones "
          f"({args.urgent_prompt}-token prompts, {args.urgent_tokens} out, priority {URGENT_PRIORITY}), all at once; "
          f"--max-num-seqs {args.max_num_seqs}; medians of {args.repeats} repeats\n")
    print("| measure | fcfs (baseline) | priority | priority / fcfs |")
    print("|---|---|---|---|")
    for label, fcfs, priority, ratio in rows:
        print(f"| {label} | {fcfs:.2f} | {priority:.2f} | {ratio:.2f}x |")
    if args.json:
        with open(args.json, "w") as sink:
            json.dump({"args": vars(args), "runs": runs}, sink, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
