"""Bad input at a real cluster over gRPC: the status code each RPC's proto comment documents, and a sentence.

One cluster for the module (a router, a prefill and a decode worker as processes, KV over p2p), with
``max_model_len`` 256 so that over-long prompts are cheap to build. A table of bad requests goes to every
service (Inference on the router, WorkerRegistry on it, PrefillWorker and DecodeWorker straight to the
workers); each must end with its documented code and a short sentence that quotes no unbounded client
string. Valid edge values must not be refused. Then hypothesis throws random GenerateRequests and random
bytes at the router: every outcome is OK or a code inference.proto documents, never INTERNAL or UNKNOWN,
and afterwards the cluster still serves and every KV block is free again.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from splitserve.client import Client
from splitserve.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.cluster_helpers import all_blocks_free, start_cluster, wait_until

pytestmark = pytest.mark.timeout(420)

MAX_MODEL_LEN = 256
VOCAB_SIZE = 49152  # SmolLM2's; checked against GetModelInfo by the fixture
UINT32_MAX = 2**32 - 1
LONG = 100_000  # characters of a client string that no answer may quote whole
CALL_TIMEOUT = 10.0
Code = grpc.StatusCode

# What Generate and GenerateStream may answer (inference.proto); CANCELLED is left out: these tests never cancel.
GENERATE_CODES = {Code.OK, Code.INVALID_ARGUMENT, Code.RESOURCE_EXHAUSTED, Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED}
FINISHED = {inference_pb2.FINISH_REASON_STOP, inference_pb2.FINISH_REASON_LENGTH}


@dataclass
class Stubs:
    """Stubs on every service of the cluster, and the facts a valid registration needs."""

    inference: inference_pb2_grpc.InferenceStub
    registry: worker_pb2_grpc.WorkerRegistryStub
    prefill: worker_pb2_grpc.PrefillWorkerStub
    decode: worker_pb2_grpc.DecodeWorkerStub
    router_channel: grpc.Channel
    worker_status: worker_pb2.GetWorkerStatusResponse  # the decode worker's: fingerprint, KV layout, endpoint

    def raw_unary(self, method: str) -> grpc.UnaryUnaryMultiCallable:
        return self.router_channel.unary_unary(f"/splitserve.v1.Inference/{method}", request_serializer=None,
                                               response_deserializer=None)

    def raw_stream(self, method: str) -> grpc.UnaryStreamMultiCallable:
        return self.router_channel.unary_stream(f"/splitserve.v1.Inference/{method}", request_serializer=None,
                                                response_deserializer=None)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    limit = ["--max-model-len", str(MAX_MODEL_LEN)]
    cluster = start_cluster("p2p", tmp_path_factory.mktemp("bad-input"), router_args=limit, worker_args=limit)
    yield cluster
    cluster.stop()


@pytest.fixture(scope="module")
def stubs(cluster, client):
    [prefill] = [p for p in cluster.workers if p.name.startswith("prefill")]
    [decode] = [p for p in cluster.workers if p.name.startswith("decode")]
    channels = [grpc.insecure_channel(address) for address in (cluster.router.address, prefill.address,
                                                                decode.address)]
    decode_stub = worker_pb2_grpc.DecodeWorkerStub(channels[2])
    info = client.model_info()
    assert (info.max_model_len, info.vocab_size) == (MAX_MODEL_LEN, VOCAB_SIZE)
    yield Stubs(inference_pb2_grpc.InferenceStub(channels[0]), worker_pb2_grpc.WorkerRegistryStub(channels[0]),
                worker_pb2_grpc.PrefillWorkerStub(channels[1]), decode_stub, channels[0],
                decode_stub.GetStatus(worker_pb2.GetWorkerStatusRequest(), timeout=CALL_TIMEOUT))
    for channel in channels:
        channel.close()


def assert_sentence(details: str | None) -> None:
    """A status message a user reads: one short sentence, no traceback, no unbounded echo of the request."""
    assert details, "the status carries no message"
    assert len(details) < 300, f"{len(details)} characters: {details[:120]}..."
    assert details.endswith("."), details
    assert "Traceback" not in details and 'File "' not in details, details
    assert not details.startswith("Internal error"), details


# ---------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------


def generate_request(prompt: dict | None = None, request_id: str | None = None, **sampling) -> inference_pb2.GenerateRequest:
    """A GenerateRequest: ``prompt`` the oneof's field (None: a short text), ``sampling`` the SamplingParams'
    fields (max_tokens 2 unless given; a None value leaves the field unset)."""
    sampling = {"max_tokens": 2, **sampling}
    request = inference_pb2.GenerateRequest(
        **(dict(text="Hello") if prompt is None else prompt),
        sampling_params=inference_pb2.SamplingParams(**{k: v for k, v in sampling.items() if v is not None}),
    )
    if request_id is not None:
        request.request_id = request_id
    return request


def ids(*token_ids: int) -> dict:
    return dict(token_ids=inference_pb2.TokenIds(ids=list(token_ids)))


def chat(*messages: tuple[str, str]) -> dict:
    return dict(chat=inference_pb2.ChatPrompt(messages=[inference_pb2.ChatMessage(role=role, content=content)
                                                        for role, content in messages]))


def with_tools(*tools: inference_pb2.Tool) -> dict:
    """A one-message chat with ``tools``."""
    return dict(chat=inference_pb2.ChatPrompt(messages=[inference_pb2.ChatMessage(role="user", content="hi")],
                                              tools=tools))


NAN, INF = math.nan, math.inf

# (id, GenerateRequest, a piece of the sentence); each goes through Generate and GenerateStream: INVALID_ARGUMENT.
BAD_GENERATE_REQUESTS = [
    ("no-prompt", generate_request({}), "The request has no prompt: set text, token_ids or chat."),
    ("empty-text", generate_request(dict(text="")), "The prompt is empty"),
    ("empty-token-ids", generate_request(ids()), "The prompt is empty"),
    ("token-id-equal-to-vocab-size", generate_request(ids(1, VOCAB_SIZE)),
     f"Prompt token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})."),
    ("token-id-uint32-max", generate_request(ids(UINT32_MAX)), f"Prompt token id {UINT32_MAX} is outside"),
    ("prompt-of-max-model-len-tokens", generate_request(ids(*[1] * MAX_MODEL_LEN)),
     f"The prompt has {MAX_MODEL_LEN} tokens; max_model_len is {MAX_MODEL_LEN}"),
    ("prompt-far-over-max-model-len", generate_request(ids(*[1] * 50_000)), "The prompt has 50000 tokens"),
    ("text-over-max-model-len-once-tokenized", generate_request(dict(text="hello" * 300)), "The prompt has 300 tokens"),
    ("huge-text-refused-before-tokenizing", generate_request(dict(text="a" * 3_000_000)),
     "The text prompt is 3000000 bytes, more than max_model_len tokens can hold"),
    ("chat-without-messages", generate_request(dict(chat=inference_pb2.ChatPrompt())),
     "The chat prompt has no messages."),
    ("chat-message-without-role", generate_request(chat(("user", "hi"), ("", "hello"))), "Chat message 1 has no role."),
    ("huge-chat-refused-before-rendering", generate_request(chat(("user", "b" * 3_000_000))),
     "The chat's messages are 3000004 bytes"),
    ("huge-chat-role", generate_request(chat(("r" * 3_000_000, "hi"))), "The chat's messages are 3000002 bytes"),
    ("tool-parameters-not-json", generate_request(with_tools(inference_pb2.Tool(name="f", parameters="{"))),
     "tools[0].parameters must be a JSON Schema object, as JSON text."),
    ("tool-parameters-an-array", generate_request(with_tools(inference_pb2.Tool(name="f", parameters="[1, 2]"))),
     "tools[0].parameters must be a JSON Schema object"),
    ("tool-name-with-a-space", generate_request(with_tools(inference_pb2.Tool(name="get weather"))),
     "tools[0].function.name must be 1 to 64 letters, digits, underscores or hyphens, got 'get weather'."),
    ("tool-name-empty", generate_request(with_tools(inference_pb2.Tool(name=""))), "got ''."),
    ("tool-name-quoted-at-most-64-characters", generate_request(with_tools(inference_pb2.Tool(name="x" * 5000))),
     f"got {'x' * 64!r}."),
    ("two-tools-of-one-name", generate_request(with_tools(inference_pb2.Tool(name="f"), inference_pb2.Tool(name="f"))),
     "Two tools are named 'f': each name must be unique."),
    ("too-many-tools", generate_request(with_tools(*(inference_pb2.Tool(name=f"f{i}") for i in range(129)))),
     "129 tools are more than the 128 a request may give."),
    ("huge-tool-description", generate_request(with_tools(inference_pb2.Tool(name="f", description="d" * 3_000_000))),
     "The chat's messages are 3000"),
    ("huge-tool-call-arguments", generate_request(dict(chat=inference_pb2.ChatPrompt(messages=[
        inference_pb2.ChatMessage(role="assistant", tool_calls=[inference_pb2.ToolCall(
            id="c", name="f", arguments="[" * 3_000_000)])]))), "The chat's messages are 3000"),
    ("temperature-negative", generate_request(temperature=-0.5), "temperature must be a finite number >= 0"),
    ("temperature-nan", generate_request(temperature=NAN), "temperature must be"),
    ("temperature-inf", generate_request(temperature=INF), "temperature must be a finite number"),
    ("temperature-minus-inf", generate_request(temperature=-INF), "temperature must be"),
    ("top-p-zero", generate_request(top_p=0.0), "top_p must be in (0, 1]"),
    ("top-p-over-one", generate_request(top_p=1.5), "top_p must be in (0, 1]"),
    ("top-p-negative", generate_request(top_p=-0.1), "top_p must be in (0, 1]"),
    ("top-p-nan", generate_request(top_p=NAN), "top_p must be in (0, 1]"),
    ("top-k-minus-two", generate_request(top_k=-2), "top_k must be -1 (disabled) or an integer >= 1, got -2."),
    ("top-k-int32-min", generate_request(top_k=-(2**31)), "top_k must be -1"),
    ("min-p-negative", generate_request(min_p=-0.1), "min_p must be in [0, 1]"),
    ("min-p-over-one", generate_request(min_p=1.5), "min_p must be in [0, 1]"),
    ("min-p-nan", generate_request(min_p=NAN), "min_p must be in [0, 1]"),
    ("max-tokens-zero", generate_request(max_tokens=0), "max_tokens must be an integer >= 1, got 0."),
    ("min-tokens-over-max-tokens", generate_request(max_tokens=2, min_tokens=3),
     "min_tokens (3) must not exceed max_tokens (2)."),
    ("min-tokens-over-default-max-tokens", generate_request(max_tokens=None, min_tokens=UINT32_MAX),
     f"min_tokens ({UINT32_MAX}) must not exceed max_tokens (16)."),
    ("stop-empty-string", generate_request(stop=[""]), "stop must be a list of non-empty strings."),
    ("stop-empty-among-others", generate_request(stop=["ok", "", "x" * LONG]), "stop must be a list of non-empty"),
    ("logprobs-21", generate_request(logprobs=21), "logprobs must be an integer in [0, 20], got 21."),
    ("logprobs-uint32-max", generate_request(logprobs=UINT32_MAX), "logprobs must be an integer in [0, 20]"),
    ("prompt-logprobs-21", generate_request(prompt_logprobs=21), "prompt_logprobs must be an integer in [0, 20], got 21."),
    ("logit-bias-over-100", generate_request(logit_bias={7: 100.5}), "logit_bias values must be numbers in [-100, 100]"),
    ("logit-bias-nan", generate_request(logit_bias={7: NAN}), "logit_bias values must be numbers in [-100, 100]"),
    ("logit-bias-minus-inf", generate_request(logit_bias={7: -INF}), "logit_bias values must be numbers"),
    ("logit-bias-id-equal-to-vocab-size", generate_request(logit_bias={VOCAB_SIZE: 1.0}),
     f"logit_bias token id {VOCAB_SIZE} is outside the vocabulary [0, {VOCAB_SIZE})."),
    ("logit-bias-id-uint32-max", generate_request(logit_bias={1: 1.0, UINT32_MAX: 1.0}), "outside the vocabulary"),
    ("logit-bias-1025-entries", generate_request(logit_bias=dict.fromkeys(range(1025), 1.0)),
     "logit_bias has 1025 entries; at most 1024 are allowed."),
    ("repetition-penalty-zero", generate_request(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    ("repetition-penalty-negative", generate_request(repetition_penalty=-1.0), "repetition_penalty must be"),
    ("repetition-penalty-nan", generate_request(repetition_penalty=NAN), "repetition_penalty must be"),
    ("repetition-penalty-inf", generate_request(repetition_penalty=INF), "repetition_penalty must be"),
    ("presence-penalty-over-two", generate_request(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
    ("presence-penalty-under-minus-two", generate_request(presence_penalty=-2.5), "presence_penalty must be in [-2, 2]"),
    ("presence-penalty-nan", generate_request(presence_penalty=NAN), "presence_penalty must be in [-2, 2]"),
    ("frequency-penalty-just-over-two", generate_request(frequency_penalty=2.01), "frequency_penalty must be in [-2, 2]"),
    ("frequency-penalty-minus-three", generate_request(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2]"),
    ("frequency-penalty-inf", generate_request(frequency_penalty=INF), "frequency_penalty must be in [-2, 2]"),
    ("request-id-empty", generate_request(request_id=""), "request_id '' (0 characters) is not a valid id"),
    ("request-id-129-characters", generate_request(request_id="x" * 129), "(129 characters) is not a valid id"),
    ("request-id-huge", generate_request(request_id="x" * LONG), f"({LONG} characters) is not a valid id"),
    ("request-id-newline", generate_request(request_id="a\nINFO forged log line"), "is not a valid id"),
    ("request-id-carriage-return", generate_request(request_id="a\rb"), "is not a valid id"),
    ("request-id-nul", generate_request(request_id="a\x00b"), "is not a valid id"),
    ("request-id-escape-sequence", generate_request(request_id="\x1b[31mred"), "is not a valid id"),
    ("request-id-space", generate_request(request_id="a b"), "is not a valid id"),
    ("request-id-slash", generate_request(request_id="../etc/passwd"), "is not a valid id"),
    ("request-id-accented", generate_request(request_id="héllo"), "is not a valid id"),
    ("request-id-emoji", generate_request(request_id="id-🙂"), "is not a valid id"),
    ("request-id-line-separator", generate_request(request_id="a\u2028b"), "is not a valid id"),
]


def generate_unary(stubs: Stubs, request, timeout: float = CALL_TIMEOUT):
    return stubs.inference.Generate(request, timeout=timeout)


def generate_stream(stubs: Stubs, request, timeout: float = CALL_TIMEOUT):
    return list(stubs.inference.GenerateStream(request, timeout=timeout))


def negative_token_id_bytes() -> bytes:
    """A GenerateRequest whose token_ids hold -1, as a client in a language without unsigned ints may encode it:
    the ten-byte varint of -1, which proto3 reads as the uint32 4294967295."""
    token_ids = b"\x08" + b"\xff" * 9 + b"\x01"  # TokenIds.ids (field 1, varint) = -1
    return b"\x1a" + bytes([len(token_ids)]) + token_ids  # GenerateRequest.token_ids (field 3)


# A worker's KV endpoint no one listens on; the registrations below use addresses no worker has.
NOWHERE = worker_pb2.KVEndpoint(connector=worker_pb2.KV_CONNECTOR_TYPE_P2P, address="127.0.0.1:9", worker_id="nobody")


def register(stubs: Stubs, **fields) -> worker_pb2.RegisterResponse:
    """Register a made-up prefill worker at a discard address: the decode worker's facts, ``fields`` overriding."""
    status = stubs.worker_status
    request = worker_pb2.RegisterRequest(
        role=inference_pb2.WORKER_ROLE_PREFILL, address="127.0.0.1:9", kv_endpoint=NOWHERE,
        model_fingerprint=status.model_fingerprint, kv_layout=status.kv_layout, capacity=status.capacity,
    )
    for name, value in fields.items():
        if value is None:
            request.ClearField(name)
        elif isinstance(value, worker_pb2.KVCacheLayout):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    return stubs.registry.Register(request, timeout=CALL_TIMEOUT)


