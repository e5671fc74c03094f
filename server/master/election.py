"""Leader election of HA masters on etcd (``kvstore master --etcd H:2379 --cluster-id ID``).

Every master takes an etcd lease of ``ttl_s`` seconds, keeps it alive, and lists itself under
``/kvstore/<id>/masters/`` with it. The leader is the master whose transaction created
``/kvstore/<id>/leader`` (bound to its lease; the value names its RPC and admin addresses, as
:class:`transfer.discovery.MasterRecord`). The others watch that key and campaign again when it
goes (the leader's lease ran out, or it resigned at shutdown).

Fencing:

- A leader serves only while its lease is surely alive: each keep-alive that etcd confirms
  makes the lease good until *send time* + TTL, measured on this machine's monotonic clock
  (never later than etcd's own expiry). Past that, :meth:`Election.leading` is False and the
  master answers NotLeader, even if it never hears from etcd again (a partition).
- The leadership epoch is the leader key's create revision: it grows with each new leader.
  The master sends it to daemons (RegisterReply, MasterHello), and a daemon refuses the commands
  of a master older than the newest it has met.
- A keep-alive answered with TTL 0 means the lease is gone in etcd (someone else may lead): the
  master drops everything it knew (``on_standby``) and campaigns afresh as a standby. A lease
  that outlived an etcd outage (etcd restores leases on restart) keeps its leadership and table.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

import aetcd
import aetcd.exceptions
import aetcd.rtypes

from kvstore.errors import ConnectionFailed, NotLeader
from transfer.aio import port_refuses
from transfer.discovery import EtcdCluster, MasterRecord
from transfer.wire import parse_address

log = logging.getLogger("kvstore.master.election")

Role = Literal["standby", "leader"]


LEADER_PROBE_S = 0.1
"""How often a standby looks whether the leader's process is gone (its RPC port refuses)."""


class LeaseLost(Exception):
    """etcd no longer has this master's lease."""


