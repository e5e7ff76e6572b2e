"""Offline throughput and batch-1 decode latency: splitserve against transformers.

Workload (the same for every system, in the same run):

* throughput: ``--num-requests`` prompts of random token ids (lengths uniform in
  [``--min-prompt``, ``--max-prompt``], ids in [100, vocab - 100) so no special
  tokens), ``--output-len`` tokens each, greedy, EOS ignored. splitserve gets
  them all in one ``LLM.generate``; transformers runs static batches of
  ``--hf-batch-size`` with left padding. Reported as output tokens per second.
* batch-1 latency: one prompt of ``--latency-prompt-len`` random ids,
  ``--latency-output-len`` output tokens; ms per output token after the first
  = (end-to-end time - time to first token) / (output tokens - 1).

Every measurement is repeated ``--repeats`` times, interleaving the systems and
reversing their order each repeat (splitserve, transformers, [vLLM], then [vLLM],
transformers, splitserve, ...), so that a host drifting in speed through the run
favours no system; medians are compared with the targets: throughput at least 4x
transformers', latency at most 1.15x. Each pair of systems is also compared
repeat by repeat (the two ran one after the other, on the host of that moment): those
paired ratios and their median are printed below the ratios of medians.

Before the first timed run each system is warmed up on two short prompts and then,
by default (``--warmup workload``), by one untimed run of the throughput workload:
splitserve's KV cache is mapped lazily and its first run would pay the page faults
of every block it first writes, which vLLM pays at start by zeroing its cache.

Usage::

    python benchmarks/offline_throughput.py
    python benchmarks/offline_throughput.py --num-requests 16 --repeats 1 --json out.json
    python benchmarks/offline_throughput.py --vllm-python ~/.cache/splitserve-peers/vllm/bin/python

Progress goes to stderr, the results table to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make the repository importable as splitserve
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from splitserve.engine.host_allocator import glibc_tunables  # noqa: E402

THROUGHPUT_TARGET = 4.0  # splitserve tok/s / transformers tok/s must reach this
LATENCY_TARGET = 1.15  # splitserve ms/token / transformers ms/token must not exceed this
SPECIAL_ID_MARGIN = 100  # prompt ids are drawn from [margin, vocab - margin)
BUSY_LOAD_AVERAGE = 0.5  # 1-minute load at the start above which the header warns
WARMUP_PROMPT_LEN = 32
WARMUP_OUTPUT_LEN = 8


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- data


@dataclass
class Workload:
    """Token-id prompts shared by every system."""

    prompts: list[list[int]]  # throughput requests
    output_len: int
    latency_prompt: list[int]
    latency_output_len: int
    warmup_prompts: list[list[int]]  # drawn apart from the others: no shared prefixes


@dataclass
class ThroughputRun:
    seconds: float
    num_output_tokens: int

    @property
    def tokens_per_second(self) -> float:
        return self.num_output_tokens / self.seconds


@dataclass
class LatencyRun:
    ttft_seconds: float  # time to first token
    e2e_seconds: float  # whole request, prompt in to last token out
    num_output_tokens: int

    @property
    def ms_per_output_token(self) -> float:
        return 1000.0 * (self.e2e_seconds - self.ttft_seconds) / (self.num_output_tokens - 1)


@dataclass
class SystemResult:
    """Everything measured for one system."""

    name: str
    throughput_runs: list[ThroughputRun] = field(default_factory=list)
    latency_runs: list[LatencyRun] = field(default_factory=list)
    output_token_ids: list[list[int]] | None = None  # from the last throughput run

    def tokens_per_second(self) -> list[float]:
        return [run.tokens_per_second for run in self.throughput_runs]

    def ms_per_token(self) -> list[float]:
        return [run.ms_per_output_token for run in self.latency_runs]

    def to_json(self) -> dict:
        return {
            "throughput_runs": [dict(asdict(r), tokens_per_second=r.tokens_per_second) for r in self.throughput_runs],
            "latency_runs": [dict(asdict(r), ms_per_output_token=r.ms_per_output_token) for r in self.latency_runs],
            "median_tokens_per_second": _median(self.tokens_per_second()),
            "median_ms_per_output_token": _median(self.ms_per_token()),
        }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    """Draw every prompt from one generator seeded with ``args.seed``."""
    rng = random.Random(args.seed)
    low, high = SPECIAL_ID_MARGIN, vocab_size - SPECIAL_ID_MARGIN

    def random_prompt(length: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(length)]

    prompts = [random_prompt(rng.randint(args.min_prompt, args.max_prompt)) for _ in range(args.num_requests)]
    return Workload(
        prompts=prompts,
        output_len=args.output_len,
        latency_prompt=random_prompt(args.latency_prompt_len),
        latency_output_len=args.latency_output_len,
        warmup_prompts=[random_prompt(WARMUP_PROMPT_LEN) for _ in range(2)],
    )


def _check_output_lengths(system: str, token_ids: list[list[int]], expected: int) -> int:
    """Total output tokens; raises unless every request produced exactly ``expected`` (EOS ignored)."""
    wrong = [i for i, ids in enumerate(token_ids) if len(ids) != expected]
    if wrong:
        raise RuntimeError(
            f"{system}: {len(wrong)} requests did not produce exactly {expected} tokens "
            f"(e.g. request {wrong[0]}: {len(token_ids[wrong[0]])}); is EOS ignored?"
        )
    return sum(len(ids) for ids in token_ids)


# ----------------------------------------------------------------------------- splitserve


class SplitserveRunner:
    """splitserve's offline ``LLM``, built once and reused for every repeat."""

    name = "splitserve"

    def __init__(self, model_path: str, engine_kwargs: dict, workload: Workload, dtype: str = "float32") -> None:
        from splitserve import LLM

        self.workload = workload
        self.llm = LLM(model=model_path, dtype=dtype, **engine_kwargs)

    def _generate(self, prompts: list[list[int]], max_tokens: int, use_tqdm: bool = False) -> list:
        from splitserve import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=use_tqdm)

    def warm_up(self) -> None:
        self._generate(self.workload.warmup_prompts, WARMUP_OUTPUT_LEN)

    def run_throughput(self) -> tuple[ThroughputRun, list[list[int]]]:
        start = time.perf_counter()
        outputs = self._generate(self.workload.prompts, self.workload.output_len, use_tqdm=True)
        seconds = time.perf_counter() - start
        token_ids = [list(output.outputs[0].token_ids) for output in outputs]
        num_tokens = _check_output_lengths(self.name, token_ids, self.workload.output_len)
        return ThroughputRun(seconds, num_tokens), token_ids

    def run_latency(self) -> LatencyRun:
        (output,) = self._generate([self.workload.latency_prompt], self.workload.latency_output_len)
        metrics = output.metrics
        return LatencyRun(
            ttft_seconds=metrics.first_token_time - metrics.arrival_time,
            e2e_seconds=metrics.finished_time - metrics.arrival_time,
            num_output_tokens=len(output.outputs[0].token_ids),
        )

    def close(self) -> None:
        self.llm = None


