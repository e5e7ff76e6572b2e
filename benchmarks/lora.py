"""Multi-LoRA serving: splitserve without adapters, splitserve with them, and vLLM-CPU with them, on one batch of
requests spread over several adapters.

Workload (the same for every system, in the same run): ``--num-prompts`` plain-text prompts of varied length (a
question of a line, a story's opening, field journals of 2 to 20 days: about 15 to 500 tokens), tokenized here so
every system gets the same token ids, greedy, exactly ``--max-tokens`` tokens each (EOS ignored, so every system
does the same work), all submitted in one ``generate`` (multi-LoRA serving is a throughput feature: requests of
different adapters share each step). ``--num-adapters`` K random PEFT LoRA adapters of the model are made once,
into ``--adapter-dir`` or a temporary folder: rank ``--rank``, alpha twice the rank, on all seven projections (q, k,
v, o, gate, up, down), A as PEFT initialises it and B drawn from N(0, 0.02) with seed 1 + the adapter's index (PEFT's
own B is zero, which would change nothing). Request i runs adapter i % K.

Systems: "splitserve" is the engine without LoRA on the same prompts (the baseline); "splitserve lora" is
``LLM(enable_lora=True, max_loras=--max-loras, max_cpu_loras=K)``; with ``--vllm-python``, "vllm lora" is vLLM-CPU in
its own venv with ``enable_lora=True`` and the same max_loras and max_cpu_loras, each prompt with vLLM's
``LoRARequest(name, id, path)``. Both engines get ``max_lora_rank`` the smallest rank vLLM accepts at or above
``--rank`` (8 for the default), and prefix caching off (every repeat sends the same prompts). ``--max-loras`` below K
measures adapters taking turns: a step holds the requests of at most that many adapters, the others wait; every
adapter stays loaded (max_cpu_loras K), so turns swap slots, not files. vLLM-CPU 0.32 serves LoRA, but with
``enable_lora`` its CPU platform turns torch.compile off (``CompilationMode.NONE``) and runs the adapters through
``PunicaWrapperCPU``'s plain torch ops, so its row is its eager engine.

Every system runs the workload once untimed before the timed runs (splitserve maps its KV cache lazily; vLLM
compiles). Repeats interleave the systems and reverse their order each repeat, so a host drifting in speed favours
none. Reported: output tokens per second of each system (medians), splitserve lora over splitserve (the cost of the
adapters) and over vLLM lora, each also repeat by repeat; for how many requests the adapters changed splitserve's
greedy token ids (if none did, the adapters did nothing); and for how many the greedy token ids of splitserve lora
and vLLM lora are identical (float32 on both: informative, not a failure; a pair that parts does so at near-ties,
which the two engines' different summation orders round differently).

Usage::

    python benchmarks/lora.py
    python benchmarks/lora.py --vllm-python ~/.cache/splitserve-peers/vllm/bin/python --repeats 3
    python benchmarks/lora.py --num-adapters 8 --max-loras 2   # adapters taking turns

Progress goes to stderr, the results table to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.offline_throughput import (  # noqa: E402
    PeerProcess,
    add_vllm_peer_arguments,
    default_vllm_threads_bind,
    log,
)

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER_B_STD = 0.02
ANIMALS = ["fox", "owl", "whale", "tiger", "heron", "otter", "lynx", "crane", "bison", "gecko"]
PLACES = ["river", "forest", "desert", "harbor", "valley", "glacier", "meadow", "canyon"]


def prompt_text(index: int) -> str:
    """The ``index``-th request's prompt: a question, a story's opening or a field journal of 2 to 20 days."""
    animal, place = ANIMALS[index % len(ANIMALS)], PLACES[(index * 3) % len(PLACES)]
    kind = index % 4
    if kind == 0:
        return f"Question: why does the {animal} live near the {place}?\nAnswer:"
    if kind == 1:
        return (f"Once upon a time, a young {animal} left the {place} where it was born, because the winter "
                f"had been long and the food scarce. On the first day of its journey,")
    days = 2 + (index // 4 * 5) % 19 if kind == 2 else 4 + (index // 4 * 7) % 17  # the first few short
    lines = [f"Field journal of a naturalist, kept near the {place}.\n"]
    for day in range(days):
        seen = ANIMALS[(index + day) % len(ANIMALS)]
        lines.append(f"Day {day + 1}: I watched a {seen} for {day % 7 + 2} hours; it moved "
                     f"{['slowly', 'quickly', 'carefully'][day % 3]} and ate {day % 5 + 1} times.")
    lines.append("\nSummary of these days, in one paragraph:")
    return "\n".join(lines)


def make_prompts(model: str, count: int) -> list[list[int]]:
    """The token ids of the first ``count`` prompts (:func:`prompt_text`), with the tokenizer's special tokens."""
    from splitserve.engine.model_store import load_tokenizer

    tokenizer = load_tokenizer(model)
    return [tokenizer.encode(prompt_text(index)) for index in range(count)]


