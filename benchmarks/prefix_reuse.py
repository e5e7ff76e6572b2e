"""Prefix reuse through a running cluster: time to first token with KV over LMCache against p2p, same run.

Two workloads whose prompts repeat the leading tokens of earlier ones, sent to
local clusters started here (real processes, real gRPC, a private
redis-server for LMCache), greedy, ``--max-tokens`` each (few: the time to
first token is the figure):

* ``multi-turn``: ``--conversations`` chats of ``--turns`` turns. Turn 1 is a
  user message of ``--first-turn-len`` random token ids; each later turn's
  prompt is the previous prompt + the answer the cluster gave + a new user
  message of ``--turn-len`` ids (plain concatenation of token ids). Turns of
  different chats are interleaved: turn 1 of every chat, then turn 2, ...
* ``shared-prefix``: ``--families`` groups of ``--prompts-per-family`` prompts
  of ``--prompt-len`` ids; every prompt of a family repeats the leading
  ``--shared-fraction`` (75%) of the earlier ones and ends in new ids. The
  first prompt of each family ("cold") goes first, then the second of each,
  and so on.

Setups, each a cluster of 2 prefill workers and 1 decode worker (one torch
thread each, ``--kv-cache-gb`` of KV cache each) started fresh and stopped
here: every combination of ``--transports`` (``p2p``: KV over Gloo pairs,
prefix reuse only from the prefill worker's own prefix cache; ``lmcache``: KV
through LMCache in a private redis-server, where any prefill worker may load a
prefix another one stored) and ``--policies`` (the router's
``--prefill-policy``: ``prefix_aware`` sends prompts with the same first
blocks to the same prefill worker; ``round_robin`` and ``least_loaded`` ignore
the prompt). The setups of one policy run side by side, one cluster per
transport, and take turns wave by wave (the first of each wave rotates), so
that a busy moment of this shared machine falls on all of them alike: the
ratio lmcache / p2p compares requests sent seconds apart. Policies run one
after the other (their ratio is noisier). Each idle cluster holds about
4 GB of memory (three workers of 1.3 GB).

Measured per request: the client's time to first token (send until the first
streamed token), the router's ``timing.time_to_first_token_seconds``, the
final ``usage`` (``cached_tokens``: prompt tokens not computed; of them
``loaded_tokens``, loaded from LMCache; the rest came from the prefill worker's
own prefix cache), ``timing.prefix_load_seconds``, and which prefill worker
served it (from the workers' logs). Fields an older protocol lacks read n/a.
``--rounds`` repeats each workload with fresh token ids (the seed plus the
round) in the same cluster; medians and p90 pool the rounds. Printed, per
(setup, workload): the latencies, and the prompt tokens computed, found in a
prefix cache and loaded from LMCache (these counts do not depend on the
machine's load: the steadiest figure here); then the ratios lmcache / p2p and prefix-aware / blind on
the same workload of this run, for all requests and for the reusing ones
(every turn after the first, every prompt after its family's first), and
whether every setup produced the same token ids for every request. ``--plot``
writes a PNG: median TTFT per turn (multi-turn), cold against reusing prompts
per setup (shared-prefix).

Usage::

    python benchmarks/prefix_reuse.py --quick --plot /tmp/prefix_reuse.png
    python benchmarks/prefix_reuse.py --rounds 2 --plot /tmp/prefix_reuse.png --json /tmp/prefix_reuse.json
    python benchmarks/prefix_reuse.py --transports lmcache --policies prefix_aware,round_robin
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import random
import re
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

from tqdm import tqdm

from splitserve.client import Client
from splitserve.common.sampling_params import SamplingParams
from splitserve.launcher import LocalCluster

SPECIAL_ID_MARGIN = 100  # random ids stay clear of the vocabulary's ends (special tokens)
BLIND_POLICIES = ("round_robin", "least_loaded")
# A prefill worker's line about a request names its id as the router sent it: the client's id, '#', an attempt.
_PREFILL_REQUEST_ID = re.compile(r"request=([A-Za-z0-9._:-]+)#")


@dataclass
class Sample:
    """One request through one setup."""

    setup: str
    workload: str
    round: int
    group: int        # chat (multi-turn) or family (shared-prefix)
    position: int     # turn index, or the prompt's index in its family, from 0
    request_id: str
    prompt_len: int
    reuses_prefix: bool  # its leading tokens were in an earlier prompt of the group
    ttft_client: float | None = None
    ttft_router: float | None = None
    kv_transfer_seconds: float | None = None
    prefix_load_seconds: float | None = None  # Timing.prefix_load_seconds, where the protocol has it
    cached_tokens: int | None = None
    loaded_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)
    prefill_worker: str = ""
    same_worker_as_previous: bool | None = None  # its prefill worker served the group's previous prompt
    error: str = ""


def random_ids(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(SPECIAL_ID_MARGIN, vocab_size - SPECIAL_ID_MARGIN) for _ in range(count)]


def send(client: Client, request_id: str, prompt: list[int], args) -> dict:
    """One streaming request: the measurements of :class:`Sample` as a dict (``error`` set when it failed)."""
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    result: dict = {"token_ids": []}
    sent = time.perf_counter()
    try:
        last = None
        for chunk in client.generate_stream(prompt, params, request_id=request_id, timeout=args.request_timeout):
            if chunk.token_ids and result.get("ttft_client") is None:
                result["ttft_client"] = time.perf_counter() - sent
            result["token_ids"].extend(chunk.token_ids)
            last = chunk
        if last is not None and last.HasField("timing"):
            result["ttft_router"] = last.timing.time_to_first_token_seconds
            result["kv_transfer_seconds"] = last.timing.kv_transfer_seconds
            result["prefix_load_seconds"] = getattr(last.timing, "prefix_load_seconds", None)
        if last is not None and last.HasField("usage"):
            result["cached_tokens"] = last.usage.cached_tokens
            result["loaded_tokens"] = getattr(last.usage, "loaded_tokens", None)  # newer protocol only
        if last is not None and last.error_message:  # a failure after the first token (status OK)
            result["error"] = last.error_message[:200]
    except Exception as error:  # noqa: BLE001 - recorded, counted and printed
        result["error"] = (str(error) or repr(error)).splitlines()[0][:200]
    return result


def run_wave(pool: ThreadPoolExecutor, client: Client, wave: list[tuple[Sample, list[int]]], args, progress) -> None:
    """Send a wave of independent requests, ``--concurrency`` at a time, and fill in their samples."""

    def one(item: tuple[Sample, list[int]]) -> None:
        sample, prompt = item
        for name, value in send(client, sample.request_id, prompt, args).items():
            setattr(sample, name, value)
        progress.update()

    list(pool.map(one, wave))


def multi_turn_waves(setup: str, round_index: int, args, vocab_size: int) -> Iterator[list[tuple[Sample, list[int]]]]:
    """One wave per turn: that turn of every chat, built from the answers the setup gave to the previous wave."""
    rng = random.Random(f"multi-turn/{args.seed}/{round_index}")
    messages = [[random_ids(rng, args.first_turn_len if turn == 0 else args.turn_len, vocab_size)
                 for turn in range(args.turns)] for _ in range(args.conversations)]
    prompts = [list(chat[0]) for chat in messages]
    previous: list[Sample] = []
    for turn in range(args.turns):
        wave = []
        for chat in range(args.conversations):
            if turn:
                prompts[chat] = prompts[chat] + previous[chat].token_ids + messages[chat][turn]
            sample = Sample(setup, "multi-turn", round_index, chat, turn, f"mt-r{round_index}-c{chat}-t{turn}",
                            len(prompts[chat]), reuses_prefix=turn > 0)
            wave.append((sample, prompts[chat]))
        yield wave  # the caller runs it before asking for the next one
        previous = [sample for sample, _ in wave]


def shared_prefix_waves(setup: str, round_index: int, args, vocab_size: int) -> Iterator[list[tuple[Sample, list[int]]]]:
    """One wave per position in the families: every family's first prompt (cold), then every second one, ...

    Every prompt of a family starts with the family's shared ids (``--shared-fraction`` of it) and ends in its own.
    """
    rng = random.Random(f"shared-prefix/{args.seed}/{round_index}")
    num_shared = round(args.prompt_len * args.shared_fraction)
    families = []
    for _ in range(args.families):
        shared = random_ids(rng, num_shared, vocab_size)
        families.append([shared + random_ids(rng, args.prompt_len - num_shared, vocab_size)
                         for _ in range(args.prompts_per_family)])
    for position in range(args.prompts_per_family):
        yield [(Sample(setup, "shared-prefix", round_index, family, position,
                       f"sp-r{round_index}-f{family}-p{position}", args.prompt_len, reuses_prefix=position > 0),
                prompts[position]) for family, prompts in enumerate(families)]


WORKLOADS = {"multi-turn": multi_turn_waves, "shared-prefix": shared_prefix_waves}


def num_requests(workload: str, args) -> int:
    if workload == "multi-turn":
        return args.rounds * args.conversations * args.turns
    return args.rounds * args.families * args.prompts_per_family


# ---- clusters -----------------------------------------------------------------------------------


def start_setup(transport: str, policy: str, args) -> LocalCluster:
    worker_args = ["--kv-cache-gb", str(args.kv_cache_gb), "--max-model-len", str(args.max_model_len),
                   "--threads", "1"]
    if transport == "lmcache" and args.lmcache_chunk_size:
        worker_args += ["--lmcache-chunk-size", str(args.lmcache_chunk_size)]
    cluster = LocalCluster(kv_transfer=transport, worker_args=worker_args,
                           router_args=["--max-model-len", str(args.max_model_len), "--prefill-policy", policy])
    try:
        cluster.start_router()
        cluster.start_workers("prefill", 2)
        cluster.start_workers("decode", 1)
    except BaseException:
        cluster.stop()
        raise
    return cluster


def warm_up(cluster: LocalCluster, vocab_size: int, max_prompts: int = 8) -> None:
    """Unrelated prompts until every prefill worker has served one (the policy decides where they go)."""
    rng = random.Random("warm-up")
    prefill_workers = [p for p in cluster.workers if p.name.startswith("prefill")]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with Client(cluster.router.address) as client:
        for index in range(max_prompts):
            prompt = random_ids(rng, 300, vocab_size)
            list(client.generate_stream(prompt, params, request_id=f"warm-up-{index}", timeout=300))
            if all("request=warm-up-" in p.log() for p in prefill_workers):
                return


def attribute_prefill_workers(cluster: LocalCluster, samples: list[Sample]) -> None:
    """Name each sample's prefill worker (from the workers' logs) and whether it served the group's previous one."""
    served_by: dict[str, str] = {}
    for process in cluster.workers:
        if process.name.startswith("prefill"):
            for request_id in _PREFILL_REQUEST_ID.findall(process.log()):
                served_by.setdefault(request_id, process.name)
    previous: dict[tuple, str] = {}
    for sample in sorted(samples, key=lambda s: (s.workload, s.round, s.group, s.position)):
        sample.prefill_worker = served_by.get(sample.request_id, "")
        group = (sample.workload, sample.round, sample.group)
        if sample.reuses_prefix and sample.prefill_worker and previous.get(group):
            sample.same_worker_as_previous = sample.prefill_worker == previous[group]
        previous[group] = sample.prefill_worker


