"""Authentication: the first frames of a connection to a server that requires it, and tenants' tickets.

See :mod:`kvstore.auth` for what the nonces, proofs and tickets are.
"""

from __future__ import annotations

from typing import Literal

from kvstore.protocol.base import Message


class AuthHello(Message, tag=80, frozen=True):
    """A connection's first frame (see :mod:`kvstore.auth`): who the client claims to be and its nonce."""

    kind: Literal["cluster", "tenant", "ticket"]
    name: str
    nonce: bytes
    ticket: bytes
    """For ``kind="ticket"``: the ticket the master issued (empty otherwise)."""
    ephemeral: bytes = b""
    """For ``kind="tenant"``: the client's ephemeral X25519 public key (the session's key comes from it)."""


class AuthChallenge(Message, tag=81, frozen=True):
    nonce: bytes
    ephemeral: bytes = b""
    """For a tenant: the server's ephemeral X25519 public key."""
    legacy: bool = False
    """For a tenant: one of its verifiers is a legacy sha256 one, so the proof of that scheme is asked too."""


class AuthProof(Message, tag=82, frozen=True):
    proof: bytes
    signature: bytes = b""
    """For a tenant: its Ed25519 signature of the handshake's transcript."""


class AuthOk(Message, tag=83, frozen=True):
    """The server's proof that it knows the client's key too; the connection serves from here on."""

    proof: bytes


class GetTicket(Message, tag=84, frozen=True):
    """A tenant asks the master for a ticket to show the daemons (answered by a TicketReply)."""


class TicketReply(Message, tag=85, frozen=True):
    ticket: bytes
    sealed_key: bytes
    """The ticket's session key, masked with a key only this connection's two ends can derive."""
    expires_ms: int
    """Unix time (ms) the ticket ends at."""


class TenantsPolicy(Message, tag=89, frozen=True):
    """Master -> daemon: the tenants whose tickets a daemon may take now, and what each may do
    (answered by OkReply). A tenant not listed is refused; a ticket whose key is not among its
    tenant's ``keys`` (fingerprints of the tokens the master takes, a rotated one's during its grace)
    is refused; a ticket's operations are narrowed to its tenant's. Sent whenever the tenants file
    changes and every few seconds, so that a removal or a narrowing reaches open sessions at once."""

    names: list[str]
    operations: list[list[str]]
    keys: list[list[bytes]]
    as_of_ms: int = 0
    """When the master read this (its clock, as tickets' times are): a ticket issued later, of a
    tenant or key not listed, is newer than this word and taken until the next one comes."""
    max_sessions: list[int] = []
    """Per tenant, the sessions it may have open at once on each daemon (empty: no caps)."""
    max_inflight: list[int] = []
    """Per tenant, the bytes of frames it may have begun and not finished on each daemon (empty: the
    daemon's default)."""
