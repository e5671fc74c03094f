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
    FetchBlocks,
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
    Replicate,
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


async def _one_node(inventory: list[InventoryItem] | None = None) -> tuple[MasterService, list[list[str]]]:
    """A master with node "n0" (holding ``inventory``) whose daemon answers every command at once;
    the drops it was sent."""
    service = MasterService(MasterConfig(port=0))
    drops: list[list[str]] = []

    async def daemon(node_id: str, lane: str, message: Message, expect: type) -> CommandReply:
        if isinstance(message, DropBlocks):
            drops.append(list(message.keys))
        return CommandReply([True] * len(message.keys))  # type: ignore[attr-defined]

    service.commands.call = daemon  # type: ignore[method-assign]
    await service.core.register(RegisterNode(
        "n0", "127.0.0.1:40000", 64 * KB, 0, 64, inventory or [], [], "host", "", 0,
        [Nic("lo", "127.0.0.1", -1, -1)], False, "", 0, [],
    ))  # fmt: skip
    return service, drops


async def test_a_late_put_end_commits_only_a_reservation_of_its_own_write() -> None:
    """Put 11 reserved "k", its writer stalled past the reservation, which was revoked; put 22
    reserved "k" anew and has not written yet. Put 11's PutEnd comes now: it must not commit put
    22's reservation (its extent holds no bytes of either yet, and its checksum would be 11's),
    nor should put 22's end then answer EXISTS of a block that is not there. Without write ids the
    table committed whatever reservation "k" had."""
    service, _ = await _one_node()
    core = service.core
    first = await core.put_start(PutStart(["k"], [KB], 1, None, False, 11))
    assert isinstance(first, PutStartReply) and first.statuses == ["ok"]
    await core.put_revoke(PutRevoke(["k"]))  # as the reservation's expiry does
    second = await core.put_start(PutStart(["k"], [KB], 1, None, False, 22))
    assert isinstance(second, PutStartReply) and second.statuses == ["ok"]
    assert await core.put_end(PutEnd(["k"], [7], 11)) == PutEndReply([False])
    entry = service.table.describe("k")
    assert entry is not None and entry["state"] == "writing"  # still put 22's, uncommitted
    assert await core.put_end(PutEnd(["k"], [9], 22)) == PutEndReply([True])
    assert await core.put_end(PutEnd(["k"], [9], 22)) == PutEndReply([True])  # its answer lost: asked again
    assert await core.put_end(PutEnd(["k"], [9], 23)) == PutEndReply([False])  # the same bytes, another put's
    got = await core.get_replicas(GetReplicas(["k", "none"], [], False, write_ids=True))
    assert isinstance(got, GetReplicasReply) and got.checksums[0] == 9 and got.write_ids == [22, 0]
    plain = await core.get_replicas(GetReplicas(["k"], [], False))
    assert isinstance(plain, GetReplicasReply) and plain.write_ids == []  # only when asked
    await service.stop()


async def test_a_put_start_asked_again_by_its_own_put_gets_its_reservation_back() -> None:
    """A PutStart whose answer was lost is sent again by its client: the put finds its own
    reservation and is given the same extents (it answered EXISTS, and the put, having written
    nothing, gave up while its reservation lingered to expiry). Another put of the key is told
    EXISTS; the same put naming another size is refused."""
    service, _ = await _one_node()
    core = service.core
    first = await core.put_start(PutStart(["a", "b"], [KB, 2 * KB], 1, None, False, 5))
    again = await core.put_start(PutStart(["a", "b"], [KB, 2 * KB], 1, None, False, 5))
    assert isinstance(first, PutStartReply) and isinstance(again, PutStartReply)
    assert again.statuses == ["ok", "ok"] and again.offsets == first.offsets and again.nodes == first.nodes
    other = await core.put_start(PutStart(["a"], [KB], 1, None, False, 6))
    assert isinstance(other, PutStartReply) and other.statuses == ["exists"]
    unknown = await core.put_start(PutStart(["a"], [KB], 1, None, False))  # a writer without ids
    assert isinstance(unknown, PutStartReply) and unknown.statuses == ["exists"]
    resized = await core.put_start(PutStart(["a"], [3 * KB], 1, None, False, 5))
    assert isinstance(resized, PutStartReply) and resized.statuses == ["error"]
    assert "with 1024 bytes, not 3072" in resized.errors[0]
    assert await core.put_end(PutEnd(["a", "b"], [1, 2], 5)) == PutEndReply([True, True])
    done = await core.put_start(PutStart(["a"], [KB], 1, None, False, 5))  # committed: nothing to resume
    assert isinstance(done, PutStartReply) and done.statuses == ["exists"]
    await service.stop()


async def test_a_removed_blocks_put_knows_its_write_after_the_key_was_put_again() -> None:
    """Put 31's block was adopted from the daemon's inventory with its write id, removed, and
    "k" put again (put 32 begun) before put 31's PutEnd came: its bytes were the key's value,
    so it was committed (without ids a put of the key begun here made the leader forget the
    removal, and the put said EXISTS of its own bytes). A PutEnd of the same bytes from another
    put (33) is not; nor is one of a removal the leader no longer remembers of the key."""
    service, drops = await _one_node([InventoryItem("k", "dram", 0, KB, 7, False, 31)])
    core = service.core
    entry = service.table.objects.get("k")
    assert entry is not None and entry.write_id == 31  # adopted with its write
    assert await core.remove(Remove(["k"])) == RemoveReply(1, [])
    start = await core.put_start(PutStart(["k"], [KB], 1, None, False, 32))
    assert isinstance(start, PutStartReply) and start.statuses == ["ok"]
    assert await core.put_end(PutEnd(["k"], [7], 33)) == PutEndReply([False])
    assert await core.put_end(PutEnd(["k"], [7], 31)) == PutEndReply([True])
    assert ["k"] in drops  # what the late put may still hold is dropped everywhere
    entry = service.table.describe("k")
    assert entry is not None and entry["state"] == "writing"  # put 32's reservation is untouched
    await service.stop()


async def test_a_copy_keeps_the_write_id_of_its_block() -> None:
    """A replicate (or a drain) has the target's daemon copy a block: the copy keeps the block's write
    id (the FetchBlocks names it), so that its inventory tells a new leader whose write it is."""
    service, _ = await _one_node([InventoryItem("k", "dram", 0, KB, 7, False, 31)])
    fetched: list[FetchBlocks] = []

    async def daemon(node_id: str, lane: str, message: Message, expect: type) -> CommandReply:
        if isinstance(message, FetchBlocks):
            fetched.append(message)
        return CommandReply([True] * len(message.keys))  # type: ignore[attr-defined]

    service.commands.call = daemon  # type: ignore[method-assign]
    await service.core.register(RegisterNode(
        "n1", "127.0.0.1:40001", 64 * KB, 0, 64, [], [], "host", "", 0, [Nic("lo", "127.0.0.1", -1, -1)], False,
        "", 0, [],
    ))  # fmt: skip
    await service.core.replicate(Replicate(["k"], "n1", 1 << 20))
    assert [(f.keys, f.checksums, f.write_ids) for f in fetched] == [(["k"], [7], [31])]
    await service.stop()