def run_side_by_side(transports: list[str], policy: str, args, vocab_size: int) -> list[Sample]:
    """Start one cluster per transport with this prefill policy, all at once, and run every workload through
    them wave by wave in turn (the first setup of each wave rotates), so that the load of the machine falls on
    all of them alike; then stop them."""
    setups = [f"{transport}/{policy}" for transport in transports]
    clusters: dict[str, LocalCluster] = {}
    clients: dict[str, Client] = {}
    samples: list[Sample] = []
    try:
        for transport, setup in zip(transports, setups):
            print(f"[bench] starting the {setup} cluster (2 prefill + 1 decode workers)...", file=sys.stderr,
                  flush=True)
            started = time.monotonic()
            clusters[setup] = start_setup(transport, policy, args)
            warm_up(clusters[setup], vocab_size)
            clients[setup] = Client(clusters[setup].router.address)
            print(f"[bench] {setup}: ready and warm in {time.monotonic() - started:.0f} s", file=sys.stderr,
                  flush=True)
        deadline = time.monotonic() + args.time_limit
        with ThreadPoolExecutor(args.concurrency) as pool:
            for workload in args.workloads:
                with tqdm(total=num_requests(workload, args) * len(setups), desc=f"{policy} {workload}",
                          unit="req", file=sys.stderr) as progress:
                    for round_index in range(args.rounds):
                        waves = {s: WORKLOADS[workload](s, round_index, args, vocab_size) for s in setups}
                        for wave_index in itertools.count():
                            if not waves or time.monotonic() > deadline:
                                break
                            for setup in rotated(list(waves), wave_index):
                                wave = next(waves[setup], None)
                                if wave is None:
                                    del waves[setup]
                                    continue
                                run_wave(pool, clients[setup], wave, args, progress)
                                samples.extend(sample for sample, _ in wave)
        for setup, cluster in clusters.items():
            attribute_prefill_workers(cluster, [s for s in samples if s.setup == setup])
    finally:
        for client in clients.values():
            client.close()
        for cluster in clusters.values():
            cluster.stop()
    for cluster in clusters.values():  # reached after a clean run only: a failed one keeps its logs
        cluster.remove_log_dir()
    return samples


