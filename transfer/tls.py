"""TLS for kvstore's connections (:class:`kvstore.config.TlsConfig`), on the standard library's ``ssl``.

Contexts are built once per process from the config; :func:`wrap_client` and :func:`wrap_server`
run the TLS handshake on a connected socket within a timeout and turn its failures into typed
errors (a certificate that does not verify: :class:`~kvstore.errors.AuthFailed`). Blocking I/O on
the wrapped sockets goes through :mod:`transfer.wire` as on plain ones (an ``SSLSocket`` has no
scatter-gather calls: wire falls back to one buffer per call).
"""

from __future__ import annotations

import socket
import ssl

from kvstore.config import TlsConfig
from kvstore.errors import AuthFailed, ConfigError, ConnectionFailed, Timeout

HANDSHAKE_TIMEOUT_S = 10.0
"""Bound on a TLS handshake a server runs (a peer that connects and says nothing holds a slot no longer)."""


def _load(context: ssl.SSLContext, tls: TlsConfig) -> None:
    try:
        if tls.cert_file is not None:
            context.load_cert_chain(tls.cert_file, tls.key_file)
        if tls.ca_file is not None:
            context.load_verify_locations(tls.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"TLS: cannot load {tls.cert_file or tls.ca_file}: {exc.strerror or exc}") from None


def server_context(tls: TlsConfig) -> ssl.SSLContext:
    """The context a server wraps accepted connections in: its certificate, and the clients' CA
    when it verifies them. ConfigError names a missing or unreadable file."""
    if tls.cert_file is None:
        raise ConfigError("serving TLS needs a certificate: TlsConfig.cert_file and key_file (--tls-cert, --tls-key)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(context, tls)
    if tls.verify_clients:
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(tls: TlsConfig) -> ssl.SSLContext:
    """The context a client connects with: verifies the server's certificate and name (with ``ca_file``,
    else the system's CAs) and shows this process's certificate, if it has one."""
    context = ssl.create_default_context() if tls.ca_file is None else ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    _load(context, tls)
    return context


def contexts(tls: TlsConfig | None) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """(to the master, to daemons): the client contexts of a process's two planes, None where plain."""
    if tls is None:
        return None, None
    context = client_context(tls)
    return context, context if tls.data_plane else None


def refusal(exc: ssl.SSLError, what: str) -> AuthFailed | ConnectionFailed:
    """The typed error of a failed TLS handshake: AuthFailed for a certificate that does not verify."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return AuthFailed(f"{what}: TLS certificate rejected: {exc.verify_message or exc.reason}")
    reason = str(exc.reason or exc)
    if "CERTIFICATE" in reason.upper():  # the peer's alert: it wants a certificate, or refused ours
        return AuthFailed(f"{what}: TLS certificate refused by the peer: {reason}")
    plain = any(word in reason.upper() for word in ("VERSION", "PACKET", "RECORD"))
    hint = " (does the other end speak TLS? data_plane must be set alike on every process)" if plain else ""
    return ConnectionFailed(f"{what}: TLS handshake failed: {reason}{hint}")


def wrap_client(sock: socket.socket, context: ssl.SSLContext, host: str, timeout: float, what: str) -> ssl.SSLSocket:
    """Run the client's TLS handshake on a connected ``sock`` (which it takes over); the server's
    certificate must name ``host``."""
    try:
        tls = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    except (ssl.SSLError, OSError) as exc:
        sock.close()
        raise ConnectionFailed(f"{what}: TLS: {exc}") from None
    return _handshake(tls, timeout, timeout, what)


def wrap_server(sock: socket.socket, context: ssl.SSLContext, timeout: float) -> ssl.SSLSocket:
    """Run the server's TLS handshake on an accepted ``sock`` (bounded by :data:`HANDSHAKE_TIMEOUT_S`),
    then bound its waits by ``timeout``. Raises AuthFailed, ConnectionFailed or Timeout; the caller closes."""
    tls = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    return _handshake(tls, min(timeout, HANDSHAKE_TIMEOUT_S), timeout, "accepting a TLS connection")


def _handshake(tls: ssl.SSLSocket, during: float, after: float, what: str) -> ssl.SSLSocket:
    """Run ``tls``'s handshake within ``during`` seconds, then bound its waits by ``after``; on
    failure close it and raise the typed error."""
    try:
        tls.settimeout(during)
        tls.do_handshake()
        tls.settimeout(after)
    except ssl.SSLError as exc:
        tls.close()
        raise refusal(exc, what) from None
    except TimeoutError:
        tls.close()
        raise Timeout(f"{what}: TLS handshake timed out") from None
    except OSError as exc:
        tls.close()
        raise ConnectionFailed(f"{what}: TLS handshake: {exc.strerror or exc}") from None
    return tls
