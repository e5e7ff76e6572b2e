"""The serving subcommands: ``router``, ``prefill``, ``decode``, ``colocated``, ``up``."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from splitserve.common.tools import TOOL_CALL_PARSERS

DEFAULT_ROUTER_PORT = 50051

_CLUSTER_TOKEN_HELP = (
    "require the cluster token in this file (one line; # comments are skipped) on {who}, as "
    "'x-splitserve-cluster-token' metadata, and have it {sent}. Without it, the token is read from "
    "$SPLITSERVE_CLUSTER_TOKEN; with neither, these calls are open (a WARNING says so at start). The router and "
    "every worker must share one token; `splitserve up` generates one and passes it to its processes itself."
)


def add_serving_commands(commands, add_engine_arguments, engine_options) -> None:
    """Register the serving subcommands on the top-level parser's subparsers."""
    global _engine_options
    _engine_options = engine_options

    router = commands.add_parser(
        "router", help="run the router: the public Inference API in front of the worker pools",
        description="Serve splitserve.v1.Inference (and WorkerRegistry, for workers started with --router). "
        "Tokenizes, validates, routes each request to a decode worker and (for long enough prompts) a prefill worker. "
        "The router loads no model: it reads the tokenizer files and config.json of --model DIR (a directory "
        "with just those is enough), or of the default model once `splitserve prepare-model` has converted it.",
    )
    _add_router_arguments(router)
    router.set_defaults(handler=_run_router)

    for name, role, text in (
        ("prefill", "prefill", "run a prefill worker: computes prompts' KV and sends it to decode workers"),
        ("decode", "decode", "run a decode worker: receives prompts' KV (or prefills short ones) and generates"),
        ("colocated", "both", "run a colocated worker: prefills and decodes its own requests (no KV transfer)"),
    ):
        worker = commands.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        _add_worker_arguments(worker, role)
        add_engine_arguments(worker)
        _add_lora_modules_argument(worker)
        worker.set_defaults(handler=_run_worker, role=role)

    up = commands.add_parser(
        "up", help="start a local cluster (router + prefill and decode workers) and serve until Ctrl-C",
        description="Start a router and its workers as child processes on this machine, print the router's "
        "address, and stop everything cleanly on Ctrl-C (or SIGTERM). Try it with "
        "`splitserve generate --server ADDRESS \"prompt\"`. A random cluster token guards the calls between the "
        "router and its workers (passed to them through their environment); the public API requires a key only "
        "when $SPLITSERVE_API_KEYS is set. While it serves, `up` supervises its processes: when one exits "
        "unexpectedly it prints which one, how it ended and where its log is, stops the rest and exits with "
        "status 1 (it never restarts one; leave that to the operator's supervisor). On Linux its processes also "
        "die with it, even when it is killed with SIGKILL.",
    )
    up.add_argument("--host", default="127.0.0.1", help="interface every process listens on (default: %(default)s)")
    up.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT, help="router port (default: %(default)s)")
    up.add_argument("--http-port", type=int, metavar="PORT",
                    help="also serve the OpenAI-compatible HTTP API (`splitserve gateway`, needs the gateway extra) on "
                    "--host at this port, supervised with the rest; 0 picks a free one, printed at start (default: "
                    "no HTTP)")
    up.add_argument("--enable-auto-tool-choice", action="store_true",
                    help="the HTTP gateway lets the model choose its tool calls (tool_choice auto); see `splitserve "
                    "gateway --help` (needs --http-port and --tool-call-parser)")
    up.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                    help="how the model writes tool calls, for --enable-auto-tool-choice")
    _add_chat_template_argument(up)
    up.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill workers (default: %(default)s)")
    up.add_argument("--decode", type=int, default=1, metavar="M", help="decode workers (default: %(default)s)")
    up.add_argument("--colocated", type=int, default=0, metavar="N",
                    help="colocated workers instead of prefill/decode pools (default: %(default)s)")
    up.add_argument("--kv-transfer", choices=_KV_TRANSFERS, default="p2p",
                    help="KV connector between the pools: p2p, redis, or lmcache (LMCache with Redis as its backend; "
                    "needs pip install 'splitserve[lmcache]'); see `splitserve decode --help` (default: %(default)s)")
    up.add_argument("--redis-url", help="Redis for --kv-transfer redis or lmcache, redis:// or rediss://, no password "
                    "in it (default: start a private redis-server)")
    up.add_argument("--redis-password-file", metavar="PATH",
                    help="the password of --redis-url, passed on to the workers (default: $SPLITSERVE_REDIS_PASSWORD, "
                    "which the workers inherit)")
    up.add_argument("--redis-tls-ca", metavar="PATH", help="CA certificate(s) verifying a rediss:// --redis-url")
    up.add_argument("--kv-checksum", choices=("xxh3", "none"), default="xxh3",
                    help="checksum every KV payload (xxh3) or none; see `splitserve decode --help` (default: %(default)s)")
    _add_lmcache_arguments(up, cluster=True)
    up.add_argument("--gpus", metavar="LIST",
                    help="where the workers run when they run on CUDA: comma-separated GPUs (indices or UUIDs, as "
                    "CUDA_VISIBLE_DEVICES takes them), each worker given one in turn; with --kv-transfer p2p and two "
                    "or more GPUs the prefill and decode pools get GPUs of their own (KV over NCCL, GPU to GPU); on "
                    "one GPU all workers share it (KV copied within it over CUDA IPC) (default: every GPU visible "
                    "to `up`; refused when the workers run on the CPU)")
    up.add_argument("--threads-per-worker", type=int, metavar="N",
                    help="torch threads of each worker (default: the CPUs this process may run on, divided among the "
                    "workers, at least 1: workers whose threads outnumber the cores wait on each other's)")
    up.add_argument("--log-dir", help="folder for each process's log (default: a new temporary folder)")
    up.add_argument("--local-prefill-threshold", type=int, default=0, metavar="TOKENS",
                    help="prompts shorter than this are prefilled by the decode worker (default: %(default)s)")
    up.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                    help="once the cluster serves, stream a reply to this prompt through it, then shut down "
                    "(repeatable; greedy, --max-tokens 32)")
    up.add_argument("--chat", action="append", default=[], metavar="TEXT",
                    help="as --prompt, but TEXT is a user message put through the model's chat template, so the reply "
                    "ends where the model ends its turn (repeatable; `make demo` asks one)")
    up.add_argument("--max-tokens", type=int, default=32,
                    help="most tokens to generate for --prompt and --chat (default: %(default)s)")
    up.add_argument("--otlp-traces-endpoint", metavar="URL",
                    help="the router exports a span of every generation and embedding request, the workers one of "
                    "every prefill, decode and embed call, and with --http-port the gateway one of every API call, to "
                    "this OTLP/gRPC collector; see `splitserve router --help` (needs the tracing extra; default: no "
                    "traces)")
    up.add_argument("--prefill-policy", choices=_POLICIES, default="prefix_aware",
                    help="how the prefill pool is chosen from: prefix_aware sends prompts with the same first blocks to "
                    "the same worker (its prefix cache) unless it is overloaded (default: %(default)s)")
    up.add_argument("--decode-policy", choices=_POLICIES, default="least_loaded",
                    help="how the decode pool is chosen from: least_loaded weighs KV usage and running requests "
                    "(default: %(default)s)")
    _add_tls_arguments(up, "each other", cluster=True)
    add_engine_arguments(up)
    _add_lora_modules_argument(up)
    up.set_defaults(handler=_run_up)