def rotated(items: list, offset: int) -> list:
    offset %= max(len(items), 1)
    return items[offset:] + items[:offset]


# ---- summaries ----------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def done(samples: list[Sample]) -> list[Sample]:
    return [s for s in samples if not s.error and s.ttft_client is not None]


def summarize(samples: list[Sample]) -> dict:
    """Medians, p90 and token sums of one (setup, workload); token sums over the completed requests."""
    ok = done(samples)
    reusing = [s for s in ok if s.reuses_prefix]
    affinity = [s.same_worker_as_previous for s in reusing if s.same_worker_as_previous is not None]
    has_usage = all(s.cached_tokens is not None for s in ok)
    has_loaded = all(s.loaded_tokens is not None for s in ok)
    cached = sum(s.cached_tokens or 0 for s in ok)
    loaded = sum(s.loaded_tokens or 0 for s in ok)
    return {
        "requests": len(samples), "errors": len(samples) - len(ok),
        "ttft_client_p50": median([s.ttft_client for s in ok]),
        "ttft_client_p90": percentile([s.ttft_client for s in ok], 90),
        "ttft_router_p50": median([s.ttft_router for s in ok if s.ttft_router is not None]),
        "ttft_router_p90": percentile([s.ttft_router for s in ok if s.ttft_router is not None], 90),
        "cold_ttft_p50": median([s.ttft_client for s in ok if not s.reuses_prefix]),
        "reusing_ttft_p50": median([s.ttft_client for s in reusing]),
        "reusing_ttft_p90": percentile([s.ttft_client for s in reusing], 90),
        "prompt_tokens": sum(s.prompt_len for s in ok),
        # Usage.cached_tokens: prompt tokens not computed; Usage.loaded_tokens: those of them loaded from LMCache.
        "computed_tokens": sum(s.prompt_len for s in ok) - cached if has_usage else None,
        "prefix_cache_tokens": cached - loaded if has_usage and has_loaded else None,
        "loaded_tokens": loaded if has_loaded else None,
        "prefix_load_p50": median([s.prefix_load_seconds for s in ok if s.loaded_tokens and s.prefix_load_seconds]),
        "same_worker_fraction": sum(affinity) / len(affinity) if affinity else float("nan"),
    }


