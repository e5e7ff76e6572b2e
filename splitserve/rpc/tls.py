"""TLS, optionally mutual, on every gRPC channel: one certificate, key and CA per process.

A process holds one :class:`TLSConfig`, from ``--tls-cert``, ``--tls-key`` and
``--tls-ca``, and uses it on both sides, as SGLang and vLLM do:

* as a server (:meth:`TLSConfig.server_credentials`, used by ``start_server``) it
  presents its certificate; with a CA it also *requires* a client certificate
  signed by that CA (mutual TLS): a client without one fails the handshake and
  sees UNAVAILABLE;
* as a client (:func:`open_channel`) it verifies the server's certificate
  against the CA (without one: the system's trusted roots) and the dialed host
  name, and presents its own certificate when it has one.

TLS composes with :mod:`splitserve.rpc.auth`: the API keys and the cluster token
still travel as metadata, now encrypted. A server call's verified client
identity is :func:`peer_identity`. Files are read once, when the configuration
is built; the key's bytes are never part of ``repr`` or of any message.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc

# The channel option that checks the server's certificate against another name than the dialed host.
SERVER_NAME_OPTION = "grpc.ssl_target_name_override"

_CERTIFICATE_MARKER = re.compile(rb"-----BEGIN CERTIFICATE-----")
_PRIVATE_KEY_MARKER = re.compile(rb"-----BEGIN (?:[A-Z]+ )?PRIVATE KEY-----")


@dataclass(frozen=True)
class TLSConfig:
    """One process's TLS material, read from its files when built; ``repr`` shows the paths only.

    Attributes:
        cert_file: PEM certificate (chain) this process presents, as a server and as a client (None: none;
            a server needs one).
        key_file: PEM private key of ``cert_file``; given together with it.
        ca_file: PEM CA certificate(s). A server requires and verifies client certificates signed by them
            (mutual TLS); a client verifies servers against them (None: a server asks for no client
            certificate, a client trusts the system's roots).
        server_name: the name a client checks the server's certificate against instead of the dialed host
            (``grpc.ssl_target_name_override``), for certificates whose names differ from the address
            (None: the dialed host, normal hostname verification).

    Raises:
        ValueError: a file is unreadable or holds no PEM certificate or key (a sentence naming the file,
            never its content), only one of ``cert_file`` and ``key_file`` is given, or nothing is given.
    """

    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    server_name: str | None = None
    _certificate: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _private_key: bytes | None = field(default=None, init=False, repr=False, compare=False)
    _root_certificates: bytes | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("--tls-cert and --tls-key go together: give both (this process's certificate and its "
                             "private key) or neither.")
        if not self.cert_file and not self.ca_file:
            raise ValueError("TLS needs --tls-ca (to verify servers), --tls-cert with --tls-key (to present a "
                             "certificate), or all three.")
        if self.cert_file:
            object.__setattr__(self, "_certificate", _read_pem(self.cert_file, "certificate", _CERTIFICATE_MARKER))
            object.__setattr__(self, "_private_key", _read_pem(self.key_file, "private key", _PRIVATE_KEY_MARKER))
        if self.ca_file:
            object.__setattr__(self, "_root_certificates", _read_pem(self.ca_file, "CA certificate",
                                                                     _CERTIFICATE_MARKER))

    @classmethod
    def from_flags(cls, cert_file: str | None, key_file: str | None, ca_file: str | None,
                   server_name: str | None = None) -> TLSConfig | None:
        """The configuration of ``--tls-cert/--tls-key/--tls-ca/--tls-server-name``; None when no file is given
        (plaintext). Raises ValueError as the constructor does."""
        if not (cert_file or key_file or ca_file):
            if server_name:
                raise ValueError("--tls-server-name needs TLS: give --tls-ca (and --tls-cert/--tls-key for mutual TLS).")
            return None
        return cls(cert_file or None, key_file or None, ca_file or None, server_name or None)

    @property
    def is_mutual(self) -> bool:
        """Whether a server with this configuration requires client certificates (a CA is given)."""
        return self._root_certificates is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials of a TLS server port: this certificate; with a CA, client certificates signed by it required.

        Raises:
            ValueError: no certificate and key (a server must present one).
        """
        if self._certificate is None:
            raise ValueError("A TLS server needs --tls-cert and --tls-key (its certificate and private key).")
        return grpc.ssl_server_credentials([(self._private_key, self._certificate)],
                                           root_certificates=self._root_certificates,
                                           require_client_auth=self._root_certificates is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Credentials of a TLS channel: servers verified against the CA (else the system's roots); this
        certificate presented as the client's when there is one."""
        return grpc.ssl_channel_credentials(root_certificates=self._root_certificates,
                                            private_key=self._private_key, certificate_chain=self._certificate)


def _read_pem(path: str, what: str, marker: re.Pattern) -> bytes:
    """The bytes of the PEM file ``path``; ValueError naming the file (never its content) when unusable."""
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"Cannot read the TLS {what} file {path}: {error.strerror or error}.") from None
    if not marker.search(data):
        raise ValueError(f"The TLS {what} file {path} holds no PEM {what} "
                         f"(a '-----BEGIN ...-----' block); give a PEM file.")
    return data


# What every splitserve server may send and receive in one message (a response with a long prompt's logprobs, say);
# channels take as much, where gRPC's default receive limit is 4 MB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


def open_channel(address: str, tls: TLSConfig | None,
                 options: Sequence[tuple[str, object]] = ()) -> grpc.Channel:
    """A channel to ``address`` (host:port): TLS with ``tls``, plaintext without.

    With TLS the server's certificate must be signed by ``tls.ca_file`` (else a system root) and name the
    dialed host (an IP address in its SAN for an IP, a DNS name for a name), or ``tls.server_name`` when
    set. A failed handshake is not an exception here: calls on the channel fail with UNAVAILABLE.

    Args:
        options: gRPC channel options, passed on (beside ``CHANNEL_OPTIONS``).
    """
    options = [*CHANNEL_OPTIONS, *options]
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    if tls.server_name:
        options.append((SERVER_NAME_OPTION, tls.server_name))
    return grpc.secure_channel(address, tls.channel_credentials(), options=options)


def peer_identity(context: grpc.ServicerContext) -> str | None:
    """The verified identity of the client of a server call: its certificate's subject common name (CN), else
    its first subject alternative name (SAN); None when the call came without mutual TLS.

    A server started with a CA (``TLSConfig.is_mutual``) completes a handshake only with clients whose
    certificate chains to that CA, so the identity returned is one the CA vouched for; compare it with what
    the call claims (a worker id, say) to bind the call to its caller. Without TLS, or on a TLS server that
    asks for no client certificate, there is no verified client and this returns None.

    Args:
        context: the ``grpc.ServicerContext`` of the call being served.
    """
    if not context.peer_identities():  # None unless the peer was authenticated by a certificate
        return None
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    names = auth.get("x509_common_name") or auth.get("x509_subject_alternative_name") or context.peer_identities()
    return names[0].decode("utf-8", errors="replace") if names else None
