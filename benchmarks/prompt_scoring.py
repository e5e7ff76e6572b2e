"""Prompt scoring (``prompt_logprobs``, what lm-evaluation-harness's loglikelihood asks): splitserve against vLLM.

Workload (the same for every system, in the same run): ``--num-prompts`` prompts of random token ids (lengths
uniform in [``--min-prompt``, ``--max-prompt``], ids clear of special tokens), each scored with
``prompt_logprobs=--top`` and ``max_tokens=1``, all in one ``LLM.generate``; prefix caching off in both, so
every repeat computes every prompt. The baseline measured beside it in the same process is a plain prefill of
the same prompts (``max_tokens=1``, no prompt logprobs): scoring costs the logits of every prompt row (the
vocabulary's GEMM, about a quarter more FLOPs per token for SmolLM2) and their log-softmax.

Repeats interleave the systems and reverse their order each repeat, so a host drifting in speed favours none.
Reported: prompt tokens per second, scoring over plain prefill for each system, splitserve over vLLM, and the
largest difference between the two systems' logprobs of the prompts' tokens (and, with ``--check-hf N``,
against transformers on the first N prompts).

Usage::

    python benchmarks/prompt_scoring.py
    python benchmarks/prompt_scoring.py --vllm-python ~/.cache/splitserve-peers/vllm/bin/python --repeats 3

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
    SPECIAL_ID_MARGIN,
    PeerProcess,
    add_vllm_peer_arguments,
    default_vllm_threads_bind,
    log,
)

# Runs inside the vLLM venv: loads the model, warms up, then answers "score", "prefill" or "quit" (one a line on
# stdin) with one JSON line behind a marker on stdout (vLLM logs to stdout too).
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
    llm = LLM(model=config["model"], dtype=config["dtype"], seed=0, enable_prefix_caching=False,
              max_model_len=config["max_model_len"], max_num_batched_tokens=config["max_num_batched_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in config["prompts"]]

    def run(prompt_logprobs):
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    def score(_):
        seconds, outputs = run(config["top"])
        scored = [[entry[token].logprob for entry, token in zip(output.prompt_logprobs[1:], prompt[1:])]
                  for output, prompt in zip(outputs, config["prompts"])]
        return {"seconds": seconds, "scored": scored}

    def prefill(_):
        seconds, _ = run(None)
        return {"seconds": seconds}

    run(config["top"])
    serve(marker, vllm.__version__, {"score": score, "prefill": prefill})


if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep this guard
    main()
"""
VLLM_PEER_MARKER = "@@prompt_scoring@@ "


class Splitserve:
    name = "splitserve"

    def __init__(self, model: str, dtype: str, prompts: list[list[int]], top: int, max_model_len: int,
                 max_num_batched_tokens: int) -> None:
        from splitserve import LLM

        self.llm = LLM(model, dtype=dtype, enable_prefix_caching=False, max_model_len=max_model_len,
                       max_num_batched_tokens=max_num_batched_tokens)
        self.prompts = [{"prompt_token_ids": prompt} for prompt in prompts]
        self.top = top
        self.score()  # warm-up: the first run maps the KV cache's pages

    def _run(self, prompt_logprobs: int | None):
        from splitserve import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=prompt_logprobs)
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    def score(self) -> tuple[float, list[list[float]]]:
        seconds, outputs = self._run(self.top)
        scored = [[entry[token] for entry, token in zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])]
                  for output in outputs]
        return seconds, scored

    def prefill(self) -> float:
        return self._run(None)[0]

    def close(self) -> None:
        pass


class VllmPeer:
    """vLLM-CPU in its own venv (offline_throughput's :class:`PeerProcess`)."""

    name = "vllm"

    def __init__(self, python: str, model: str, dtype: str, prompts: list[list[int]], top: int, max_model_len: int,
                 max_num_batched_tokens: int, threads_bind: str, kv_space_gib: int) -> None:
        config = {"model": model, "dtype": dtype, "prompts": prompts, "top": top, "max_model_len": max_model_len,
                  "max_num_batched_tokens": max_num_batched_tokens}
        self.peer = PeerProcess(python, VLLM_PEER_SCRIPT, config, VLLM_PEER_MARKER, threads_bind=threads_bind,
                                kv_space_gib=kv_space_gib)

    def score(self) -> tuple[float, list[list[float]]]:
        message = self.peer.request("score", "score")
        return message["seconds"], message["scored"]

    def prefill(self) -> float:
        return self.peer.request("prefill", "prefill")["seconds"]

    def close(self) -> None:
        self.peer.close()


def largest_difference(ours: list[list[float]], theirs: list[list[float]]) -> float:
    return max(abs(a - b) for row_a, row_b in zip(ours, theirs) for a, b in zip(row_a, row_b))