def print_tables(samples: list[Sample], setups: list[str], workloads: list[str]) -> dict:
    """Print the latency table and the token table; returns the summaries by (setup, workload)."""
    summaries = {(setup, workload): summarize([x for x in samples if x.setup == setup and x.workload == workload])
                 for workload in workloads for setup in setups}

    def ms(value: float) -> str:
        return "-" if value != value else f"{value * 1e3:.0f}"  # NaN: no such request

    def count(value: int | None) -> str:
        return "n/a" if value is None else str(value)

    print(f"\n{'setup':<22} {'workload':<13} {'n':>3} {'err':>3}  {'TTFT p50/p90 ms':>16}  {'router p50/p90':>15}  "
          f"{'cold p50':>8}  {'reusing p50/p90':>16}")
    for (setup, workload), s in summaries.items():
        print(f"{setup:<22} {workload:<13} {s['requests']:>3} {s['errors']:>3}  "
              f"{ms(s['ttft_client_p50']) + '/' + ms(s['ttft_client_p90']):>16}  "
              f"{ms(s['ttft_router_p50']) + '/' + ms(s['ttft_router_p90']):>15}  {ms(s['cold_ttft_p50']):>8}  "
              f"{ms(s['reusing_ttft_p50']) + '/' + ms(s['reusing_ttft_p90']):>16}")
    print("(TTFT: the client's, send to first token; router: Timing.time_to_first_token_seconds; cold: first turns "
          "and each family's first prompt; reusing: the others.)")
    print(f"\n{'setup':<22} {'workload':<13} {'prompt':>7} {'computed':>8} {'prefix $':>8} {'loaded':>7} "
          f"{'load p50 ms':>11} {'same pf':>7}")
    for (setup, workload), s in summaries.items():
        print(f"{setup:<22} {workload:<13} {s['prompt_tokens']:>7} {count(s['computed_tokens']):>8} "
              f"{count(s['prefix_cache_tokens']):>8} {count(s['loaded_tokens']):>7} {ms(s['prefix_load_p50']):>11} "
              f"{s['same_worker_fraction']:>7.0%}")
    print("(prompt tokens summed: computed = prompt - usage.cached_tokens; prefix $ = found in the prefill worker's "
          "prefix cache; loaded = usage.loaded_tokens, from LMCache (n/a: the protocol has no such field); load: "
          "Timing.prefix_load_seconds; same pf: reusing requests served by the prefill worker of the previous turn "
          "of their chat, or of the previous prompt of their family.)")
    return summaries