def _add_lora_modules_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
        help="LoRA adapters to serve (vLLM's flag): each a name (1-64 characters from [A-Za-z0-9._-]) and the local "
        "directory of its PEFT checkpoint (adapter_config.json, adapter_model.safetensors), loaded at start; a request "
        "names one as GenerateRequest.lora_name (the gateway: as its OpenAI model); implies --enable-lora; with --kv-transfer "
        "lmcache each adapter's KV goes under its own tag (default: none)")
    parser.add_argument(
        "--lora-dir", metavar="DIR",
        help="a directory of LoRA adapters served by name while the worker runs (vLLM's filesystem LoRA resolver): "
        "each subdirectory named as an adapter (1-64 characters from [A-Za-z0-9._-], a letter or digit first) that "
        "holds a PEFT checkpoint is checked, then served under that name within seconds; one that goes is served no "
        "more, one whose files change is served no more until the worker restarts (copy under a .hidden name, then "
        "rename); at most 64 adapters with --lora-modules; implies --enable-lora (default: none)")


_POLICIES = ("round_robin", "least_loaded", "prefix_aware")
_KV_TRANSFERS = ("p2p", "redis", "lmcache")
_engine_options = None


def _add_chat_template_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--chat-template", metavar="FILE",
                        help="a Jinja chat template file that replaces the model's for every chat request (as vLLM's "
                        "--chat-template): e.g. examples/chat-templates/chatml-tools.jinja, which shows a ChatML "
                        "model its tools and the calls it made (default: the model's tokenizer_config.json template)")


