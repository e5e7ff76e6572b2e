"""The gRPC contract: generated stubs, their freshness, comments and field presence.

The stubs are generated at install time (setup.py) or by ``make protos``; these
tests check that what is imported is exactly what the .proto files produce
today, that every RPC, message, field and enum value is documented, and that
``optional`` marks every sampling field whose default is not zero.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.resources
import re
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pb2

from splitserve.common.sampling_params import SamplingParams as EngineSamplingParams
from splitserve.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
PROTO_FILES = ["splitserve/v1/inference.proto", "splitserve/v1/worker.proto"]
STUB_MODULES = [inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc]

UNARY, SERVER_STREAMING = "unary", "server_streaming"
EXPECTED_SERVICES = {
    inference_pb2: {
        "Inference": {
            "Generate": UNARY,
            "GenerateStream": SERVER_STREAMING,
            "Embed": UNARY,
            "Abort": UNARY,
            "Tokenize": UNARY,
            "Detokenize": UNARY,
            "GetModelInfo": UNARY,
            "GetClusterStatus": UNARY,
        },
    },
    worker_pb2: {
        "PrefillWorker": {"Prefill": UNARY, "Abort": UNARY, "GetStatus": UNARY},
        "DecodeWorker": {"Decode": SERVER_STREAMING, "Embed": UNARY, "Abort": UNARY, "GetStatus": UNARY},
        "WorkerRegistry": {
            "Register": UNARY,
            "Heartbeat": UNARY,
            "Deregister": UNARY,
            "Drain": UNARY,
        },
    },
}


def _protoc(*args: str) -> None:
    """Run grpc_tools' protoc as `make protos` does, from the repo root."""
    command = [sys.executable, "-m", "grpc_tools.protoc", "-I", "protos", *args, *(
        f"protos/{name}" for name in PROTO_FILES
    )]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, f"protoc failed: {result.stderr}"


# ---------------------------------------------------------------------------
# (a) the stubs import and expose the services
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, service_name",
    [(module, name) for module, services in EXPECTED_SERVICES.items() for name in services],
)
def test_service_has_the_expected_rpcs(module, service_name):
    expected = EXPECTED_SERVICES[module][service_name]
    service = module.DESCRIPTOR.services_by_name[service_name]
    assert service.full_name == f"splitserve.v1.{service_name}"
    kinds = {}
    for method in service.methods:
        assert not method.client_streaming, f"{service_name}.{method.name} streams requests"
        kinds[method.name] = SERVER_STREAMING if method.server_streaming else UNARY
    assert kinds == expected

    grpc_module = {inference_pb2: inference_pb2_grpc, worker_pb2: worker_pb2_grpc}[module]
    servicer = getattr(grpc_module, f"{service_name}Servicer")
    assert callable(getattr(grpc_module, f"{service_name}Stub"))
    assert callable(getattr(grpc_module, f"add_{service_name}Servicer_to_server"))
    for method_name in expected:
        assert callable(getattr(servicer, method_name))


def test_stubs_import_as_the_splitserve_v1_package():
    assert inference_pb2.DESCRIPTOR.package == "splitserve.v1"
    assert worker_pb2.DESCRIPTOR.package == "splitserve.v1"
    assert worker_pb2.DESCRIPTOR.name == "splitserve/v1/worker.proto"
    # worker.proto reuses the public messages rather than redefining them.
    assert "splitserve/v1/inference.proto" in [d.name for d in worker_pb2.DESCRIPTOR.dependencies]
    prefill_params = worker_pb2.PrefillRequest.DESCRIPTOR.fields_by_name["sampling_params"]
    assert prefill_params.message_type is inference_pb2.SamplingParams.DESCRIPTOR


def test_proto_sources_ship_with_the_package():
    shipped = importlib.resources.files("splitserve.v1")
    for name in PROTO_FILES:
        file_name = name.rsplit("/", 1)[1]
        assert shipped.joinpath(file_name).read_text() == (PROTO_ROOT / name).read_text()


