"""The daemon's storage operations, without the network: commands are idempotent."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvstore.config import DramConfig, SsdConfig
from kvstore.errors import ConnectionFailed, CorruptBlock, InvalidArgument, NotReady, RetryLater
from kvstore.keys import BlockKey, checksum
from kvstore.protocol import CheckBlocks, CheckBlocksReply
from server.daemon.master_link import MasterLink
from server.daemon.orphans import Orphans
from server.daemon.service import DaemonServer
from server.daemon.storage import BlockState, DaemonStorage
from tests.unit.conftest import storage_configs

K = BlockKey
KB = 1024


def write(s: DaemonStorage, key: str, offset: int, data: bytes) -> None:
    [view] = s.begin_writes([(K(key), offset, len(data))])
    assert isinstance(view, memoryview)
    view[:] = data
    assert s.finish_writes([(K(key), view, checksum(data))]) == [None]


def test_write_read_and_inventory(storage: DaemonStorage) -> None:
    write(storage, "a", 0, b"a" * KB)
    write(storage, "b", 4 * KB, b"b" * 100)
    with storage.read_views([K("a"), K("zz"), K("b")]) as views:
        assert [None if v is None else bytes(v) for v in views] == [b"a" * KB, None, b"b" * 100]
    assert [(i.key, i.tier, i.offset) for i in storage.inventory()] == [("a", "dram", 0), ("b", "dram", 4 * KB)]


def test_while_registering_the_blocks_stay_as_the_inventory_says(storage: DaemonStorage) -> None:
    write(storage, "a", 0, b"a" * KB)
    write(storage, "b", 4 * KB, b"b" * KB)
    with storage.registering():
        taken = storage.inventory()
        with pytest.raises(NotReady, match="registering"):
            storage.drop([K("a")])
        with pytest.raises(NotReady):
            storage.demote([K("b")])
        with pytest.raises(NotReady):
            storage.promote([K("b")], [8 * KB])
        [view] = storage.begin_writes([(K("c"), 8 * KB, KB)])
        assert isinstance(view, memoryview)
        view[:] = b"c" * KB
        [refused] = storage.finish_writes([(K("c"), view, checksum(b"c" * KB))])
        assert isinstance(refused, RetryLater)  # the writer puts it again
        assert storage.drop_orphans([(K("a"), storage.describe([K("a")])[0])]) == []  # type: ignore[list-item]
        assert storage.inventory() == taken
    assert storage.drop([K("a")]) == [True]  # answered: changes go on
    write(storage, "c", 8 * KB, b"c" * KB)
    assert [i.key for i in storage.inventory()] == ["b", "c"]


def test_a_node_out_of_its_lease_refuses_reads_instead_of_answering_misses(storage: DaemonStorage) -> None:
    """A lapsed serve lease (the master may have fenced the node, or only stalled) is NotReady, never
    a miss: the block may be stored elsewhere or here; the reader fails over or says it cannot tell."""
    write(storage, "a", 0, b"a" * KB)
    waits: list[float] = []
    storage.serving = lambda wait_s=0.0: bool(waits.append(wait_s))
    with pytest.raises(NotReady, match="lease"), storage.read_views([K("a"), K("zz")], wait_s=0.3):
        pass
    assert waits == [0.3]  # asked to wait for a renewal first
    storage.serving = lambda wait_s=0.0: True
    with storage.read_views([K("a"), K("zz")]) as views:
        assert [None if v is None else bytes(v) for v in views] == [b"a" * KB, None]


def test_a_lapsed_lease_is_waited_for_until_a_heartbeat_renews_it(storage: DaemonStorage) -> None:
    link = MasterLink("127.0.0.1:1", "n0", "127.0.0.1:2", storage)  # not started: no master needed
    try:
        assert not link.serving() and not link.serving(0.01)  # never registered
        assert link.renewal_s == 0.5  # a registration on its way: at most half a second
        link._lease_s, link._interval = 5.0, 0.05
        link.registered.set()
        assert link.renewal_s == 0.1
        renewer = threading.Timer(0.05, lambda: link._renew(time.monotonic()))
        renewer.start()
        assert link.serving(30.0)  # woken by the renewal, long before the 30 s
        renewer.join()
        link._serve_until = time.monotonic() - 1  # lapsed, and no heartbeat comes
        assert not link.serving(0.05)
    finally:
        link.stop()


def write_two_trip(s: DaemonStorage, key: str, offset: int, data: bytes) -> None:
    batch = s.write_batch([K(key)], [offset], [len(data)], [checksum(data)], confirmed=False)
    batch.targets[0][:] = data
    batch.verify()
    assert batch.finish() == [None]


def by_key(s: DaemonStorage, key: str) -> bytes | None:
    with s.read_views([K(key)], asked=([0], [0])) as [view]:
        return None if view is None else bytes(view)


def test_a_two_trip_block_is_served_by_key_only_once_the_master_vouched_for_it(storage: DaemonStorage) -> None:
    """A two-trip put's bytes land before its commit at the master, which may never come (an orphan):
    a reader by key alone is not served them until a reader the master sent names their extent."""
    write_two_trip(storage, "t", 0, b"t" * KB)
    assert storage.unconfirmed() == 1 and by_key(storage, "t") is None  # the hinted reader asks the master
    with pytest.raises(InvalidArgument, match="1 offsets, 2 sizes"), storage.read_views([K("t")], asked=([0], [0, 0])):
        pass  # a malformed ReadBlocks: refused before any index is read
    with storage.read_views([K("t")], asked=([8 * KB], [KB])) as [view]:  # located, another extent: served
        assert view is not None
    assert by_key(storage, "t") is None
    with storage.read_views([K("t")], asked=([0], [KB])) as [view]:  # located at its extent: vouched for
        assert view is not None and bytes(view) == b"t" * KB
    assert storage.unconfirmed() == 0 and by_key(storage, "t") == b"t" * KB
    # An orphan check the master answered "known" confirms; one for other bytes does not.
    write_two_trip(storage, "u", 4 * KB, b"u" * KB)
    storage.confirm([(K("u"), BlockState(4 * KB, KB, checksum(b"x" * KB)))])
    assert by_key(storage, "u") is None
    [state] = storage.describe([K("u")])
    assert state is not None
    storage.confirm([(K("u"), state)])
    assert by_key(storage, "u") == b"u" * KB
    # A registration's answer: the master adopted every block it did not name.
    write_two_trip(storage, "v", 8 * KB, b"v" * KB)
    with storage.registering():
        storage.drop_unadopted([], [])
    assert by_key(storage, "v") == b"v" * KB
    # Dropped and put again by a grant (the master's already): served at once, the old note forgotten.
    write_two_trip(storage, "w", 12 * KB, b"w" * KB)
    assert not storage.vouched(K("w")) and storage.vouched(K("v")) and storage.vouched(K("absent"))
    assert storage.drop([K("w")]) == [True]
    assert storage.unconfirmed() == 0  # a dropped block's note goes with it
    write(storage, "w", 12 * KB, b"W" * KB)
    assert by_key(storage, "w") == b"W" * KB and storage.unconfirmed() == 0


def test_a_refused_commit_drops_only_the_very_block_it_was_for(storage: DaemonStorage) -> None:
    """A cached put's block whose commit the master refused goes; one written under its key since
    (the first dropped by a remove, then a new put) stays: the master knows that one."""
    server = DaemonServer(storage)  # not started: its drop of refused commits, on this storage
    try:
        write(storage, "k", 0, b"a" * KB)
        first = (K("k"), 0, KB, checksum(b"a" * KB))
        assert storage.drop([K("k")]) == [True]
        write(storage, "k", 8 * KB, b"b" * KB)
        server._drop_refused([first])
        with storage.read_views([K("k")]) as [view]:
            assert view is not None and bytes(view) == b"b" * KB
        server._drop_refused([(K("k"), 8 * KB, KB, checksum(b"b" * KB))])
        assert storage.describe([K("k")]) == [None]
        with storage.registering(), pytest.raises(NotReady):
            server._drop_refused([first])
    finally:
        server.stop()


def test_a_reservation_given_up_names_its_extent_and_a_block_elsewhere_is_not_it(storage: DaemonStorage) -> None:
    """A drop of reservations given up (``at``) takes a key's block only where it was reserved; a drop
    with ``keep`` asks about each block held, with its state, under the drop's own lock."""
    write(storage, "k", 0, b"a" * KB)  # a cached put's block, its commit pending at the master
    write(storage, "j", 8 * KB, b"j" * KB)
    [view] = storage.begin_writes([(K("w"), 16 * KB, KB)])  # another key being written
    assert isinstance(view, memoryview)
    with pytest.raises(InvalidArgument, match="reserved offsets"):
        storage.drop([K("k")], at=[0, 4 * KB])
    assert storage.drop([K("k"), K("none")], at=[4 * KB, 0]) == [False, False]  # elsewhere: kept
    assert storage.describe([K("k")]) == [BlockState(0, KB, checksum(b"a" * KB))]
    asked: list[tuple[BlockKey, object]] = []

    def keep(key: BlockKey, state: object) -> bool:
        asked.append((key, state))
        return key == "j"

    assert storage.drop([K("j"), K("w")], keep=keep) == [False, True]
    assert asked == [(K("j"), BlockState(8 * KB, KB, checksum(b"j" * KB))), (K("w"), BlockState(16 * KB, KB, -1))]
    assert storage.drop([K("k")], at=[0]) == [True]  # where it was reserved: dropped
    view.release()