class Election:
    def __init__(
        self,
        cluster: EtcdCluster,
        record: MasterRecord,
        ttl_s: int,
        on_leader: Callable[[int], None],
        on_standby: Callable[[], None],
        revoke_gone: bool = False,
    ) -> None:
        """``revoke_gone``: a standby that finds the leader's RPC port refusing (its process is gone)
        revokes the leader's etcd lease, so that a new leader is elected now, not once the lease ran
        out (``MasterConfig.fence_refused``)."""
        self.cluster = cluster
        self.revoke_gone = revoke_gone
        self.record = record
        self.ttl_s = ttl_s
        self._on_leader = on_leader
        self._on_standby = on_standby
        self.role: Role = "standby"
        self.epoch = 0
        self.leader: MasterRecord | None = None
        """The leader as last seen in etcd (this master when it leads)."""
        self._valid_until = 0.0
        self._endpoint = 0
        self._client: Any = None
        self._lease: Any = None
        self._task: asyncio.Task[None] | None = None
        self.elections_won = 0
        self.leadership_lost = 0
        self.etcd_errors = 0
        self.etcd_reachable = False
        self.lease_confirmed_at = 0.0
        """When etcd last confirmed this master's lease (time.monotonic(); 0: never)."""

    # -- what the service asks --------------------------------------------------------------
    def leading(self) -> bool:
        """Whether this master may serve now: it leads and its lease is surely alive."""
        return self.role == "leader" and time.monotonic() < self._valid_until

    def status(self) -> dict[str, Any]:
        return {
            "role": self.role if self.role == "standby" or self.leading() else "leader (lease unconfirmed)",
            "epoch": self.epoch,
            "leader": self.leader.address if self.leader else None,
            "cluster_id": self.cluster.cluster_id,
            "etcd": list(self.cluster.endpoints),
            "etcd_reachable": self.etcd_reachable,
            "elections_won": self.elections_won,
            "leadership_lost": self.leadership_lost,
            "etcd_errors": self.etcd_errors,
            "leader_epoch": self.leader.epoch if self.leader else 0,
            "lease_confirmed_s_ago": round(time.monotonic() - self.lease_confirmed_at, 3)
            if self.lease_confirmed_at
            else None,
        }

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="master-election")

    async def stop(self) -> None:
        """Stop campaigning; a leader resigns (revokes its lease) so that a standby takes over now."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._lease.revoke(), 2.0)
        self.role = "standby"
        await self._close_client()

    async def _run(self) -> None:
        backoff = 0.1
        while True:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except (aetcd.exceptions.ClientError, OSError, TimeoutError, LeaseLost) as exc:
                self.etcd_errors += 1
                self.etcd_reachable = False
                log.warning(
                    "etcd at %s: %s; %s, retrying in %.1f s",
                    self.cluster.endpoints[self._endpoint], exc or type(exc).__name__,
                    "still leading while the lease lasts" if self.leading() else "not serving", backoff,
                )  # fmt: skip
                if isinstance(exc, LeaseLost):
                    self._lose("its etcd lease ended")
                await self._close_client()
                self._endpoint = (self._endpoint + 1) % len(self.cluster.endpoints)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
            else:
                backoff = 0.1

    async def _session(self) -> None:
        """One connection to etcd: take (or keep) a lease, list this master, then lead or watch."""
        client = await self._connect()
        if self._lease is None:
            sent = time.monotonic()
            self._lease = await self._bounded(client.lease(self.ttl_s))
            self._valid_until = sent + self._lease.ttl
            self.lease_confirmed_at = time.monotonic()
        else:
            await self._keep_alive_once()  # the lease of before an etcd outage, if it is still alive
        self.etcd_reachable = True
        await self._bounded(client.put(self._masters_key(), self.record.value(), lease=self._lease))
        keepalive = asyncio.create_task(self._keep_alive_forever(), name="master-lease-keepalive")
        try:
            while True:
                await self._campaign(client)
                if keepalive.done():
                    keepalive.result()  # raises what ended it
        finally:
            keepalive.cancel()
            with contextlib.suppress(BaseException):
                await keepalive

    async def _campaign(self, client: Any) -> None:
        """Create the leader key if nobody holds it; otherwise wait (a watch, bounded) for it to go."""
        key = self.cluster.leader_key
        tx = client.transactions
        won, responses = await self._bounded(
            client.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, self.record.value(), lease=self._lease)],
                failure=[tx.get(key)],
            )
        )
        if won:
            held = await self._bounded(client.get(key))
            if held is None or held.lease != self._lease.id:
                return  # gone again at once (our lease ended): campaign again
            self._lead(held.create_revision)
            await asyncio.sleep(self.ttl_s / 3)  # the keep-alive task fences; look at the key again now and then
            return
        kvs = responses[0] if responses else []
        if not kvs:
            return  # gone between the compare and the read: campaign again
        value, meta = kvs[0]
        if meta.lease == self._lease.id:  # ours (from before an etcd outage, or checked again): leading
            self._lead(meta.create_revision)
            await asyncio.sleep(self.ttl_s / 3)
            return
        if self.role == "leader":
            raise LeaseLost("another master holds the leader key")
        self.leader = MasterRecord.from_kv(value, meta.create_revision)
        await self._wait_for_vacancy(client, meta.header.revision + 1, meta.lease)

    async def _wait_for_vacancy(self, client: Any, after_revision: int, leader_lease: int) -> None:
        """Until the leader key is deleted, or ``ttl_s`` passed (then look again anyway). A leader
        whose process is gone is not waited for: its lease is revoked (see ``revoke_gone``)."""
        watch = await self._bounded(
            client.watch(self.cluster.leader_key, start_revision=after_revision, kind=aetcd.rtypes.EventKind.DELETE)
        )
        try:
            vacancy = asyncio.ensure_future(watch.__aiter__().__anext__())
            gone = asyncio.ensure_future(self._leader_gone())
            try:
                done, _ = await asyncio.wait({vacancy, gone}, timeout=self.ttl_s, return_when=asyncio.FIRST_COMPLETED)
            finally:
                vacancy.cancel()
                gone.cancel()
            if vacancy in done:
                vacancy.result()  # a deletion, or the watch's failure
            elif gone in done and gone.result():
                gone_at = self.leader.address if self.leader else "?"
                log.warning("leader %s refuses connections (its process is gone): revoking its etcd lease %x "
                            "to elect a new leader now", gone_at, leader_lease)  # fmt: skip
                try:
                    await self._bounded(client.revoke_lease(leader_lease))
                except aetcd.exceptions.ClientError as exc:  # already ended, or not ours to revoke
                    log.warning("revoking lease %x failed (%s); waiting for it to end", leader_lease, exc)
                    await asyncio.sleep(LEADER_PROBE_S)  # not a loop of refused probes and failed revokes
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(watch.cancel(), 1.0)

    async def _leader_gone(self) -> bool:
        """True once the leader's RPC port refuses a connection (with ``revoke_gone``); else never."""
        leader = self.leader
        if not self.revoke_gone or leader is None:
            await asyncio.sleep(self.ttl_s)
            return False
        while not await port_refuses(leader.address, LEADER_PROBE_S * 2):
            await asyncio.sleep(LEADER_PROBE_S)
        return True

    def _lead(self, epoch: int) -> None:
        if self.role == "leader" and self.epoch == epoch:
            return
        self.role = "leader"
        self.epoch = epoch
        self.leader = MasterRecord(self.record.address, self.record.admin, epoch)
        self.elections_won += 1
        log.info("leading cluster %s (epoch %d) at %s", self.cluster.cluster_id, epoch, self.record.address)
        self._on_leader(epoch)

    def _lose(self, why: str) -> None:
        self._lease = None
        if self.role != "leader":
            return
        self.role = "standby"
        self.leadership_lost += 1
        log.warning("no longer leading cluster %s: %s; serving nothing", self.cluster.cluster_id, why)
        self._on_standby()

    async def _keep_alive_forever(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            await self._keep_alive_once()

    async def _keep_alive_once(self) -> None:
        sent = time.monotonic()
        reply = await self._bounded(self._lease.refresh())
        if reply is None or reply.TTL <= 0:
            raise LeaseLost(f"lease {self._lease.id:x} expired in etcd")
        self._valid_until = sent + min(reply.TTL, self.ttl_s)
        self.etcd_reachable = True
        self.lease_confirmed_at = time.monotonic()

    # -- etcd plumbing -----------------------------------------------------------------------
    async def save(self, key: bytes, value: bytes | None) -> None:
        """Put ``value`` under ``key`` in etcd (None: delete it), while this master leads; raises
        NotLeader when it does not, ConnectionFailed when etcd does not take it."""
        if not self.leading():
            raise NotLeader(f"master {self.record.address} no longer leads: it writes nothing to etcd")
        epoch, leader_key = self.epoch, self.cluster.leader_key

        def write(client: Any) -> Any:
            # Only while the leader key is the one this term created: a write delayed past the end of
            # this master's lease must not undo what the next leader wrote.
            tx = client.transactions
            change = tx.delete(key) if value is None else tx.put(key, value)
            return client.transaction(compare=[tx.create(leader_key) == epoch], success=[change], failure=[])

        done, _ = await self._kv(write, f"a write of {key.decode()!r}")
        if not done:
            raise NotLeader(f"master {self.record.address} no longer leads (epoch {epoch}): its write was refused")

    async def load(self, key: bytes) -> bytes | None:
        """The value under ``key`` in etcd (None: none); ConnectionFailed when etcd does not answer."""
        held = await self._kv(lambda c: c.get(key), f"a read of {key.decode()!r}")
        return None if held is None else bytes(held.value)

    async def list_prefix(self, prefix: bytes) -> list[bytes]:
        """The keys under ``prefix`` in etcd (not their values); ConnectionFailed when etcd does not answer."""
        held = await self._kv(lambda c: c.get_prefix(prefix, keys_only=True), f"a listing of {prefix.decode()!r}")
        return [bytes(kv.key) for kv in held]

    async def masters(self) -> list[MasterRecord]:
        """Every master listed in etcd (leader and standbys), in key order, read on the election's own
        connection (never a second one: the election loop owns it); ConnectionFailed when there is none
        now or etcd does not answer. Not counted in :attr:`etcd_errors` (the election's own)."""
        client = self._client
        if client is None:
            raise ConnectionFailed("this master has no connection to etcd now")
        try:
            held = await self._bounded(client.get_prefix(self.cluster.masters_prefix))
        except (aetcd.exceptions.ClientError, OSError, TimeoutError) as exc:
            raise ConnectionFailed(f"etcd did not answer a listing of the masters: {exc}") from None
        return [r for kv in held if (r := MasterRecord.from_kv(bytes(kv.value), kv.create_revision)) is not None]

    async def _kv(self, call: Callable[[Any], Any], what: str) -> Any:
        """``call(client)``'s answer, bounded; an etcd that fails it is counted and a ConnectionFailed."""
        try:
            return await self._bounded(call(await self._connect()))
        except (aetcd.exceptions.ClientError, OSError, TimeoutError) as exc:
            self.etcd_errors += 1
            raise ConnectionFailed(f"etcd did not answer {what}: {exc}") from None

    def _masters_key(self) -> bytes:
        return self.cluster.masters_prefix + self.record.address.encode()

    async def _connect(self) -> Any:
        if self._client is None:
            host, port = parse_address(self.cluster.endpoints[self._endpoint])
            client = aetcd.Client(host=host, port=port, timeout=max(1, self.ttl_s // 2))
            await self._bounded(client.connect())
            self._client = client
        return self._client

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), 1.0)

    async def _bounded(self, call: Any) -> Any:
        """Every etcd call within the lease's TTL: a hung etcd must not outlast a leader's fence."""
        return await asyncio.wait_for(call, max(1.0, self.ttl_s / 2))