def _add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)")
    parser.add_argument("--port", type=int, default=DEFAULT_ROUTER_PORT, help="port; 0 picks a free one (default: %(default)s)")
    parser.add_argument("--model", metavar="DIR",
                        help="model directory to read the tokenizer files and config.json from; no weights are "
                        "loaded, and a directory without them is enough (default: SmolLM2-135M-Instruct, converted "
                        "beforehand by `splitserve prepare-model`)")
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="the workers' dtype, part of the model fingerprint; auto accepts either, and the first "
                        "worker to register sets it for the rest (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, help="longest prompt + output accepted (default: the model's)")
    _add_chat_template_argument(parser)
    parser.add_argument("--block-size", type=int, default=16, help="the workers' KV block size (default: %(default)s)")
    parser.add_argument("--prefill-worker", action="append", default=[], metavar="ADDR",
                        help="a static prefill worker's host:port (repeatable); workers may also register themselves")
    parser.add_argument("--decode-worker", action="append", default=[], metavar="ADDR", help="a static decode worker (repeatable)")
    parser.add_argument("--colocated-worker", action="append", default=[], metavar="ADDR",
                        help="a static colocated worker (repeatable)")
    parser.add_argument("--prefill-policy", choices=_POLICIES, default="prefix_aware",
                    help="how the prefill pool is chosen from: prefix_aware sends prompts with the same first blocks to "
                    "the same worker (its prefix cache) unless it is overloaded (default: %(default)s)")
    parser.add_argument("--decode-policy", choices=_POLICIES, default="least_loaded",
                    help="how the decode pool is chosen from: least_loaded weighs KV usage and running requests "
                    "(default: %(default)s)")
    parser.add_argument("--local-prefill-threshold", type=int, default=0, metavar="TOKENS",
                        help="prompts shorter than this are prefilled by the decode worker itself (default: %(default)s)")
    parser.add_argument("--max-in-flight-requests", type=int, default=512,
                        help="requests in flight on the router, over all workers, beyond which new ones get "
                        "RESOURCE_EXHAUSTED; the router serves this many calls plus 16 at once. Each worker also "
                        "refuses beyond its own --max-queued-requests, and the router then tries another "
                        "(default: %(default)s)")
    parser.add_argument("--lease-seconds", type=float, default=10.0,
                        help="a registered worker silent this long is removed (default: %(default)s)")
    parser.add_argument("--heartbeat-seconds", type=float, default=1.0,
                        help="worker heartbeat and static-worker poll interval (default: %(default)s)")
    parser.add_argument("--prefill-attempts", type=int, default=2,
                        help="prefill workers tried before the decode worker prefills itself (default: %(default)s)")
    parser.add_argument("--kv-timeout", type=float, metavar="SECONDS",
                        help="decode workers' wait for KV before recomputing (default: each worker's own)")
    parser.add_argument("--migration-limit", type=int, default=3, metavar="N",
                        help="how many times one request may move to another decode worker when its decode worker "
                        "fails mid-stream (killed, or silent past its lease): the router sends the prompt plus the "
                        "tokens already streamed to another decode worker and the client's stream goes on "
                        "(token-identical for greedy requests; sampled ones continue with fresh draws). 0 turns "
                        "migration off: such a stream ends with FINISH_REASON_ERROR (default: %(default)s)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="on SIGTERM or SIGINT, the router stops taking requests (new ones get UNAVAILABLE, "
                        "health says NOT_SERVING) and lets those in flight finish for this long; the ones still "
                        "running then end with FINISH_REASON_ABORT and the router exits (default: %(default)s)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus metrics over HTTP at http://HOST:PORT/metrics, on --host only (0: a free port, "
                        "logged at start; default: not served). Read-only and unauthenticated: keep the port inside "
                        "the cluster's network")
    parser.add_argument("--otlp-traces-endpoint", metavar="URL",
                        help="export an OpenTelemetry span of every generation request (vLLM's llm_request: token "
                        "counts, queue time, time to first token, end to end, KV transfer time, finish reason; "
                        "never a prompt or a token), and an embedding_request span of every embedding, to this "
                        "OTLP/gRPC collector, http://HOST:PORT or "
                        "https://HOST:PORT; a caller's W3C traceparent makes it a child of the caller's span. "
                        "Needs the tracing extra: pip install 'splitserve[tracing]' (default: no traces)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR, to stderr (default: %(default)s)")
    parser.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="text lines, or one JSON object a line; both carry the request id and the KV transfer id "
                             "of every line about a request (default: %(default)s)")
    parser.add_argument("--api-key-file", metavar="PATH",
                        help="require an API key from this file (one a line; blank lines and # comments are skipped) "
                        "on every Inference call, sent as 'authorization: Bearer <key>' metadata. Without it, the "
                        "keys are read from $SPLITSERVE_API_KEYS (comma-separated); with neither, the public API is "
                        "open to anyone who reaches the port (a WARNING says so at start). Health checks and "
                        "reflection stay open.")
    parser.add_argument("--cluster-token-file", metavar="PATH",
                        help=_CLUSTER_TOKEN_HELP.format(who="worker registrations, heartbeats and drains",
                                                        sent="sent with every call to a worker"))
    _add_tls_arguments(parser, "workers")


def _add_worker_arguments(parser: argparse.ArgumentParser, role: str) -> None:
    group = parser.add_argument_group("worker")
    group.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)")
    group.add_argument("--port", type=int, default=0, help="gRPC port; 0 picks a free one (default: %(default)s)")
    group.add_argument("--worker-id", default="", help="id in the cluster (default: derived from the address)")
    group.add_argument("--router", metavar="ADDR", help="register with this router and heartbeat to it")
    group.add_argument("--threads", type=int, help="torch threads for this worker (default: torch's)")
    group.add_argument("--max-queued-requests", type=int, default=256,
                       help="requests in flight on this worker beyond which new ones get RESOURCE_EXHAUSTED; "
                       "its gRPC server holds this many calls plus 32 (refusals, status polls, aborts), so "
                       "overload is answered by this limit, never by a call left waiting (default: %(default)s)")
    group.add_argument("--drain-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="on SIGTERM, how long in-flight requests may finish before they are aborted (default: %(default)s)")
    group.add_argument("--register-timeout", type=float, default=30.0, metavar="SECONDS",
                       help="with --router: how long to retry the first registration (the router not up yet, "
                       "unreachable or refusing) before exiting with status 1 and the reason (default: %(default)s)")
    group.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus metrics over HTTP at http://HOST:PORT/metrics, on --host only (0: a free port, "
                       "logged at start; default: not served). Read-only and unauthenticated: keep the port inside "
                       "the cluster's network")
    group.add_argument("--otlp-traces-endpoint", metavar="URL",
                       help="export an OpenTelemetry span of every prefill, decode or embed call (its queue, compute and KV "
                       "transfer times, token counts; never a prompt or a token) to this OTLP/gRPC collector, "
                       "http://HOST:PORT or https://HOST:PORT, each a child of the router's span of the request when "
                       "the router traces too. Needs the tracing extra: pip install 'splitserve[tracing]' (default: "
                       "no traces)")
    group.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR, to stderr (default: %(default)s)")
    group.add_argument("--log-format", default="text", choices=["text", "json"],
                        help="text lines, or one JSON object a line; both carry the request id and the KV transfer id "
                             "of every line about a request (default: %(default)s)")
    group.add_argument("--cluster-token-file", metavar="PATH",
                       help=_CLUSTER_TOKEN_HELP.format(who="the router's calls to this worker",
                                                       sent="sent with its registration and heartbeats"))
    _add_tls_arguments(parser, "the router")
    if role != "both":
        group.add_argument("--kv-transfer", choices=_KV_TRANSFERS, default="p2p",
                           help="KV connector: p2p (Gloo between the two workers), redis (through a Redis server) or "
                           "lmcache (prefill workers store prompts' KV in LMCache with Redis as its backend, decode "
                           "workers load it from there; needs pip install 'splitserve[lmcache]'). Every worker of "
                           "the cluster must use the same (default: %(default)s)")
        group.add_argument("--kv-address", default="",
                           help="p2p: host the KV rendezvous and Gloo bind, nothing else (default: --host); prefill "
                           "workers must prove the cluster token there; redis and lmcache: a redis:// URL, or "
                           "rediss:// for TLS, with no password in it (it is advertised to the router and the "
                           "prefill workers)")
        group.add_argument("--redis-password-file", metavar="PATH",
                           help="redis, lmcache: the password this worker sends to every Redis it uses, on the file's "
                           "first line (default: $SPLITSERVE_REDIS_PASSWORD; never a flag or a URL)")
        group.add_argument("--redis-username", metavar="NAME",
                           help="redis, lmcache: the ACL user (default: Redis's default user)")
        group.add_argument("--redis-tls-ca", metavar="PATH",
                           help="redis, lmcache: PEM CA certificate(s) verifying rediss:// servers (default: the "
                           "system's roots)")
        group.add_argument("--redis-tls-cert", metavar="PATH",
                           help="redis, lmcache: a PEM client certificate for rediss:// servers that ask for one; "
                           "needs --redis-tls-key")
        group.add_argument("--redis-tls-key", metavar="PATH", help="redis, lmcache: the PEM private key of --redis-tls-cert")
        _add_lmcache_arguments(group)
        group.add_argument("--kv-checksum", choices=("xxh3", "none"), default="xxh3",
                           help="xxh3: checksum every KV payload sent, and require and verify one on every payload "
                           "received; none: neither (trust the transport, as vLLM's and SGLang's connectors do). "
                           "Both pools must agree (default: %(default)s)")
    else:
        parser.set_defaults(kv_transfer="p2p", kv_address="", kv_checksum="xxh3", redis_password_file=None,
                            redis_username=None, redis_tls_ca=None, redis_tls_cert=None, redis_tls_key=None,
                            lmcache_chunk_size=256, lmcache_local_cpu_mb=64, lmcache_ttl=600.0)
    if role == "decode":
        group.add_argument("--kv-timeout", type=float, default=30.0, metavar="SECONDS",
                           help="longest wait for a prompt's KV (default: %(default)s)")
        group.add_argument("--kv-load-failure", choices=("recompute", "fail"), default="recompute",
                           help="late or refused KV: recompute the prompt here, or fail the request (default: %(default)s)")
    else:
        parser.set_defaults(kv_timeout=30.0, kv_load_failure="recompute")


