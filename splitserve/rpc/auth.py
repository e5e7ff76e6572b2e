"""Access control: API keys on the public API, a cluster token between the router and its workers.

Two secrets, both checked by :class:`MetadataGuard`, a server interceptor that
``start_server`` installs when it is given :class:`Credentials`:

* API keys guard ``splitserve.v1.Inference``: a call carries metadata
  ``authorization: Bearer <key>``. Keys come from ``--api-key-file`` (one a line)
  or ``SPLITSERVE_API_KEYS`` (comma-separated); clients send theirs
  (``splitserve.client.Client``, ``SPLITSERVE_API_KEY``).
* The cluster token guards ``WorkerRegistry``, ``PrefillWorker`` and ``DecodeWorker``:
  metadata ``x-splitserve-cluster-token: <token>``, from ``--cluster-token-file``
  or ``SPLITSERVE_CLUSTER_TOKEN``, on the router and every worker alike.

A secret not configured leaves its services open (as before access control).
Health checks and server reflection are always open. A refused call ends with
UNAUTHENTICATED and a sentence that never repeats what was sent; secrets are
compared with ``hmac.compare_digest`` and never logged.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import grpc

API_KEYS_ENV = "SPLITSERVE_API_KEYS"  # servers: the accepted keys, comma-separated
API_KEY_ENV = "SPLITSERVE_API_KEY"  # clients: the key to send
CLUSTER_TOKEN_ENV = "SPLITSERVE_CLUSTER_TOKEN"

AUTHORIZATION_HEADER = "authorization"
BEARER_PREFIX = "Bearer "
CLUSTER_TOKEN_HEADER = "x-splitserve-cluster-token"

# Method-name prefixes each secret guards (a method name is "/package.Service/Method").
PUBLIC_API_PREFIXES = ("/splitserve.v1.Inference/",)
CLUSTER_PREFIXES = ("/splitserve.v1.WorkerRegistry/", "/splitserve.v1.PrefillWorker/", "/splitserve.v1.DecodeWorker/")

API_KEY_REFUSAL = "Missing or invalid API key: send 'authorization: Bearer <key>' metadata."
CLUSTER_TOKEN_REFUSAL = "Missing or invalid cluster token: send 'x-splitserve-cluster-token: <token>' metadata."


@dataclass(frozen=True)
class Credentials:
    """The secrets one server checks. Empty ones leave their services open; ``repr`` shows no secret.

    Attributes:
        api_keys: keys accepted on the public API (empty: open).
        cluster_token: the token of router-worker calls (None: open).
    """

    api_keys: frozenset[str] = field(default_factory=frozenset, repr=False)
    cluster_token: str | None = field(default=None, repr=False)

    def __repr__(self) -> str:
        token = "set" if self.cluster_token else "none"
        return f"Credentials(api_keys=<{len(self.api_keys)} keys>, cluster_token=<{token}>)"


def read_secrets(path: str | None, environment: Mapping[str, str], variable: str, what: str) -> frozenset[str]:
    """The secrets of ``path`` (one a line; blank lines and ``#`` comments skipped), else of ``environment[variable]``.

    The file wins over the variable, whose value is comma-separated. Neither: an empty set (open).

    Raises:
        ValueError: the file cannot be read or holds no secret (a sentence naming the file, never its content).
    """
    if path:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"Cannot read the {what} file {path}: {error.strerror or error}.") from None
        secrets = [line.strip() for line in text.splitlines()]
        secrets = [line for line in secrets if line and not line.startswith("#")]
        if not secrets:
            raise ValueError(f"The {what} file {path} holds no {what}: write one a line (# starts a comment).")
        return frozenset(secrets)
    value = environment.get(variable, "")
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def load_credentials(api_key_file: str | None, cluster_token_file: str | None,
                     environment: Mapping[str, str]) -> Credentials:
    """Credentials from the flags' files, else from ``SPLITSERVE_API_KEYS`` and ``SPLITSERVE_CLUSTER_TOKEN``.

    Raises:
        ValueError: a file is unreadable or empty, or more than one cluster token is given.
    """
    api_keys = read_secrets(api_key_file, environment, API_KEYS_ENV, "API key")
    tokens = read_secrets(cluster_token_file, environment, CLUSTER_TOKEN_ENV, "cluster token")
    if len(tokens) > 1:
        raise ValueError("Give exactly one cluster token (--cluster-token-file or SPLITSERVE_CLUSTER_TOKEN).")
    return Credentials(api_keys, next(iter(tokens), None))


def _matches(sent: str, accepted: Iterable[str]) -> bool:
    """Whether ``sent`` is one of ``accepted``, comparing every one in constant time."""
    sent_bytes = sent.encode()
    found = False
    for secret in accepted:
        found |= hmac.compare_digest(sent_bytes, secret.encode())
    return found


class MetadataGuard(grpc.ServerInterceptor):
    """Refuses calls to the guarded methods (UNAUTHENTICATED) unless a metadata header holds an accepted secret.

    Args:
        guarded_prefixes: method-name prefixes to guard ("/splitserve.v1.Inference/"); other methods pass.
        header: the metadata key (lower case).
        accepted: the secrets accepted.
        value_prefix: what precedes the secret in the header's value ("Bearer ").
        refusal: the status details of a refused call.
    """

    def __init__(self, guarded_prefixes: Iterable[str], header: str, accepted: Iterable[str],
                 refusal: str, value_prefix: str = "") -> None:
        self._prefixes = tuple(guarded_prefixes)
        self._header = header
        self._accepted = frozenset(accepted)
        self._value_prefix = value_prefix
        self._refusal = refusal
        if not self._accepted:
            raise ValueError("A guard needs at least one accepted secret.")

    def __repr__(self) -> str:
        return f"MetadataGuard({self._prefixes}, header={self._header!r})"

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        if self._allows(handler_call_details.invocation_metadata or ()):
            return handler
        return _refusing(handler, self._refusal)

    def _allows(self, metadata) -> bool:
        for key, value in metadata:
            if key == self._header and isinstance(value, str) and value.startswith(self._value_prefix):
                if _matches(value[len(self._value_prefix):], self._accepted):
                    return True
        return False


def api_key_guard(api_keys: Iterable[str]) -> MetadataGuard:
    """The guard of the public API: ``authorization: Bearer <key>``."""
    return MetadataGuard(PUBLIC_API_PREFIXES, AUTHORIZATION_HEADER, api_keys, API_KEY_REFUSAL, BEARER_PREFIX)


def cluster_token_guard(cluster_token: str) -> MetadataGuard:
    """The guard of router-worker calls: ``x-splitserve-cluster-token: <token>``."""
    return MetadataGuard(CLUSTER_PREFIXES, CLUSTER_TOKEN_HEADER, [cluster_token], CLUSTER_TOKEN_REFUSAL)


def _refusing(handler: grpc.RpcMethodHandler, refusal: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that ends every call with UNAUTHENTICATED."""

    def refuse(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)

    def refuse_stream(request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, refusal)
        yield  # never reached: makes this a generator, as a streaming handler must be

    serializers = dict(request_deserializer=handler.request_deserializer,
                       response_serializer=handler.response_serializer)
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **serializers)
    return grpc.unary_unary_rpc_method_handler(refuse, **serializers)