def print_ratios(summaries: dict, transports: list[str], policies: list[str], workloads: list[str]) -> None:
    def ratio(numerator: dict, denominator: dict, key: str) -> str:
        value = numerator[key] / denominator[key] if denominator[key] > 0 else float("nan")
        return "n/a" if value != value else f"{value:.2f}x"

    pairs = []
    if "lmcache" in transports and "p2p" in transports:
        pairs += [(f"lmcache/{p}", f"p2p/{p}") for p in policies]
    blind = [p for p in policies if p in BLIND_POLICIES]
    if "prefix_aware" in policies:
        pairs += [(f"{t}/prefix_aware", f"{t}/{p}") for t in transports for p in blind]
    if not pairs:
        return
    print("\nRatios of median TTFT (client), same run, same workload (below 1: the first setup is faster):")
    for workload in workloads:
        for first, baseline in pairs:
            a, b = summaries.get((first, workload)), summaries.get((baseline, workload))
            if a and b:
                print(f"  {workload:<13} {first} / {baseline}:  all {ratio(a, b, 'ttft_client_p50')}  "
                      f"reusing {ratio(a, b, 'reusing_ttft_p50')}  (p90 {ratio(a, b, 'ttft_client_p90')})")


def check_identical(samples: list[Sample], setups: list[str]) -> bool:
    """Print whether every setup produced the same token ids for each request id; returns True if so."""
    by_request: dict[tuple, dict[str, list[int]]] = {}
    for s in done(samples):
        by_request.setdefault((s.workload, s.request_id), {})[s.setup] = s.token_ids
    complete = {key: outputs for key, outputs in by_request.items() if len(outputs) == len(setups)}
    differing = [key for key, outputs in complete.items()
                 if any(ids != next(iter(outputs.values())) for ids in outputs.values())]
    if differing:
        print(f"\nOUTPUTS DIFFER between setups for {len(differing)} of {len(complete)} requests, e.g. "
              f"{', '.join(request_id for _, request_id in differing[:5])}")
    else:
        print(f"\nOutputs: identical token ids (greedy) in all {len(setups)} setups for all {len(complete)} "
              f"requests that every setup completed.")
    return not differing


