"""The ``gateway`` subcommand: an OpenAI-compatible HTTP server in front of a router (``splitserve.gateway``)."""

from __future__ import annotations

import argparse

from splitserve.common.tools import TOOL_CALL_PARSERS
from splitserve.gateway_reasoning import REASONING_PARSERS

DEFAULT_GATEWAY_PORT = 8000


def add_gateway_command(commands, add_client_tls_arguments) -> None:
    gateway = commands.add_parser(
        "gateway", help="serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/responses) "
        "in front of a router",
        description="Serve /v1/completions, /v1/chat/completions, /v1/responses (OpenAI's Responses API as vLLM "
        "serves it, stateless: previous_response_id and background are refused, function tools work and built-in ones are refused; all three streaming as "
        "server-sent events), /v1/embeddings (through the router's Embed), vLLM's /v1/score and /v1/rerank (cosine similarities of "
        "those embeddings; also at /score, /rerank and /v2/rerank), /v1/models, /tokenize, /detokenize, /health and /version, and SageMaker's /ping and /invocations (the body's fields pick the route, as in vLLM), over HTTP (chat requests may give tools: calls forced by tool_choice \"required\" or a named "
        "function, or left to the model with --enable-auto-tool-choice; a reasoning model's think block apart from "
        "its answer with --reasoning-parser), each request one gRPC call on the router at --router (calls side by side for n "
        "choices and for a batch of prompts). The gateway keeps no state and no key: a caller's 'Authorization: Bearer KEY' header is passed on "
        "to the router, which checks it as it checks gRPC clients. A caller that disconnects cancels its request on "
        "the workers. Errors are OpenAI's JSON error object with the matching HTTP status (400, 401, 404, 413, 429, "
        "503, 504). Prints 'READY http://HOST:PORT gateway' once it listens.",
    )
    gateway.add_argument("--router", required=True, metavar="ADDR", help="the router's host:port")
    gateway.add_argument("--host", default="127.0.0.1", help="interface to listen on (default: %(default)s)")
    gateway.add_argument("--port", type=int, default=DEFAULT_GATEWAY_PORT,
                         help="HTTP port; 0 picks a free one (default: %(default)s)")
    gateway.add_argument("--served-model-name", metavar="NAME",
                         help="the model's name in /v1/models and the 'model' a request must name (default: the "
                         "router's model name); other names get 404")
    gateway.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, metavar="BYTES",
                         help="largest request body read; larger ones get 413 (default: %(default)s)")
    gateway.add_argument("--max-choices", type=int, default=16, metavar="N",
                         help="the most generations one request may ask for: n choices for each prompt of a batch, "
                         "each a generation of its own on the cluster, side by side with the others; also the "
                         "most texts one embeddings, score or rerank request embeds (default: %(default)s)")
    gateway.add_argument("--metrics-port", type=int, metavar="PORT",
                         help="serve Prometheus metrics (requests by route and status, durations, in flight, "
                         "generations) at http://HOST:PORT/metrics, on --host only; 0 picks a free port and logs it "
                         "(default: not served). Read-only and unauthenticated: keep the port inside the cluster's "
                         "network")
    gateway.add_argument("--enable-auto-tool-choice", action="store_true",
                         help='let chat requests with tools leave the choice to the model (tool_choice "auto", the '
                         "default when a request gives tools); its calls are read from the text by --tool-call-parser "
                         '(default: off; "required", a named function and "none" always work, by a JSON schema '
                         "that forces the call)")
    gateway.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS,
                         help="how the model writes tool calls, for --enable-auto-tool-choice: hermes is "
                         "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call> (Hermes, Qwen 2.5 and 3, "
                         "SmolLM3, examples/chat-templates/chatml-tools.jinja)")
    gateway.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                         help="split chat answers as vLLM's --reasoning-parser does: the text of the <think> block "
                         "goes to the message's (or stream delta's) \"reasoning\" field, the rest to \"content\", "
                         "which alone is read for tool calls. deepseek_r1: everything before </think> is reasoning, "
                         "with or without <think> first (DeepSeek-R1 and its distills); qwen3: the same unless the "
                         "request's chat_template_kwargs set enable_thinking false, when all is content (Qwen3). "
                         "/v1/completions is not split (default: the workers' --reasoning-parser, which the router "
                         "reports; none when they have none)")
    gateway.add_argument("--otlp-traces-endpoint", metavar="URL",
                         help="export a span of every API call (POST /v1/...: its route, status and router calls, "
                         "until its last byte) to this OTLP/gRPC collector, http://HOST:PORT or https://HOST:PORT; a "
                         "caller's W3C traceparent header makes it the child of the caller's span, and the router's "
                         "request spans are its children. Without it the caller's trace context is passed on to the "
                         "router as it is. Needs the tracing extra: pip install 'splitserve[tracing]' (default: no "
                         "spans)")
    gateway.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR, to stderr (default: %(default)s)")
    add_client_tls_arguments(gateway)
    gateway.set_defaults(handler=_run_gateway)


def _run_gateway(args: argparse.Namespace) -> int:
    from splitserve.common.log_fields import configure_logging
    from splitserve.rpc.server import CannotListen, bind_problem
    from splitserve.rpc.tls import TLSConfig

    try:
        from splitserve.gateway import GatewayConfig, run_gateway
    except ImportError as error:
        raise ValueError(f"The gateway needs the 'gateway' extra: pip install 'splitserve[gateway]' ({error}).") from None
    if args.max_body_bytes < 1:
        raise ValueError("--max-body-bytes must be positive.")
    if args.max_choices < 1:
        raise ValueError("--max-choices must be positive.")
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser: say how the model writes its calls.")
    for port in (args.port, args.metrics_port):
        if port and (problem := bind_problem(f"{args.host}:{port}")):
            raise CannotListen(f"Cannot listen on {args.host}:{port}: {problem}.")
    if args.otlp_traces_endpoint:
        from splitserve.rpc.tracing import check_endpoint

        check_endpoint(args.otlp_traces_endpoint)
    configure_logging(args.log_level)
    tls = TLSConfig.from_flags(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)
    config = GatewayConfig(args.router, args.served_model_name, tls, args.max_body_bytes, args.max_choices,
                           args.metrics_port, args.tool_call_parser if args.enable_auto_tool_choice else None,
                           args.reasoning_parser, args.otlp_traces_endpoint)
    return run_gateway(config, args.host, args.port, args.log_level)
