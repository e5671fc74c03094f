"""Who may use a daemon's connections, and for how long: the login deadline, tenants' sessions as
the master's policy allows them now, and the seals of tenants' writes.

A connection that has not authenticated within ``login_timeout`` is cut (a peer must not hold a
slot by trickling a handshake a byte at a time); a tenant's session is cut as soon as the master's
:class:`~kvstore.protocol.TenantsPolicy` no longer takes its ticket (the tenant was removed, or
the token its ticket came from was replaced), and its operations narrow with the policy. The
server calls :meth:`Gate.sweep` every half second and cuts what it returns. Thread-safe.
"""

from __future__ import annotations

import socket
import threading
import time

from kvstore.auth import ANYONE, Authority, Identity
from kvstore.errors import AuthFailed
from kvstore.protocol import CommitBlocks, Message, TenantsPolicy, WriteBlocks, WriteSlices
from transfer.tls import HANDSHAKE_TIMEOUT_S


class Gate:
    def __init__(self, authority: Authority | None, node_id: str, login_timeout: float = HANDSHAKE_TIMEOUT_S) -> None:
        self.authority = authority
        self.node_id = node_id
        self.login_timeout = login_timeout
        self._opened: dict[socket.socket, float] = {}
        """When each connection not yet authenticated was accepted."""
        self._identities: dict[socket.socket, Identity] = {}
        self._lock = threading.Lock()
        self.login_timeouts = 0
        """Connections cut because they did not authenticate within ``login_timeout``."""
        self.revoked_sessions = 0
        """Tenants' sessions cut because the master's policy no longer takes their tickets."""
        self.auth_failures = 0
        """Handshakes refused."""

    def accepted(self, sock: socket.socket) -> None:
        """A connection came in: it has ``login_timeout`` to authenticate."""
        with self._lock:
            self._opened[sock] = time.monotonic()

    def authenticated(self, sock: socket.socket, identity: Identity) -> None:
        with self._lock:
            self._opened.pop(sock, None)
            self._identities[sock] = identity

    def refused(self) -> int:
        """Count a refused handshake; the count so far."""
        with self._lock:
            self.auth_failures += 1
            return self.auth_failures

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._opened.pop(sock, None)
            self._identities.pop(sock, None)

    def identity(self, sock: socket.socket) -> Identity:
        with self._lock:
            return self._identities.get(sock, ANYONE)

    def admit(self, identity: Identity, message: Message) -> tuple[Identity, Message]:
        """A tenant's request as it may be served now: its identity as the master's policy has it
        (AuthFailed when its session is over: the caller closes), its keys in its namespace, and its
        writes checked against the master's seals (PermissionDenied)."""
        if identity.tenant is None:
            return identity, message
        assert self.authority is not None
        current = self.authority.current(identity)
        if current is None:
            raise AuthFailed(f"tenant {identity.tenant!r} was removed or its token replaced: its ticket is refused")
        message = current.admit(message)
        if isinstance(message, WriteBlocks | WriteSlices | CommitBlocks):
            assert current.tenant is not None
            self.authority.check_seals(
                current.tenant, self.node_id, message.keys, message.offsets, message.sizes, message.seals
            )
        return current, message

    def take_policy(self, policy: TenantsPolicy) -> None:
        """The master's word on tenants (the caller then sweeps, to cut what it no longer allows)."""
        assert self.authority is not None
        self.authority.take_policy(policy)

    def sweep(self, now: float | None = None) -> tuple[list[socket.socket], list[socket.socket]]:
        """The connections to cut now: those past the login deadline, and tenants' sessions the
        master's policy no longer allows."""
        now = time.monotonic() if now is None else now
        authority = self.authority
        with self._lock:
            late = [s for s, t in self._opened.items() if now - t > self.login_timeout]
            for sock in late:
                del self._opened[sock]
            revoked = [s for s, i in self._identities.items()
                       if i.tenant is not None and authority is not None and authority.current(i) is None]  # fmt: skip
            for sock in revoked:
                del self._identities[sock]
            self.login_timeouts += len(late)
            self.revoked_sessions += len(revoked)
        return late, revoked