def make_adapters(model: str, directory: str, count: int, rank: int) -> list[str]:
    """Save ``count`` random PEFT LoRA adapters of ``model`` in ``directory``/adapter-<i> (overwriting any there):
    rank ``rank``, alpha ``2 * rank``, every projection, B from N(0, ADAPTER_B_STD) with seed 1 + i. Returns
    their paths."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for index in range(count):
        torch.manual_seed(1 + index)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS, lora_dropout=0.0)
        adapted = get_peft_model(base, config)
        with torch.no_grad():
            for name, parameter in adapted.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0.0, ADAPTER_B_STD)
        path = os.path.join(directory, f"adapter-{index}")
        adapted.save_pretrained(path)
        paths.append(path)
    return paths


def max_lora_rank_for(rank: int) -> int:
    """The smallest max_lora_rank vLLM accepts (``SUPPORTED_MAX_RANKS``) that is at least ``rank``."""
    from splitserve.engine.lora import SUPPORTED_MAX_RANKS

    fitting = [value for value in SUPPORTED_MAX_RANKS if value >= rank]
    if not fitting:
        raise SystemExit(f"--rank {rank} is above the highest max_lora_rank vLLM accepts ({SUPPORTED_MAX_RANKS[-1]})")
    return fitting[0]


# Runs inside the vLLM venv: loads the model with LoRA, runs the workload once untimed, then answers "run" or "quit"
# (one a line on stdin) with one JSON line behind a marker on stdout (vLLM logs to stdout too).
VLLM_PEER_SCRIPT = r"""
import json, sys, time

import vllm
from peer_loop import serve
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest


def main():
    config_path, marker = sys.argv[1], sys.argv[2]
    with open(config_path) as file:
        config = json.load(file)
    llm = LLM(model=config["model"], dtype=config["dtype"], seed=0, max_model_len=config["max_model_len"],
              enable_prefix_caching=False, enable_lora=True, max_loras=config["max_loras"],
              max_cpu_loras=config["max_cpu_loras"], max_lora_rank=config["max_lora_rank"])
    adapters = [LoRARequest(f"adapter-{index}", index + 1, path) for index, path in enumerate(config["adapters"])]
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in config["prompts"]]
    params = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"], ignore_eos=True)
    lora_requests = [adapters[index % len(adapters)] for index in range(len(prompts))]

    def run():
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_requests)
        return time.perf_counter() - start, [list(output.outputs[0].token_ids) for output in outputs]

    def timed_run(_):
        seconds, token_ids = run()
        return {"seconds": seconds, "token_ids": token_ids}

    run()
    serve(marker, vllm.__version__, {"run": timed_run})


if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep this guard
    main()
"""
VLLM_PEER_MARKER = "@@lora@@ "


class Splitserve:
    """splitserve's offline engine: without LoRA (``adapters`` None), or with request i on adapter i % K."""

    def __init__(self, name: str, model: str, dtype: str, prompts: list[list[int]], max_tokens: int,
                 max_model_len: int, adapters: list[str] | None, max_loras: int, max_lora_rank: int) -> None:
        from splitserve import LLM, LoRARequest

        self.name = name
        options = {}
        self.lora_requests = None
        if adapters:
            options = {"enable_lora": True, "max_loras": max_loras, "max_cpu_loras": len(adapters),
                       "max_lora_rank": max_lora_rank}
            requests = [LoRARequest(f"adapter-{index}", index + 1, path) for index, path in enumerate(adapters)]
            self.lora_requests = [requests[index % len(requests)] for index in range(len(prompts))]
        self.llm = LLM(model, dtype=dtype, max_model_len=max_model_len, enable_prefix_caching=False, **options)
        self.prompts = [{"prompt_token_ids": prompt} for prompt in prompts]
        self.max_tokens = max_tokens
        self.run()  # warm-up: the first run maps the KV cache's pages and loads the adapters

    def run(self) -> tuple[float, list[list[int]]]:
        from splitserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, params, use_tqdm=False, lora_request=self.lora_requests)
        return time.perf_counter() - start, [list(output.outputs[0].token_ids) for output in outputs]

    def close(self) -> None:
        pass


