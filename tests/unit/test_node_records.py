"""What a new leader learns of the nodes before it answers: the records an earlier leader kept in
etcd (members are waited for, the others are absent), the nodes the daemons name, and what a term
that is not ready yet tells the daemons."""

from __future__ import annotations

import time

from kvstore.config import MasterConfig
from kvstore.placement.nodes import EVERYTHING, NodeRecord
from kvstore.policy import TierName
from server.master.core import _parse_record, _record_bytes
from server.master.leadership import Leadership


def test_records_round_trip_and_one_that_cannot_be_read_drops_everything() -> None:
    record = NodeRecord(True, frozenset({("ключ", TierName.DRAM, 4096), ("k", TierName.SSD, -1)}))
    value = _record_bytes(record)
    assert "ключ".encode() in value  # UTF-8, not \\u escapes: a key of 256 bytes stays ~256 bytes
    assert _parse_record("n", value) == record
    assert _parse_record("n", b'[["k", "dram", -1]]') == NodeRecord(False, frozenset({("k", TierName.DRAM, -1)}))
    for bad in (b"{", b'{"member": true}', b'[["k", "tape", 0]]', b"7"):
        assert _parse_record("n", bad) == NodeRecord(False, frozenset({EVERYTHING}))


def test_a_term_waits_for_members_not_for_nodes_the_records_call_absent() -> None:
    up: set[str] = set()
    missing: list[list[str]] = []
    leadership = Leadership(MasterConfig(ready_wait_ms=60_000, heartbeat_interval_ms=10), lambda: up)
    leadership.on_ready = missing.append
    leadership.begin_term(7)
    leadership.know_absent(["m"], ["m", "f"])  # m: a member when the last term ended; f: fenced then
    leadership.expect(["a", "f"])  # a daemon's peer list (stale: it still names f)
    up.add("a")
    time.sleep(0.03)  # past the settle
    assert not leadership.ready()  # m is waited for
    assert leadership.waiting_for(up) == {"a", "m"}  # told to the daemons: a next term waits for m too
    up.add("m")
    assert leadership.ready() and missing == [[]]  # f was not waited for
    assert leadership.waiting_for(up) == set()


def test_a_term_ready_without_a_member_names_it_absent() -> None:
    up = {"a"}
    missing: list[list[str]] = []
    leadership = Leadership(MasterConfig(ready_wait_ms=20, heartbeat_interval_ms=10), lambda: up)
    leadership.on_ready = missing.append
    leadership.begin_term(1)
    leadership.expect(["a", "b"])
    time.sleep(0.05)
    assert leadership.ready() and missing == [["b"]]