def test_stream_round_trip_through_a_real_server():
    """The generated servicer/stub pair carries a server stream over a socket."""

    class EchoInference(inference_pb2_grpc.InferenceServicer):
        def GenerateStream(self, request, context):
            yield inference_pb2.GenerateStreamResponse(
                request_id=request.request_id, text="Par", token_ids=[7, 8]
            )
            yield inference_pb2.GenerateStreamResponse(
                request_id=request.request_id,
                text="is",
                token_ids=[9],
                finish_reason=inference_pb2.FINISH_REASON_LENGTH,
                usage=inference_pb2.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=3),
            )

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    inference_pb2_grpc.add_InferenceServicer_to_server(EchoInference(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            request = inference_pb2.GenerateRequest(
                request_id="r1",
                token_ids=inference_pb2.TokenIds(ids=[1, 2, 3, 4]),
                sampling_params=inference_pb2.SamplingParams(max_tokens=3, temperature=0.0),
            )
            chunks = list(stub.GenerateStream(request, timeout=10))
            assert [list(chunk.token_ids) for chunk in chunks] == [[7, 8], [9]]
            assert "".join(chunk.text for chunk in chunks) == "Paris"
            assert chunks[-1].finish_reason == inference_pb2.FINISH_REASON_LENGTH
            assert chunks[-1].usage.prompt_tokens == 4
            # An RPC the servicer does not implement answers UNIMPLEMENTED.
            with pytest.raises(grpc.RpcError) as error:
                stub.Tokenize(inference_pb2.TokenizeRequest(text="hi"), timeout=10)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        server.stop(grace=None)


# ---------------------------------------------------------------------------
# (b) no drift between the .proto files and the imported stubs
# ---------------------------------------------------------------------------


def test_generator_pins_agree():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    build_pin = [r for r in pyproject["build-system"]["requires"] if r.startswith("grpcio-tools")]
    test_pin = [
        r for r in pyproject["project"]["optional-dependencies"]["test"] if r.startswith("grpcio-tools")
    ]
    makefile_pin = re.findall(r"^GRPC_TOOLS = (\S+)$", (REPO / "Makefile").read_text(), re.M)
    assert build_pin == test_pin == makefile_pin and len(build_pin) == 1
    pinned_version = build_pin[0].split("==")[1]
    installed = importlib.metadata.version("grpcio-tools")
    assert installed == pinned_version, (
        f"grpcio-tools {installed} is installed but stubs are built with {pinned_version}: "
        f"run `make protos` (it installs {build_pin[0]})."
    )


def test_imported_stubs_match_freshly_generated_ones(tmp_path):
    _protoc(f"--python_out={tmp_path}", f"--grpc_python_out={tmp_path}", f"--pyi_out={tmp_path}")
    generated = sorted(tmp_path.glob("splitserve/v1/*"))
    assert {path.name for path in generated} == {
        "inference_pb2.py", "inference_pb2_grpc.py", "inference_pb2.pyi",
        "worker_pb2.py", "worker_pb2_grpc.py", "worker_pb2.pyi",
    }
    installed_dir = Path(inference_pb2.__file__).parent
    for module in STUB_MODULES:
        assert Path(module.__file__).parent == installed_dir
    for path in generated:
        installed = installed_dir / path.name
        assert installed.exists(), f"{installed} is missing: run `make protos` or pip install again"
        assert installed.read_text() == path.read_text(), (
            f"{installed} is stale: the .proto files changed since it was generated. "
            "Run `make protos` (or `pip install -e .`)."
        )


# ---------------------------------------------------------------------------
# (c) every service, RPC, message, field, oneof, enum and enum value is documented
# ---------------------------------------------------------------------------

# Field numbers of the descriptor.proto fields that source-code-info paths use.
FILE_MESSAGE, FILE_ENUM, FILE_SERVICE = 4, 5, 6
MESSAGE_FIELD, MESSAGE_NESTED, MESSAGE_ENUM, MESSAGE_ONEOF = 2, 3, 4, 8
ENUM_VALUE, SERVICE_METHOD = 2, 2


def _documented_elements(file_proto):
    """Yield (kind, full name, source path) of every element that needs a comment."""
    prefix = file_proto.package

    def enum_elements(enum, name, path):
        yield "enum", name, path
        for index, value in enumerate(enum.value):
            yield "enum value", f"{name}.{value.name}", (*path, ENUM_VALUE, index)

    def message_elements(message, name, path):
        if message.options.map_entry:  # synthesized for map<,> fields
            return
        yield "message", name, path
        for index, field in enumerate(message.field):
            yield "field", f"{name}.{field.name}", (*path, MESSAGE_FIELD, index)
        for index, oneof in enumerate(message.oneof_decl):
            if not oneof.name.startswith("_"):  # synthetic oneofs of proto3 `optional`
                yield "oneof", f"{name}.{oneof.name}", (*path, MESSAGE_ONEOF, index)
        for index, nested in enumerate(message.nested_type):
            yield from message_elements(nested, f"{name}.{nested.name}", (*path, MESSAGE_NESTED, index))
        for index, enum in enumerate(message.enum_type):
            yield from enum_elements(enum, f"{name}.{enum.name}", (*path, MESSAGE_ENUM, index))

    for index, service in enumerate(file_proto.service):
        path = (FILE_SERVICE, index)
        yield "service", f"{prefix}.{service.name}", path
        for method_index, method in enumerate(service.method):
            yield "rpc", f"{prefix}.{service.name}.{method.name}", (*path, SERVICE_METHOD, method_index)
    for index, message in enumerate(file_proto.message_type):
        yield from message_elements(message, f"{prefix}.{message.name}", (FILE_MESSAGE, index))
    for index, enum in enumerate(file_proto.enum_type):
        yield from enum_elements(enum, f"{prefix}.{enum.name}", (FILE_ENUM, index))


@pytest.fixture(scope="module")
def descriptor_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("descriptors") / "splitserve.pb"
    _protoc(f"--descriptor_set_out={out}", "--include_source_info")
    return descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())


def test_every_element_has_a_leading_comment(descriptor_set):
    assert sorted(f.name for f in descriptor_set.file) == PROTO_FILES
    undocumented = []
    counts: dict[str, int] = {}
    for file_proto in descriptor_set.file:
        comments = {
            tuple(location.path): location.leading_comments.strip()
            for location in file_proto.source_code_info.location
        }
        for kind, name, path in _documented_elements(file_proto):
            counts[kind] = counts.get(kind, 0) + 1
            if not comments.get(path):
                undocumented.append(f"{kind} {name}")
    assert not undocumented, "no leading comment on: " + ", ".join(undocumented)
    # The walk really visited the contract (a walk that finds nothing cannot fail).
    assert counts["service"] == 4 and counts["rpc"] == 19
    assert counts["message"] > 40 and counts["field"] > 150


def test_every_rpc_comment_names_its_error_codes(descriptor_set):
    codes = ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED")
    inference = next(f for f in descriptor_set.file if f.name.endswith("inference.proto"))
    comments = {tuple(loc.path): loc.leading_comments for loc in inference.source_code_info.location}
    generate = comments[(FILE_SERVICE, 0, SERVICE_METHOD, 0)]
    for code in codes:
        assert code in generate, f"Inference.Generate's comment does not say when it returns {code}"


# ---------------------------------------------------------------------------
# (d) `optional` wherever zero is not the default
# ---------------------------------------------------------------------------


def _zero_value(value) -> bool:
    return value in (0, 0.0, False, "") if not isinstance(value, list | dict) else not value


def _is_repeated(field) -> bool:
    # protobuf >= 6.32 has is_repeated and deprecates label; 6.31 has only label.
    if hasattr(type(field), "is_repeated"):
        return field.is_repeated
    return field.label == field.LABEL_REPEATED


def _engine_defaults() -> dict[str, object]:
    defaults = {}
    for field in dataclasses.fields(EngineSamplingParams):
        if field.default is not dataclasses.MISSING:
            defaults[field.name] = field.default
        else:
            defaults[field.name] = field.default_factory()
    return defaults


def test_sampling_params_mirror_the_engine():
    proto_fields = set(inference_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert proto_fields == set(_engine_defaults())


@pytest.mark.parametrize("name, default", sorted(_engine_defaults().items()))
def test_optional_exactly_where_the_engine_default_is_not_zero(name, default):
    field = inference_pb2.SamplingParams.DESCRIPTOR.fields_by_name[name]
    needs_presence = default is None or not _zero_value(default)
    if _is_repeated(field):
        if default is None:  # a list the engine never takes empty: empty on the wire can only mean unset
            with pytest.raises(ValueError):
                EngineSamplingParams(**{name: []})
            return
        assert _zero_value(default), f"{name} is repeated but its engine default is {default!r}"
        return
    assert field.has_presence == needs_presence, (
        f"SamplingParams.{name}: engine default {default!r}, so it should "
        f"{'' if needs_presence else 'not '}be `optional`"
    )


@pytest.mark.parametrize(
    "name", ["temperature", "top_p", "top_k", "seed", "max_tokens", "repetition_penalty", "logprobs"]
)
def test_explicit_zero_is_distinguishable_from_unset(name):
    params = inference_pb2.SamplingParams()
    assert not params.HasField(name)
    setattr(params, name, 0)
    assert params.HasField(name)
    decoded = inference_pb2.SamplingParams.FromString(params.SerializeToString())
    assert decoded.HasField(name) and getattr(decoded, name) == 0


@pytest.mark.parametrize(
    "message, name",
    [
        (inference_pb2.GenerateRequest, "request_id"),
        (inference_pb2.ChatPrompt, "add_generation_prompt"),
        (worker_pb2.KVTransferHeader, "first_token_id"),
        (worker_pb2.DecodeRequest, "kv_timeout_seconds"),
        (inference_pb2.EmbedRequest, "request_id"),
        (inference_pb2.EmbedRequest, "normalize"),
        (worker_pb2.EmbedPromptRequest, "normalize"),
    ],
)
def test_other_fields_whose_unset_state_matters_have_presence(message, name):
    assert message.DESCRIPTOR.fields_by_name[name].has_presence