# ----------------------------------------------------------------------------- transformers


class _FirstTokenTimer:
    """A transformers streamer (batch 1) that notes when the first new token is out.

    ``generate`` calls ``put`` once with the prompt, then once per generated token.
    """

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token_time: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.num_puts += 1
        if self.num_puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


class TransformersRunner:
    """transformers ``generate`` on static, left-padded batches."""

    name = "transformers"

    def __init__(self, model_path: str, batch_size: int, workload: Workload, dtype: str = "float32") -> None:
        from transformers import AutoModelForCausalLM

        self.workload = workload
        self.batch_size = batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).eval()
        eos = self.model.generation_config.eos_token_id
        self.pad_token_id = eos[0] if isinstance(eos, list) else eos

    def _generate(self, prompts: list[list[int]], max_new_tokens: int, streamer=None) -> list[list[int]]:
        """Greedy generation of exactly ``max_new_tokens`` per prompt, EOS ignored.

        ``eos_token_id=None`` removes the EOS stopping criterion, so EOS may be
        generated and kept, as with vLLM's ``ignore_eos``; ``min_new_tokens`` only
        matters if a transformers version brought the model's EOS back.
        """
        longest = max(len(p) for p in prompts)
        # Left padding: input_ids / attention_mask: [B, longest]
        input_ids = torch.tensor([[self.pad_token_id] * (longest - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            sequences = self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.pad_token_id,
                streamer=streamer,
            )
        return sequences[:, longest:].tolist()  # [B, max_new_tokens]

    def warm_up(self) -> None:
        self._generate(self.workload.warmup_prompts, WARMUP_OUTPUT_LEN)

    def run_throughput(self) -> tuple[ThroughputRun, list[list[int]]]:
        prompts, size = self.workload.prompts, self.batch_size
        batches = [prompts[i : i + size] for i in range(0, len(prompts), size)]
        token_ids: list[list[int]] = []
        start = time.perf_counter()
        for batch in tqdm(batches, desc="transformers batches", unit="batch", file=sys.stderr):
            token_ids.extend(self._generate(batch, self.workload.output_len))
        seconds = time.perf_counter() - start
        num_tokens = _check_output_lengths(self.name, token_ids, self.workload.output_len)
        return ThroughputRun(seconds, num_tokens), token_ids

    def run_latency(self) -> LatencyRun:
        timer = _FirstTokenTimer()
        start = time.perf_counter()
        (token_ids,) = self._generate([self.workload.latency_prompt], self.workload.latency_output_len, timer)
        e2e = time.perf_counter() - start
        return LatencyRun(ttft_seconds=timer.first_token_time - start, e2e_seconds=e2e,
                          num_output_tokens=len(token_ids))

    def close(self) -> None:
        self.model = None


# ----------------------------------------------------------------------------- vLLM peer

# The command loop every vLLM peer script ends with, written beside it as peer_loop.py (PeerProcess), which the
# script imports (vLLM's venv has no splitserve): "ready" with vLLM's version once the script calls it, then one
# reply a command line ("<command> [argument]") on stdin, each one JSON line on stdout behind the marker (vLLM
# logs to stdout too), until "quit".
PEER_LOOP = r"""
import json
import sys


def serve(marker, version, commands):
    def reply(message):
        print(marker + json.dumps(message), flush=True)

    reply({"event": "ready", "vllm_version": version})
    for line in sys.stdin:
        command, _, argument = line.strip().partition(" ")
        if command == "quit":
            return
        if command not in commands:
            raise ValueError(f"unknown command {command!r}")
        reply({"event": command, **commands[command](argument)})
"""

# Runs inside the vLLM venv. Loads the model once, warms up, then answers one
# command a line on stdin ("throughput", "latency", "quit"; peer_loop.serve). Errors end the process with
# a traceback on stderr. Time to first token is the time of a max_tokens=1
# generate (the offline LLM reports no per-request metrics by default).
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
    llm = LLM(model=config["model"], dtype=config["dtype"], seed=config["seed"], **config["engine_kwargs"])

    def generate(prompts, max_tokens, use_tqdm=False):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        requests = [TokensPrompt(prompt_token_ids=prompt) for prompt in prompts]
        start = time.perf_counter()
        outputs = llm.generate(requests, params, use_tqdm=use_tqdm)
        seconds = time.perf_counter() - start
        return seconds, [list(output.outputs[0].token_ids) for output in outputs]

    def throughput(_):
        seconds, token_ids = generate(config["prompts"], config["output_len"], use_tqdm=True)
        return {"seconds": seconds, "token_ids": token_ids}

    def latency(_):
        prompt = [config["latency_prompt"]]
        ttft, _ = generate(prompt, 1)
        e2e, token_ids = generate(prompt, config["latency_output_len"])
        return {"ttft_seconds": ttft, "e2e_seconds": e2e, "num_output_tokens": len(token_ids[0])}

    generate(config["warmup_prompts"], config["warmup_output_len"])
    serve(marker, vllm.__version__, {"throughput": throughput, "latency": latency})


if __name__ == "__main__":  # vLLM starts its engine core with spawn: keep this guard
    main()
"""
VLLM_PEER_MARKER = "@@offline_throughput@@ "


def add_vllm_peer_arguments(parser: argparse.ArgumentParser) -> None:
    """``--vllm-python`` and ``--vllm-threads-bind``, as a benchmark that runs vLLM beside splitserve takes them."""
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="python of a vLLM-CPU venv (built by /work/shared/tools/vllm-peer-setup); without it "
                        "splitserve runs alone")
    parser.add_argument("--vllm-threads-bind", default=None, metavar="CPUS",
                        help="VLLM_CPU_OMP_THREADS_BIND for the vLLM peer (default: as many CPUs as splitserve's "
                        f"torch threads, lowest first; here {default_vllm_threads_bind()})")


def default_vllm_threads_bind() -> str:
    """vLLM's OpenMP threads pinned one to a CPU, as many as splitserve's torch threads, on the CPUs this process
    may use (lowest first): e.g. "0,1" on two cores. vLLM's own default ("auto") reserves CPUs for its other
    processes, which would leave it fewer threads than splitserve."""
    cpus = sorted(os.sched_getaffinity(0))[: torch.get_num_threads()]
    return ",".join(str(cpu) for cpu in cpus)


class PeerProcess:
    """A script run by another venv's python (vLLM's), long-lived and driven over stdin/stdout: one command a line
    in, one JSON reply a line out behind ``marker`` (its other output, vLLM's logs, copied to stderr). The script
    reads its ``config`` from the JSON file named by its first argument, the marker is its second, and once loaded
    it hands its commands to ``peer_loop.serve`` (:data:`PEER_LOOP`, written beside it), which replies
    {"event": "ready", "vllm_version": ...} first; "quit" ends it."""

    def __init__(self, python: str, script: str, config: dict, marker: str, *, threads_bind: str,
                 kv_space_gib: int) -> None:
        self.marker = marker
        self.folder = tempfile.TemporaryDirectory(prefix="splitserve-vllm-peer-")
        script_path = os.path.join(self.folder.name, "vllm_peer.py")
        config_path = os.path.join(self.folder.name, "config.json")
        with open(script_path, "w") as file:
            file.write(script)
        with open(os.path.join(self.folder.name, "peer_loop.py"), "w") as file:
            file.write(PEER_LOOP)
        with open(config_path, "w") as file:
            json.dump(config, file)
        env = {name: value for name, value in os.environ.items() if name not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(VLLM_CPU_OMP_THREADS_BIND=threads_bind, VLLM_USE_AOT_COMPILE="0",
                   VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib), PYTHONUNBUFFERED="1")
        # The malloc settings splitserve's engine makes in-process (engine/host_allocator.py), so that
        # neither system pays page faults the other does not; vLLM's guide gets the same from tcmalloc.
        env.setdefault("GLIBC_TUNABLES", glibc_tunables())
        # stderr (vLLM's progress bars, tracebacks) goes straight to ours.
        self.process = subprocess.Popen([python, script_path, config_path, marker], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env, cwd=self.folder.name)
        try:
            self.version = self.wait_for("ready")["vllm_version"]
        except BaseException:
            self.close()
            raise
        log(f"vLLM {self.version} ready")

    def wait_for(self, event: str) -> dict:
        """Read the peer's stdout until its next reply; its log lines are copied to stderr."""
        for line in self.process.stdout:
            if line.startswith(self.marker):
                message = json.loads(line[len(self.marker):])
                if message.get("event") != event:
                    raise RuntimeError(f"vLLM peer replied {message.get('event')!r}, expected {event!r}")
                return message
            sys.stderr.write(f"[vllm] {line}")
        code = self.process.wait()
        raise RuntimeError(f"the vLLM peer exited with code {code} before replying {event!r}; "
                           "its traceback is above")

    def request(self, command: str, event: str) -> dict:
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        return self.wait_for(event)

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write("quit\n")
                self.process.stdin.flush()
                self.process.wait(timeout=120)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.folder.cleanup()


class VllmPeer:
    """vLLM in its own venv (a :class:`PeerProcess`).

    The model is loaded (and compiled) once; every repeat sends one command, so
    vLLM's runs interleave with the other systems'.
    """

    name = "vllm"

    def __init__(self, python: str, model_path: str, workload: Workload, engine_kwargs: dict,
                 kv_space_gib: int, seed: int, dtype: str = "float32", *, threads_bind: str) -> None:
        self.workload = workload
        config = {"model": model_path, "seed": seed, "dtype": dtype, "engine_kwargs": engine_kwargs,
                  "prompts": workload.prompts, "output_len": workload.output_len,
                  "latency_prompt": workload.latency_prompt, "latency_output_len": workload.latency_output_len,
                  "warmup_prompts": workload.warmup_prompts, "warmup_output_len": WARMUP_OUTPUT_LEN}
        self.peer = PeerProcess(python, VLLM_PEER_SCRIPT, config, VLLM_PEER_MARKER, threads_bind=threads_bind,
                                kv_space_gib=kv_space_gib)
        self.version = self.peer.version

    def warm_up(self) -> None:
        pass  # done by the peer before it reports ready

    def run_throughput(self) -> tuple[ThroughputRun, list[list[int]]]:
        reply = self.peer.request("throughput", "throughput")
        token_ids = reply["token_ids"]
        num_tokens = _check_output_lengths(self.name, token_ids, self.workload.output_len)
        return ThroughputRun(reply["seconds"], num_tokens), token_ids

    def run_latency(self) -> LatencyRun:
        reply = self.peer.request("latency", "latency")
        return LatencyRun(reply["ttft_seconds"], reply["e2e_seconds"], reply["num_output_tokens"])

    def close(self) -> None:
        self.peer.close()


# ----------------------------------------------------------------------------- reporting


def _spread(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def paired_ratios(ours: list[float], theirs: list[float]) -> list[float]:
    """ours[i] / theirs[i] for each repeat both measured."""
    return [a / b for a, b in zip(ours, theirs) if b]


def compare(ours: SystemResult, theirs: SystemResult, with_targets: bool) -> dict:
    """Ratios of medians ours/theirs, with PASS/MISS when ``with_targets``, and the ratios repeat by repeat
    (``*_ratios``) with their median (``*_paired_median``)."""
    comparison: dict = {"ours": ours.name, "theirs": theirs.name}
    for kind, values_of in (("throughput", SystemResult.tokens_per_second), ("latency", SystemResult.ms_per_token)):
        ratios = paired_ratios(values_of(ours), values_of(theirs))
        if ratios:
            comparison[f"{kind}_ratios"] = ratios
            comparison[f"{kind}_paired_median"] = statistics.median(ratios)
    ours_tps, theirs_tps = _median(ours.tokens_per_second()), _median(theirs.tokens_per_second())
    if ours_tps and theirs_tps:
        ratio = ours_tps / theirs_tps
        comparison["throughput_ratio"] = ratio
        if with_targets:
            comparison["throughput_pass"] = ratio >= THROUGHPUT_TARGET
    ours_ms, theirs_ms = _median(ours.ms_per_token()), _median(theirs.ms_per_token())
    if ours_ms and theirs_ms:
        ratio = ours_ms / theirs_ms
        comparison["latency_ratio"] = ratio
        if with_targets:
            comparison["latency_pass"] = ratio <= LATENCY_TARGET
    if ours.output_token_ids is not None and theirs.output_token_ids is not None:
        pairs = list(zip(ours.output_token_ids, theirs.output_token_ids, strict=True))
        comparison["num_requests"] = len(pairs)
        comparison["identical_requests"] = sum(a == b for a, b in pairs)
        comparison["differing_requests"] = [i for i, (a, b) in enumerate(pairs) if a != b]
    return comparison


def _ratio_cell(comparison: dict, kind: str, target: str) -> str:
    """'3.21x >=4x MISS' when the pair has a target, '3.21x' when informative, '-' when unmeasured."""
    if f"{kind}_ratio" not in comparison:
        return "-"
    cell = f"{comparison[f'{kind}_ratio']:.2f}x"
    if f"{kind}_pass" in comparison:
        cell += f" {target} {'PASS' if comparison[f'{kind}_pass'] else 'MISS'}"
    return cell


def print_report(results: list[SystemResult], comparisons: list[dict], header: list[str]) -> None:
    """The results table, on stdout."""
    print()
    for line in header:
        print(line)
    print()
    print(f"{'system':<24} {'output tok/s: median (min-max)':>32} {'batch-1 ms/token: median (min-max)':>36}")
    for result in results:
        print(f"{result.name:<24} {_spread(result.tokens_per_second(), 1):>32} {_spread(result.ms_per_token(), 2):>36}")
    print()
    if not comparisons:
        print("no other system ran: targets not checked")
        sys.stdout.flush()
        return
    print(f"{'ratio (medians)':<24} {'throughput, higher better':>32} {'latency, lower better':>36}   greedy ids identical")
    for comparison in comparisons:
        pair = f"{comparison['ours']}/{comparison['theirs']}"
        throughput = _ratio_cell(comparison, "throughput", f">={THROUGHPUT_TARGET:g}x")
        latency = _ratio_cell(comparison, "latency", f"<={LATENCY_TARGET:g}x")
        identical = (f"{comparison['identical_requests']}/{comparison['num_requests']}"
                     if "identical_requests" in comparison else "-")
        print(f"{pair:<24} {throughput:>32} {latency:>36}   {identical}")
    print("targets apply to splitserve/transformers; other ratios and the id agreement are informative")
    print()
    print("repeat by repeat (each pair ran one after the other in the same repeat):")
    for comparison in comparisons:
        parts = [f"{kind} {' '.join(f'{ratio:.2f}x' for ratio in comparison[f'{kind}_ratios'])} "
                 f"(median {comparison[f'{kind}_paired_median']:.2f}x)"
                 for kind in ("throughput", "latency") if f"{kind}_ratios" in comparison]
        print(f"{comparison['ours']}/{comparison['theirs']}: " + ("; ".join(parts) if parts else "-"))
    sys.stdout.flush()


def write_plot(path: str, results: list[SystemResult]) -> None:
    """Bar charts of median tok/s and ms/token per system, min-max as error bars."""
    try:
        import matplotlib
    except ImportError:
        log(f"--plot {path}: matplotlib is not installed (pip install matplotlib, or the "
            "project's [bench] extra); no plot written.")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = [("output tokens/s (higher is better)", SystemResult.tokens_per_second),
              ("batch-1 ms per output token (lower is better)", SystemResult.ms_per_token)]
    colors = {result.name: f"C{i}" for i, result in enumerate(results)}  # one color per system
    for axis, (title, values_of) in zip(axes, panels):
        measured = [(r.name, values_of(r)) for r in results if values_of(r)]
        names = [name for name, _ in measured]
        medians = [statistics.median(values) for _, values in measured]
        errors = [[m - min(v) for m, (_, v) in zip(medians, measured)],
                  [max(v) - m for m, (_, v) in zip(medians, measured)]]
        axis.bar(names, medians, yerr=errors, capsize=6, color=[colors[name] for name in names])
        for x, (median, (_, values)) in enumerate(zip(medians, measured)):
            axis.annotate(f"{median:.1f}", (x, max(values)), xytext=(0, 4), textcoords="offset points",
                          ha="center", va="bottom")
        axis.margins(y=0.12)
        axis.set_title(title)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    log(f"plot written to {path}")


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Offline throughput (output tokens/s) and batch-1 decode latency (ms per output "
        "token) of splitserve's LLM.generate against transformers generate (and optionally vLLM), "
        "on one seeded synthetic workload in the same run. Targets: throughput >= "
        f"{THROUGHPUT_TARGET:g}x transformers', latency <= {LATENCY_TARGET:g}x transformers'.",
        epilog="Progress goes to stderr, the results table to stdout. Greedy ids are compared "
        "request by request (informative, not a failure). The vLLM peer runs in a subprocess "
        "with VLLM_CPU_OMP_THREADS_BIND=<--vllm-threads-bind> VLLM_USE_AOT_COMPILE=0 VLLM_CPU_KVCACHE_SPACE=<GiB>; "
        "the machine is noisy, so compare numbers only within one run.",
    )
    parser.add_argument("--model", default=None,
                        help="local Hugging Face model directory (default: the converted default model, "
                        "SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="weights, activations and KV cache of every system (default: %(default)s, where "
                        "greedy ids should agree exactly; in bfloat16 each system rounds its own way, and "
                        "ids part at near ties)")
    parser.add_argument("--num-requests", type=int, default=64, help="requests in the throughput workload (default: %(default)s)")
    parser.add_argument("--min-prompt", type=int, default=64, help="shortest prompt, in tokens (default: %(default)s)")
    parser.add_argument("--max-prompt", type=int, default=512, help="longest prompt, in tokens (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="output tokens per throughput request (default: %(default)s)")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="static batch size of transformers generate, left padded (default: %(default)s)")
    parser.add_argument("--latency-prompt-len", type=int, default=128, help="prompt tokens of the batch-1 request (default: %(default)s)")
    parser.add_argument("--latency-output-len", type=int, default=128, help="output tokens of the batch-1 request (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed runs per measurement and system, interleaved, the systems' order reversed each "
                        "repeat; medians and repeat-by-repeat ratios are reported (default: %(default)s)")
    parser.add_argument("--warmup", choices=("short", "workload"), default="workload",
                        help="before anything is timed, each system generates for two short prompts (short), "
                        "then runs the throughput workload once, untimed (workload): splitserve maps its KV cache "
                        "lazily, so its first run of the workload takes a page fault on every block it first "
                        "writes (3-4 s of a 36 s run on a 2-core Zen 4 VM), while vLLM writes its whole cache "
                        "with zeros at start (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt generator (default: %(default)s)")
    parser.add_argument("--skip-hf", action="store_true", help="do not run transformers (no targets checked)")
    parser.add_argument("--skip-latency", action="store_true", help="measure throughput only")
    parser.add_argument("--max-num-seqs", type=int, default=None,
                        help="splitserve (and vLLM) max running requests (default: the engine's)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="splitserve (and vLLM) tokens per forward pass (default: the engine's)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="splitserve (and vLLM) tokens per KV block (default: the engine's)")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0,
                        help="KV cache size in GiB for splitserve (kv_cache_memory_bytes) and vLLM "
                        "(VLLM_CPU_KVCACHE_SPACE, rounded to whole GiB) (default: %(default)s)")
    parser.add_argument("--enable-prefix-caching", action="store_true",
                        help="leave prefix caching on in splitserve and vLLM; off by default because "
                        "every repeat sends the same prompts and would hit the cache")
    parser.add_argument("--vllm-python", default=None, metavar="PATH",
                        help="python of a vLLM-CPU venv (built by /work/shared/tools/vllm-peer-setup); "
                        "runs the same workload in vLLM as a third system")
    parser.add_argument("--vllm-threads-bind", default=None, metavar="CPUS|nobind|auto",
                        help="VLLM_CPU_OMP_THREADS_BIND for the vLLM peer: a CPU list (e.g. 0,1 or 0-3) pins one "
                        "OpenMP thread to each CPU; nobind leaves them unpinned, as splitserve's are; auto is "
                        "vLLM's own default, which reserves CPUs for its other processes (default: as many CPUs "
                        f"as splitserve has torch threads, the lowest this process may use; here {default_vllm_threads_bind()})")
    parser.add_argument("--json", default=None, metavar="OUT", help="write all raw numbers to this JSON file")
    parser.add_argument("--plot", default=None, metavar="OUT.png",
                        help="write a bar chart of tok/s and ms/token per system (needs matplotlib)")
    args = parser.parse_args(argv)
    if not 1 <= args.min_prompt <= args.max_prompt:
        parser.error("need 1 <= --min-prompt <= --max-prompt")
    for name in ("num_requests", "output_len", "hf_batch_size", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.latency_output_len < 2 or args.latency_prompt_len < 1:
        parser.error("--latency-output-len must be >= 2 and --latency-prompt-len >= 1")
    bind = args.vllm_threads_bind
    if bind is None:
        args.vllm_threads_bind = default_vllm_threads_bind()
    elif bind not in ("nobind", "auto") and not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", bind):
        parser.error(f"--vllm-threads-bind takes a CPU list such as 0,1 or 0-3, nobind or auto, not {bind[:40]!r}")
    return args


def resolve_model(model: str | None) -> str:
    if model is not None:
        return model
    from splitserve.engine.model_store import prepare_default_model

    return str(prepare_default_model())


def engine_kwargs(args: argparse.Namespace) -> dict:
    """Engine settings shared by splitserve and vLLM; unset ones keep each engine's default."""
    kwargs: dict = {"enable_prefix_caching": args.enable_prefix_caching}
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = args.max_num_seqs
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    return kwargs


def build_runners(args: argparse.Namespace, model_path: str, workload: Workload, stack: contextlib.ExitStack) -> list:
    """Load every system (splitserve first), warm each up, and register its teardown."""
    runners = []

    def add(runner) -> None:
        stack.callback(runner.close)
        runners.append(runner)

    log("loading splitserve LLM")
    splitserve_kwargs = dict(engine_kwargs(args), kv_cache_memory_bytes=int(args.kv_cache_gib * 1024**3))
    add(SplitserveRunner(model_path, splitserve_kwargs, workload, args.dtype))
    if not args.skip_hf:
        log("loading transformers model")
        add(TransformersRunner(model_path, args.hf_batch_size, workload, args.dtype))
    if args.vllm_python:
        log(f"starting vLLM peer with {args.vllm_python} (the first start compiles for minutes)")
        kv_space_gib = max(1, round(args.kv_cache_gib))
        add(VllmPeer(args.vllm_python, model_path, workload, engine_kwargs(args), kv_space_gib, args.seed, args.dtype,
                     threads_bind=args.vllm_threads_bind))
    for runner in runners:
        log(f"warming up {runner.name}")
        runner.warm_up()
        if args.warmup == "workload":
            log(f"warming up {runner.name}: one untimed run of the throughput workload")
            runner.run_throughput()
    return runners


def repeat_order(runners: list, repeat: int) -> list:
    """The systems in the order repeat ``repeat`` (from 1) runs them: as given in odd repeats, reversed in even
    ones, so that over the run each system goes first as often as last."""
    return list(runners) if repeat % 2 else list(reversed(runners))


def run_benchmark(args: argparse.Namespace, runners: list) -> list[SystemResult]:
    """Repeat the measurements, interleaving systems within each repeat in :func:`repeat_order`."""
    results = {runner.name: SystemResult(runner.name) for runner in runners}
    for repeat in range(1, args.repeats + 1):
        order = repeat_order(runners, repeat)
        for runner in order:
            log(f"repeat {repeat}/{args.repeats}: {runner.name} throughput")
            run, token_ids = runner.run_throughput()
            results[runner.name].throughput_runs.append(run)
            results[runner.name].output_token_ids = token_ids
            log(f"  {runner.name}: {run.tokens_per_second:.1f} output tok/s ({run.seconds:.1f} s)")
        if args.skip_latency:
            continue
        for runner in order:
            log(f"repeat {repeat}/{args.repeats}: {runner.name} batch-1 latency")
            run = runner.run_latency()
            if run.num_output_tokens != args.latency_output_len:
                raise RuntimeError(f"{runner.name}: the batch-1 request produced {run.num_output_tokens} "
                                   f"tokens, not {args.latency_output_len}; is EOS ignored?")
            results[runner.name].latency_runs.append(run)
            log(f"  {runner.name}: {run.ms_per_output_token:.2f} ms/token (ttft {1000 * run.ttft_seconds:.0f} ms)")
    return list(results.values())


def comparisons_of(results: list[SystemResult]) -> list[dict]:
    by_name = {result.name: result for result in results}
    ours, hf, vllm = by_name["splitserve"], by_name.get("transformers"), by_name.get("vllm")
    comparisons = []
    if hf is not None:
        comparisons.append(compare(ours, hf, with_targets=True))
    if vllm is not None:
        comparisons.append(compare(ours, vllm, with_targets=False))
        if hf is not None:
            comparisons.append(compare(vllm, hf, with_targets=False))
    return comparisons


def write_json(args: argparse.Namespace, model_path: str, workload: Workload, environment: dict,
               results: list[SystemResult], comparisons: list[dict]) -> None:
    report = {
        "args": vars(args),
        "model_path": model_path,
        "environment": environment,
        "workload": {"prompt_lens": [len(p) for p in workload.prompts], "output_len": workload.output_len,
                     "latency_prompt_len": len(workload.latency_prompt),
                     "latency_output_len": workload.latency_output_len},
        "targets": {"throughput_ratio_min": THROUGHPUT_TARGET, "latency_ratio_max": LATENCY_TARGET},
        "systems": {result.name: result.to_json() for result in results},
        "comparisons": comparisons,
    }
    with open(args.json, "w") as file:
        json.dump(report, file, indent=2)
    log(f"raw numbers written to {args.json}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from transformers import AutoConfig

    load_before = os.getloadavg()
    model_path = resolve_model(args.model)
    workload = make_workload(args, AutoConfig.from_pretrained(model_path).vocab_size)
    prompt_lens = [len(p) for p in workload.prompts]
    log(f"model {model_path}; {len(prompt_lens)} requests, {sum(prompt_lens)} prompt tokens "
        f"({min(prompt_lens)}-{max(prompt_lens)}), {args.output_len} output tokens each")

    with contextlib.ExitStack() as stack:
        runners = build_runners(args, model_path, workload, stack)
        results = run_benchmark(args, runners)
    comparisons = comparisons_of(results)
    load_after = os.getloadavg()

    header = [
        f"model: {model_path}",
        f"workload: {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
        f"(seed {args.seed}, {sum(prompt_lens)} in all), {args.output_len} output tokens, greedy, EOS ignored; "
        f"transformers batches of {args.hf_batch_size}; {args.dtype}",
        ("batch-1 latency: skipped" if args.skip_latency else
         f"batch-1 latency: prompt {args.latency_prompt_len}, output {args.latency_output_len}")
        + f"; {args.repeats} repeat(s), systems interleaved, their order reversed each repeat; warm-up: "
        + ("two short prompts, then the throughput workload once, untimed" if args.warmup == "workload"
           else "two short prompts"),
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
        f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f}",
    ]
    if args.vllm_python:
        header.append(f"vLLM ran with VLLM_CPU_OMP_THREADS_BIND={args.vllm_threads_bind} and "
                      f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', glibc_tunables())} "
                      "(the malloc settings splitserve's engine makes in-process)")
    if load_before[0] > BUSY_LOAD_AVERAGE:  # "after" includes this benchmark's own load
        header.append(f"WARNING: load average {load_before[0]:.2f} before the start: other work shares the "
                      "cores, so absolute numbers are low and ratios noisy; run again when idle")
    print_report(results, comparisons, header)

    if args.json:
        environment = {
            "python": platform.python_version(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_average_before": load_before, "load_average_after": load_after,
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        if args.vllm_python:
            environment["vllm_threads_bind"] = args.vllm_threads_bind
        write_json(args, model_path, workload, environment, results, comparisons)
    if args.plot:
        write_plot(args.plot, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
