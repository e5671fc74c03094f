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
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.auth import ANYONE, TICKET_SKEW_MS, Authority, Identity
from kvstore.errors import AuthFailed, PermissionDenied, QuotaExceeded
from kvstore.protocol import MAX_BATCH_KEYS, CommitBlocks, Message, TenantsPolicy, WriteBlocks, WriteSlices, too_many
from transfer.tls import HANDSHAKE_TIMEOUT_S


@dataclass(slots=True)
class _Use:
    """A seal used here: the block it reserved, when it ends, and whether its slices may still come."""

    key: str
    offset: int
    expires_ms: int
    open: bool


class Gate:
    def __init__(
        self, authority: Authority | None, node_id: str, login_timeout: float = HANDSHAKE_TIMEOUT_S,
        shm_writes: bool = False,
    ) -> None:  # fmt: skip
        self.authority = authority
        self.shm_writes = shm_writes
        """Whether tenants may write through the shared-memory arena (a CommitBlocks of bytes copied
        in by a same-host client, not slices): off, a tenant's bytes come through the socket."""
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
        self._seals: dict[bytes, _Use] = {}
        """Seals of tenants' reservations used here, until they expire: each is written once."""
        self._sealed: dict[str, set[bytes]] = {}
        """The seals of each key's reservations, to close when the block is dropped (a dropped key's
        seals stay in ``_seals``, closed, until they expire; the key may be written anew meanwhile)."""
        self.replayed_seals = 0
        """Writes refused because their reservation was written already (a replay)."""
        self._void: dict[str, int] = {}
        """Per key dropped by the master, the end of the seals its drop made void (wall ms): a
        reservation given up is written nothing, even by a seal never used here. Kept only where
        tenants write (an authority), until the voided seals are past their end."""
        self._void_order: deque[tuple[int, str]] = deque()
        """(end, key) of :attr:`_void` in the order they came (pruned from the left)."""
        self.void_seals = 0
        """Writes refused because their reservation was given up before they came."""
        self.refused_sessions = 0
        """Tenants' logins refused because the tenant had as many sessions here as it may."""
        self._inflight: Counter[str] = Counter()
        """Per tenant, bytes of the large frames its connections are receiving now."""
        self.refused_inflight = 0
        """Tenants' frames refused because they took the tenant past its cap of bytes in flight."""

    def counts(self) -> dict[str, int]:
        """What the gate refused since the start, by kind."""
        return {"auth_failures": self.auth_failures, "login_timeouts": self.login_timeouts,
                "revoked_sessions": self.revoked_sessions, "replayed_seals": self.replayed_seals,
                "void_seals": self.void_seals, "refused_sessions": self.refused_sessions,
                "refused_inflight": self.refused_inflight}  # fmt: skip

    def accepted(self, sock: socket.socket) -> None:
        """A connection came in: it has ``login_timeout`` to authenticate."""
        with self._lock:
            self._opened[sock] = time.monotonic()

    def authenticated(self, sock: socket.socket, identity: Identity) -> None:
        """A connection proved ``identity``: served from now on, unless its tenant has as many
        sessions here as the master's policy allows it (QuotaExceeded; the caller closes)."""
        with self._lock:
            self._opened.pop(sock, None)
            tenant = identity.tenant
            if tenant is not None and self.authority is not None:
                cap = self.authority.max_sessions(tenant)
                open_ = sum(1 for i in self._identities.values() if i.tenant == tenant)
                if open_ >= cap:
                    self.refused_sessions += 1
                    raise QuotaExceeded(
                        f"tenant {tenant!r} has {open_} sessions open on daemon {self.node_id}, the most it may"
                        f" (max_sessions {cap})"
                    )
            self._identities[sock] = identity

    def holder(self, identity: Identity) -> Callable[[int], Callable[[], None]] | None:
        """For :func:`~transfer.wire.recv_message`: what counts a tenant's large frame against its cap
        of bytes in flight on this daemon (QuotaExceeded past it: the caller closes); None for the cluster's."""
        tenant = identity.tenant
        if tenant is None or self.authority is None:
            return None
        authority = self.authority

        def hold(length: int) -> Callable[[], None]:
            with self._lock:
                cap = authority.max_inflight(tenant)
                if self._inflight[tenant] + length > cap:
                    self.refused_inflight += 1
                    raise QuotaExceeded(
                        f"tenant {tenant!r} has {self._inflight[tenant]} bytes of frames in flight on daemon"
                        f" {self.node_id}; a frame of {length} more would pass its cap of {cap} (max_inflight_bytes)"
                    )
                self._inflight[tenant] += length

            def release() -> None:
                with self._lock:
                    self._inflight[tenant] -= length

            return release

        return hold

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
        keys = getattr(message, "keys", None)
        if keys is not None and len(keys) > MAX_BATCH_KEYS:  # one request holds a thread and the storage lock
            raise too_many(type(message).__name__, "keys", len(keys))
        if isinstance(message, WriteBlocks | WriteSlices | CommitBlocks):
            assert current.tenant is not None
            self.authority.check_seals(
                current.tenant, self.node_id, message.keys, message.offsets, message.sizes, message.seals
            )
            self._claim(message)
        return current, message

    def _claim(self, message: WriteBlocks | WriteSlices | CommitBlocks) -> None:
        """Use each seal of a tenant's write once: a WriteBlocks takes its reservation whole; the
        slices of one block (WriteSlices) share it until their CommitBlocks closes it; a drop of the
        block closes it too. A seal used already is refused (PermissionDenied): no replay of a
        reservation can write a block the master no longer expects there."""
        slices = isinstance(message, WriteSlices)
        with self._lock:
            for key, offset, seal in zip(message.keys, message.offsets, message.seals, strict=True):
                use = self._seals.get(seal)
                if use is None and isinstance(message, CommitBlocks) and not self.shm_writes:
                    raise PermissionDenied(
                        f"daemon {self.node_id} takes no shared-memory writes from tenants ({key!r}): write through"
                        " its socket (tenant_shm_writes is off)"
                    )
                if use is not None and not (use.open and not isinstance(message, WriteBlocks)
                                            and (use.key, use.offset) == (key, offset)):  # fmt: skip
                    self.replayed_seals += 1
                    raise PermissionDenied(
                        f"the reservation for {key!r} at offset {offset} was written already: each is written once"
                    )
                if use is None and int.from_bytes(seal[:8], "big") <= self._void.get(key, 0):
                    self.void_seals += 1
                    raise PermissionDenied(
                        f"the reservation for {key!r} at offset {offset} was given up (revoked, expired or its key"
                        " dropped) before this write: put the block again"
                    )
            for key, offset, seal in zip(message.keys, message.offsets, message.seals, strict=True):
                if seal not in self._seals:
                    self._sealed.setdefault(key, set()).add(seal)
                self._seals[seal] = _Use(key, offset, int.from_bytes(seal[:8], "big"), slices)

    def dropped(self, keys: Sequence[str], void_until_ms: int = 0) -> None:
        """Blocks were dropped: their reservations are closed (their seals write nothing more), and
        with ``void_until_ms`` every seal of those keys ending by then, used here or not."""
        with self._lock:
            if void_until_ms and self.authority is not None:
                for key in keys:
                    self._void[key] = max(self._void.get(key, 0), void_until_ms)
                    self._void_order.append((void_until_ms, key))
            for key in keys:
                for seal in self._sealed.pop(key, ()):
                    use = self._seals.get(seal)
                    if use is not None:
                        use.open = False

    def _prune(self, now_ms: int) -> None:
        """Forget seals past their end (and the skew): the daemon refuses them as expired anyway."""
        order, void = self._void_order, self._void
        while order and order[0][0] + TICKET_SKEW_MS < now_ms:
            until, key = order.popleft()
            if void.get(key) == until:  # not voided again later
                del void[key]
        gone = [seal for seal, use in self._seals.items() if use.expires_ms + TICKET_SKEW_MS < now_ms]
        for seal in gone:
            use = self._seals.pop(seal)
            seals = self._sealed.get(use.key)
            if seals is not None:
                seals.discard(seal)  # gone already when the key was dropped since
                if not seals:
                    del self._sealed[use.key]

    def take_policy(self, policy: TenantsPolicy) -> None:
        """The master's word on tenants (the caller then sweeps, to cut what it no longer allows)."""
        assert self.authority is not None
        self.authority.take_policy(policy)

    def sweep(
        self, now: float | None = None, wall_ms: int | None = None
    ) -> tuple[list[socket.socket], list[socket.socket]]:
        """The connections to cut now: those past the login deadline, and tenants' sessions the
        master's policy no longer allows (``now``: time.monotonic(); ``wall_ms``: the wall clock
        seals are judged by)."""
        now = time.monotonic() if now is None else now
        authority = self.authority
        with self._lock:
            self._prune(int(time.time() * 1000) if wall_ms is None else wall_ms)
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