def other_layout(stubs: Stubs) -> worker_pb2.KVCacheLayout:
    layout = worker_pb2.KVCacheLayout()
    layout.CopyFrom(stubs.worker_status.kv_layout)
    layout.block_size *= 2
    return layout


def prefill(stubs: Stubs, prompt=(1, 2, 3), **fields) -> worker_pb2.PrefillResponse:
    request = worker_pb2.PrefillRequest(request_id="bad-input#00000000", transfer_id="bad-input-transfer",
                                        prompt_token_ids=list(prompt), destination=NOWHERE,
                                        sampling_params=inference_pb2.SamplingParams(max_tokens=2))
    for name, value in fields.items():
        if value is None:
            request.ClearField(name)
        elif isinstance(value, inference_pb2.SamplingParams | worker_pb2.KVEndpoint):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    return stubs.prefill.Prefill(request, timeout=CALL_TIMEOUT)


def decode(stubs: Stubs, prompt=(1, 2, 3), **fields) -> list:
    request = worker_pb2.DecodeRequest(request_id="bad-input#00000000", prompt_token_ids=list(prompt),
                                       prefill_locally=True, sampling_params=inference_pb2.SamplingParams(max_tokens=2))
    for name, value in fields.items():
        if isinstance(value, inference_pb2.SamplingParams | worker_pb2.KVEndpoint):
            getattr(request, name).CopyFrom(value)
        else:
            setattr(request, name, value)
    return list(stubs.decode.Decode(request, timeout=CALL_TIMEOUT))