def test_a_write_whose_bytes_do_not_match_is_discarded(storage: DaemonStorage) -> None:
    view, refused = storage.begin_writes([(K("x"), 0, 10), (K("y"), 3, 10)])
    assert isinstance(view, memoryview) and isinstance(refused, InvalidArgument)  # misaligned
    view[:] = b"0123456789"
    [err] = storage.finish_writes([(K("x"), view, 12345)])
    assert isinstance(err, CorruptBlock)
    assert "x" not in storage.arena


def test_commands_are_idempotent(storage: DaemonStorage) -> None:
    write(storage, "a", 0, b"a" * KB)
    write(storage, "b", KB, b"b" * KB)
    assert storage.demote([K("a"), K("missing")]) == [True, False]
    assert storage.demote([K("a")]) == [True]  # retried: already on SSD
    tiers: list[str] = []
    with storage.read_views([K("a"), K("b"), K("missing")], tiers=tiers) as [view, _, _]:
        assert view is not None and bytes(view) == b"a" * KB
    assert tiers == ["ssd", "dram", ""]  # where each was read from, as the access reports say
    assert storage.promote([K("a")], [8 * KB]) == [True]
    assert storage.promote([K("a")], [8 * KB]) == [True]  # retried: already there
    assert storage.arena.extent(K("a")).offset == 8 * KB
    assert storage.drop([K("a"), K("b")]) == [True, True]
    assert storage.drop([K("a")]) == [False]
    with pytest.raises(InvalidArgument):
        storage.promote([K("a")], [])