def transformers_scores(model: str, prompts: list[list[int]]) -> list[list[float]]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    scores = []
    with torch.inference_mode():
        for prompt in prompts:
            logprobs = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
            scores.append(logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])].tolist())
    return scores


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face Llama-family directory (default: SmolLM2-135M)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV cache (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts scored per run (default: %(default)s)")
    parser.add_argument("--min-prompt", type=int, default=128, help="shortest prompt, in tokens (default: %(default)s)")
    parser.add_argument("--max-prompt", type=int, default=1024, help="longest prompt, in tokens (default: %(default)s)")
    parser.add_argument("--top", type=int, default=1,
                        help="prompt_logprobs: alternatives per prompt position, 0-20 (default: %(default)s, as "
                        "lm-evaluation-harness asks)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens a step, the same for both systems (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each kind per system (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt generator (default: %(default)s)")
    parser.add_argument("--check-hf", type=int, default=2, metavar="N",
                        help="also compare the first N prompts' scores with transformers' (0: no; default: %(default)s)")
    add_vllm_peer_arguments(parser)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the raw timings to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.top <= 20 or not 2 <= args.min_prompt <= args.max_prompt or args.num_prompts < 1:
        raise SystemExit("--top must be 0-20, 2 <= --min-prompt <= --max-prompt, and --num-prompts >= 1")
    from splitserve.common.model_info import ModelConfig
    from splitserve.engine.model_store import prepare_default_model, resolve_model

    model = resolve_model(args.model) if args.model else str(prepare_default_model())
    vocab = ModelConfig.from_model_dir(model).vocab_size
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(SPECIAL_ID_MARGIN, vocab - SPECIAL_ID_MARGIN)
                for _ in range(rng.randint(args.min_prompt, args.max_prompt))] for _ in range(args.num_prompts)]
    num_tokens = sum(len(prompt) for prompt in prompts)
    max_model_len = args.max_prompt + 16
    log(f"model {model}; {args.num_prompts} prompts, {num_tokens} tokens ({args.min_prompt}-{args.max_prompt}), "
        f"prompt_logprobs={args.top}, {args.dtype}")
    systems = [Splitserve(model, args.dtype, prompts, args.top, max_model_len, args.max_num_batched_tokens)]
    try:
        if args.vllm_python:
            log("starting the vLLM peer (its first start compiles for minutes)")
            systems.append(VllmPeer(args.vllm_python, model, args.dtype, prompts, args.top, max_model_len,
                                    args.max_num_batched_tokens, args.vllm_threads_bind or default_vllm_threads_bind(),
                                    kv_space_gib=4))
        timings = {system.name: {"score": [], "prefill": []} for system in systems}
        scores = {}
        for repeat in range(args.repeats):
            order = systems if repeat % 2 == 0 else systems[::-1]
            for system in order:
                seconds, scores[system.name] = system.score()
                timings[system.name]["score"].append(seconds)
                timings[system.name]["prefill"].append(system.prefill())
                log(f"repeat {repeat + 1}/{args.repeats} {system.name}: scoring {seconds:.2f} s, plain prefill "
                    f"{timings[system.name]['prefill'][-1]:.2f} s")
    finally:
        for system in systems:
            system.close()

    def rate(seconds: list[float]) -> float:
        return num_tokens / statistics.median(seconds)

    print(f"\nPrompt scoring: {args.num_prompts} prompts, {num_tokens} tokens, prompt_logprobs={args.top}, "
          f"{args.dtype}, medians of {args.repeats}\n")
    print("| system | scoring tok/s | plain prefill tok/s | scoring / plain |")
    print("|---|---|---|---|")
    for name, kinds in timings.items():
        print(f"| {name} | {rate(kinds['score']):.1f} | {rate(kinds['prefill']):.1f} | "
              f"{rate(kinds['score']) / rate(kinds['prefill']):.2f}x |")
    ours = timings["splitserve"]
    if "vllm" in timings:
        theirs = timings["vllm"]
        paired = [b / a for a, b in zip(ours["score"], theirs["score"])]
        print(f"\nsplitserve / vLLM, scoring: {rate(ours['score']) / rate(theirs['score']):.2f}x (repeat by repeat "
              f"{', '.join(f'{ratio:.2f}' for ratio in paired)}); plain prefill: "
              f"{rate(ours['prefill']) / rate(theirs['prefill']):.2f}x")
        print(f"largest |splitserve - vLLM| over the {num_tokens - args.num_prompts} scored tokens: "
              f"{largest_difference(scores['splitserve'], scores['vllm']):.2e}")
    if args.check_hf:
        count = min(args.check_hf, len(prompts))
        reference = transformers_scores(model, prompts[:count])
        print(f"largest |splitserve - transformers| over the first {count} prompts: "
              f"{largest_difference(scores['splitserve'][:count], reference):.2e}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"num_tokens": num_tokens, "top": args.top, "dtype": args.dtype, "timings": timings}, file,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
