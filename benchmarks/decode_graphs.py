"""Decode steps replayed from CUDA graphs against the same steps launched eagerly, in the same run, on a GPU.

Two engines on the same GPU and model (``--cuda-graphs`` off and on, the Triton backend) run the same
batches: ``--batch-sizes`` requests of ``--prompt-len`` random prompt tokens each, greedy, end of text
ignored. A decode step's time is the difference between generating ``--steps`` + 1 tokens and generating
one (the prefill alone), divided by ``--steps``: the steps' forward passes, sampling and scheduling, as a
user's decode sees them. The two engines alternate, ``--repeats`` times each; medians are reported, with
the graphs' speed-up as a ratio, and whether both gave the same greedy ids. In float32 they do (H100: every
request at every batch size). In bfloat16 they part after a few tokens on near-ties: the same kernels run,
but a graph's block tables are ``max_model_len`` wide and an eager step's only as wide as its longest
request, so decode attention may cut the context into another number of splits, and its bfloat16 output
rounds differently. The column says how many requests agree and where the others part.

Without a CUDA GPU it says so and exits: there is nothing to replay (the padded static-buffer path the
graphs replay is checked on CPU by tests/e2e/test_triton_backend.py).

Usage::

    python benchmarks/decode_graphs.py                                  # batches of 1, 4, 16 and 64
    python benchmarks/decode_graphs.py --batch-sizes 1 8 --prompt-len 2048 --dtype float32 --json graphs.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

NO_GPU = ("no CUDA device here (torch.cuda.is_available() is False): nothing to time. This benchmark compares "
          "decode steps replayed from CUDA graphs with eager launches on a GPU.")


def add_common_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    """--model, --dtype, --repeats, --seed and --json: the options this benchmark shares with
    benchmarks/prefill_graphs.py."""
    parser.add_argument("--model", default=None,
                        help="local Hugging Face model directory (default: the converted default model, "
                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16",
                        help="weights, activations and KV cache (default: %(default)s, the engine's on CUDA)")
    parser.add_argument("--repeats", type=int, default=repeats,
                        help="timed runs per size and engine, interleaved; medians reported (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt generator (default: %(default)s)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write every timing to this JSON file")


def gpu_engine_options(args: argparse.Namespace, no_gpu: str) -> dict | None:
    """The LLM options both graph benchmarks share (the model, CUDA, --dtype, the Triton backend, no prefix
    caching), or None after printing ``no_gpu`` where torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        print(no_gpu)
        return None
    from splitserve.engine.model_store import prepare_default_model

    return dict(model=args.model or str(prepare_default_model()), device="cuda", dtype=args.dtype,
                attention_backend="triton", enable_prefix_caching=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="ms per decode step of the engine on a CUDA GPU with --cuda-graphs against without, in the "
        "same run, and the ratio (medians of interleaved repeats). Without a GPU it says so and exits 0.")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="requests decoding together (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens per request (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed per run (default: %(default)s)")
    add_common_arguments(parser, repeats=5)
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.steps < 1 or args.repeats < 1:
        parser.error("--batch-sizes, --prompt-len, --steps and --repeats must be >= 1")
    return args


def _timed_generate(llm, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    from splitserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, [output.outputs[0].token_ids for output in outputs]


def ms_per_step(llm, prompts: list[list[int]], steps: int) -> tuple[float, list[list[int]]]:
    """One timed run: (generate steps + 1 tokens - generate 1) / steps, in ms, and the greedy ids."""
    prefill_seconds, _ = _timed_generate(llm, prompts, 1)
    total_seconds, token_ids = _timed_generate(llm, prompts, steps + 1)
    return (total_seconds - prefill_seconds) / steps * 1e3, token_ids


def first_differences(eager: list[list[int]], graphs: list[list[int]]) -> list[int | None]:
    """Per request, the index of the first token where the two engines' greedy ids differ (None: none)."""
    return [next((index for index, (a, b) in enumerate(zip(one, other)) if a != b),
                 None if len(one) == len(other) else min(len(one), len(other)))
            for one, other in zip(eager, graphs)]


def agreement(differences: list[int | None], tokens: int) -> str:
    """'all 4' when every request's ids agree, else how many do and where the earliest others part."""
    same = sum(index is None for index in differences)
    if same == len(differences):
        return f"all {same}"
    parted = sorted(index for index in differences if index is not None)
    return f"{same} of {len(differences)}; others from token {parted[0]} to {parted[-1]} of {tokens}"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    options = gpu_engine_options(args, NO_GPU)
    if options is None:
        return 0
    import torch

    from splitserve import LLM

    max_batch = max(args.batch_sizes)
    max_model_len = args.prompt_len + args.steps + 1
    options.update(max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch), max_model_len=max_model_len,
                   num_kv_blocks=max_batch * (-(-max_model_len // 16) + 1))
    print(f"{torch.cuda.get_device_name()}: loading two engines (eager, graphs) ...", file=sys.stderr)
    engines = {"eager": LLM(cuda_graphs=False, **options), "graphs": LLM(cuda_graphs=True, **options)}
    vocab = engines["eager"].engine.model_config.vocab_size
    rng = random.Random(args.seed)
    rows = []
    for batch in args.batch_sizes:
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        timings: dict[str, list[float]] = {name: [] for name in engines}
        ids: dict[str, list[list[int]]] = {}
        for llm in engines.values():  # warm-up: first use of each shape
            ms_per_step(llm, prompts, 2)
        for repeat in range(args.repeats):
            for name, llm in engines.items():
                ms, ids[name] = ms_per_step(llm, prompts, args.steps)
                timings[name].append(ms)
            print(f"batch {batch}, repeat {repeat + 1}/{args.repeats}: "
                  + ", ".join(f"{name} {values[-1]:.2f} ms" for name, values in timings.items()), file=sys.stderr)
        eager, graphs = (statistics.median(timings[name]) for name in ("eager", "graphs"))
        rows.append({"batch": batch, "eager_ms": eager, "graphs_ms": graphs, "speedup": eager / graphs,
                     "identical_ids": ids["eager"] == ids["graphs"],
                     "first_differences": first_differences(ids["eager"], ids["graphs"]), "timings": timings})

    print(f"| batch | eager ms/step | graphs ms/step | graphs speed-up | same greedy ids (requests) |  "
          f"({torch.cuda.get_device_name()}, {args.dtype}, prompts of {args.prompt_len}, medians of {args.repeats})")
    print("|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['batch']} | {row['eager_ms']:.2f} | {row['graphs_ms']:.2f} | {row['speedup']:.2f}x | "
              f"{agreement(row['first_differences'], args.steps + 1)} |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "rows": rows}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
