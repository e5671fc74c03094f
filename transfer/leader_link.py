"""The master of a cluster on the event loop, followed across its restarts and failovers: :class:`LeaderLink`.

One pipelined connection (:class:`~transfer.link.AsyncLink`) to the master a
:class:`~transfer.discovery.MasterLocator` names now, replaced by one to its successor when the
locator names another (pushed by its watch, or read from etcd after a failure). A call rides out
a restart or a failover by the rule the blocking :class:`~transfer.rpc.Connection` follows too
(:func:`~transfer.rpc.after_failure`). The asyncio client's calls to the master go through one
(:class:`kvstore_client.aio.AsyncStore`), and so do the conductor's lookups.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from typing import Any, TypeVar

from kvstore.errors import KVStoreError, NotLeader, StoreClosed, Timeout
from kvstore.protocol import Message
from transfer.discovery import MasterLocator
from transfer.link import AsyncCredential, AsyncLink
from transfer.rpc import LEADER_CHECK_S, Retry, after_failure, attempt_timeout

R = TypeVar("R", bound=Message)


class LeaderLink:
    """Calls to the master the locator names, on the event loop.

    ``timeout`` bounds a call, all its attempts together; one attempt is bounded as the blocking
    client bounds it (:func:`~transfer.rpc.attempt_timeout`: an HA leader gone silent is given up
    in time to ask its successor within the call's time). Its link changes only to follow a new
    leader, the old one closed. Once :meth:`stop`-ped, no call makes another attempt; once
    :meth:`close`-d, nothing connects any more, a new leader named or not.
    """

    def __init__(
        self,
        locator: MasterLocator,
        timeout: float,
        credential: AsyncCredential | None = None,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """``credential``: how to get what each new connection proves itself with (None: nothing);
        ``tls``: connect over TLS with this context. The locator is the caller's: it closes it."""
        self.locator = locator
        self.timeout = timeout
        self._credential = credential
        self._tls = tls
        self._moved: asyncio.Future[None] | None = None
        """Done when the locator's watch next names a new leader (for the calls waiting on one)."""
        locator.on_change(self._leader_changed)
        self._stopped = False
        """:meth:`stop`-ped: a call makes no attempt more."""
        self._closed = False
        """:meth:`close`-d: no link to a new leader is made."""
        # For etcd://, re-pointed at the leader.
        self._link = self._new_link(locator.spec)

    @property
    def address(self) -> str:
        """The master asked now (the locator's spec while an etcd leader is not resolved yet)."""
        return self._link.address

    @property
    def session_key(self) -> bytes:
        """The key the current connection's handshake agreed (empty without a credential)."""
        return self._link.session_key

    async def call(
        self, message: Message, expect: type[R], *, retry_for: float | None = None, retry_moved: bool = False
    ) -> R:
        """``message``'s reply, of type ``expect``: every attempt under the same request id (the master
        answers a retry once), through a master's restart or failover for ``retry_for`` seconds (the
        link's timeout by default; 0: one attempt). ``retry_moved``: after a failure that was no
        timeout (a connection refused or cut, a NotLeader) and sent the call to another master, that
        one is asked at once, once, whatever time is left (as the blocking :class:`~transfer.rpc.Connection`
        asks again at once on a connection found broken): the first call after a leader died finds its
        successor."""
        deadline = time.monotonic() + (self.timeout if retry_for is None else retry_for)
        backoff = 0.01
        request_id = self._link.next_id()  # every attempt the same: the master answers a retry once
        while True:
            if self._stopped:  # closed meanwhile too: its links connect no more
                raise StoreClosed(f"the link to the master {self.locator.spec} is closed")
            try:
                await self.follow()
                return await self._request_leader(message, expect, request_id)
            except KVStoreError as exc:
                # Ride out a master restart or failover as the blocking client does (one rule for both).
                decision = after_failure(exc, dynamic=self.locator.dynamic)
                if decision is Retry.GIVE_UP:
                    raise
                if decision is Retry.ELSEWHERE:
                    asked = self._link.address
                    await self._relocate()
                    if retry_moved and not isinstance(exc, Timeout) and self._link.address != asked:
                        retry_moved = False
                        continue
                if time.monotonic() + backoff > deadline:
                    raise
                await self._wait_moved(backoff)
                backoff = min(2 * backoff, LEADER_CHECK_S if self.locator.dynamic else 0.5)

    async def request(self, message: Message, expect: type[R]) -> R:
        """One attempt at the master asked now, without following another: a notice worth no retry."""
        return (await self._link.request(message, expect))[0]

    async def _wait_moved(self, seconds: float) -> None:
        """Sleep ``seconds``, or less: until the locator's watch names a leader other than the one asked."""
        if not self.locator.watching:
            await asyncio.sleep(seconds)
            return
        moved = self._next_move()
        if self.locator.current() not in (None, self._link.address):
            return
        await asyncio.wait((moved,), timeout=seconds)

    def _next_move(self) -> asyncio.Future[None]:
        """A future done when the watch next names a new leader (made before the leader is looked at:
        a change between the two is not missed)."""
        if self._moved is None or self._moved.done():
            self._moved = asyncio.get_running_loop().create_future()
        return self._moved

    def _leader_changed(self) -> None:
        """(The watch's thread, or a read's) a new leader: wake the calls waiting on one."""
        moved = self._moved
        if moved is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed meanwhile
                moved.get_loop().call_soon_threadsafe(_set_done, moved)

    async def _request_leader(self, message: Message, expect: type[R], request_id: int) -> R:
        """One attempt of a master call. For an HA master, until the reply comes: a new leader the
        locator's watch pushes, or etcd names when asked (every LEADER_CHECK_S), raises NotLeader (this
        one frozen, cut off or deposed), so that the call goes to it now rather than after the
        attempt's timeout."""
        request = self._link.request(message, expect, request_id=request_id)
        if not self.locator.dynamic:
            return (await request)[0]
        task = asyncio.ensure_future(request)
        try:
            ask = time.monotonic() + LEADER_CHECK_S
            while True:
                waits: set[asyncio.Future[Any]] = {task}
                if self.locator.watching:
                    waits.add(self._next_move())
                pushed = self.locator.current()
                if pushed is not None and pushed != self._link.address:
                    raise NotLeader(f"{type(message).__name__}: {pushed} leads {self.locator.spec} now")
                done, _ = await asyncio.wait(
                    waits, timeout=max(ask - time.monotonic(), 0.0), return_when=asyncio.FIRST_COMPLETED
                )
                if task in done:
                    return task.result()[0]
                if done:
                    continue  # a new leader pushed: looked at above
                ask = time.monotonic() + LEADER_CHECK_S
                try:
                    leader = await asyncio.to_thread(self.locator.refresh, LEADER_CHECK_S)
                except KVStoreError:
                    continue  # etcd unreachable, or an election under way: wait on
                if leader != self._link.address:
                    raise NotLeader(f"{type(message).__name__}: {leader} leads {self.locator.spec} now")
        finally:
            if not task.done():
                task.cancel()
                task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def follow(self) -> None:
        """Point the link at the address the locator names (resolving etcd on first use; a leader
        its watch pushed since, at once)."""
        pushed = self.locator.current()
        if pushed is not None and self.locator.dynamic:
            await self._point(pushed)
        if self.locator.dynamic and self._link.address == self.locator.spec:
            await self._relocate()
            if self._link.address == self.locator.spec:
                raise NotLeader(f"no leader of {self.locator.spec} resolved yet")

    async def _relocate(self) -> None:
        if not self.locator.dynamic:
            return
        try:  # a blocking HTTP read of etcd, in a thread: only after a failure or at first use
            address = await asyncio.to_thread(self.locator.refresh, 0.05)
        except KVStoreError:
            return
        await self._point(address)

    async def _point(self, address: str) -> None:
        """The link at ``address`` from now on (the old one closed); none new once closed."""
        if address != self._link.address and not self._closed:
            old, self._link = self._link, self._new_link(address)
            await old.close()

    def _new_link(self, address: str) -> AsyncLink:
        timeout = attempt_timeout(self.timeout, dynamic=self.locator.dynamic)
        return AsyncLink(address, timeout, self._credential, self._tls)

    def stop(self) -> None:
        """No call makes another attempt (it raises StoreClosed); :meth:`request` still goes, until
        :meth:`close` (a client gives back what it holds between the two)."""
        self._stopped = True

    async def close(self) -> None:
        """Close the link; calls end, and nothing connects any more."""
        self._stopped = self._closed = True
        await self._link.close()


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