def _add_lmcache_arguments(group, cluster: bool = False) -> None:
    """The LMCache flags of a prefill or decode worker (``cluster``: of ``up``, passed on to its workers)."""
    who = "every worker's" if cluster else "this worker's"
    group.add_argument("--lmcache-chunk-size", type=int, default=256, metavar="TOKENS",
                       help="lmcache: tokens per LMCache chunk, a multiple of --block-size; LMCache keys KV by chunks, "
                       "so every worker sharing the Redis must use the same (default: %(default)s)")
    group.add_argument("--lmcache-local-cpu-mb", type=int, default=64, metavar="MIB",
                       help=f"lmcache: {who} LMCache staging buffer in MiB, allocated in full at start; it must hold "
                       "one chunk (11.8 MB for SmolLM2-135M in float32 at 256 tokens), and a store or retrieve moves "
                       "at most this much at a time (default: %(default)s)")
    group.add_argument("--lmcache-ttl", type=float, default=600.0, metavar="SECONDS",
                       help="lmcache: every key LMCache writes to Redis expires this long after it is written, so "
                       "abandoned KV does not accumulate; a decode worker must load a prompt within it "
                       "(default: %(default)s)")


def _add_tls_arguments(parser: argparse.ArgumentParser, peers: str, cluster: bool = False) -> None:
    """The TLS flags of a process that serves a port and calls ``peers`` (``cluster``: of ``up``, for all of them)."""
    whose = "every process of the cluster" if cluster else "this process"
    group = parser.add_argument_group(
        "TLS", f"Without these flags every channel of {whose} is plaintext. One certificate, key and CA serve "
        f"{whose} both as a server (its own port) and as a client (its calls to {peers})"
        + ("; they are passed on to the router and every worker, and `up`'s own --prompt requests use them."
           if cluster else "."))
    group.add_argument("--tls-cert", metavar="PATH",
                       help="serve TLS with this PEM certificate (chain) and present it as the client certificate "
                       f"on calls to {peers}; its subject alternative names must include the host others dial "
                       "(the --host it listens on, say 127.0.0.1). Needs --tls-key")
    group.add_argument("--tls-key", metavar="PATH", help="the PEM private key of --tls-cert (read once, never printed)")
    group.add_argument("--tls-ca", metavar="PATH",
                       help="PEM CA certificate(s); turns on mutual TLS: a server then requires and verifies a "
                       "client certificate signed by this CA on every connection (a client without one is refused "
                       f"in the handshake{_PUBLIC_CLIENTS_TOO if peers != 'the router' else ''}), and the "
                       f"certificates of {peers} are verified against it. Without it no client certificate is asked "
                       "for, and servers are verified against the system's trusted roots")
    group.add_argument("--tls-server-name", metavar="NAME",
                       help=f"check the certificates of {peers} against NAME instead of the host dialed "
                       "(grpc.ssl_target_name_override), for certificates whose names differ from the addresses "
                       "(default: the host dialed)")


