"""One-trip puts into granted space: what happens when the grant's holder dies, or the grant ends."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvstore.config import ClientConfig
from kvstore.errors import GrantExpired, InvalidArgument, Timeout
from kvstore.keys import checksum
from kvstore.protocol import PUT_EXISTS, PUT_STORED, GrantReply, GrantSpace, PutReply, WriteGranted
from kvstore.results import PutStatus
from kvstore_cli.cluster import LocalCluster
from kvstore_client.aio import AsyncStore
from kvstore_client.core import ClientCore
from kvstore_client.dataplane import DataPath
from kvstore_client.effects import Block
from kvstore_client.puts import PutOptions
from kvstore_client.store import Store
from tests.conftest import admin_call

KB, MB = 1024, 1024 * 1024
TCP = ClientConfig(transport="tcp", timeout_s=5.0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    env = {"KVSTORE_MASTER_GRANT_TTL_MS": "1500"}
    with LocalCluster(1, dram="64MiB", env=env) as c:
        yield c


def _wait(predicate: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@pytest.mark.slow
def test_a_client_killed_holding_a_grant_gives_its_space_back_within_the_expiry(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address, TCP) as store:
        base = store.stats()
        script = (
            "import os, sys\n"
            "from kvstore.config import ClientConfig\n"
            "from kvstore_client.store import Store\n"
            f"s = Store.connect({cluster.master_address!r}, ClientConfig(transport='tcp'))\n"
            "assert s.put('killed-holder', b'k' * 4096).value == 'stored'\n"
            "os._exit(0)  # no close: the grant is never returned\n"
        )
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
        held = store.stats()
        assert held["grants"] == base["grants"] + 1
        assert held["dram_used"] >= base["dram_used"] + 64 * MB // 64  # the whole grant is held
        assert _wait(lambda: store.stats()["grants_expired"] > base["grants_expired"], 10)
        assert _wait(lambda: store.stats()["dram_used"] <= base["dram_used"] + 4096, 5)
        assert store.get("killed-holder") == b"k" * 4096  # what it committed stays


def test_a_grant_used_after_it_ended_is_refused_and_the_put_goes_the_two_trip_way(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address, TCP) as store:
        grant = store._call(GrantSpace(64 * KB, None), GrantReply)
        data = b"e" * (4 * KB)
        message = WriteGranted(grant.grant_id, ["late"], [grant.offset], [len(data)], [checksum(data)], False)
        pool = store._paths.pool(grant.address)
        time.sleep(grant.ttl_ms / 1000 + 0.2)
        reply = pool.call(message, PutReply, [data])
        assert reply.codes == [GrantExpired.code] and "ended" in reply.errors[0]
        assert store.get("late") is None
        # A client whose grant ended meanwhile still stores: the daemon refuses, the master places.
        assert store.put("late-put", b"1" * 100) is PutStatus.STORED
        [held] = store._core.grants.held()
        held.usable_until = time.monotonic() + 60  # as if this client's clock were behind
        time.sleep(grant.ttl_ms / 1000 + 0.2)
        assert store.put("late-put-2", b"2" * 100) is PutStatus.STORED
        assert store.get_many(["late-put", "late-put-2"]) == [b"1" * 100, b"2" * 100]


def test_a_one_trip_put_keeps_existing_bytes_and_says_so(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address, TCP) as store:
        assert store.put("kept", b"first" * 100) is PutStatus.STORED
        assert store.put("kept", b"other" * 200) is PutStatus.EXISTS
        assert store.get("kept") == b"first" * 100
    with Store.connect(cluster.master_address, TCP) as other:  # another client, its own grant
        grant = other._call(GrantSpace(64 * KB, None), GrantReply)
        data = b"x" * 500
        message = WriteGranted(grant.grant_id, ["kept", "fresh"], [grant.offset, grant.offset + 4 * KB],
                               [len(data)] * 2, [checksum(data)] * 2, False)  # fmt: skip
        reply = other._paths.pool(grant.address).call(message, PutReply, [data, data])
        assert reply.codes == [PUT_EXISTS, PUT_STORED]
        # The same extent twice: refused by the daemon, whatever the key.
        again = WriteGranted(grant.grant_id, ["twice"], [grant.offset + 4 * KB], [len(data)], [checksum(data)], False)
        reply = other._paths.pool(grant.address).call(again, PutReply, [data])
        assert reply.codes[0] not in (PUT_STORED, PUT_EXISTS) and "not free space" in reply.errors[0]
        assert other.get_many(["kept", "fresh", "twice"]) == [b"first" * 100, data, None]


def test_after_remove_no_reader_gets_the_old_bytes(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address, TCP) as reader, Store.connect(cluster.master_address, TCP) as writer:
        writer.put("short-lived", b"old" * 1000)
        assert reader.get("short-lived") == b"old" * 1000  # the reader now knows its node
        assert writer.remove("short-lived")
        assert reader.get("short-lived") is None  # straight to the node: it no longer holds it
        writer.put("short-lived", b"new" * 10)
        assert reader.get("short-lived") == b"new" * 10


def test_a_one_key_put_takes_one_trip_and_answers_as_the_core_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """Store.put's fast path (the grant in hand, one daemon round trip, no core generator) stores what
    the core's way stores: the pin, EXISTS for a held key, a location hint; anything else goes the
    core's way (a bad key's error, two replicas, no grant in hand)."""
    token = "fast-put-token"
    with (
        LocalCluster(1, dram="64MiB", admin=True, env={"KVSTORE_ADMIN_TOKEN": token}) as cluster,
        Store.connect(cluster.master_address, TCP) as store,
    ):
        core_puts: list[object] = []

        def count_core_puts(core: ClientCore) -> None:
            put_many = core.put_many

            def counted(items: object, options: object) -> object:
                core_puts.append(items)
                return put_many(items, options)  # type: ignore[arg-type]

            monkeypatch.setattr(core, "put_many", counted)

        count_core_puts(store._core)
        assert store.put("first", b"1" * 4096) is PutStatus.STORED
        assert len(core_puts) == 1  # no grant in hand yet: the core asks for one
        assert store.put("fast", b"f" * 4096, PutOptions(pin=True)) is PutStatus.STORED
        assert store.put("fast", b"g" * 100) is PutStatus.EXISTS
        assert len(core_puts) == 1  # both in one trip, through the grant the first put got
        assert store._core.hinted("fast") is not None
        status, described = admin_call(cluster.admin_address, "GET", "/api/v1/keys/fast", token=token)
        assert status == 200 and described["pinned"] and described["size"] == 4096
        assert store.get("fast") == b"f" * 4096
        with pytest.raises(InvalidArgument):
            store.put("", b"x")
        assert store.put("two", b"2" * 100, PutOptions(replicas=1, preferred_node="node0")) is PutStatus.STORED
        assert len(core_puts) == 3  # the bad key and a preferred node: the core's way

        async def the_async_face() -> None:
            async with await AsyncStore.connect(cluster.master_address, TCP) as aio:
                count_core_puts(aio._core)
                assert await aio.put("a-first", b"1" * 4096) is PutStatus.STORED
                assert await aio.put("a-fast", b"f" * 4096, PutOptions(pin=True)) is PutStatus.STORED
                assert await aio.put("fast", b"h" * 100) is PutStatus.EXISTS
                assert len(core_puts) == 4
                assert aio._core.hinted("a-fast") is not None and await aio.get("a-fast") == b"f" * 4096

        asyncio.run(the_async_face())
        status, described = admin_call(cluster.admin_address, "GET", "/api/v1/keys/a-fast", token=token)
        assert status == 200 and described["pinned"]


def test_a_fast_put_into_an_ended_grant_drops_it_and_goes_the_two_trip_way_at_once(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast path's refused write is the core's: the grant is dropped and given back, and the put
    goes the two-trip way, without a second write into the grant that ended."""
    with Store.connect(cluster.master_address, TCP) as store:
        assert store.put("ended-0", b"0" * 100) is PutStatus.STORED  # a grant in hand
        [held] = store._core.grants.held()
        held.usable_until = time.monotonic() + 60  # as if this client's clock were behind
        writes: list[int] = []
        write_granted = DataPath.write_granted

        def counted(path: DataPath, grant_id: int, blocks: object, pinned: bool, cached: bool = False) -> object:
            writes.append(grant_id)
            return write_granted(path, grant_id, blocks, pinned, cached)  # type: ignore[arg-type]

        monkeypatch.setattr(DataPath, "write_granted", counted)
        time.sleep(1.5 + 0.3)  # past the grant's ttl (the module's master grants for 1.5 s)
        assert store.put("ended-1", b"1" * 100) is PutStatus.STORED
        assert writes == [held.grant_id]  # one write into it, refused; then the master placed it
        assert held not in store._core.grants.held()
        assert store.get("ended-1") == b"1" * 100


