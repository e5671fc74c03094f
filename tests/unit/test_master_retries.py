"""Retries and terms: a resent lease release (a client resends the same request id after a broken
connection) ends nothing more, a drain stops when its master loses leadership, a remove of a
key whose drop is still under way waits for it, and a put begun with an earlier master learns
that its block was committed though it was removed before its PutEnd came."""

from __future__ import annotations

import asyncio
import time
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
from server.master.removed import PER_KEY, RecentRemovals
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
    assert old.inspection.blocks_on("n0") == 4
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
    # Without a lease to serve by key (no daemon here renews one): the drops alone settle a remove.
    service = await _service_with(["k", "j"], command_timeout_ms=300, fence_refused=False, key_lease_ms=0)
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
    # Cut off, not gone; without a lease to serve by key (no daemon here renews one): drops alone settle.
    service = await _service_with(["k"], command_timeout_ms=300, fence_refused=False, key_lease_ms=0)
    [replica] = service.table.inspection.describe("k")["replicas"]  # type: ignore[index]
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
    assert service.table.reads.removing(["k"]) == [] and service.commands.dropping(["k"]) == {
        "k"
    }  # forgotten, being dropped
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


async def test_a_remove_behind_a_frozen_daemon_is_answered_on_its_key_lease_and_says_where_the_time_went(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A frozen daemon never answers its drop: the remove is answered once the node's lease to serve by
    key lapsed (the daemon serves nothing by key past it), well before the command timeout, the key
    owed in the node's record; and a settle that slow is logged with its parts (daemons, etcd)."""
    service = await _service_with(["k"], command_timeout_ms=5000, fence_refused=False, key_lease_ms=300)

    async def frozen(node_id: str, lane: str, message: Message, expect: type) -> CommandReply:
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    service.commands.call = frozen  # type: ignore[method-assign]
    with caplog.at_level("WARNING", logger="kvstore.master"):  # unsettled at the command timeout: Timeout
        assert await service.core.remove(Remove(["k"])) == RemoveReply(1, [])
    assert service.table.inspection.describe("k") is None and "k" in service.table.nodes["n0"].owes
    [line] = [r.getMessage() for r in caplog.records if "settling the drops" in r.getMessage()]
    assert "1 settled by a lapsed key lease, 0 unsettled" in line and "keeping node records in etcd" in line
    await service.stop()


async def test_a_put_end_of_an_adopted_block_removed_before_it_came_says_committed() -> None:
    """A put reserved "k" with a leader that died; its successor adopted the block from the daemon's
    inventory, every reader saw it, and a remove took it away before the put's PutEnd reached the
    successor, which never made the reservation: the put's bytes were stored, so the PutEnd says
    committed (it said not, and the put's retry answered EXISTS of its own bytes: bench.chaos's
    own-EXISTS), and every node drops what it may still hold of the put (the writer revokes
    nothing now), a put of "k" told to retry until they did. The answer does not wait for the drops:
    the master answers PutEnd inline, where a handler that waited was an internal error (a put
    failed so in an hour of bench.chaos). Other bytes are not committed; nor is a PutEnd after a put
    of the key begun on this term."""
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
    assert service.table.inspection.describe("k") is not None  # adopted
    assert await service.core.remove(Remove(["k"])) == RemoveReply(1, [])
    assert await service.core.put_end(PutEnd(["k"], [8])) == PutEndReply([False])  # not these bytes
    late = service.core.put_end(PutEnd(["k"], [7]))
    with pytest.raises(StopIteration) as answered:  # answered without waiting, as the RPC layer runs it
        late.send(None)
    assert answered.value.value == PutEndReply([True])
    await asyncio.sleep(0.05)
    assert drops == [["k"]]  # dropped everywhere, in the background
    other = await service.core.put_start(PutStart(["k"], [KB], 1, None, False))
    assert isinstance(other, PutStartReply) and other.error_codes == [RetryLater.code]
    dropped.set()
    await asyncio.sleep(0.05)
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
    await core.put_revoke(PutRevoke(["k"], 11))  # as the reservation's expiry does
    second = await core.put_start(PutStart(["k"], [KB], 1, None, False, 22))
    assert isinstance(second, PutStartReply) and second.statuses == ["ok"]
    assert await core.put_end(PutEnd(["k"], [7], 11)) == PutEndReply([False])
    entry = service.table.inspection.describe("k")
    assert entry is not None and entry["state"] == "writing"  # still put 22's, uncommitted
    assert await core.put_end(PutEnd(["k"], [9], 22)) == PutEndReply([True])
    assert await core.put_end(PutEnd(["k"], [9], 22)) == PutEndReply([True])  # its answer lost: asked again
    assert await core.put_end(PutEnd(["k"], [9], 23)) == PutEndReply([False])  # the same bytes, another put's
    got = await core.get_replicas(GetReplicas(["k", "none"], [], False, write_ids=True))
    assert isinstance(got, GetReplicasReply) and got.checksums[0] == 9 and got.write_ids == [22, 0]
    plain = await core.get_replicas(GetReplicas(["k"], [], False))
    assert isinstance(plain, GetReplicasReply) and plain.write_ids == []  # only when asked
    await service.stop()


async def test_a_late_revoke_gives_up_only_a_reservation_of_its_own_write() -> None:
    """Put 11's reservation of "k" expired and put 22 took the key; put 11's PutEnd then answered
    not committed, and its writer revoked what it believed its own reservation: put 22's (whose
    PutEnd then failed, and whose revoke could take 11's retry in turn). A revoke names its put's
    write id now (one that names none gives up only a reservation that has none)."""
    service, _ = await _one_node()
    core = service.core
    await core.put_start(PutStart(["k", "j"], [KB, KB], 1, None, False, 11))
    await core.put_revoke(PutRevoke(["k", "j"], 11))
    await core.put_start(PutStart(["k", "j"], [KB, KB], 1, None, False, 22))
    assert await core.put_end(PutEnd(["k"], [7], 11)) == PutEndReply([False])
    await core.put_revoke(PutRevoke(["k"], 11))  # the late writer's revoke
    assert await core.put_end(PutEnd(["k"], [9], 22)) == PutEndReply([True])
    await core.put_revoke(PutRevoke(["j"]))  # no id: only a reservation that has none
    assert await core.put_end(PutEnd(["j"], [9])) == PutEndReply([False])  # nor is one committed
    assert await core.put_end(PutEnd(["j"], [9], 22)) == PutEndReply([True])
    many = [f"m{i}" for i in range(10)]  # a batch commits column-wise: the same rule
    await core.put_start(PutStart(many, [KB] * 10, 1, None, False, 33))
    assert await core.put_end(PutEnd(many, [1] * 10, 34)) == PutEndReply([False] * 10)
    assert await core.put_end(PutEnd(many, [1] * 10, 33)) == PutEndReply([True] * 10)
    await service.stop()


async def test_a_removed_blocks_put_knows_its_write_after_the_key_was_put_again() -> None:
    """Put 31's block was adopted from the daemon's inventory with its write id, removed, and
    "k" put again (put 32 begun) before put 31's PutEnd came: its bytes were the key's value,
    so it was committed (without ids a put of the key begun here made the leader forget the
    removal, and the put said EXISTS of its own bytes). A PutEnd of the same bytes from another
    put (33), or from one that names no id, is not. Put 32 holds the key: nothing is dropped for
    put 31's PutEnd (a drop on every node would take put 32's block); once nothing holds it, what
    put 31 may still have written is dropped everywhere."""
    service, drops = await _one_node([InventoryItem("k", "dram", 0, KB, 7, False, 31)])
    core = service.core
    entry = service.table.objects.get("k")
    assert entry is not None and entry.write_id == 31  # adopted with its write
    assert await core.remove(Remove(["k"])) == RemoveReply(1, [])
    start = await core.put_start(PutStart(["k"], [KB], 1, None, False, 32))
    assert isinstance(start, PutStartReply) and start.statuses == ["ok"]
    drops.clear()
    assert await core.put_end(PutEnd(["k"], [7], 33)) == PutEndReply([False])
    assert await core.put_end(PutEnd(["k"], [7])) == PutEndReply([False])
    assert await core.put_end(PutEnd(["k"], [7], 31)) == PutEndReply([True])
    assert drops == []
    described = service.table.inspection.describe("k")
    assert described is not None and described["state"] == "writing"  # put 32's reservation is untouched
    assert await core.put_end(PutEnd(["k"], [8], 32)) == PutEndReply([True])
    assert await core.put_end(PutEnd(["k"], [7], 31)) == PutEndReply([True]) and drops == []
    assert await core.remove(Remove(["k"])) == RemoveReply(1, [])
    drops.clear()
    assert await core.put_end(PutEnd(["k"], [7], 31)) == PutEndReply([True])  # remembered with put 32's
    await asyncio.sleep(0.05)
    assert drops == [["k"]]  # nothing holds the key now: dropped everywhere (in the background)
    await service.stop()


def test_removals_are_remembered_per_key_by_write_for_a_while() -> None:
    """The last PER_KEY removed blocks of a key, for kept_s; a block removed without a write id is
    matched by its checksum until the key is reserved anew, one with an id by its id only then."""
    removals = RecentRemovals(kept_s=60.0)
    removals.removed([("k", i, 100 + i) for i in range(1, PER_KEY + 2)])  # one too many: the first goes
    assert not removals.was_committed("k", 101, 1)
    assert all(removals.was_committed("k", 100 + i, i) for i in range(2, PER_KEY + 2))
    assert not removals.was_committed("k", 999, 2)  # the same write names its own bytes
    assert removals.was_committed("k", 102)  # no id given: by checksum
    removals.removed([("u", 0, 5)])  # a block whose write was not known
    assert removals.was_committed("u", 5, 77)
    removals.reserved(["k", "u"])
    assert not removals.was_committed("u", 5, 77)  # the table judges it from now on
    assert removals.was_committed("k", 102, 2) and not removals.was_committed("k", 102)
    expired = RecentRemovals(kept_s=0.0)
    expired.removed([("k", 1, 2)])
    time.sleep(0.01)
    assert not expired.was_committed("k", 2, 1)


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