_PUBLIC_CLIENTS_TOO = "; on the router that includes every client of the public API: give them --tls-cert too"


def _tls_from_args(args: argparse.Namespace):
    """The ``TLSConfig`` of the parsed TLS flags, its files read now; None without them (plaintext)."""
    from splitserve.rpc.tls import TLSConfig

    return TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def _run_router(args: argparse.Namespace) -> int:
    from splitserve.router.config import RouterConfig
    from splitserve.router.server import run_router
    from splitserve.rpc.auth import load_credentials
    from splitserve.serve import configure_logging

    configure_logging(args.log_level, args.log_format)
    config = RouterConfig(
        host=args.host, port=args.port, model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
        chat_template=_chat_template(args.chat_template), prefill_workers=args.prefill_worker, decode_workers=args.decode_worker,
        colocated_workers=args.colocated_worker, prefill_policy=args.prefill_policy,
        decode_policy=args.decode_policy, local_prefill_threshold=args.local_prefill_threshold,
        max_in_flight_requests=args.max_in_flight_requests, lease_seconds=args.lease_seconds,
        heartbeat_seconds=args.heartbeat_seconds, prefill_attempts=args.prefill_attempts,
        kv_timeout_seconds=args.kv_timeout, drain_timeout_seconds=args.drain_timeout, block_size=args.block_size,
        migration_limit=args.migration_limit, metrics_port=args.metrics_port,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        credentials=load_credentials(args.api_key_file, args.cluster_token_file, os.environ),
        tls=_tls_from_args(args),
    )
    return run_router(config)


def _chat_template(path: str | None) -> str | None:
    """The text of a --chat-template file (None without one)."""
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ValueError(f"Cannot read --chat-template {path}: {error}.") from None


def worker_engine_options(role: str, options: dict) -> dict:
    """A worker's EngineConfig keyword arguments from the engine flags' (``options``): a prefill worker's graphs
    are its steps' pieces alone unless another mode is asked for (it runs each request for one token, so it
    never takes a decode step to replay)."""
    if role == "prefill" and options.get("cuda_graph_mode") is None:
        return {**options, "cuda_graph_mode": "piecewise"}
    return options