Call = Callable[[Stubs], object]
Invalid = Code.INVALID_ARGUMENT


def case(case_id: str, code: grpc.StatusCode, sentence: str, call: Call, *marks):
    return pytest.param(call, code, sentence, id=case_id, marks=marks)


# (id, expected code, a piece of the sentence, the call) for every other RPC, each as its proto comment documents.
BAD_CALLS = [
    # Inference, raw bytes: what a client's own encoder may send.
    case("generate-negative-token-id-on-the-wire", Invalid, f"Prompt token id {UINT32_MAX} is outside the vocabulary",
         lambda s: s.raw_unary("Generate")(negative_token_id_bytes(), timeout=CALL_TIMEOUT)),
    case("generate-truncated-bytes", Invalid, "The request is not a valid GenerateRequest: its bytes do not parse",
         lambda s: s.raw_unary("Generate")(b"\x12\xff", timeout=CALL_TIMEOUT)),
    case("generate-stream-text-not-utf8", Invalid, "The request is not a valid GenerateRequest",
         lambda s: list(s.raw_stream("GenerateStream")(b"\x12\x02\xff\xfe", timeout=CALL_TIMEOUT))),
    # Inference.Abort: INVALID_ARGUMENT for an empty id or one outside the id rule.
    case("abort-empty-id", Invalid, "request_id '' (0 characters) is not a valid id",
         lambda s: s.inference.Abort(inference_pb2.AbortRequest(), timeout=CALL_TIMEOUT)),
    case("abort-id-newline", Invalid, "is not a valid id",
         lambda s: s.inference.Abort(inference_pb2.AbortRequest(request_id="a\nb"), timeout=CALL_TIMEOUT)),
    case("abort-id-129-characters", Invalid, "(129 characters) is not a valid id",
         lambda s: s.inference.Abort(inference_pb2.AbortRequest(request_id="x" * 129), timeout=CALL_TIMEOUT)),
    case("abort-id-huge", Invalid, f"({LONG} characters) is not a valid id",
         lambda s: s.inference.Abort(inference_pb2.AbortRequest(request_id="é" * LONG), timeout=CALL_TIMEOUT)),
    # Inference.Tokenize: INVALID_ARGUMENT for no prompt (and a chat the template cannot take).
    case("tokenize-no-prompt", Invalid, "The request has no prompt",
         lambda s: s.inference.Tokenize(inference_pb2.TokenizeRequest(), timeout=CALL_TIMEOUT)),
    case("tokenize-chat-without-messages", Invalid, "The chat prompt has no messages.",
         lambda s: s.inference.Tokenize(inference_pb2.TokenizeRequest(chat=inference_pb2.ChatPrompt()),
                                        timeout=CALL_TIMEOUT)),
    case("tokenize-chat-message-without-role", Invalid, "Chat message 0 has no role.",
         lambda s: s.inference.Tokenize(inference_pb2.TokenizeRequest(**chat(("", "hi"))), timeout=CALL_TIMEOUT)),
    case("tokenize-huge-text", Invalid, "The text prompt is 3000000 bytes",
         lambda s: s.inference.Tokenize(inference_pb2.TokenizeRequest(text="a" * 3_000_000), timeout=CALL_TIMEOUT)),
    # Inference.Detokenize: INVALID_ARGUMENT for an id outside the vocabulary or more ids than max_model_len.
    case("detokenize-id-equal-to-vocab-size", Invalid, f"Token id {VOCAB_SIZE} is outside the vocabulary",
         lambda s: s.inference.Detokenize(inference_pb2.DetokenizeRequest(token_ids=[5, VOCAB_SIZE]),
                                          timeout=CALL_TIMEOUT)),
    case("detokenize-id-uint32-max", Invalid, "is outside the vocabulary",
         lambda s: s.inference.Detokenize(inference_pb2.DetokenizeRequest(token_ids=[UINT32_MAX]),
                                          timeout=CALL_TIMEOUT)),
    case("detokenize-more-ids-than-max-model-len", Invalid, f"{MAX_MODEL_LEN + 1} token ids are more than max_model_len",
         lambda s: s.inference.Detokenize(inference_pb2.DetokenizeRequest(token_ids=[504] * (MAX_MODEL_LEN + 1)),
                                          timeout=CALL_TIMEOUT)),
    # WorkerRegistry.Register: INVALID_ARGUMENT (no address, unspecified role, no KV endpoint or layout for a
    # prefill or decode worker, no fingerprint), FAILED_PRECONDITION (other fingerprint or layout).
    case("register-no-address", Invalid, "address is required", lambda s: register(s, address="")),
    case("register-unspecified-role", Invalid, "role is required",
         lambda s: register(s, role=inference_pb2.WORKER_ROLE_UNSPECIFIED)),
    case("register-unknown-role", Invalid, "role 99 is not a WorkerRole", lambda s: register(s, role=99)),
    case("register-unknown-state", Invalid, "state 77 is not a WorkerState", lambda s: register(s, state=77)),
    case("register-prefill-without-kv-endpoint", Invalid, "kv_endpoint", lambda s: register(s, kv_endpoint=None)),
    case("register-prefill-without-fingerprint", Invalid, "model_fingerprint is required",
         lambda s: register(s, model_fingerprint="")),
    case("register-decode-without-kv-layout", Invalid, "kv_layout is required",
         lambda s: register(s, role=inference_pb2.WORKER_ROLE_DECODE, kv_layout=None)),
    case("register-other-fingerprint", Code.FAILED_PRECONDITION, "but this cluster serves",
         lambda s: register(s, model_fingerprint="f" * 64)),
    case("register-other-kv-layout", Code.FAILED_PRECONDITION, "another KV layout",
         lambda s: register(s, kv_layout=other_layout(s))),
    # WorkerRegistry.Heartbeat / Deregister: NOT_FOUND for an unknown lease; Drain: INVALID_ARGUMENT without one.
    case("heartbeat-unknown-lease", Code.NOT_FOUND, "unknown or expired",
         lambda s: s.registry.Heartbeat(worker_pb2.HeartbeatRequest(lease_id="no-such-lease"), timeout=CALL_TIMEOUT)),
    case("heartbeat-empty-lease", Code.NOT_FOUND, "unknown or expired",
         lambda s: s.registry.Heartbeat(worker_pb2.HeartbeatRequest(), timeout=CALL_TIMEOUT)),
    case("heartbeat-huge-lease", Code.NOT_FOUND, "unknown or expired",
         lambda s: s.registry.Heartbeat(worker_pb2.HeartbeatRequest(lease_id="L" * LONG), timeout=CALL_TIMEOUT)),
    case("deregister-unknown-lease", Code.NOT_FOUND, "unknown or expired",
         lambda s: s.registry.Deregister(worker_pb2.DeregisterRequest(lease_id="no-such-lease"), timeout=CALL_TIMEOUT)),
    case("deregister-empty-lease", Code.NOT_FOUND, "unknown or expired",
         lambda s: s.registry.Deregister(worker_pb2.DeregisterRequest(), timeout=CALL_TIMEOUT)),
    case("drain-without-lease", Invalid, "lease_id is required",
         lambda s: s.registry.Drain(worker_pb2.DrainRequest(worker_id="decode-1"), timeout=CALL_TIMEOUT)),
    case("drain-unknown-lease", Code.NOT_FOUND, "unknown or expired",
         lambda s: s.registry.Drain(worker_pb2.DrainRequest(lease_id="no-such-lease"), timeout=CALL_TIMEOUT)),
    # PrefillWorker.Prefill: INVALID_ARGUMENT (empty prompt, prompt at or over max_model_len, bad sampling
    # parameters, no transfer_id or destination); its ids follow the id rule.
    case("prefill-no-request-id", Invalid, "request_id '' (0 characters) is not a valid id",
         lambda s: prefill(s, request_id="")),
    case("prefill-request-id-newline", Invalid, "is not a valid id", lambda s: prefill(s, request_id="r\n1")),
    case("prefill-no-transfer-id", Invalid, "transfer_id '' (0 characters) is not a valid id",
         lambda s: prefill(s, transfer_id="")),
    case("prefill-no-destination", Invalid, "destination", lambda s: prefill(s, destination=None)),
    case("prefill-unknown-connector", Invalid, "connector",
         lambda s: prefill(s, destination=worker_pb2.KVEndpoint(connector=99, address="127.0.0.1:9"))),
    case("prefill-empty-prompt", Invalid, "prompt", lambda s: prefill(s, prompt=())),
    case("prefill-prompt-of-max-model-len-tokens", Invalid, f"max_model_len is {MAX_MODEL_LEN}",
         lambda s: prefill(s, prompt=[1] * MAX_MODEL_LEN)),
    case("prefill-token-outside-vocabulary", Invalid, f"Prompt token id {VOCAB_SIZE} is outside",
         lambda s: prefill(s, prompt=[1, VOCAB_SIZE])),
    case("prefill-bad-temperature", Invalid, "temperature must be",
         lambda s: prefill(s, sampling_params=inference_pb2.SamplingParams(temperature=-1.0))),
    case("prefill-cached-tokens-not-a-block-multiple", Invalid, "num_destination_cached_tokens (5)",
         lambda s: prefill(s, prompt=[1] * 40, num_destination_cached_tokens=5)),
    case("prefill-abort-empty-id", Invalid, "is not a valid id",
         lambda s: s.prefill.Abort(worker_pb2.AbortPrefillRequest(), timeout=CALL_TIMEOUT)),
    case("prefill-abort-id-too-long", Invalid, "(138 characters) is not a valid id",
         lambda s: s.prefill.Abort(worker_pb2.AbortPrefillRequest(request_id="x" * 138), timeout=CALL_TIMEOUT)),
    # DecodeWorker.Decode: INVALID_ARGUMENT (empty prompt, prompt at or over max_model_len, bad sampling
    # parameters, no transfer_id without prefill_locally).
    case("decode-no-request-id", Invalid, "request_id '' (0 characters) is not a valid id",
         lambda s: decode(s, request_id="")),
    case("decode-remote-without-transfer-id", Invalid, "transfer_id is required unless prefill_locally is set.",
         lambda s: decode(s, prefill_locally=False)),
    case("decode-transfer-id-with-space", Invalid, "is not a valid id",
         lambda s: decode(s, prefill_locally=False, transfer_id="t 1")),
    case("decode-empty-prompt", Invalid, "The prompt is empty", lambda s: decode(s, prompt=())),
    case("decode-prompt-over-max-model-len", Invalid, f"max_model_len is {MAX_MODEL_LEN}",
         lambda s: decode(s, prompt=[1] * (MAX_MODEL_LEN + 1))),
    case("decode-token-outside-vocabulary", Invalid, f"Prompt token id {UINT32_MAX} is outside",
         lambda s: decode(s, prompt=[UINT32_MAX])),
    case("decode-bad-top-p", Invalid, "top_p must be in (0, 1]",
         lambda s: decode(s, sampling_params=inference_pb2.SamplingParams(top_p=2.0))),
    case("decode-source-unknown-connector", Invalid, "connector",
         lambda s: decode(s, prefill_locally=False, transfer_id="bad-input-t1", kv_timeout_seconds=0.1,
                          source=worker_pb2.KVEndpoint(connector=99, address="127.0.0.1:9"))),
    case("decode-kv-timeout-nan", Invalid, "kv_timeout_seconds must be a positive, finite number",
         lambda s: decode(s, prefill_locally=False, transfer_id="bad-input-t2", kv_timeout_seconds=float("nan"))),
    case("decode-kv-timeout-negative", Invalid, "kv_timeout_seconds must be a positive, finite number",
         lambda s: decode(s, prefill_locally=False, transfer_id="bad-input-t3", kv_timeout_seconds=-1.0)),
    case("decode-abort-empty-id", Invalid, "is not a valid id",
         lambda s: s.decode.Abort(worker_pb2.AbortDecodeRequest(), timeout=CALL_TIMEOUT)),
]


