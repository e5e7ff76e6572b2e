"""Beam search: splitserve's ``LLM.beam_search`` against transformers' ``generate(num_beams=...)`` on the same
prompts in the same run, and against vLLM-CPU's ``LLM.beam_search`` with ``--vllm-python``.

Workload (the same for every system): ``--num-prompts`` short text prompts, each searched with ``--beam-width``
beams for at most ``--max-tokens`` tokens, float32. splitserve searches all prompts at once (each step one engine
batch of every live beam, each beam forking the KV of the beam it grew from); transformers one prompt at a time (its
beams batched, its cache reordered); vLLM one token of every live beam a step, the beams' KV shared through its prefix cache (whole blocks: each
beam's last partial block is recomputed every step). Repeats interleave
the systems and reverse their order each repeat, so a host drifting in speed favours none; the first call of each
is a warm-up.

Reported: seconds for the whole workload per system (medians), splitserve's speed over each other's as a ratio
(above 1: splitserve is faster), and for how many prompts every beam, in order, is transformers' (splitserve
ranks beams as transformers does, so all of them should be) and vLLM's (vLLM ranks by another rule, README
"Beam search", so its beams may differ where some end early).

Usage::

    python benchmarks/beam_search.py
    python benchmarks/beam_search.py --vllm-python ~/.cache/splitserve-peers/vllm/bin/python --repeats 3

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

from benchmarks.offline_throughput import (  # noqa: E402
    PeerProcess,
    add_vllm_peer_arguments,
    default_vllm_threads_bind,
    log,
)

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away,", "def fibonacci(n):",
           "The three primary colors are", "Water boils at a temperature of", "My favourite book is",
           "The best way to learn a language is", "In the year 2050, cities will"]

# Runs inside the vLLM venv: loads the model, warms up, then answers "search" or "quit" (one a line on stdin) with
# one JSON line behind a marker on stdout (vLLM logs to stdout too).
VLLM_PEER_SCRIPT = r"""
import json, sys, time

import vllm
from peer_loop import serve
from vllm import LLM
from vllm.inputs import TokensPrompt
from vllm.sampling_params import BeamSearchParams


def main():
    config_path, marker = sys.argv[1], sys.argv[2]
    with open(config_path) as file:
        config = json.load(file)
    llm = LLM(model=config["model"], dtype="float32", seed=0, max_model_len=config["max_model_len"])
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in config["prompts"]]
    params = BeamSearchParams(beam_width=config["beam_width"], max_tokens=config["max_tokens"])

    def run():
        start = time.perf_counter()
        outputs = llm.beam_search(prompts, params)
        seconds = time.perf_counter() - start
        return seconds, [[list(beam.tokens[len(prompt):]) for beam in output.sequences]
                         for prompt, output in zip(config["prompts"], outputs)]

    def search(_):
        seconds, beams = run()
        return {"seconds": seconds, "beams": beams}

    run()
    serve(marker, vllm.__version__, {"search": search})


if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep this guard
    main()
