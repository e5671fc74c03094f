"""The handshake of :mod:`kvstore.auth` over blocking sockets: a client's half, and a server's half
(the daemon's; the master runs its half in its protocol object, and an asyncio client's half is
:func:`transfer.aio.authenticate_stream`).

Handshake frames are small: each end reads them with a bound of :data:`HANDSHAKE_FRAME` bytes, so
that a peer not yet authenticated can make a server hold no more than that.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable

from kvstore.auth import Authority, ClientHandshake, Credential, Identity, ServerHandshake, as_refusal
from kvstore.errors import AuthFailed, ConnectionFailed, KVStoreError, Timeout
from kvstore.protocol import ErrorReply, Message
from transfer.aio import HANDSHAKE_FRAME
from transfer.wire import NoRequest, recv_message, send_message

CredentialSource = Credential | Callable[[], Credential]
"""A credential, or how to get a current one at each connect (a ticket that may have expired)."""


def current(source: CredentialSource) -> Credential:
    return source if isinstance(source, Credential) else source()


def _recv(sock: socket.socket, what: str) -> Message:
    try:
        reply = recv_message(sock, HANDSHAKE_FRAME)[1]
        if isinstance(reply, ErrorReply):
            raise reply.to_error()
        return reply
    except NoRequest:
        raise Timeout(f"{what}: no answer to the handshake") from None


def authenticate(sock: socket.socket, credential: Credential, what: str) -> bytes:
    """Run the client's half on a connected socket; the connection's key. Raises AuthFailed (the
    server refused, or could not prove itself), Timeout or ConnectionFailed."""
    handshake = ClientHandshake(credential)
    send_message(sock, handshake.hello(), 0)
    challenge = _recv(sock, what)
    send_message(sock, handshake.proof(challenge), 0)
    return handshake.finish(_recv(sock, what))


def accept(sock: socket.socket, authority: Authority) -> tuple[Identity, bytes]:
    """Run the server's half on an accepted socket: the peer's identity and the connection's key.
    A refusal (a wrong proof, or a frame that is not the handshake's) is answered with an AuthFailed
    naming why, and raised; so are ConnectionFailed and Timeout. The caller closes."""
    handshake = ServerHandshake(authority)
    request_id = 0
    try:
        try:
            request_id, hello = recv_message(sock, HANDSHAKE_FRAME)
            send_message(sock, handshake.challenge(hello), request_id)
            request_id, proof = recv_message(sock, HANDSHAKE_FRAME)
        except NoRequest:
            raise AuthFailed("no handshake within the server's timeout") from None
        identity, ok, key = handshake.verify(proof)
    except (ConnectionFailed, Timeout):
        raise
    except KVStoreError as exc:  # a refusal, or a frame that is no handshake (a ProtocolError): AuthFailed
        refusal = as_refusal(exc)
        with contextlib.suppress(OSError):
            send_message(sock, ErrorReply.from_error(refusal), request_id)
        raise refusal from None
    send_message(sock, ok, request_id)
    return identity, key
