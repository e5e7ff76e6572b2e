"""Certificates for TLS tests, generated with ``cryptography``: a CA and leaf certificates signed by it.

Every leaf names 127.0.0.1 and localhost in its subject alternative names and may serve as a server and as a
client certificate (one certificate per process, as the ``--tls-*`` flags use it). Keys are ECDSA P-256:
quick to generate, and gRPC accepts them.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class CertificateAuthority:
    """A CA: its certificate file (what ``--tls-ca`` names) and its key, to sign leaves with."""

    cert_file: Path
    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class Leaf:
    """A certificate signed by a CA, and its key, as PEM files (``--tls-cert``, ``--tls-key``)."""

    cert_file: Path
    key_file: Path
    common_name: str


def _validity() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.timezone.utc)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=1)


def _write_key(private_key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(private_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
    path.chmod(0o600)


def make_ca(directory: Path, name: str = "splitserve test CA") -> CertificateAuthority:
    """A self-signed CA certificate written to ``directory/<name>.pem`` (its key stays in memory)."""
    private_key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    not_before, not_after = _validity()
    certificate = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
        .public_key(private_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(private_key.public_key()), critical=False)
        .sign(private_key, hashes.SHA256())
    )
    cert_file = Path(directory) / f"{name.replace(' ', '-')}.pem"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return CertificateAuthority(cert_file, certificate, private_key)


def issue(ca: CertificateAuthority, directory: Path, common_name: str,
          names: tuple[str, ...] = LOOPBACK_NAMES) -> Leaf:
    """A leaf certificate for ``common_name`` signed by ``ca``, valid for server and client authentication,
    with ``names`` (IP addresses or DNS names) as its SANs; written to ``directory/<common_name>.{crt,key}``."""
    private_key = ec.generate_private_key(ec.SECP256R1())
    alternative_names = []
    for name in names:
        try:
            alternative_names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            alternative_names.append(x509.DNSName(name))
    not_before, not_after = _validity()
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca.certificate.subject)
        .public_key(private_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(not_before).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alternative_names), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.private_key.public_key()),
                       critical=False)
        .sign(ca.private_key, hashes.SHA256())
    )
    cert_file, key_file = Path(directory) / f"{common_name}.crt", Path(directory) / f"{common_name}.key"
    cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    _write_key(private_key, key_file)
    return Leaf(cert_file, key_file, common_name)