def test_a_crash_mid_demotion_keeps_the_dram_copy(tmp_path: Path) -> None:
    dram = DramConfig(capacity=64 * KB, name="ds2", shm_dir=tmp_path, prefault=False)
    ssd = SsdConfig(capacity=256 * KB, path=tmp_path / "ssd2")
    s = DaemonStorage(dram, ssd)
    write(s, "a", 0, b"a" * KB)
    assert s.ssd is not None
    s.ssd.store(K("a"), memoryview(b"a" * KB), checksum(b"a" * KB), 99)
    s.close()
    again = DaemonStorage(dram, ssd)
    assert [(i.key, i.tier) for i in again.inventory()] == [("a", "dram")]
    again.close()


def test_pins_are_recorded_for_the_next_master(storage: DaemonStorage) -> None:
    [view] = storage.begin_writes([(K("p"), 0, 10)])
    assert isinstance(view, memoryview)
    view[:] = b"p" * 10
    assert storage.finish_writes([(K("p"), view, checksum(b"p" * 10))], pinned=True) == [None]
    write(storage, "q", KB, b"q" * 10)
    assert [(i.key, i.pinned) for i in storage.inventory()] == [("p", True), ("q", False)]


def test_a_batch_pins_each_block_as_asked(storage: DaemonStorage) -> None:
    batch = storage.write_batch(
        [K("p"), K("q")], [0, KB], [10, 10], [checksum(b"p" * 10), checksum(b"q" * 10)], [True, False]
    )
    for target, data in zip(batch.targets, (b"p" * 10, b"q" * 10), strict=True):
        target[:] = data
    assert batch.finish() == [None, None]
    assert [(i.key, i.pinned) for i in storage.inventory()] == [("p", True), ("q", False)]


