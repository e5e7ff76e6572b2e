"""Parallel sampling: ``SamplingParams(n=...)`` in splitserve's ``LLM.generate`` (the prompt computed once, its KV
forked for the other completions) against the same completions asked as separate requests (their prompts shared
through the prefix cache, as before n existed) in the same run, and against vLLM-CPU's ``n`` with
``--vllm-python``.

Workload (the same for every system): ``--num-prompts`` prompts of ``--prompt-len`` random token ids (seeded, so
every system gets the same ones), each sampled ``--n`` times at temperature 0.8 for exactly ``--max-tokens``
tokens (``ignore_eos``), float32, with the CPU's default offline engine; every run starts with an empty prefix
cache (``reset_prefix_cache``). Each prompt carries a seed; splitserve's
completion i draws from seed + i, so its separate requests, seeded so, must give the same tokens, which is
checked (vLLM-CPU 0.32's sampler fails on a request's seed, "CPU Generator does not use offset", so vLLM's
requests carry none: its draws differ from splitserve's, its token counts do not). Repeats interleave the systems and reverse their order each repeat, so a host drifting in speed favours
none; the first call of each is a warm-up.

Reported: seconds for the whole workload per system (medians), output tokens a second, splitserve's speed over
each other's as a ratio (above 1: splitserve's n is faster), the tokens each splitserve run computed (prompts
and decodes), and how many completions equal their separate request's, and where the others part. They draw
from the same seeds, but their batches differ in shape (n's completions compute the prompt's last token in a
decode row, then decode all together), which changes float32 rounding in the last bits; the near-flat
distributions that random prompts give turn some of those into other draws, some tokens in (with real text,
`tests/e2e/test_parallel_sampling.py` finds every completion equal).

Usage::

    python benchmarks/parallel_sampling.py
    python benchmarks/parallel_sampling.py --vllm-python ~/.cache/splitserve-peers/vllm/bin/python --repeats 3

Progress goes to stderr, the results table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.offline_throughput import (  # noqa: E402
    PeerProcess,
    add_vllm_peer_arguments,
    default_vllm_threads_bind,
    log,
)

TEMPERATURE = 0.8
FIRST_SEED = 1000
# Token ids the prompts are drawn from: ordinary vocabulary, clear of the special tokens at the start.
TOKEN_RANGE = (1000, 20000)

# Runs inside the vLLM venv: loads the model, warms up, then answers "sample" or "quit" (one a line on stdin) with
# one JSON line behind a marker on stdout (vLLM logs to stdout too).
VLLM_PEER_SCRIPT = r"""
import json, sys, time

import vllm
from peer_loop import serve
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main():
    config_path, marker = sys.argv[1], sys.argv[2]
    with open(config_path) as file:
        config = json.load(file)
    llm = LLM(model=config["model"], dtype="float32", seed=0, max_model_len=config["max_model_len"])
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in config["prompts"]]
    params = SamplingParams(n=config["n"], temperature=config["temperature"], max_tokens=config["max_tokens"],
                            ignore_eos=True)

    def run():
        llm.reset_prefix_cache()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        return seconds, sum(len(completion.token_ids) for output in outputs for completion in output.outputs)

    def sample(_):
        seconds, tokens = run()
        return {"seconds": seconds, "output_tokens": tokens}

    run()
    serve(marker, vllm.__version__, {"sample": sample})


if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep this guard
    main()
"""
VLLM_PEER_MARKER = "@@parallel_sampling@@ "


class Splitserve:
    """splitserve's ``LLM.generate``, with ``n`` (``forked``) or as ``n`` separate seeded requests a prompt."""

    def __init__(self, llm, prompts: list[list[int]], n: int, max_tokens: int, forked: bool) -> None:
        from splitserve import SamplingParams

        self.llm, self.prompts, self.n, self.forked = llm, prompts, n, forked
        self.name = "splitserve n" if forked else "separate requests"
        seeds = [FIRST_SEED + index * n for index in range(len(prompts))]
        if forked:
            self.inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
            self.params = [SamplingParams(n=n, temperature=TEMPERATURE, max_tokens=max_tokens, ignore_eos=True,
                                          seed=seed) for seed in seeds]
        else:
            self.inputs = [{"prompt_token_ids": prompt} for prompt in prompts for _ in range(n)]
            self.params = [SamplingParams(temperature=TEMPERATURE, max_tokens=max_tokens, ignore_eos=True,
                                          seed=seed + index) for seed in seeds for index in range(n)]
        self.computed_tokens = 0
        self.sample()  # warm-up (and the prefix cache's first fill, as vLLM's warm-up fills its own)

    def sample(self) -> tuple[float, int, list[list[list[int]]]]:
        """Seconds, output tokens, and each prompt's completions' tokens."""
        self.llm.reset_prefix_cache()  # each run computes its prompts, as the first one did
        stats = self.llm.engine.stats
        before = stats.num_computed_tokens
        start = time.perf_counter()
        outputs = self.llm.generate(self.inputs, self.params, use_tqdm=False)
        seconds = time.perf_counter() - start
        self.computed_tokens = stats.num_computed_tokens - before
        completions = [[completion.token_ids for completion in output.outputs] for output in outputs]
        if not self.forked:
            completions = [sum(completions[index : index + self.n], [])
                           for index in range(0, len(completions), self.n)]
        return seconds, sum(len(tokens) for prompt in completions for tokens in prompt), completions

    def close(self) -> None:
        pass


