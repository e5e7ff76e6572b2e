"""Speculative decoding by n-gram prompt lookup: splitserve with and without it, and vLLM-CPU with it, on requests
whose answers repeat their prompts; with ``--json-schema``, every answer under a JSON schema (structured outputs
speculate: each row masked by its grammar).

Workload (the same for every system, in the same run): ``--num-prompts`` chat prompts that ask for a text back
with little changed (copy a paragraph, rename a function in a piece of code, turn a list into JSON, fix a
paragraph's spelling), the model's chat template applied here so every system gets the same token ids, greedy
(or sampled at ``--temperature``, request i with seed 1000 + i), at most ``--max-tokens`` tokens each. Requests run one at a time (batch 1: the latency speculation is for), or
with ``--batched`` all in one ``generate``. ``--json-schema`` constrains every answer to
``{"answer": "..."}`` (``ANSWER_SCHEMA``) on every system: the copied text inside a JSON string (vLLM with its
llguidance backend, whose grammar is splitserve's). The baseline measured beside it in the same process is the same
engine without speculation; the speculating engines take ``--speculative-config`` (vLLM's JSON, default
``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}``).

Repeats interleave the systems and reverse their order each repeat, so a host drifting in speed favours none.
Reported: output tokens per second of each system (medians), ngram over plain for splitserve, splitserve over
vLLM with speculation, splitserve's drafts accepted, and for how many requests the token ids are identical
between splitserve with and without drafts (greedy they must all be; seeded, a sampled token draws one number with
or without drafts, so they are too, but for the logits' rounding in a step of several rows, which over the whole
vocabulary at temperature 1 now and then moves a token onto a neighbour: ``--top-k`` keeps to the likeliest) and,
greedy, between splitserve and vLLM.

Usage::

    python benchmarks/speculative.py
    python benchmarks/speculative.py --vllm-python ~/.cache/splitserve-peers/vllm/bin/python --repeats 3

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

DEFAULT_SPECULATIVE_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4}
# --json-schema: every answer a JSON object whose one field holds the text.
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
                 "additionalProperties": False}
ANIMALS = ["fox", "owl", "whale", "tiger", "heron", "otter", "lynx", "crane"]
PLACES = ["river", "forest", "desert", "harbor", "valley", "glacier", "meadow", "canyon"]
NAMES = ["Alice", "Bob", "Carol", "Dave", "Eve", "Frank", "Grace", "Heidi", "Ivan", "Judy"]
CODE = '''def {name}(values):
    total = 0
    for value in values:
        total += value
    return total / len(values)


def spread(values):
    center = {name}(values)
    total = 0
    for value in values:
        total += (value - center) ** 2
    return total / len(values)
'''


def task(index: int) -> str:
    """The ``index``-th request's message: one of four kinds of near-copy, its details varied by ``index``."""
    animal, place = ANIMALS[index % len(ANIMALS)], PLACES[(index * 3) % len(PLACES)]
    kind = index % 4
    if kind == 0:
        return (f"Copy this text exactly:\nThe quick brown {animal} crosses the {place} at dawn. The {place} is "
                f"quiet and cold. The {animal} drinks from the {place} and sleeps under the old oak tree.")
    if kind == 1:
        name = ["mean", "average", "middle", "centre"][index // 4 % 4]
        return (f"Rename the function `{name}` to `{name}_of` everywhere in this code and return the whole "
                f"code:\n\n```python\n{CODE.format(name=name)}```")
    if kind == 2:
        people = "\n".join(f"{NAMES[(index + offset) % len(NAMES)]}, {20 + (index * 7 + offset * 5) % 50}"
                           for offset in range(5))
        return f"Convert this list to JSON with keys name and age:\n{people}"
    return (f"Fix the spelling in this text and return it whole:\nThe {animal} lived neer the {place} for many "
            f"yaers. Evry morning it walked to the {place} and back agian, and evry evening it slept.")


def chat_prompts(model: str, count: int) -> list[list[int]]:
    from splitserve.engine.model_store import load_tokenizer

    tokenizer = load_tokenizer(model)
    prompts = []
    for index in range(count):
        text = tokenizer.apply_chat_template([{"role": "user", "content": task(index)}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


# Runs inside the vLLM venv: loads the model with the speculative config, warms up, then answers "run" or "quit"
# (one a line on stdin) with one JSON line behind a marker on stdout (vLLM logs to stdout too).
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
    # Under a JSON schema, vLLM's llguidance backend: the grammar splitserve builds (the same whitespace rules),
    # where its default (xgrammar) would let greedy answers differ in their whitespace.
    backend = {"structured_outputs_config": {"backend": "guidance"}} if config["json_schema"] is not None else {}
    llm = LLM(model=config["model"], dtype=config["dtype"], seed=0, max_model_len=config["max_model_len"],
              speculative_config=config["speculative_config"], **backend)
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt in config["prompts"]]
    constraint = {}
    if config["json_schema"] is not None:
        from vllm.sampling_params import StructuredOutputsParams

        constraint = {"structured_outputs": StructuredOutputsParams(json=config["json_schema"])}
    params = [SamplingParams(temperature=config["temperature"], max_tokens=config["max_tokens"], seed=1000 + index,
                             **config["sampling"], **constraint)
              for index in range(len(prompts))]

    def run():
        start = time.perf_counter()
        if config["batched"]:
            outputs = llm.generate(prompts, params, use_tqdm=False)
        else:
            outputs = [llm.generate([prompt], [param], use_tqdm=False)[0] for prompt, param in zip(prompts, params)]
        return time.perf_counter() - start, [list(output.outputs[0].token_ids) for output in outputs]

    def timed_run(_):
        seconds, token_ids = run()
        return {"seconds": seconds, "token_ids": token_ids}

    run()
    serve(marker, vllm.__version__, {"run": timed_run})


if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep this guard
    main()
"""
VLLM_PEER_MARKER = "@@speculative@@ "


class Splitserve:
    """splitserve's offline engine, with ``speculative_config`` or without (None)."""

    def __init__(self, name: str, model: str, dtype: str, prompts: list[list[int]], max_tokens: int,
                 max_model_len: int, speculative_config: dict | None, batched: bool, temperature: float,
                 json_schema: dict | None = None, sampling: dict | None = None) -> None:
        from splitserve import LLM

        self.name = name
        self.json_schema = json_schema
        self.llm = LLM(model, dtype=dtype, max_model_len=max_model_len, speculative_config=speculative_config)
        self.prompts = [{"prompt_token_ids": prompt} for prompt in prompts]
        self.max_tokens = max_tokens
        self.batched = batched
        self.temperature = temperature
        self.sampling = sampling or {}  # more SamplingParams fields (top_k, frequency_penalty), alike on every system
        self.run()  # warm-up: the first run maps the KV cache's pages

    def run(self) -> tuple[float, list[list[int]]]:
        from splitserve import SamplingParams

        constraint = {} if self.json_schema is None else {"structured_outputs": {"json": self.json_schema}}
        params = [SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, seed=1000 + index,
                                 **self.sampling, **constraint)
                  for index in range(len(self.prompts))]
        start = time.perf_counter()
        if self.batched:
            outputs = self.llm.generate(self.prompts, params, use_tqdm=False)
        else:
            outputs = [self.llm.generate(prompt, param, use_tqdm=False)[0]
                       for prompt, param in zip(self.prompts, params)]
        return time.perf_counter() - start, [list(output.outputs[0].token_ids) for output in outputs]

    def close(self) -> None:
        pass


class VllmPeer:
    """vLLM-CPU with the speculative config, in its own venv (offline_throughput's :class:`PeerProcess`)."""

    name = "vllm ngram"

    def __init__(self, python: str, model: str, dtype: str, prompts: list[list[int]], max_tokens: int,
                 max_model_len: int, speculative_config: dict, batched: bool, temperature: float,
                 threads_bind: str, json_schema: dict | None = None, sampling: dict | None = None) -> None:
        config = {"model": model, "dtype": dtype, "prompts": prompts, "max_tokens": max_tokens,
                  "max_model_len": max_model_len, "batched": batched, "temperature": temperature,
                  "sampling": sampling or {},
                  "json_schema": json_schema,
                  # The fields set only: vLLM V1's config has no disable_by_batch_size, and refuses the key.
                  "speculative_config": {key: value for key, value in speculative_config.items() if value is not None}}
        self.peer = PeerProcess(python, VLLM_PEER_SCRIPT, config, VLLM_PEER_MARKER, threads_bind=threads_bind,
                                kv_space_gib=4)

    def run(self) -> tuple[float, list[list[int]]]:
        message = self.peer.request("run", "run")
        return message["seconds"], message["token_ids"]

    def close(self) -> None:
        self.peer.close()


def without_trailing(token_ids: list[int], eos_token_ids: set[int]) -> list[int]:
    """``token_ids`` without a last end-of-sequence token."""
    return token_ids[:-1] if token_ids and token_ids[-1] in eos_token_ids else token_ids


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Hugging Face Llama-family directory (default: SmolLM2-135M)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights and KV cache (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=12, help="requests per run (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=128, help="most tokens of an answer (default: %(default)s)")
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPECULATIVE_CONFIG), metavar="JSON",
                        help="the speculating engines' config, vLLM's JSON (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 is greedy; above it each request samples with seed 1000 + its index: splitserve's "
                        "tokens are the same with and without drafts, vLLM's differ (default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0,
                        help="with --temperature, sample among the K likeliest tokens only; 0 is the whole vocabulary "
                        "(default: %(default)s)")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="every request's frequency penalty, -2 to 2 (a penalised request speculates too: each row "
                        "of a step penalised as if the drafts before it were output; default: %(default)s)")
    parser.add_argument("--batched", action="store_true",
                        help="all requests in one generate (default: one at a time, batch 1)")
    parser.add_argument("--json-schema", action="store_true",
                        help='every answer under the JSON schema {"answer": string} on every system (structured '
                        "outputs with and without drafts; default: plain text)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per system (default: %(default)s)")
    add_vllm_peer_arguments(parser)
    parser.add_argument("--json", default=None, metavar="OUT", help="write the raw timings to this JSON file")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1 or args.repeats < 1:
        raise SystemExit("--num-prompts, --max-tokens and --repeats must be at least 1")
    from splitserve.common.model_info import ModelConfig
    from splitserve.engine.model_store import prepare_default_model, resolve_model
    from splitserve.engine.speculative import SpeculativeConfig

    try:
        speculative = json.loads(SpeculativeConfig.of(args.speculative_config).to_json())
    except ValueError as error:
        raise SystemExit(f"--speculative-config: {error}") from None
    model = str(resolve_model(args.model)) if args.model else str(prepare_default_model())
    prompts = chat_prompts(model, args.num_prompts)
    max_model_len = max(len(prompt) for prompt in prompts) + args.max_tokens + 16
    mode = "all at once" if args.batched else "one at a time"
    sampling = "greedy" if args.temperature == 0 else f"temperature {args.temperature:g}"
    extra = {}  # SamplingParams fields beyond the temperature, the same on every system
    if args.temperature and args.top_k:
        sampling, extra["top_k"] = sampling + f", top-k {args.top_k}", args.top_k
    if args.frequency_penalty:
        sampling, extra["frequency_penalty"] = (sampling + f", frequency penalty {args.frequency_penalty:g}",
                                                args.frequency_penalty)
    schema = ANSWER_SCHEMA if args.json_schema else None
    if schema is not None:
        sampling += ", under a JSON schema"
    log(f"model {model}; {args.num_prompts} near-copy chat prompts {mode}, {sampling}, at most {args.max_tokens} "
        f"tokens, {args.dtype}; speculation {json.dumps(speculative)}")
    plain = Splitserve("splitserve", model, args.dtype, prompts, args.max_tokens, max_model_len, None, args.batched,
                       args.temperature, schema, extra)
    ngram = Splitserve("splitserve ngram", model, args.dtype, prompts, args.max_tokens, max_model_len, speculative,
                       args.batched, args.temperature, schema, extra)
    systems = [plain, ngram]
    timings: dict[str, list[float]] = {}
    answers: dict[str, list[list[int]]] = {}
    try:
        if args.vllm_python:
            log("starting the vLLM peer (its first start compiles for minutes)")
            systems.append(VllmPeer(args.vllm_python, model, args.dtype, prompts, args.max_tokens, max_model_len,
                                    speculative, args.batched, args.temperature,
                                    args.vllm_threads_bind or default_vllm_threads_bind(), schema, extra))
        stats = ngram.llm.engine.stats
        drafts_before, accepted_before = stats.num_draft_tokens, stats.num_accepted_tokens
        for repeat in range(args.repeats):
            for system in systems if repeat % 2 == 0 else systems[::-1]:
                seconds, answers[system.name] = system.run()
                timings.setdefault(system.name, []).append(seconds)
                log(f"repeat {repeat + 1}/{args.repeats} {system.name}: {seconds:.2f} s, "
                    f"{sum(map(len, answers[system.name]))} tokens")
        drafts = stats.num_draft_tokens - drafts_before
        accepted = stats.num_accepted_tokens - accepted_before
    finally:
        for system in systems:
            system.close()

    tokens = {name: sum(map(len, ids)) for name, ids in answers.items()}

    def rate(name: str) -> float:
        return tokens[name] / statistics.median(timings[name])

    print(f"\nSpeculative decoding: {args.num_prompts} near-copy chat requests {mode}, {sampling}, {args.dtype}, "
          f"medians of {args.repeats}; {json.dumps(speculative)}\n")
    print("| system | output tok/s | ms per output token | tokens |")
    print("|---|---|---|---|")
    for name in timings:
        print(f"| {name} | {rate(name):.1f} | {1000 / rate(name):.2f} | {tokens[name]} |")
    identical = sum(a == b for a, b in zip(answers["splitserve"], answers["splitserve ngram"]))
    paired = [(tokens["splitserve ngram"] / b) / (tokens["splitserve"] / a)
              for a, b in zip(timings["splitserve"], timings["splitserve ngram"])]
    print(f"\nsplitserve ngram / splitserve: {rate('splitserve ngram') / rate('splitserve'):.2f}x (repeat by repeat "
          f"{', '.join(f'{ratio:.2f}' for ratio in paired)}); drafts accepted {accepted}/{drafts} "
          f"({accepted / max(drafts, 1):.0%}); {'greedy' if args.temperature == 0 else 'seeded'} token ids "
          f"identical for {identical}/{len(prompts)} requests")
    if "vllm ngram" in timings:
        eos = set(ModelConfig.from_model_dir(model).eos_token_ids)
        same = sum(without_trailing(a, eos) == without_trailing(b, eos)
                   for a, b in zip(answers["splitserve ngram"], answers["vllm ngram"]))
        theirs = [(tokens["splitserve ngram"] / a) / (tokens["vllm ngram"] / b)
                  for a, b in zip(timings["splitserve ngram"], timings["vllm ngram"])]
        print(f"splitserve ngram / vLLM ngram: {rate('splitserve ngram') / rate('vllm ngram'):.2f}x (repeat by "
              f"repeat {', '.join(f'{ratio:.2f}' for ratio in theirs)})" + (
                  f"; greedy token ids identical for {same}/{len(prompts)} requests" if args.temperature == 0 else ""))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"tokens": tokens, "timings": timings, "answers": answers, "drafts": drafts,
                       "accepted": accepted}, file, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