def test_a_retried_write_batch_succeeds_without_its_bytes_and_an_aborted_one_frees_its_extents(
    storage: DaemonStorage,
) -> None:
    data = b"r" * KB
    batch = storage.write_batch([K("r")], [0], [KB], [checksum(data)])
    batch.targets[0][:] = data
    assert batch.finish() == [None]
    # The same write again (its first answer was lost): nothing to receive, reported stored.
    again = storage.write_batch([K("r"), K("s")], [0, 2 * KB], [KB, KB], [checksum(data), checksum(data)])
    assert again.targets[0].obj is not storage.arena._mm  # scratch, not the stored extent
    again.abort()
    assert "s" not in storage.arena and "r" in storage.arena
    other = storage.write_batch([K("r")], [0], [KB], [checksum(b"x" * KB)])  # other bytes: refused
    [err] = other.finish()
    assert isinstance(err, RetryLater) and "held" in str(err)  # an orphan in the way: dropped soon
    with pytest.raises(InvalidArgument, match="mismatched"):
        storage.write_batch([K("t")], [0, 1], [KB], [0])


def test_slices_of_a_block_land_in_any_order_and_commit_once(storage: DaemonStorage) -> None:
    data = bytes(range(256)) * 16  # 4 KiB in four slices
    parts = [(K("big"), 0, len(data), s, KB) for s in (3 * KB, 0, 2 * KB, KB)]
    for part, view in zip(parts, storage.slice_views(parts), strict=True):
        assert isinstance(view, memoryview)
        view[:] = data[part[3] : part[3] + KB]
    assert "big" not in storage.arena  # invisible until committed
    [bad] = storage.slice_views([(K("big"), 0, len(data), 3 * KB, 2 * KB)])
    assert isinstance(bad, InvalidArgument)  # past the block's end
    batch = storage.write_batch([K("big")], [0], [len(data)], [checksum(data)], join=True)
    assert batch.finish() == [None]
    with storage.read_views([K("big")]) as [view]:
        assert view is not None and bytes(view) == data
    # A commit retried after its answer was lost: already stored, reported stored.
    assert storage.write_batch([K("big")], [0], [len(data)], [checksum(data)], join=True).finish() == [None]


def test_a_dropped_reservation_frees_a_half_written_block(storage: DaemonStorage) -> None:
    [view] = storage.slice_views([(K("half"), 0, 2 * KB, 0, KB)])
    assert isinstance(view, memoryview)
    view.release()
    assert storage.drop([K("half")]) == [True]
    assert not storage.arena.is_pending(K("half"))
    write(storage, "reuse", 0, b"u" * KB)  # the extent is free again


def test_no_write_lands_on_the_bytes_of_another_block(tmp_path: Path, storage: DaemonStorage) -> None:
    # A master places blocks; a wrong or forged extent must never overwrite one stored or being written.
    write(storage, "victim", 4 * KB, b"v" * 2000)
    pending, overlap, inside, clear = storage.begin_writes(
        [(K("w"), 8 * KB, 100), (K("a"), 4 * KB, 10), (K("b"), 5 * KB - 64, 200), (K("c"), 9 * KB, 100)]
    )
    assert isinstance(pending, memoryview) and isinstance(clear, memoryview)
    # Retryable: the block in the way is most likely an orphan its daemon is about to drop.
    assert isinstance(overlap, RetryLater) and "overlaps the block at (4096, 2048)" in str(overlap)
    assert isinstance(inside, RetryLater)
    [late] = storage.begin_writes([(K("d"), 8 * KB - 64, 128)])  # over the one being written
    assert isinstance(late, RetryLater)
    with storage.read_views([K("victim")]) as [view]:
        assert view is not None and bytes(view) == b"v" * 2000
    # Once a block is gone its extent takes a new one.
    storage.finish_writes([(K("w"), pending, 0), (K("c"), clear, 0)])  # wrong checksums: discarded
    assert storage.drop([K("victim")]) == [True]
    write(storage, "new", 4 * KB, b"n" * 3000)
    storage.close()
    # A daemon that restarts knows where its blocks are: the check holds across the restart.
    again = DaemonStorage(*storage_configs(tmp_path))
    try:
        [refused] = again.begin_writes([(K("x"), 6 * KB, 64)])
        assert isinstance(refused, RetryLater)
    finally:
        again.close()