def test_a_put_whose_write_landed_but_whose_answer_was_lost_reports_stored(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found by bench.chaos (a leader stopped mid-put): the write into the grant was committed, its
    answer never came, and the retry the two-trip way found the key stored: the put said EXISTS
    ("wrote nothing") of bytes it had written itself. Now the stored block is compared with the
    put's own: the same size and checksum is this put's doing."""
    write_granted = DataPath.write_granted

    def lost_answer(path: DataPath, grant_id: int, blocks: object, pinned: bool, cached: bool = False) -> object:
        write_granted(path, grant_id, blocks, pinned, cached)  # type: ignore[arg-type]
        raise Timeout("no reply within 10 s")

    with Store.connect(cluster.master_address, TCP) as store:
        assert store.put("lost-0", b"0" * 100) is PutStatus.STORED  # a grant in hand
        monkeypatch.setattr(DataPath, "write_granted", lost_answer)
        assert store.put("lost-1", b"1" * 100) is PutStatus.STORED  # the fast path
        assert store.put_many([("lost-2", b"2" * 100), ("lost-3", b"3" * 100)]) == [PutStatus.STORED] * 2
        monkeypatch.setattr(DataPath, "write_granted", write_granted)
        # Another writer's bytes under the key are still EXISTS.
        assert store.put("lost-1", b"x" * 100) is PutStatus.EXISTS
        assert [store.get(f"lost-{i}") for i in (1, 2, 3)] == [b"1" * 100, b"2" * 100, b"3" * 100]


def test_a_two_trip_put_whose_commit_answer_was_lost_reports_stored(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same on the two-trip way (same-host clients, and puts too large for a grant): the master
    committed, but the answer the put got said otherwise (as a new leader that adopted the block from
    the daemon's inventory answers for a reservation it never made), so the put went round again and
    found the key stored: its own bytes, STORED."""
    from kvstore_client import core

    take_commits = core.take_commits
    lied: list[str] = []

    def lost_once(plan: object, items: list[tuple[str, memoryview]], done: list[int], committed: list[bool],
                  out: list[object]) -> object:  # fmt: skip
        if not lied:
            lied.append(items[done[0]][0])
            committed = [False] * len(committed)
        return take_commits(plan, items, done, committed, out)  # type: ignore[arg-type]

    monkeypatch.setattr(core, "take_commits", lost_once)
    config = ClientConfig(transport="tcp", timeout_s=5.0, grant_bytes=0)  # every put the two-trip way
    with Store.connect(cluster.master_address, config) as store:
        assert store.put("two-trip-0", b"0" * 100) is PutStatus.STORED
        assert lied == ["two-trip-0"]
        assert store.put("two-trip-0", b"x" * 100) is PutStatus.EXISTS  # another put's bytes: EXISTS
        assert store.get("two-trip-0") == b"0" * 100


def test_a_write_answered_exists_for_its_own_bytes_reports_stored(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write into a grant answered EXISTS (the daemon holds the key already) for a block that is the
    put's own write, as when an earlier attempt of it landed: STORED. A put of other bytes under a
    stored key is still EXISTS (with one more trip, to compare writes), and so is another put of the
    same bytes."""
    write_granted = DataPath.write_granted

    def twice(path: DataPath, grant_id: int, blocks: list[Block], pinned: bool, cached: bool = False) -> object:
        write_granted(path, grant_id, blocks, pinned, cached)
        # The same bytes again, further into the grant (a first attempt's extent is not free twice).
        again = [b._replace(offset=b.offset + 4096) for b in blocks]
        return write_granted(path, grant_id, again, pinned, cached)

    with Store.connect(cluster.master_address, TCP) as store:
        assert store.put("twice-0", b"0" * 100) is PutStatus.STORED  # a grant in hand
        monkeypatch.setattr(DataPath, "write_granted", twice)
        assert store.put("twice-1", b"1" * 100) is PutStatus.STORED
        assert store.put_many([("twice-2", b"2" * 100)]) == [PutStatus.STORED]
        monkeypatch.setattr(DataPath, "write_granted", write_granted)
        assert store.put("twice-1", b"x" * 100) is PutStatus.EXISTS
        # The same bytes from another put: EXISTS (by its write id; by its checksum it said STORED).
        assert store.put("twice-1", b"1" * 100) is PutStatus.EXISTS
        assert store.put_many([("twice-2", b"2" * 100)]) == [PutStatus.EXISTS]
        assert store.get("twice-1") == b"1" * 100