def _run_worker(args: argparse.Namespace) -> int:
    from splitserve.common.lora_names import parse_lora_modules
    from splitserve.engine.config import EngineConfig
    from splitserve.kvtransfer.redis_access import load_redis_access
    from splitserve.prefill_service.faults import KVFaults
    from splitserve.rpc.auth import load_credentials
    from splitserve.rpc.server import CannotListen, bind_problem
    from splitserve.rpc.worker_config import WorkerConfig
    from splitserve.serve import configure_logging, run_worker

    configure_logging(args.log_level, args.log_format)
    # Before the model loads (and, on a first start, the kernels compile): a taken port is said in a second.
    for port in (args.port, args.metrics_port):
        if port and (problem := bind_problem(f"{args.host}:{port}")):
            raise CannotListen(f"Cannot listen on {args.host}:{port}: {problem}.")
    config = WorkerConfig(
        role=args.role, host=args.host, port=args.port, worker_id=args.worker_id, router=args.router,
        kv_transfer=args.kv_transfer, kv_address=args.kv_address, kv_checksum=args.kv_checksum,
        kv_timeout_seconds=args.kv_timeout,
        kv_load_failure=args.kv_load_failure, max_queued_requests=args.max_queued_requests,
        num_threads=args.threads, drain_timeout_seconds=args.drain_timeout,
        register_timeout_seconds=args.register_timeout,
        engine=EngineConfig(args.model, **worker_engine_options(args.role, _engine_options(args))),
        cluster_token=load_credentials(None, args.cluster_token_file, os.environ).cluster_token,
        tls=_tls_from_args(args),
        redis_access=load_redis_access(args.redis_password_file, os.environ, args.redis_username, args.redis_tls_ca,
                                       args.redis_tls_cert, args.redis_tls_key),
        kv_faults=KVFaults.from_environment(os.environ) if args.role == "prefill" else None,
        lmcache_chunk_size=args.lmcache_chunk_size, lmcache_local_cpu_mb=args.lmcache_local_cpu_mb,
        lmcache_ttl_seconds=args.lmcache_ttl, metrics_port=args.metrics_port,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        lora_modules=parse_lora_modules(args.lora_modules), lora_dir=args.lora_dir,
    )
    status = run_worker(config)
    # The worker has drained and closed everything it serves. Leave now, without interpreter teardown:
    # torch.distributed's Gloo groups own C++ threads that can abort the process (std::terminate,
    # "terminate called without an active exception") when destroyed during it while a peer's
    # connection is still open, which would turn a clean shutdown into SIGABRT.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run_up(args: argparse.Namespace) -> int:
    from splitserve.engine.model_store import resolve_model
    from splitserve.launcher import LocalCluster, threads_per_worker
    from splitserve.rpc.server import bind_problem
    from splitserve.rpc.tracing import check_endpoint

    if args.colocated < 0 or args.prefill < 0 or args.decode < 0:
        raise ValueError("Worker counts must be >= 0.")
    if args.colocated == 0 and args.decode == 0:
        raise ValueError("A cluster needs at least one decode worker (--decode) or colocated worker (--colocated).")
    for port in (args.port, args.http_port):
        if port and (problem := bind_problem(f"{args.host}:{port}")):  # in a second, not after a start
            raise ValueError(f"Cannot listen on {args.host}:{port}: {problem}.")
    if args.http_port is not None and importlib.util.find_spec("uvicorn") is None:
        raise ValueError("--http-port needs the gateway extra: pip install 'splitserve[gateway]'.")
    from splitserve.engine.config import EngineConfig

    EngineConfig(**_engine_options(args))  # a bad engine flag is refused once here, not by every worker
    # Convert the default model once, before any process starts: the router reads it but never converts it.
    model_dir = str(resolve_model(args.model))
    worker_args = _engine_flags(args, model_dir)
    if args.threads_per_worker is not None and args.threads_per_worker < 1:
        raise ValueError("--threads-per-worker must be at least 1.")
    threads = args.threads_per_worker or threads_per_worker(args.colocated or args.prefill + args.decode)
    worker_args += ["--threads", str(threads)]
    if args.redis_url:
        from splitserve.kvtransfer.redis_access import public_redis_url

        public_redis_url(args.redis_url)  # a password in it would be on every worker's command line: refused
    moves_kv = args.kv_transfer in ("redis", "lmcache") and not args.colocated  # colocated workers move no KV
    if moves_kv and not args.redis_url and shutil.which("redis-server") is None:  # before anything starts
        raise ValueError(f"--kv-transfer {args.kv_transfer} starts a private redis-server, and none is on the PATH: "
                         "install Redis (e.g. `apt install redis-server`) or pass --redis-url of a running one.")
    for flag, value in (("--redis-password-file", args.redis_password_file), ("--redis-tls-ca", args.redis_tls_ca)):
        if value and moves_kv:
            worker_args += [flag, value]
    if args.kv_transfer == "lmcache" and not args.colocated:
        try:  # before any process starts: the workers would each fail with the same sentence
            import splitserve.kvtransfer.lmcache_connector  # noqa: F401 (its ImportError says how to install it)
        except ImportError as error:
            raise ValueError(str(error)) from None
        worker_args += ["--lmcache-chunk-size", str(args.lmcache_chunk_size), "--lmcache-local-cpu-mb",
                        str(args.lmcache_local_cpu_mb), "--lmcache-ttl", str(args.lmcache_ttl)]
    router_args = ["--model", model_dir, "--dtype", _resolved_dtype(args), "--block-size", str(args.block_size),
                   "--local-prefill-threshold", str(args.local_prefill_threshold),
                   "--prefill-policy", args.prefill_policy, "--decode-policy", args.decode_policy]
    if args.max_model_len:
        router_args += ["--max-model-len", str(args.max_model_len)]
    if args.otlp_traces_endpoint:
        router_args += ["--otlp-traces-endpoint", check_endpoint(args.otlp_traces_endpoint)]
        worker_args += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    if args.chat_template:
        _chat_template(args.chat_template)  # read now: a missing file is said before anything starts
        router_args += ["--chat-template", str(Path(args.chat_template).resolve())]
    gateway_args = ["--enable-auto-tool-choice", "--tool-call-parser", args.tool_call_parser] \
        if args.enable_auto_tool_choice else []
    if args.enable_auto_tool_choice and (not args.tool_call_parser or args.http_port is None):
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser and --http-port (the HTTP gateway reads "
                         "the calls).")
    if args.reasoning_parser:  # the workers' engine flag (_engine_flags), and with --http-port the gateway's
        gateway_args += ["--reasoning-parser", args.reasoning_parser]
    if args.otlp_traces_endpoint:
        gateway_args += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    roles = ["both"] * args.colocated if args.colocated else ["prefill"] * args.prefill + ["decode"] * args.decode
    placement = _place_workers(args, roles)  # before anything starts
    shares = _memory_shares(args, placement)
    cluster = LocalCluster(kv_transfer=args.kv_transfer, kv_checksum=args.kv_checksum, redis_url=args.redis_url,
                           worker_args=worker_args,
                           router_args=router_args, log_dir=args.log_dir, host=args.host, router_port=args.port,
                           generate_cluster_token=True, tls=_tls_from_args(args),
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    started = time.monotonic()
    status = 1
    try:
        print(f"Starting the router on {args.host}:{args.port} (logs in {cluster.log_dir})...", file=sys.stderr)
        address = cluster.start_router()
        on_gpus = f" on GPUs {', '.join(placement)}" if placement else ""
        on_gpus += f", {threads} torch thread{'s' if threads > 1 else ''} each"
        if args.colocated:
            print(f"Starting {args.colocated} colocated worker(s){on_gpus}...", file=sys.stderr)
            cluster.start_workers("both", args.colocated, gpus=placement, memory_shares=shares)
        else:
            print(f"Starting {args.prefill} prefill and {args.decode} decode worker(s){on_gpus}, KV over "
                  f"{args.kv_transfer}...", file=sys.stderr)
            cluster.start_pools(args.prefill, args.decode, gpus=placement, memory_shares=shares)
        if args.http_port is not None:
            http = cluster.start_gateway(args.http_port, gateway_args)
            print(f"OpenAI-compatible HTTP on {http}/v1 (splitserve gateway).", file=sys.stderr)
        print(f"splitserve is serving on {address} ({time.monotonic() - started:.0f} s to start).", file=sys.stderr)
        print("Processes: " + ", ".join(f"{p.name} pid {p.pid}" for p in cluster.processes()), file=sys.stderr)
        if args.prompt or args.chat:
            prompts = [*args.prompt, *([{"role": "user", "content": text}] for text in args.chat)]
            status = _answer(address, prompts, args.max_tokens, _first_api_key(), cluster.tls)
            return status
        print(f"Try: splitserve generate --server {address}{_client_tls_flags(cluster.tls)} "
              f"\"The capital of France is\"   Ctrl-C stops.", file=sys.stderr)
        print(address, flush=True)
        status = _supervise(cluster)
        return status
    finally:
        print("Stopping the cluster...", file=sys.stderr)
        cluster.stop()
        # A clean run leaves no temporary log folder behind; a failed one keeps it (and --log-dir is always kept).
        if status == 0:
            cluster.remove_log_dir()
        else:
            print(f"Logs kept in {cluster.log_dir}.", file=sys.stderr)


def _place_workers(args: argparse.Namespace, roles: list[str]) -> list[str] | None:
    """Each worker's GPU (a ``CUDA_VISIBLE_DEVICES`` value, in start order) when the workers run on CUDA, else None.

    Raises:
        ValueError: --gpus or --gpu-memory-utilization where the workers run on the CPU, a KV connector that
            cannot take caches on CUDA, or no GPU visible (a sentence).
    """
    import torch

    from splitserve.engine.config import resolve_device
    from splitserve.launcher import place_on_gpus, visible_gpus

    if resolve_device(args.device, torch.cuda.is_available()) != "cuda":
        if args.gpus:
            raise ValueError("--gpus places workers on GPUs, but they run on the CPU here (--device cpu, or torch "
                             "finds no CUDA device).")
        if args.gpu_memory_utilization is not None:
            raise ValueError("--gpu-memory-utilization sizes the KV caches of workers on GPUs, but they run on the "
                             "CPU here (--device cpu, or torch finds no CUDA device): size them with --kv-cache-gb.")
        return None
    if args.gpus:
        gpus = [entry.strip() for entry in args.gpus.split(",") if entry.strip()]
    else:
        gpus = visible_gpus(dict(os.environ), torch.cuda.device_count())
    return place_on_gpus(roles, gpus, pairs_over_p2p=args.kv_transfer == "p2p" and not args.colocated)


def _memory_shares(args: argparse.Namespace, placement: list[str] | None) -> list[float] | None:
    """Each worker's --gpu-memory-utilization (in start order): the cluster's share of each GPU divided among the
    workers placed on it; None where the workers are on the CPU or their caches have a size (--kv-cache-gb)."""
    if placement is None or args.kv_cache_gb is not None:
        return None
    from splitserve.engine.config import DEFAULT_GPU_MEMORY_UTILIZATION
    from splitserve.launcher import gpu_memory_shares

    return gpu_memory_shares(placement, args.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION)


def _supervise(cluster) -> int:
    """Serve until SIGINT/SIGTERM (0) or until a child exits on its own (1, after one line naming it).

    Main thread only (signal handlers). The caller stops the cluster afterwards either way.
    """
    import signal
    import threading

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        dead = cluster.watch(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if dead is None:
        return 0
    print(f"splitserve up: {dead.name} (pid {dead.pid}) exited unexpectedly ({dead.exit_description()}); its log is "
          f"{dead.log_path}. Stopping the cluster.", file=sys.stderr, flush=True)
    return 1


def _first_api_key() -> str | None:
    """One of the keys ``up``'s router requires ($SPLITSERVE_API_KEYS), for its own --prompt requests."""
    from splitserve.rpc.auth import API_KEYS_ENV, read_secrets

    return min(read_secrets(None, os.environ, API_KEYS_ENV, "API key"), default=None)


def _client_tls_flags(tls) -> str:
    """The ``generate`` flags that reach a router serving with ``tls`` (paths only; empty without TLS)."""
    if tls is None:
        return ""
    flags = [("--tls-ca", tls.ca_file), ("--tls-cert", tls.cert_file), ("--tls-key", tls.key_file),
             ("--tls-server-name", tls.server_name)]
    return "".join(f" {flag} {value}" for flag, value in flags if value)


def _answer(address: str, prompts: list, max_tokens: int, api_key: str | None = None, tls=None) -> int:
    """Stream a greedy reply to each prompt (a text, or chat messages) through the router; report its usage and
    timing."""
    from splitserve.client import Client
    from splitserve.common.sampling_params import SamplingParams

    with Client(address, api_key=api_key, tls=tls) as client:
        for prompt in prompts:
            print(f"> {prompt if isinstance(prompt, str) else prompt[-1]['content']}", file=sys.stderr)
            last = None
            for chunk in client.generate_stream(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                                timeout=300):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
            timing = last.timing
            print(f"\n[{last.usage.prompt_tokens} prompt tokens, {last.usage.completion_tokens} generated; first token "
                  f"after {timing.time_to_first_token_seconds * 1000:.0f} ms; KV handed over in "
                  f"{timing.kv_transfer_seconds * 1000:.1f} ms]", file=sys.stderr)
    return 0


def _resolved_dtype(args: argparse.Namespace) -> str:
    """``up``'s --dtype as its workers on this machine will resolve it (auto: bfloat16 on CUDA, float32 on CPU),
    so that the router pins the same fingerprint."""
    if args.dtype != "auto":
        return args.dtype
    import torch

    from splitserve.engine.config import resolve_device, resolve_dtype

    return resolve_dtype("auto", resolve_device(args.device, torch.cuda.is_available()))


def _engine_flags(args: argparse.Namespace, model_dir: str) -> list[str]:
    """The engine flags of ``up``, passed on to every worker."""
    from splitserve.common.lora_names import parse_lora_modules

    flags = ["--model", model_dir, "--dtype", _resolved_dtype(args), "--block-size", str(args.block_size),
             "--engine-seed", str(args.engine_seed), "--attention-backend", args.attention_backend,
             "--scheduling-policy", args.scheduling_policy,
             "--device", args.device]
    for flag, value in (("--max-num-seqs", args.max_num_seqs), ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value is not None:  # else each worker's default for its device
            flags += [flag, str(value)]
    if args.kv_cache_gb is not None:  # else each worker's default (on GPUs, its share: _memory_shares)
        flags += ["--kv-cache-gb", str(args.kv_cache_gb)]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    if args.no_chunked_prefill:
        flags.append("--no-chunked-prefill")
    if args.no_prefix_caching:
        flags.append("--no-prefix-caching")
    if args.cuda_graphs:
        flags.append("--cuda-graphs")
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if args.cuda_graph_mode:
        flags += ["--cuda-graph-mode", args.cuda_graph_mode]
    if args.speculative_config is not None:
        flags += ["--speculative-config", args.speculative_config.to_json()]
    if args.reasoning_parser:
        flags += ["--reasoning-parser", args.reasoning_parser]
    lora_modules = getattr(args, "lora_modules", [])  # up's flags (the engine group has the others)
    lora_dir = getattr(args, "lora_dir", None)
    if args.enable_lora or lora_modules or lora_dir:
        flags += ["--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
    if args.max_cpu_loras:
        flags += ["--max-cpu-loras", str(args.max_cpu_loras)]
    if lora_modules:  # checked, with paths the workers find whatever their directory
        modules = parse_lora_modules(lora_modules)
        for name, path in modules.items():  # said once here, not by every worker as it exits
            if not (Path(path) / "adapter_config.json").is_file():
                raise ValueError(f"--lora-modules {name}={path}: no adapter_config.json there (a PEFT LoRA "
                                 "checkpoint's directory).")
        flags += ["--lora-modules", *(f"{name}={Path(path).resolve()}" for name, path in modules.items())]
    if lora_dir:
        if not Path(lora_dir).is_dir():
            raise ValueError(f"--lora-dir {lora_dir}: no such directory (its subdirectories are the adapters served).")
        flags += ["--lora-dir", str(Path(lora_dir).resolve())]
    return flags
