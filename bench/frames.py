"""Raw frames to a real master or daemon, as an attacker (or a careful test) speaks them: one
request on a fresh connection, authenticated or not, each with a request id of its own (so that
the master's replies cache never answers one request for another). Used by bench.tenant_attacks
and the tests that attack a cluster."""

from __future__ import annotations

import itertools
import socket

from kvstore.auth import Credential, open_ticket, tenant_credential
from kvstore.protocol import ErrorReply, GetTicket, Message, TicketReply
from kvstore_cli.cluster import LocalCluster
from transfer.auth import authenticate
from transfer.wire import connect, recv_message, send_message

REQUEST_IDS = itertools.count(1000)


def raw(address: str, credential: Credential | None = None) -> tuple[socket.socket, bytes]:
    """A connection to ``address``, authenticated with ``credential`` when given; (socket, session key)."""
    sock = connect(address, 10.0)
    key = authenticate(sock, credential, "test") if credential is not None else b""
    return sock, key


def ask(address: str, message: Message, credential: Credential | None = None, payload: bytes = b"") -> Message:
    """One request on a fresh connection: the reply, or the typed error it carried (raised)."""
    sock, _ = raw(address, credential)
    with sock:
        send_message(sock, message, next(REQUEST_IDS), [payload] if payload else [])
        reply = recv_message(sock)[1]
    if isinstance(reply, ErrorReply):
        raise reply.to_error()
    return reply


def ticket(cluster: LocalCluster, token: str) -> Credential:
    """A tenant's ticket for the daemons, as its client gets one from the master."""
    sock, key = raw(cluster.master_address, tenant_credential(token))
    with sock:
        send_message(sock, GetTicket(), next(REQUEST_IDS))
        reply = recv_message(sock)[1]
    assert isinstance(reply, TicketReply)
    return open_ticket(reply, key, token.split(".")[0])