def test_a_drop_of_one_tier_keeps_the_copy_in_the_other(storage: DaemonStorage) -> None:
    write(storage, "k", 0, b"k" * 100)
    assert storage.demote([K("k")]) == [True]
    write(storage, "k", 0, b"k" * 100)  # in both tiers, as a demotion cut short leaves it
    assert sorted((i.key, i.tier) for i in storage.inventory()) == [("k", "dram"), ("k", "ssd")]
    assert storage.drop([K("k")], "ssd") == [True] and storage.drop([K("k")], "ssd") == [False]
    assert [(i.key, i.tier) for i in storage.inventory()] == [("k", "dram")]
    assert storage.drop([K("k")], "dram") == [True] and storage.inventory() == []


def test_a_fenced_copy_is_refused_once_and_a_drop_of_one_being_written_aborts_it(storage: DaemonStorage) -> None:
    data = b"f" * 100
    assert storage.drop([K("f")], "", [KB]) == [False]  # the copy had not arrived: fenced off
    other = storage.write_batch([K("f")], [0], [100], [checksum(data)], fenced=True)  # another extent: not fenced
    other.abort()
    batch = storage.write_batch([K("f")], [KB], [100], [checksum(data)], fenced=True)
    assert batch.targets[0].nbytes == 0 and isinstance(batch.finish()[0], InvalidArgument)
    batch = storage.write_batch([K("f")], [KB], [100], [checksum(data)], fenced=True)  # the fence is spent
    batch.targets[0][:] = data
    assert storage.drop([K("f")], "", [KB]) == [True]  # being written: aborted, no fence needed
    assert isinstance(batch.finish()[0], InvalidArgument) and storage.inventory() == []


def test_orphans_are_asked_about_after_their_delay_and_only_those_unchanged_are_dropped(
    storage: DaemonStorage,
) -> None:
    orphans = Orphans(storage, "n", delay_s=2.0, sweep_s=0)
    orphans.dropped_absent([K("kept"), K("lost"), K("rewritten")])  # the master's drops came first
    orphans.wrote([K("unsuspected")])  # a put the master did not drop: never asked about
    write(storage, "unsuspected", 12 * KB, b"u" * 100)
    write(storage, "kept", 0, b"k" * 100)
    write(storage, "lost", 4 * KB, b"l" * 100)
    write(storage, "rewritten", 8 * KB, b"r" * 100)
    orphans.wrote([K("kept"), K("lost"), K("rewritten")])
    asked: list[CheckBlocks] = []

    def master(m: CheckBlocks) -> CheckBlocksReply:
        asked.append(m)
        if m.keys:  # meanwhile "rewritten" is dropped and written anew (a new put of the key)
            storage.drop([K("rewritten")])
            write(storage, "rewritten", 8 * KB, b"R" * 100)
        return CheckBlocksReply([k != "kept" for k in m.keys])

    assert orphans.check(master, now=time.monotonic()) == 0 and not asked  # not due yet
    assert orphans.check(master, now=time.monotonic() + 3) == 1
    [question] = asked
    assert (question.keys, question.offsets, question.sizes) == (
        ["kept", "lost", "rewritten"],
        [0, 4096, 8192],
        [100] * 3,
    )
    assert question.checksums[0] == checksum(b"k" * 100)
    assert storage.holds(K("kept")) and not storage.holds(K("lost")) and storage.holds(K("rewritten"))
    # The master is told at the next check that their extents are free.
    orphans.check(master, now=time.monotonic() + 4)
    assert asked[-1].dropped == ["lost", "rewritten"] and asked[-1].keys == []