def refusal_of(call: Call, stubs: Stubs, max_seconds: float = 5.0) -> grpc.RpcError:
    """The error ``call`` ends with, within ``max_seconds``; a made-up registration it was granted is undone."""
    started = time.monotonic()
    try:
        result = call(stubs)
    except grpc.RpcError as error:
        elapsed = time.monotonic() - started
        assert elapsed < max_seconds, f"refused after {elapsed:.1f} s"
        return error
    if isinstance(result, worker_pb2.RegisterResponse):
        stubs.registry.Deregister(worker_pb2.DeregisterRequest(lease_id=result.lease_id), timeout=CALL_TIMEOUT)
    raise AssertionError(f"accepted: {str(result)[:300]}")


@pytest.mark.parametrize("method", [generate_unary, generate_stream], ids=["Generate", "GenerateStream"])
@pytest.mark.parametrize("request_message, sentence", [pytest.param(r, s, id=i) for i, r, s in BAD_GENERATE_REQUESTS])
def test_a_bad_generate_request_is_invalid_argument_with_a_sentence(stubs, method, request_message, sentence):
    # Everything here is refused at the door: well under 2 s, the 3 MB prompts included (never tokenized).
    error = refusal_of(lambda s: method(s, request_message), stubs, max_seconds=2.0)
    assert (error.code(), sentence in error.details()) == (Code.INVALID_ARGUMENT, True), error.details()
    assert_sentence(error.details())