class VllmPeer:
    """vLLM-CPU in its own venv (offline_throughput's :class:`PeerProcess`)."""

    name = "vllm n"
    computed_tokens = None

    def __init__(self, python: str, model: str, prompts: list[list[int]], n: int, max_tokens: int,
                 max_model_len: int, threads_bind: str) -> None:
        config = {"model": model, "prompts": prompts, "n": n, "max_tokens": max_tokens, "temperature": TEMPERATURE,
                  "max_model_len": max_model_len}
        self.peer = PeerProcess(python, VLLM_PEER_SCRIPT, config, VLLM_PEER_MARKER, threads_bind=threads_bind,
                                kv_space_gib=4)

    def sample(self) -> tuple[float, int, None]:
        message = self.peer.request("sample", "sample")
        return message["seconds"], message["output_tokens"], None

    def close(self) -> None:
        self.peer.close()


def random_prompts(count: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = random.Random(seed)
    return [[generator.randrange(*TOKEN_RANGE) for _ in range(length)] for _ in range(count)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face Llama-family directory (default: SmolLM2-135M)")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts sampled (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=500, help="tokens a prompt (default: %(default)s)")
    parser.add_argument("--n", type=int, default=8, help="completions a prompt (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32,
                        help="tokens a completion, exactly (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each system (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the timings and agreement to FILE as JSON")
    add_vllm_peer_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("num_prompts", "prompt_len", "n", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be at least 1")
    from splitserve import LLM
    from splitserve.engine.model_store import prepare_default_model

    model = args.model or str(prepare_default_model())
    prompts = random_prompts(args.num_prompts, args.prompt_len)
    max_model_len = args.prompt_len + args.max_tokens + 16
    log(f"{len(prompts)} prompts of {args.prompt_len} tokens, n={args.n}, {args.max_tokens} tokens each; "
        "starting the systems")
    llm = LLM(model, dtype="float32", max_model_len=max_model_len)
    systems = [Splitserve(llm, prompts, args.n, args.max_tokens, forked=True),
               Splitserve(llm, prompts, args.n, args.max_tokens, forked=False)]
    if args.vllm_python:
        systems.append(VllmPeer(args.vllm_python, model, prompts, args.n, args.max_tokens, max_model_len,
                                args.vllm_threads_bind or default_vllm_threads_bind()))
    seconds: dict[str, list[float]] = {system.name: [] for system in systems}
    output_tokens: dict[str, int] = {}
    completions: dict[str, list] = {}
    try:
        for repeat in range(args.repeats):
            for system in systems if repeat % 2 == 0 else systems[::-1]:
                elapsed, output_tokens[system.name], completions[system.name] = system.sample()
                seconds[system.name].append(elapsed)
                log(f"repeat {repeat + 1}/{args.repeats}: {system.name} {elapsed:.2f} s")
    finally:
        for system in systems:
            system.close()
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    computed = {system.name: system.computed_tokens for system in systems if system.computed_tokens is not None}
    pairs = [(ours, theirs) for prompt_ours, prompt_theirs in zip(completions["splitserve n"],
                                                                 completions["separate requests"])
             for ours, theirs in zip(prompt_ours, prompt_theirs)]
    same = sum(ours == theirs for ours, theirs in pairs)
    parted = [next(index for index, (a, b) in enumerate(zip(ours, theirs)) if a != b)
              for ours, theirs in pairs if ours != theirs]
    print(f"parallel sampling: {len(prompts)} prompts of {args.prompt_len} tokens, n={args.n}, {args.max_tokens} "
          f"tokens each, float32; medians of {args.repeats}")
    print(f"{'system':<20}{'seconds':>9}{'output tok/s':>14}{'splitserve n speed / this':>28}"
          f"{'tokens computed':>17}")
    for name, median in medians.items():
        ratio = "" if name == "splitserve n" else f"{median / medians['splitserve n']:.2f}x"
        print(f"{name:<20}{median:>9.2f}{output_tokens[name] / median:>14.1f}{ratio:>28}"
              f"{computed.get(name, ''):>17}")
    print(f"completions equal to their separate request's (seed + i): {same}/{len(pairs)}"
          + (f"; the others part at tokens {sorted(parted)}" if parted else ""))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "seconds": seconds, "medians": medians, "output_tokens": output_tokens,
                       "computed_tokens": computed, "identical_completions": same, "num_completions": len(pairs),
                       "parted_at": parted}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