def test_a_refused_write_has_the_blocks_written_checked_at_once(storage: DaemonStorage) -> None:
    orphans = Orphans(storage, "n", delay_s=60.0, sweep_s=0)
    write(storage, "orphan", 0, b"o" * 100)  # nothing says it is suspect: only the refusal below
    write(storage, "bystander", 4 * KB, b"b" * 100)
    [refused] = storage.begin_writes([(K("new"), 64, 64)])
    assert isinstance(refused, RetryLater)
    assert orphans.check(lambda m: CheckBlocksReply([True] * len(m.keys))) == 1
    assert storage.describe([K("orphan")]) == [None]
    [view] = storage.begin_writes([(K("new"), 64, 64)])
    assert isinstance(view, memoryview) and storage.holds(K("bystander"))
    view.release()


def test_the_sweep_asks_about_every_block_and_a_master_that_fails_is_asked_again(storage: DaemonStorage) -> None:
    orphans = Orphans(storage, "n", delay_s=2.0, sweep_s=10.0, batch=2)
    for i in range(3):
        write(storage, f"b{i}", i * 4 * KB, bytes([i]) * 10)
    seen: list[str] = []

    def down(m: CheckBlocks) -> CheckBlocksReply:
        raise ConnectionFailed("master away")

    def master(m: CheckBlocks) -> CheckBlocksReply:
        seen.extend(m.keys)
        return CheckBlocksReply([False] * len(m.keys))

    now = time.monotonic()
    assert orphans.check(master, now) == 0 and seen == []  # the first sweep starts sweep_s after the start
    orphans.check(down, now + 11)  # two asked, not answered: asked again
    for step in range(4):
        orphans.check(master, now + 12 + step)
    assert sorted(seen) == ["b0", "b1", "b2"]
    assert storage.describe([K("b0")]) == [BlockState(0, 10, checksum(bytes([0]) * 10))]


def test_a_block_written_again_with_the_same_bytes_while_asked_about_is_kept(storage: DaemonStorage) -> None:
    """A retried write of the very bytes held ("stored already") is a new put of the key: the
    answer about the block before it must not drop it."""
    orphans = Orphans(storage, "n", delay_s=0.0, sweep_s=0)
    orphans.dropped_absent([K("k")])
    write(storage, "k", 0, b"k" * 100)
    orphans.wrote([K("k")])

    def master(m: CheckBlocks) -> CheckBlocksReply:
        [again] = storage.begin_writes([(K("k"), 0, 100)], [checksum(b"k" * 100)])
        assert again is None  # stored already: no bytes needed
        return CheckBlocksReply([True] * len(m.keys))

    assert orphans.check(master, now=time.monotonic() + 1) == 0
    assert storage.holds(K("k"))


def test_a_block_keeps_its_puts_write_id_for_the_next_master(tmp_path: Path) -> None:
    """Each block's write id (kvstore.write_ids) is in the inventory a new leader adopts it from, so
    that leader knows whose write the block is; ids are kept in memory, so an arena reopened after a
    restart reports them unknown (0), and a batch whose ids do not fit its blocks is refused."""
    dram = DramConfig(capacity=64 * KB, name="wid", shm_dir=tmp_path, prefault=False)
    s = DaemonStorage(dram, SsdConfig(capacity=0))
    batch = s.write_batch([K("a"), K("b")], [0, KB], [10, 10], [checksum(b"a" * 10), checksum(b"b" * 10)],
                          confirmed=False, write_ids=[41, 42])  # fmt: skip
    for target, data in zip(batch.targets, (b"a" * 10, b"b" * 10), strict=True):
        target[:] = data
    batch.verify()
    assert batch.finish() == [None, None]
    write(s, "c", 2 * KB, b"c" * 10)  # a writer that sent none
    assert [(i.key, i.write_id) for i in s.inventory()] == [("a", 41), ("b", 42), ("c", 0)]
    with pytest.raises(InvalidArgument, match="write_ids has 1 entries for 2 blocks"):
        s.write_batch([K("d"), K("e")], [3 * KB, 4 * KB], [1, 1], [0, 0], write_ids=[1])
    with pytest.raises(InvalidArgument, match=r"in \[0, 2\*\*64\), got -1"):
        s.write_batch([K("d")], [3 * KB], [1], [0], write_ids=[-1])
    s.close()
    again = DaemonStorage(dram, SsdConfig(capacity=0))
    assert [(i.key, i.write_id) for i in again.inventory()] == [("a", 0), ("b", 0), ("c", 0)]
    again.close()