@pytest.mark.parametrize("call, code, sentence", BAD_CALLS)
def test_a_bad_call_gets_its_documented_status_and_a_sentence(stubs, call, code, sentence):
    error = refusal_of(call, stubs)
    assert (error.code(), sentence in error.details()) == (code, True), error.details()
    assert_sentence(error.details())


def test_the_table_is_at_least_forty_bad_requests():
    assert len(BAD_GENERATE_REQUESTS) + len(BAD_CALLS) >= 40
    case_ids = [case_id for case_id, _, _ in BAD_GENERATE_REQUESTS] + [param.id for param in BAD_CALLS]
    assert len(set(case_ids)) == len(case_ids)


# ---------------------------------------------------------------------------
# Still serving
# ---------------------------------------------------------------------------


def assert_still_serving(stubs: Stubs, client: Client) -> None:
    """A greedy request completes on every server, and every KV block is free again."""
    response = stubs.inference.Generate(generate_request(dict(text="The capital of France is"), max_tokens=4,
                                                         temperature=0.0), timeout=60)
    assert response.finish_reason in FINISHED and response.token_ids, response
    wait_until(lambda: all_blocks_free(client), timeout=30, message="all KV blocks free")
    pools = {pool.role: len(pool.workers) for pool in client.cluster_status().pools}
    assert pools == {inference_pb2.WORKER_ROLE_PREFILL: 1, inference_pb2.WORKER_ROLE_DECODE: 1}
