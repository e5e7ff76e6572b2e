"""Prompt steps replayed from CUDA graphs in pieces (attention eager between them) against the same steps launched
eagerly, in the same run, on a GPU.

Two engines on the same GPU and model (``cuda_graphs`` off, and on in ``piecewise`` mode, the Triton backend)
prefill the same prompts: for each of ``--tokens``, ``--requests`` random prompts whose tokens together make one
step of that many tokens (``max_num_batched_tokens`` is the largest), each generating one token, greedy. A step's
time is the wall time of that ``generate`` call (the prefill step, sampling and scheduling, as a user's time to
first token sees them). The engines alternate, ``--repeats`` times each; medians are reported with the pieces'
speed-up as a ratio, and whether both sampled the same first tokens.

Without a CUDA GPU it says so and exits: there is nothing to replay (the padded, split forward pass the pieces
replay is checked on CPU by tests/e2e/test_triton_backend.py).

Usage::

    python benchmarks/prefill_graphs.py                                  # steps of 64, 256, 512 and 2,048 tokens
    python benchmarks/prefill_graphs.py --tokens 128 1024 --requests 4 --dtype float32 --json pieces.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds the benchmarks package
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.decode_graphs import add_common_arguments, gpu_engine_options  # noqa: E402

NO_GPU = ("no CUDA device here (torch.cuda.is_available() is False): nothing to time. This benchmark compares "
          "prompt steps replayed from piecewise CUDA graphs with eager launches on a GPU.")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="ms per prompt step of the engine on a CUDA GPU with piecewise CUDA graphs against without, in "
        "the same run, and the ratio (medians of interleaved repeats). Without a GPU it says so and exits 0.")
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 512, 2048],
                        help="prompt tokens in one step, at most 2,048, the largest captured (default: %(default)s)")
    parser.add_argument("--requests", type=int, default=1,
                        help="prompts sharing each step's tokens equally (default: %(default)s)")
    add_common_arguments(parser, repeats=7)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.repeats < 1 or min(args.tokens) < args.requests or max(args.tokens) > 2048:
        parser.error("--requests and --repeats must be >= 1, and every --tokens between --requests and 2048")
    return args


def timed_step(llm, prompts: list[list[int]]) -> tuple[float, list[int]]:
    """One prompt step (the prompts' one token each): its wall time in ms and the sampled tokens."""
    from splitserve import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return (time.perf_counter() - start) * 1e3, [output.outputs[0].token_ids[0] for output in outputs]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = gpu_engine_options(args, NO_GPU)
    if options is None:
        return 0
    import torch

    from splitserve import LLM

    largest = max(args.tokens)
    options.update(max_num_seqs=args.requests, max_num_batched_tokens=largest, max_model_len=largest + 16,
                   num_kv_blocks=args.requests * (-(-largest // args.requests // 16) + 2))
    print(f"{torch.cuda.get_device_name()}: loading two engines (eager, pieces) ...", file=sys.stderr)
    engines = {"eager": LLM(cuda_graphs=False, **options),
               "pieces": LLM(cuda_graphs=True, cuda_graph_mode="piecewise", **options)}
    pieces = engines["pieces"].engine.model_runner.piecewise_graphs
    vocab = engines["eager"].engine.model_config.vocab_size
    rng = random.Random(args.seed)
    rows = []
    for tokens in args.tokens:
        prompts = [[rng.randrange(vocab) for _ in range(tokens // args.requests)] for _ in range(args.requests)]
        timings: dict[str, list[float]] = {name: [] for name in engines}
        first: dict[str, list[int]] = {}
        for llm in engines.values():  # warm-up: first use of each shape
            timed_step(llm, prompts)
        steps_before = pieces.num_steps
        for _repeat in range(args.repeats):
            for name, llm in engines.items():
                ms, first[name] = timed_step(llm, prompts)
                timings[name].append(ms)
        eager, replayed = (statistics.median(timings[name]) for name in engines)
        rows.append({"tokens": tokens, "requests": args.requests, "eager_ms": eager, "pieces_ms": replayed,
                     "speedup": eager / replayed, "same_first_tokens": first["eager"] == first["pieces"],
                     "replayed_steps": pieces.num_steps - steps_before, "timings": timings})
        print(f"{tokens} tokens: eager {eager:.2f} ms, pieces {replayed:.2f} ms", file=sys.stderr)

    print(f"| step tokens | eager ms | pieces ms | speed-up | same first tokens |  ({torch.cuda.get_device_name()}, "
          f"{args.dtype}, {args.requests} request(s) a step, medians of {args.repeats})")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['tokens']} | {row['eager_ms']:.2f} | {row['pieces_ms']:.2f} | {row['speedup']:.2f}x | "
              f"{'yes' if row['same_first_tokens'] else 'no'} |")
    if any(row["replayed_steps"] != args.repeats for row in rows):
        print("warning: some timed steps did not replay the pieces", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