def plot(samples: list[Sample], setups: list[str], workloads: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4.5), squeeze=False)
    for axis, workload in zip(axes[0], workloads):
        if workload == "multi-turn":
            for setup in setups:
                ok = [s for s in done(samples) if s.setup == setup and s.workload == workload]
                turns = sorted({s.position for s in ok})
                axis.plot([t + 1 for t in turns],
                          [median([s.ttft_client * 1e3 for s in ok if s.position == t]) for t in turns],
                          marker="o", label=setup)
            axis.set_xlabel("turn")
            axis.set_title("multi-turn chats: median TTFT per turn")
            axis.xaxis.get_major_locator().set_params(integer=True)
        else:
            width = 0.8 / max(len(setups), 1)
            for index, setup in enumerate(setups):
                ok = [s for s in done(samples) if s.setup == setup and s.workload == workload]
                values = [median([s.ttft_client * 1e3 for s in ok if s.reuses_prefix == reuses])
                          for reuses in (False, True)]
                axis.bar([x + (index - (len(setups) - 1) / 2) * width for x in (0, 1)], values, width, label=setup)
            axis.set_xticks([0, 1], ["cold (family's first)", "sharing 75% with earlier"])
            axis.set_title("shared-prefix prompts: median TTFT")
        axis.set_ylabel("time to first token (ms, client)")
        axis.set_ylim(bottom=0)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# ---- command line -------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--transports", default="p2p,lmcache", help="comma-separated KV transports: p2p, lmcache (default: %(default)s)")
    add("--policies", default="prefix_aware,round_robin",
        help="comma-separated router --prefill-policy values: prefix_aware, round_robin, least_loaded "
             "(default: %(default)s)")
    add("--workloads", default="multi-turn,shared-prefix", help="comma-separated (default: %(default)s)")
    add("--conversations", type=int, default=3, help="multi-turn: chats per round (default: %(default)s)")
    add("--turns", type=int, default=3, help="multi-turn: turns per chat (default: %(default)s)")
    add("--first-turn-len", type=int, default=384, help="multi-turn: ids in the first user message (default: %(default)s)")
    add("--turn-len", type=int, default=128, help="multi-turn: ids in each later user message (default: %(default)s)")
    add("--families", type=int, default=3, help="shared-prefix: families per round (default: %(default)s)")
    add("--prompts-per-family", type=int, default=2, help="shared-prefix: prompts per family (default: %(default)s)")
    add("--prompt-len", type=int, default=1200, help="shared-prefix: ids per prompt (default: %(default)s)")
    add("--shared-fraction", type=float, default=0.75,
        help="shared-prefix: leading share of a prompt repeated from the earlier ones (default: %(default)s)")
    add("--rounds", type=int, default=1, help="repeats of each workload with fresh ids, same cluster (default: %(default)s)")
    add("--max-tokens", type=int, default=8, help="tokens generated per request (default: %(default)s)")
    add("--concurrency", type=int, default=1,
        help="requests in flight at once; turns of one chat are always sequential (default: %(default)s)")
    add("--kv-cache-gb", type=float, default=0.25, help="KV cache per worker (default: %(default)s)")
    add("--max-model-len", type=int, default=2048, help="workers' and router's --max-model-len (default: %(default)s)")
    add("--lmcache-chunk-size", type=int, default=0,
        help="workers' --lmcache-chunk-size; 0 keeps the workers' default (default: %(default)s)")
    add("--seed", type=int, default=0, help="workload seed (default: %(default)s)")
    add("--request-timeout", type=float, default=300.0, help="seconds per request (default: %(default)s)")
    add("--time-limit", type=float, default=600.0,
        help="seconds of requests per policy (its setups side by side); later waves are skipped and left out "
             "(default: %(default)s)")
    add("--quick", action="store_true",
        help="a smoke run: 3 chats of 2 turns (256 + 96 ids), 3 families of 2 prompts of 600 ids, 4 tokens")
    add("--plot", metavar="PNG", help="write the TTFT plot here (needs matplotlib: pip install -e '.[bench]')")
    add("--json", metavar="FILE", help="write the arguments, summaries and every sample here")
    args = parser.parse_args(argv)
    if args.quick:
        args.conversations, args.turns, args.first_turn_len, args.turn_len = 3, 2, 256, 96
        args.families, args.prompts_per_family, args.prompt_len, args.max_tokens = 3, 2, 600, 4
    args.transports, args.policies = args.transports.split(","), args.policies.split(",")
    args.workloads = args.workloads.split(",")
    for name, values, allowed in (("--transports", args.transports, ("p2p", "lmcache")),
                                  ("--policies", args.policies, ("prefix_aware", *BLIND_POLICIES)),
                                  ("--workloads", args.workloads, tuple(WORKLOADS))):
        if not values or set(values) - set(allowed):
            parser.error(f"{name} takes a comma-separated subset of {', '.join(allowed)}; got {','.join(values)}.")
    longest = args.first_turn_len + (args.turns - 1) * (args.turn_len + args.max_tokens) + args.max_tokens
    if "multi-turn" in args.workloads and longest > args.max_model_len:
        parser.error(f"the last turn reaches {longest} tokens, past --max-model-len {args.max_model_len}.")
    if not 0 < args.shared_fraction < 1:
        parser.error("--shared-fraction must be between 0 and 1.")
    if "lmcache" in args.transports and importlib.util.find_spec("lmcache") is None:
        parser.error("--transports lmcache needs the extra: pip install -e '.[lmcache]'")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # checked before minutes of running
        parser.error("--plot needs matplotlib: pip install -e '.[bench]'")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from transformers import AutoConfig

    from splitserve.engine.model_store import resolve_model

    vocab_size = AutoConfig.from_pretrained(str(resolve_model(None))).vocab_size
    setups = [f"{t}/{p}" for p, t in itertools.product(args.policies, args.transports)]
    samples: list[Sample] = []
    started = time.monotonic()
    for policy in args.policies:
        samples += run_side_by_side(args.transports, policy, args, vocab_size)
    print(f"\n[bench] {len(setups)} setups in {time.monotonic() - started:.0f} s", file=sys.stderr)
    summaries = print_tables(samples, setups, args.workloads)
    print_ratios(summaries, args.transports, args.policies, args.workloads)
    identical = check_identical(samples, setups)
    for sample in samples:
        if sample.error:
            print(f"error: {sample.setup} {sample.request_id}: {sample.error}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "identical_outputs": identical,
                       "summaries": [{"setup": s, "workload": w, **v} for (s, w), v in summaries.items()],
                       "samples": [asdict(s) for s in samples]}, handle, indent=1)
    if args.plot:
        plot(samples, setups, args.workloads, args.plot)
        print(f"plot: {args.plot}", file=sys.stderr)
    return 0 if identical and not any(s.error for s in samples) else 1


if __name__ == "__main__":
    sys.exit(main())