def test_after_the_table_every_server_still_serves_and_every_block_is_free(stubs, client):
    assert_still_serving(stubs, client)


# ---------------------------------------------------------------------------
# Valid edges: accepted, and generated
# ---------------------------------------------------------------------------

VALID_EDGES = [
    ("seed-zero", generate_request(seed=0, temperature=1.0)),
    ("seed-minus-one", generate_request(seed=-1, temperature=1.0)),
    ("seed-int64-max", generate_request(seed=2**63 - 1, temperature=1.0)),
    ("seed-int64-min", generate_request(seed=-(2**63), temperature=1.0, top_k=0, top_p=1.0)),
    ("temperature-float32-max-and-min-p-one", generate_request(temperature=3.4e38, min_p=1.0)),
    ("top-k-one-top-p-tiny", generate_request(temperature=1.0, top_k=1, top_p=1e-6)),
    ("logprobs-zero", generate_request(logprobs=0, temperature=0.0)),
    ("logprobs-twenty", generate_request(logprobs=20, temperature=0.0)),
    ("prompt-logprobs-twenty-echoed", generate_request(dict(text="Hello there, world", echo=True), prompt_logprobs=20,
                                                       temperature=0.0)),
    ("penalties-at-their-bounds", generate_request(temperature=0.0, presence_penalty=-2.0, frequency_penalty=2.0,
                                                   repetition_penalty=1e-6)),
    ("max-tokens-uint32-max-capped-by-the-context", generate_request(ids(*[504] * (MAX_MODEL_LEN - 2)),
                                                                     max_tokens=UINT32_MAX, ignore_eos=True)),
    ("min-tokens-equal-to-max-tokens", generate_request(max_tokens=3, min_tokens=3, temperature=0.0)),
    ("stop-token-ids-outside-the-vocabulary", generate_request(stop_token_ids=[VOCAB_SIZE, UINT32_MAX])),
    ("logit-bias-at-its-bounds-on-the-vocabularys-ends", generate_request(
        logit_bias={0: -100.0, VOCAB_SIZE - 1: 100.0} | dict.fromkeys(range(1, 1023), 0.5), temperature=0.0)),
    ("a-long-stop-string", generate_request(stop=["x" * 10_000], temperature=0.0)),
    ("a-thousand-stop-strings", generate_request(stop=[f"stop-{index}" for index in range(1000)])),
    ("request-id-of-128-characters-of-the-rule", generate_request(request_id=("aZ09._:#-" * 15)[:128])),
    ("text-with-nul-and-unicode", generate_request(dict(text="a\x00b \u2028 🙂 é"))),
    ("chat-without-generation-prompt", generate_request(dict(chat=inference_pb2.ChatPrompt(
        messages=[inference_pb2.ChatMessage(role="user", content="Hi")], add_generation_prompt=False)))),
    ("chat-with-an-unusual-role", generate_request(chat(("robot", "{{ 7 * 7 }} {% raw %}")))),
]


@pytest.mark.parametrize("request_message", [pytest.param(r, id=i) for i, r in VALID_EDGES])
def test_a_valid_edge_value_is_accepted_and_generates(stubs, request_message):
    response = stubs.inference.Generate(request_message, timeout=60)
    assert response.finish_reason in FINISHED, response.error_message
    max_tokens = request_message.sampling_params.max_tokens
    if max_tokens == UINT32_MAX:  # capped at what the context has room for
        assert response.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert len(response.token_ids) == MAX_MODEL_LEN - len(request_message.token_ids.ids)
    else:
        assert 1 <= len(response.token_ids) <= max_tokens
    if request_message.sampling_params.HasField("logprobs"):
        assert len(response.logprobs) == len(response.token_ids)
        assert all(len(position.top) == request_message.sampling_params.logprobs for position in response.logprobs)
    if request_message.sampling_params.HasField("prompt_logprobs"):
        assert response.prompt_text == request_message.text and len(response.prompt_logprobs) == 4
        assert all(len(position.top) == 20 for position in response.prompt_logprobs[1:])
    if request_message.HasField("request_id"):
        assert response.request_id == request_message.request_id