class VllmPeer:
    """vLLM-CPU with LoRA, in its own venv (offline_throughput's :class:`PeerProcess`)."""

    name = "vllm lora"

    def __init__(self, python: str, model: str, dtype: str, prompts: list[list[int]], max_tokens: int,
                 max_model_len: int, adapters: list[str], max_loras: int, max_lora_rank: int,
                 threads_bind: str) -> None:
        config = {"model": model, "dtype": dtype, "prompts": prompts, "max_tokens": max_tokens,
                  "max_model_len": max_model_len, "adapters": adapters, "max_loras": max_loras,
                  "max_cpu_loras": len(adapters), "max_lora_rank": max_lora_rank}
        self.peer = PeerProcess(python, VLLM_PEER_SCRIPT, config, VLLM_PEER_MARKER, threads_bind=threads_bind,
                                kv_space_gib=4)
        self.version = self.peer.version

    def run(self) -> tuple[float, list[list[int]]]:
        message = self.peer.request("run", "run")
        return message["seconds"], message["token_ids"]

    def close(self) -> None:
        self.peer.close()


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The index of the first token at which two answers differ (the shorter one's length if one is a prefix of
    the other), or None where they are identical."""
    if ours == theirs:
        return None
    return next((index for index, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="The vLLM peer runs with VLLM_CPU_OMP_THREADS_BIND=<--vllm-threads-bind>, "
                                     "VLLM_USE_AOT_COMPILE=0\nand VLLM_CPU_KVCACHE_SPACE=4 (GiB). Progress goes to "
                                     "stderr, the results table to stdout;\nthe machine may be shared, so compare "
                                     "numbers within one run only.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face Llama-family directory (default: SmolLM2-135M)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights, adapters and KV cache of every system (default: %(default)s, where greedy ids "
                        "should mostly agree between engines)")
    parser.add_argument("--num-prompts", type=int, default=32,
                        help="requests, all in one generate (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="output tokens of every request, EOS ignored (default: %(default)s)")
    parser.add_argument("--num-adapters", type=int, default=4,
                        help="K, the random LoRA adapters made; request i runs adapter i %% K (default: %(default)s)")
    parser.add_argument("--max-loras", type=int, default=None,
                        help="adapters one step may run, in both engines; fewer than K makes adapters take turns "
                        "(default: K)")
    parser.add_argument("--rank", type=int, default=8, help="rank of every adapter (default: %(default)s)")
    parser.add_argument("--adapter-dir", default=None, metavar="DIR",
                        help="make the adapters in DIR/adapter-<i>, overwriting any there, and keep them (default: "
                        "a temporary folder, removed at the end)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per system, interleaved, their order reversed each repeat (default: "
                        "%(default)s)")
    add_vllm_peer_arguments(parser)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the raw timings and answers to this JSON "
                        "file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.num_prompts, args.max_tokens, args.num_adapters, args.rank, args.repeats) < 1:
        raise SystemExit("--num-prompts, --max-tokens, --num-adapters, --rank and --repeats must be at least 1")
    max_loras = args.num_adapters if args.max_loras is None else args.max_loras
    if not 1 <= max_loras <= args.num_adapters:
        raise SystemExit(f"--max-loras must be from 1 to --num-adapters ({args.num_adapters}), got {max_loras}")
    max_lora_rank = max_lora_rank_for(args.rank)
    from splitserve.engine.model_store import prepare_default_model, resolve_model

    model = str(resolve_model(args.model)) if args.model else str(prepare_default_model())
    prompts = make_prompts(model, args.num_prompts)
    max_model_len = max(len(prompt) for prompt in prompts) + args.max_tokens + 16
    load_before = os.getloadavg()[0]
    temporary = None if args.adapter_dir else tempfile.TemporaryDirectory(prefix="splitserve-lora-bench-")
    adapter_dir = args.adapter_dir or temporary.name
    lengths = sorted(map(len, prompts))
    log(f"model {model}; {args.num_prompts} prompts ({lengths[0]}-{lengths[-1]} tokens, {sum(lengths)} in all) in one "
        f"generate, greedy, {args.max_tokens} tokens each, {args.dtype}; making {args.num_adapters} rank-{args.rank} "
        f"adapters in {adapter_dir}")
    systems: list = []
    timings: dict[str, list[float]] = {}
    answers: dict[str, list[list[int]]] = {}
    vllm_version = None
    try:
        adapters = make_adapters(model, adapter_dir, args.num_adapters, args.rank)
        systems.append(Splitserve("splitserve", model, args.dtype, prompts, args.max_tokens, max_model_len, None,
                                  max_loras, max_lora_rank))
        systems.append(Splitserve("splitserve lora", model, args.dtype, prompts, args.max_tokens, max_model_len,
                                  adapters, max_loras, max_lora_rank))
        if args.vllm_python:
            log("starting the vLLM peer (its first start compiles for minutes)")
            peer = VllmPeer(args.vllm_python, model, args.dtype, prompts, args.max_tokens, max_model_len, adapters,
                            max_loras, max_lora_rank, args.vllm_threads_bind or default_vllm_threads_bind())
            systems.append(peer)
            vllm_version = peer.version
        for repeat in range(args.repeats):
            for system in systems if repeat % 2 == 0 else systems[::-1]:
                seconds, answers[system.name] = system.run()
                timings.setdefault(system.name, []).append(seconds)
                log(f"repeat {repeat + 1}/{args.repeats} {system.name}: {seconds:.2f} s, "
                    f"{sum(map(len, answers[system.name]))} tokens")
    finally:
        for system in systems:
            system.close()
        if temporary is not None:
            temporary.cleanup()

    tokens = {name: sum(map(len, ids)) for name, ids in answers.items()}

    def rate(name: str) -> float:
        return tokens[name] / statistics.median(timings[name])

    def paired(ours: str, theirs: str) -> list[float]:
        return [(tokens[ours] / a) / (tokens[theirs] / b) for a, b in zip(timings[ours], timings[theirs])]

    count = len(prompts)
    print(f"\nMulti-LoRA: {count} requests in one generate ({lengths[0]}-{lengths[-1]} prompt tokens), greedy, "
          f"{args.max_tokens} tokens each, {args.dtype}; {args.num_adapters} adapters of rank {args.rank} on every "
          f"projection, request i on adapter i % {args.num_adapters}, max_loras {max_loras}; medians of "
          f"{args.repeats}; load average {load_before:.2f} at the start\n")
    print("| system | output tok/s | ms per output token | tokens |")
    print("|---|---|---|---|")
    for name in timings:
        print(f"| {name} | {rate(name):.1f} | {1000 / rate(name):.2f} | {tokens[name]} |")
    changed = sum(a != b for a, b in zip(answers["splitserve"], answers["splitserve lora"]))
    report = {"args": vars(args), "max_loras": max_loras, "max_lora_rank": max_lora_rank, "vllm_version": vllm_version,
              "prompt_lens": [len(prompt) for prompt in prompts], "tokens": tokens, "timings": timings,
              "answers": answers, "changed_by_adapters": changed,
              "ratios": {"splitserve lora / splitserve": rate("splitserve lora") / rate("splitserve")}}
    print(f"\nsplitserve lora / splitserve: {rate('splitserve lora') / rate('splitserve'):.2f}x (repeat by repeat "
          f"{', '.join(f'{ratio:.2f}' for ratio in paired('splitserve lora', 'splitserve'))}); the adapters changed "
          f"the greedy token ids of {changed}/{count} requests")
    if "vllm lora" in timings:
        parts = [first_difference(a, b) for a, b in zip(answers["splitserve lora"], answers["vllm lora"])]
        parted = sorted(index for index in parts if index is not None)
        vllm_changed = sum(a != b for a, b in zip(answers["splitserve"], answers["vllm lora"]))
        report["ratios"]["splitserve lora / vllm lora"] = rate("splitserve lora") / rate("vllm lora")
        report.update(identical_to_vllm=count - len(parted), first_differences=parts,
                      vllm_differs_from_base=vllm_changed)
        print(f"splitserve lora / vLLM lora: {rate('splitserve lora') / rate('vllm lora'):.2f}x (repeat by repeat "
              f"{', '.join(f'{ratio:.2f}' for ratio in paired('splitserve lora', 'vllm lora'))}); greedy token ids "
              f"identical for {count - len(parted)}/{count} requests"
              + (f" (the others part at token {', '.join(map(str, parted))})" if parted else "")
              + f"; vLLM lora differs from splitserve without adapters in {vllm_changed}/{count}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
