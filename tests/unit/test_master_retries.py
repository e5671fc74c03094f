"""Retries and terms: a resent lease release (a client resends the same request id after a broken
connection) ends nothing more, a drain stops when its master loses leadership, a remove of a
key whose drop is still under way waits for it, and a put begun with an earlier master learns
that its block was committed though it was removed before its PutEnd came."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvstore.config import MasterConfig
from kvstore.errors import ConnectionFailed, NotLeader, RetryLater, Timeout
from kvstore.protocol import (
    CommandReply,
    DropBlocks,
    GetReplicas,
    GetReplicasReply,
    InventoryItem,
    Message,
    Nic,
    PutEnd,
    PutEndReply,
    PutRevoke,
    PutStart,
    PutStartReply,
    RegisterNode,
    ReleaseLeases,
    Remove,
    RemoveReply,
)
from server.master.service import MasterService

KB = 1024


async def _service_with(keys: list[str], **config: Any) -> MasterService:
    service = MasterService(MasterConfig(port=0, **config))
    await service.core.register(RegisterNode(
        "n0", "127.0.0.1:40000", 64 * KB, 0, 64, [], [], "host", "", 0, [Nic("lo", "127.0.0.1", -1, -1)], False,
        "", 0, [],
    ))  # fmt: skip
    start = await service.core.put_start(PutStart(keys, [KB] * len(keys), 1, None, False))
    assert isinstance(start, PutStartReply)
    await service.core.put_end(PutEnd(keys, [7] * len(keys)))
    return service


async def test_a_retried_lookup_releases_its_piggybacked_leases_once() -> None:
    service = await _service_with(["k"])
    leases = service.table.leases
    a = await service.rpc.dispatch(GetReplicas(["k"], []), 1)  # reader A
    await service.rpc.dispatch(GetReplicas(["k"], []), 2)  # reader B
    assert len(leases) == 2 and isinstance(a, GetReplicasReply)
    # A is done and says so on its next lookup; the connection breaks and the lookup is resent.
    await service.rpc.dispatch(GetReplicas(["other"], [a.first_lease]), 3)
    await service.rpc.dispatch(GetReplicas(["other"], [a.first_lease]), 3)
    assert len(leases) == 1  # B's lease is still there
    await service.stop()


async def test_a_retried_release_releases_once() -> None:
    service = await _service_with(["k"])
    leases = service.table.leases
    replies = [await service.rpc.dispatch(GetReplicas(["k"], []), request_id) for request_id in (1, 2)]
    assert isinstance(replies[0], GetReplicasReply)
    await service.rpc.dispatch(ReleaseLeases([replies[0].first_lease]), 9)
    await service.rpc.dispatch(ReleaseLeases([replies[0].first_lease]), 9)
    assert len(leases) == 1
    await service.stop()


async def test_a_drain_stops_when_leadership_is_lost_midway() -> None:
    service = await _service_with([])
    await service.core.register(RegisterNode(
        "n1", "127.0.0.1:40001", 64 * KB, 0, 64, [], [], "host", "", 0, [Nic("lo", "127.0.0.1", -1, -1)], False,
        "", 0, [],
    ))  # fmt: skip
    keys = [f"d{i}" for i in range(4)]
    start = await service.core.put_start(PutStart(keys, [KB] * 4, 1, "n0", False))
    assert isinstance(start, PutStartReply)
    await service.core.put_end(PutEnd(keys, [7] * 4))
    old = service.table
    assert old.blocks_on("n0") == 4
    sent: list[str] = []

    async def fetch_then_lose_leadership(target: str, source: str, group: list[Any], why: str) -> list[bool]:
        sent.append(target)
        service._become_standby()  # the lease went while the copy ran
        return [True] * len(group)

    service.commands.fetch = fetch_then_lose_leadership  # type: ignore[method-assign]
    with pytest.raises(NotLeader):
        await service.core.drain("n0")
    assert sent == ["n1"] and service.table is not old  # one copy asked; nothing planned on the old table ran on
    await service.stop()


async def test_a_second_remove_of_a_key_waits_for_the_first_ones_drop() -> None:
    """A remove answered while an earlier remove's drop is still on its way would let a reader that
    goes to the daemon directly read the value after the answer (bench.chaos saw it: the second remove
    said "not stored" at once)."""
    # A cut-off daemon: the master's probe would go unanswered, not refused (nothing listens at the
    # test's node address, so the probe's fence is off: it would fence the node as gone).
    service = await _service_with(["k", "j"], command_timeout_ms=300, fence_refused=False)
    release, fail = asyncio.Event(), False

    async def slow_drop(node_id: str, lane: str, message: Message, expect: type) -> CommandReply:
        await release.wait()
        if fail:
            raise ConnectionFailed("the daemon is cut off")
        return CommandReply([True] * len(message.keys))  # type: ignore[attr-defined]

    service.commands.call = slow_drop  # type: ignore[method-assign]
    first = asyncio.create_task(service.core.remove(Remove(["k"])))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(service.core.remove(Remove(["k"])))
    await asyncio.sleep(0.1)
    assert not second.done()  # the drop is not made: no answer yet
    release.set()
    assert await first == RemoveReply(1, []) and await second == RemoveReply(0, [])
    # The drop fails: the first is unsure (Timeout), and so is the second, once its wait runs out.
    release.clear()
    fail = True
    first = asyncio.create_task(service.core.remove(Remove(["j"])))
    await asyncio.sleep(0.05)
    second = asyncio.create_task(service.core.remove(Remove(["j"])))
    release.set()
    for task in (first, second):
        with pytest.raises(Timeout, match="did not confirm dropping"):
            await task
    await service.stop()


async def test_a_remove_after_a_registration_waits_for_the_drops_it_asked_for() -> None:
    """A daemon cut off while "k" was removed registers again with "k" in its inventory: the master
    forgets the key and asks the daemon to drop it. Until that drop is made the daemon still serves
    "k" to readers that go to it directly, so a remove of "k" meanwhile is not answered "not stored"."""
    service = await _service_with(["k"], command_timeout_ms=300, fence_refused=False)  # cut off, not gone
    [replica] = service.table.describe("k")["replicas"]  # type: ignore[index]
    release, cut = asyncio.Event(), True

    async def daemon(node_id: str, lane: str, message: Message, expect: type) -> CommandReply:
        if cut:
            raise ConnectionFailed("the daemon is cut off")
        await release.wait()
        return CommandReply([True] * len(message.keys))  # type: ignore[attr-defined]

    service.commands.call = daemon  # type: ignore[method-assign]
    with pytest.raises(Timeout):
        await service.core.remove(Remove(["k"]))
    cut = False
    await service.core.register(RegisterNode(
        "n0", "127.0.0.1:40000", 64 * KB, 0, 64, [InventoryItem("k", "dram", replica["offset"], KB, 7)], [],
        "host", "", 0, [Nic("lo", "127.0.0.1", -1, -1)], False, "", 0, [],
    ))  # fmt: skip
    assert service.table.removing(["k"]) == [] and service.commands.dropping(["k"]) == {"k"}  # forgotten, being dropped
    again = asyncio.create_task(service.core.remove(Remove(["k"])))
    await asyncio.sleep(0.1)
    assert not again.done()
    release.set()
    assert await again == RemoveReply(0, [])
    assert not service.commands.dropping(["k"])
    await service.stop()


async def test_a_remove_whose_drop_finds_the_daemon_gone_is_answered_once_the_probe_fences_it() -> None:
    """The drop cannot reach the daemon, and nothing listens at its address (its process is gone):
    the master's probe is refused, so it fences the node at once and the remove is answered, where
    a cut-off daemon (above) makes it wait until its TTL or the command timeout."""
    service = await _service_with(["k"], command_timeout_ms=2000)

    async def gone(node_id: str, lane: str, message: Message, expect: type) -> CommandReply:
        raise ConnectionFailed("connection reset by the daemon")

    service.commands.call = gone  # type: ignore[method-assign]
    assert await service.core.remove(Remove(["k"])) == RemoveReply(1, [])
    assert service.table.nodes["n0"].fenced and service.table.counters["fences_refused"] == 1
    await service.stop()


async def test_a_put_end_of_an_adopted_block_removed_before_it_came_says_committed() -> None:
    """A put reserved "k" with a leader that died; its successor adopted the block from the daemon's
    inventory, every reader saw it, and a remove took it away before the put's PutEnd reached the
    successor, which never made the reservation: the put's bytes were stored, so the PutEnd says
    committed (it said not, and the put's retry answered EXISTS of its own bytes: bench.chaos's
    own-EXISTS), once every node dropped what it may still hold of the put (the writer revokes
    nothing now), a put of "k" meanwhile told to retry. Other bytes are not committed; nor is a
    PutEnd after a put of the key begun on this term."""
    service = MasterService(MasterConfig(port=0))
    drops: list[list[str]] = []
    dropped = asyncio.Event()

    async def daemon(node_id: str, lane: str, message: Message, expect: type) -> CommandReply:
        if isinstance(message, DropBlocks) and message.keep_pending:  # a drop on every node
            drops.append(list(message.keys))
            await dropped.wait()
        return CommandReply([True] * len(message.keys))  # type: ignore[attr-defined]

    service.commands.call = daemon  # type: ignore[method-assign]
    await service.core.register(RegisterNode(
        "n0", "127.0.0.1:40000", 64 * KB, 0, 64, [InventoryItem("k", "dram", 0, KB, 7)], [],
        "host", "", 0, [Nic("lo", "127.0.0.1", -1, -1)], False, "", 0, [],
    ))  # fmt: skip
    assert service.table.describe("k") is not None  # adopted
    assert await service.core.remove(Remove(["k"])) == RemoveReply(1, [])
    assert await service.core.put_end(PutEnd(["k"], [8])) == PutEndReply([False])  # not these bytes
    late = asyncio.create_task(service.core.put_end(PutEnd(["k"], [7])))
    await asyncio.sleep(0.05)
    assert drops == [["k"]] and not late.done()  # dropped everywhere first
    other = await service.core.put_start(PutStart(["k"], [KB], 1, None, False))
    assert isinstance(other, PutStartReply) and other.error_codes == [RetryLater.code]
    dropped.set()
    assert await late == PutEndReply([True])
    start = await service.core.put_start(PutStart(["k"], [KB], 1, None, False))  # a put of "k" on this term
    assert isinstance(start, PutStartReply) and start.statuses == ["ok"]
    await service.core.put_revoke(PutRevoke(["k"]))
    assert await service.core.put_end(PutEnd(["k"], [7])) == PutEndReply([False])  # its reservation was revoked
    await service.stop()