def test_tokenize_answers_a_prompt_longer_than_max_model_len_with_max_model_len(stubs):
    # Tokenize documents no length limit: the client compares token_ids with max_model_len itself.
    response = stubs.inference.Tokenize(inference_pb2.TokenizeRequest(text="hello" * 300), timeout=CALL_TIMEOUT)
    assert (len(response.token_ids), response.max_model_len) == (300, MAX_MODEL_LEN)


def test_detokenize_gives_back_the_text_at_the_edges(stubs):
    tokenized = stubs.inference.Tokenize(inference_pb2.TokenizeRequest(text="Hello there, 🙂 é"), timeout=CALL_TIMEOUT)
    text = stubs.inference.Detokenize(inference_pb2.DetokenizeRequest(token_ids=tokenized.token_ids),
                                      timeout=CALL_TIMEOUT).text
    assert text == "Hello there, 🙂 é"  # the emoji's bytes span tokens: decoded together, whole
    empty = stubs.inference.Detokenize(inference_pb2.DetokenizeRequest(), timeout=CALL_TIMEOUT)
    assert empty.text == ""
    edges = inference_pb2.DetokenizeRequest(token_ids=[0, VOCAB_SIZE - 1] + [504] * (MAX_MODEL_LEN - 2))
    assert stubs.inference.Detokenize(edges, timeout=CALL_TIMEOUT).text
    with_special = inference_pb2.DetokenizeRequest(token_ids=[0, 504])  # 0: SmolLM2's <|endoftext|>
    kept = stubs.inference.Detokenize(with_special, timeout=CALL_TIMEOUT).text
    with_special.skip_special_tokens = True
    skipped = stubs.inference.Detokenize(with_special, timeout=CALL_TIMEOUT).text
    assert kept == "<|endoftext|>" + skipped and skipped


# ---------------------------------------------------------------------------
# Requests in flight: a duplicate id, Abort, deadlines
# ---------------------------------------------------------------------------


def long_request(request_id: str | None = None) -> inference_pb2.GenerateRequest:
    return generate_request(dict(text="Tell me a long story."), request_id=request_id, max_tokens=200,
                            ignore_eos=True, temperature=0.0)


def test_a_request_id_in_flight_is_refused_and_abort_finds_it(stubs, client):
    stream = stubs.inference.GenerateStream(long_request("bad-input-duplicate"), timeout=60)
    try:
        first = next(stream)
        assert first.token_ids
        for method in (generate_unary, generate_stream):
            error = refusal_of(lambda s, method=method: method(s, long_request("bad-input-duplicate")), stubs)
            assert error.code() == Code.INVALID_ARGUMENT
            assert error.details() == "Request id 'bad-input-duplicate' is already in flight."
        assert stubs.inference.Abort(inference_pb2.AbortRequest(request_id="bad-input-duplicate"),
                                     timeout=CALL_TIMEOUT).found
        *_, last = stream
        assert last.finish_reason == inference_pb2.FINISH_REASON_ABORT
    finally:
        stream.cancel()
    assert not stubs.inference.Abort(inference_pb2.AbortRequest(request_id="bad-input-duplicate"),
                                     timeout=CALL_TIMEOUT).found
    wait_until(lambda: all_blocks_free(client), timeout=30, message="all KV blocks free after the abort")


def test_an_expired_deadline_is_deadline_exceeded(stubs, client):
    for method in (generate_unary, generate_stream):
        with pytest.raises(grpc.RpcError) as expired:
            method(stubs, generate_request(), timeout=1e-6)
        assert expired.value.code() == Code.DEADLINE_EXCEEDED
    # A deadline that passes mid-generation aborts the request on the workers and frees its blocks.
    for method in (generate_unary, generate_stream):
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as expired:
            method(stubs, long_request(), timeout=1.5)
        assert expired.value.code() == Code.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 5
    wait_until(lambda: all_blocks_free(client), timeout=30, message="all KV blocks free after the deadlines")


# ---------------------------------------------------------------------------
# Random requests and random bytes (hypothesis)
# ---------------------------------------------------------------------------