# ---- client side -------------------------------------------------------------------


class _CallDetails(NamedTuple):
    method: str
    timeout: float | None
    metadata: tuple | None
    credentials: object
    wait_for_ready: bool | None
    compression: object


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds fixed metadata pairs to every call of a channel."""

    def __init__(self, pairs: tuple[tuple[str, str], ...]) -> None:
        self._pairs = pairs

    def __repr__(self) -> str:
        return f"_AddMetadata(keys={[key for key, _ in self._pairs]})"

    def _details(self, details) -> grpc.ClientCallDetails:
        metadata = (*(details.metadata or ()), *self._pairs)
        return _ClientCallDetails(details.method, details.timeout, metadata, details.credentials,
                                  details.wait_for_ready, getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _ClientCallDetails(_CallDetails, grpc.ClientCallDetails):
    pass


def with_api_key(channel: grpc.Channel, api_key: str | None) -> grpc.Channel:
    """``channel`` sending ``authorization: Bearer <api_key>`` on every call (``channel`` itself when None)."""
    if not api_key:
        return channel
    return grpc.intercept_channel(channel, _AddMetadata(((AUTHORIZATION_HEADER, BEARER_PREFIX + api_key),)))


def with_cluster_token(channel: grpc.Channel, cluster_token: str | None) -> grpc.Channel:
    """``channel`` sending the cluster token on every call (``channel`` itself when None)."""
    if not cluster_token:
        return channel
    return grpc.intercept_channel(channel, _AddMetadata(((CLUSTER_TOKEN_HEADER, cluster_token),)))
