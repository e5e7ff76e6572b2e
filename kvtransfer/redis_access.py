"""How a worker authenticates to Redis: an optional ACL user, a password kept out of URLs, and TLS files.

The password comes from ``--redis-password-file`` or ``SPLITSERVE_REDIS_PASSWORD``,
never from a flag or a URL: the Redis URL travels to the router in the decode
worker's KV endpoint, on to every prefill worker, and into status replies and
logs, so it must hold no secret (``public_redis_url`` refuses one that does).
Each worker connects to the URL the other side advertises with its own
credentials. ``rediss://`` URLs use TLS, verified against ``tls_ca_file``;
``tls_cert_file`` and ``tls_key_file`` give a client certificate when Redis
asks for one (``tls-auth-clients``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

REDIS_PASSWORD_ENV = "SPLITSERVE_REDIS_PASSWORD"
REDIS_SCHEMES = ("redis", "rediss")
CREDENTIALS_HINT = ("set SPLITSERVE_REDIS_PASSWORD or --redis-password-file (and --redis-username for an ACL user) "
                    "to what this Redis requires")


@dataclass(frozen=True)
class RedisAccess:
    """A worker's credentials for Redis; ``repr`` never shows the password.

    Attributes:
        username: the ACL user (None: Redis's default user).
        password: the password (None: none sent).
        tls_ca_file: CA certificates that verify a ``rediss://`` server (None: the system's).
        tls_cert_file: a client certificate for ``rediss://`` (with ``tls_key_file``).
        tls_key_file: its private key.
    """

    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def __repr__(self) -> str:
        password = "set" if self.password else "none"
        return (f"RedisAccess(username={self.username!r}, password=<{password}>, tls_ca_file={self.tls_ca_file!r}, "
                f"tls_cert_file={self.tls_cert_file!r}, tls_key_file={self.tls_key_file!r})")

    def connector_options(self) -> dict[str, str | None]:
        """The redis connector's options for these credentials."""
        return asdict(self)

    def client_options(self, url: str) -> dict:
        """Keyword arguments of ``redis.Redis.from_url(url, ...)``: credentials, and TLS for ``rediss://``."""
        options = {"username": self.username, "password": self.password}
        if urlsplit(url).scheme == "rediss":
            options.update(ssl_ca_certs=self.tls_ca_file, ssl_certfile=self.tls_cert_file,
                           ssl_keyfile=self.tls_key_file, ssl_cert_reqs="required")
        return options


def load_redis_access(password_file: str | None, environment: Mapping[str, str], username: str | None = None,
                      tls_ca_file: str | None = None, tls_cert_file: str | None = None,
                      tls_key_file: str | None = None) -> RedisAccess:
    """Credentials from the flags, the password from ``password_file`` (its first line) or else from
    ``SPLITSERVE_REDIS_PASSWORD`` in ``environment``.

    Raises:
        ValueError: the password file cannot be read or is empty, or only one of the client certificate and
            its key is given (a sentence naming the file, never its content).
    """
    password = environment.get(REDIS_PASSWORD_ENV) or None
    if password_file:
        try:
            lines = Path(password_file).read_text().splitlines()
        except OSError as error:
            raise ValueError(f"Cannot read the Redis password file {password_file}: {error.strerror or error}.") \
                from None
        password = lines[0].strip() if lines else ""
        if not password:
            raise ValueError(f"The Redis password file {password_file} is empty: write the password on its first line.")
    if bool(tls_cert_file) != bool(tls_key_file):
        raise ValueError("Give both --redis-tls-cert and --redis-tls-key, or neither.")
    return RedisAccess(username or None, password, tls_ca_file or None, tls_cert_file or None, tls_key_file or None)


def public_redis_url(url: str) -> str:
    """``url`` as it may be advertised and logged: without a user name.

    Raises:
        ValueError: ``url`` is not a redis:// or rediss:// URL, or it holds a password.
    """
    parts = urlsplit(url)
    if parts.scheme not in REDIS_SCHEMES or not parts.hostname:
        raise ValueError("The Redis URL must look like redis://host:port/db (or rediss:// for TLS).")
    if parts.password is not None:
        raise ValueError("The Redis URL holds a password, which would be advertised to the router and every "
                         "prefill worker: remove it from the URL and give it through SPLITSERVE_REDIS_PASSWORD or "
                         "--redis-password-file.")
    netloc = parts.netloc.rpartition("@")[2]
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def url_username(url: str) -> str | None:
    """The user name a URL names (``redis://user@host``), if any."""
    return urlsplit(url).username or None