FUZZ_SETTINGS = dict(database=None, derandomize=True, deadline=None, print_blob=True,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FUZZ_CALL_TIMEOUT = 5.0

floats = st.floats(width=32, allow_nan=True, allow_infinity=True)


def sampled_or(*values, wild=None):
    return st.sampled_from(values) if wild is None else st.one_of(st.sampled_from(values), wild)


sampling_params = st.fixed_dictionaries({}, optional={
    "max_tokens": sampled_or(0, 1, 2, 3, 4, UINT32_MAX),
    "temperature": sampled_or(0.0, 0.7, 1.0, -1.0, wild=floats),
    "top_k": sampled_or(-1, 0, 1, 5, -2, wild=st.integers(-(2**31), 2**31 - 1)),
    "top_p": sampled_or(1.0, 0.9, 0.0, wild=floats),
    "min_p": sampled_or(0.0, 0.1, 1.0, wild=floats),
    "repetition_penalty": sampled_or(1.0, 1.2, 0.0, wild=floats),
    "presence_penalty": sampled_or(0.0, 2.0, -2.0, wild=floats),
    "frequency_penalty": sampled_or(0.0, 1.0, -2.0, wild=floats),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stop": st.lists(st.text(max_size=12), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, UINT32_MAX), max_size=3),
    "ignore_eos": st.booleans(),
    "min_tokens": sampled_or(0, 1, 2, wild=st.integers(0, UINT32_MAX)),
    "logprobs": sampled_or(0, 1, 5, 20, 21, wild=st.integers(0, UINT32_MAX)),
    "prompt_logprobs": sampled_or(0, 2, 21, wild=st.integers(0, UINT32_MAX)),
    "skip_special_tokens": st.booleans(),
    "logit_bias": st.dictionaries(st.one_of(st.integers(0, VOCAB_SIZE - 1), st.integers(0, UINT32_MAX)),
                                  sampled_or(0.0, 5.0, -100.0, 100.0, wild=floats), max_size=3),
})
token_ids = st.lists(st.one_of(st.integers(0, VOCAB_SIZE - 1), st.integers(0, UINT32_MAX)), max_size=300)
messages = st.lists(st.tuples(st.text(max_size=10), st.text(max_size=80)), max_size=4)
tools = st.lists(st.builds(inference_pb2.Tool, name=st.one_of(st.sampled_from(["f", "get_time"]), st.text(max_size=8)),
                           description=st.text(max_size=20),
                           parameters=st.sampled_from(["", "{}", '{"type": "object"}', "[", "null", '"x"'])),
                 max_size=3)
tool_calls = st.lists(st.builds(inference_pb2.ToolCall, id=st.text(max_size=6), name=st.text(max_size=8),
                                arguments=st.sampled_from(["{}", '{"a": 1}', "not json", "[1]", ""])), max_size=2)


@st.composite
def chats_with_tools(draw) -> dict:
    """A chat whose messages may carry tool calls and tool answers, and which may give tools."""
    chat_messages = [inference_pb2.ChatMessage(role=role, content=content, tool_calls=draw(tool_calls),
                                               tool_call_id=draw(st.text(max_size=6)))
                     for role, content in draw(messages)]
    return dict(chat=inference_pb2.ChatPrompt(messages=chat_messages, tools=draw(tools)))


prompts = st.one_of(
    st.just({}),
    st.text(max_size=400).map(lambda text: dict(text=text)),
    token_ids.map(lambda values: ids(*values)),
    messages.map(lambda pairs: chat(*pairs)),
    chats_with_tools(),
)
request_ids = st.one_of(st.none(), st.text(max_size=140), st.from_regex(r"[A-Za-z0-9._:#-]{1,128}", fullmatch=True))


@st.composite
def generate_requests(draw) -> inference_pb2.GenerateRequest:
    request = inference_pb2.GenerateRequest(**draw(prompts), echo=draw(st.booleans()),
                                            sampling_params=inference_pb2.SamplingParams(**draw(sampling_params)))
    request_id = draw(request_ids)
    if request_id is not None:
        request.request_id = request_id
    return request


def outcome_of(send: Callable[[], object]) -> tuple[grpc.StatusCode, str, object]:
    try:
        return Code.OK, "", send()
    except grpc.RpcError as error:
        return error.code(), error.details() or "", None


def test_random_generate_requests_get_only_documented_codes(stubs, client):
    """Generate and GenerateStream answer any request with OK or a code inference.proto documents for them, a
    finished completion when OK; afterwards the cluster still serves and every block is free."""
    outcomes: Counter = Counter()
    stop_at = time.monotonic() + 75  # the budget on this machine: the examples after it send nothing

    @settings(max_examples=300, **FUZZ_SETTINGS)
    @given(request=generate_requests(), streaming=st.booleans())
    def check(request, streaming):
        if time.monotonic() > stop_at:
            outcomes["skipped (time budget)"] += 1
            return
        method = generate_stream if streaming else generate_unary
        code, details, answer = outcome_of(lambda: method(stubs, request, timeout=FUZZ_CALL_TIMEOUT))
        outcomes[code.name] += 1
        assert code in GENERATE_CODES, f"{code.name}: {details[:300]}"
        if code == Code.OK:
            last = answer[-1] if streaming else answer
            assert last.finish_reason in FINISHED, f"finished with {last.finish_reason}: {last.error_message}"
        elif code != Code.DEADLINE_EXCEEDED:
            assert_sentence(details)

    check()
    print("random GenerateRequests:", dict(outcomes))
    assert outcomes[Code.OK.name] >= 5 and outcomes[Code.INVALID_ARGUMENT.name] >= 50, dict(outcomes)
    assert_still_serving(stubs, client)


RAW_METHODS = {  # method -> (streaming, the codes its proto comment allows besides OK)
    "Generate": (False, GENERATE_CODES),
    "GenerateStream": (True, GENERATE_CODES),
    "Embed": (False, GENERATE_CODES | {Code.NOT_FOUND}),
    "Abort": (False, {Code.OK, Code.INVALID_ARGUMENT}),
    "Tokenize": (False, {Code.OK, Code.INVALID_ARGUMENT}),
    "Detokenize": (False, {Code.OK, Code.INVALID_ARGUMENT}),
    "GetModelInfo": (False, {Code.OK, Code.INVALID_ARGUMENT}),
    "GetClusterStatus": (False, {Code.OK, Code.INVALID_ARGUMENT}),
}
VALID_BYTES = [  # requests to mutate: a random byte changed here and there often still parses
    generate_request(dict(text="Hi"), max_tokens=1).SerializeToString(),
    generate_request(ids(504, 3575), request_id="r-1", max_tokens=2, temperature=0.5, seed=7).SerializeToString(),
    inference_pb2.EmbedRequest(token_ids=inference_pb2.TokenIds(ids=[504, 3575]), dimensions=8).SerializeToString(),
    inference_pb2.AbortRequest(request_id="r-1").SerializeToString(),
    inference_pb2.TokenizeRequest(**chat(("user", "hi"))).SerializeToString(),
    inference_pb2.DetokenizeRequest(token_ids=[504, 3575], skip_special_tokens=True).SerializeToString(),
]


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(VALID_BYTES)))
    for _ in range(draw(st.integers(1, 4))):
        data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


def test_random_bytes_get_only_invalid_argument_or_a_documented_answer(stubs, client):
    outcomes: Counter = Counter()
    stop_at = time.monotonic() + 30

    @settings(max_examples=300, **FUZZ_SETTINGS)
    @given(method=st.sampled_from(sorted(RAW_METHODS)), data=st.one_of(st.binary(max_size=64), mutated()))
    def check(method, data):
        if time.monotonic() > stop_at:
            outcomes["skipped (time budget)"] += 1
            return
        streaming, allowed = RAW_METHODS[method]
        call = stubs.raw_stream(method) if streaming else stubs.raw_unary(method)
        code, details, _ = outcome_of(lambda: list(call(data, timeout=FUZZ_CALL_TIMEOUT)) if streaming
                                      else call(data, timeout=FUZZ_CALL_TIMEOUT))
        outcomes[f"{method} {code.name}"] += 1
        assert code in allowed, f"{method} {data!r}: {code.name}: {details[:300]}"
        if code not in (Code.OK, Code.DEADLINE_EXCEEDED):
            assert_sentence(details)

    check()
    print("random bytes:", dict(outcomes))
    assert sum(n for key, n in outcomes.items() if key.endswith("INVALID_ARGUMENT")) >= 50, dict(outcomes)
    assert_still_serving(stubs, client)