"""
VLLM_PEER_MARKER = "@@beam_search@@ "


class Splitserve:
    name = "splitserve"

    def __init__(self, model: str, prompts: list[list[int]], beam_width: int, max_tokens: int,
                 max_model_len: int) -> None:
        from splitserve import LLM, BeamSearchParams

        self.llm = LLM(model, dtype="float32", max_model_len=max_model_len)
        self.prompts = [{"prompt_token_ids": prompt} for prompt in prompts]
        self.params = BeamSearchParams(beam_width, max_tokens)
        self.search()  # warm-up

    def search(self) -> tuple[float, list[list[list[int]]]]:
        start = time.perf_counter()
        outputs = self.llm.beam_search(self.prompts, self.params)
        seconds = time.perf_counter() - start
        return seconds, [[beam.tokens[len(prompt["prompt_token_ids"]):] for beam in output.sequences]
                         for prompt, output in zip(self.prompts, outputs)]

    def close(self) -> None:
        pass


class Transformers:
    name = "transformers"

    def __init__(self, model: str, prompts: list[list[int]], beam_width: int, max_tokens: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.eos = self.model.generation_config.eos_token_id
        self.prompts, self.beam_width, self.max_tokens = prompts, beam_width, max_tokens
        self.search()  # warm-up

    def search(self) -> tuple[float, list[list[list[int]]]]:
        torch, beams = self.torch, []
        start = time.perf_counter()
        with torch.inference_mode():
            for prompt in self.prompts:
                input_ids = torch.tensor([prompt])
                output = self.model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                             num_beams=self.beam_width, num_return_sequences=self.beam_width,
                                             early_stopping=False, max_new_tokens=self.max_tokens)
                beams.append([row[: row.index(self.eos) + 1] if self.eos in row else row
                              for row in output[:, len(prompt):].tolist()])
        return time.perf_counter() - start, beams

    def close(self) -> None:
        pass


class VllmPeer:
    """vLLM-CPU in its own venv (offline_throughput's :class:`PeerProcess`)."""

    name = "vllm"

    def __init__(self, python: str, model: str, prompts: list[list[int]], beam_width: int, max_tokens: int,
                 max_model_len: int, threads_bind: str) -> None:
        config = {"model": model, "prompts": prompts, "beam_width": beam_width, "max_tokens": max_tokens,
                  "max_model_len": max_model_len}
        self.peer = PeerProcess(python, VLLM_PEER_SCRIPT, config, VLLM_PEER_MARKER, threads_bind=threads_bind,
                                kv_space_gib=4)

    def search(self) -> tuple[float, list[list[list[int]]]]:
        message = self.peer.request("search", "search")
        return message["seconds"], message["beams"]

    def close(self) -> None:
        self.peer.close()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face Llama-family directory (default: SmolLM2-135M)")
    parser.add_argument("--num-prompts", type=int, default=8,
                        help=f"prompts searched, from a list of {len(PROMPTS)} (default: %(default)s)")
    parser.add_argument("--beam-width", type=int, default=4, help="beams a prompt (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens a beam at most (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each system (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the timings and agreement to FILE as JSON")
    add_vllm_peer_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not 1 <= args.num_prompts <= len(PROMPTS):
        raise SystemExit(f"--num-prompts must be 1 to {len(PROMPTS)}")
    from splitserve.engine.model_store import load_tokenizer, prepare_default_model

    model = args.model or str(prepare_default_model())
    tokenizer = load_tokenizer(model)
    prompts = [tokenizer.encode(text) for text in PROMPTS[: args.num_prompts]]
    max_model_len = max(len(prompt) for prompt in prompts) + args.max_tokens + 16
    log(f"{len(prompts)} prompts, {args.beam_width} beams, at most {args.max_tokens} tokens; starting the systems")
    systems = [Splitserve(model, prompts, args.beam_width, args.max_tokens, max_model_len),
               Transformers(model, prompts, args.beam_width, args.max_tokens)]
    if args.vllm_python:
        systems.append(VllmPeer(args.vllm_python, model, prompts, args.beam_width, args.max_tokens, max_model_len,
                                args.vllm_threads_bind or default_vllm_threads_bind()))
    seconds: dict[str, list[float]] = {system.name: [] for system in systems}
    beams: dict[str, list] = {}
    try:
        for repeat in range(args.repeats):
            for system in systems if repeat % 2 == 0 else systems[::-1]:
                elapsed, beams[system.name] = system.search()
                seconds[system.name].append(elapsed)
                log(f"repeat {repeat + 1}/{args.repeats}: {system.name} {elapsed:.2f} s")
    finally:
        for system in systems:
            system.close()
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    same = {name: sum(ours == theirs for ours, theirs in zip(beams["splitserve"], beams[name]))
            for name in beams if name != "splitserve"}
    print(f"beam search: {len(prompts)} prompts x {args.beam_width} beams, at most {args.max_tokens} tokens, "
          f"float32; medians of {args.repeats}")
    print(f"{'system':<14}{'seconds':>9}{'splitserve speed / this':>26}{'prompts with identical beams':>31}")
    for name, median in medians.items():
        ratio = "" if name == "splitserve" else f"{median / medians['splitserve']:.2f}x"
        identical = "" if name == "splitserve" else f"{same[name]}/{len(prompts)}"
        print(f"{name:<14}{median:>9.2f}{ratio:>26}{identical:>31}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"args": vars(args), "seconds": seconds, "medians": medians, "identical_prompts": same,
                       "num_prompts": len(prompts)}, file, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
