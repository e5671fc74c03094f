"""A MasterLocator's watch of the leader key, on a real etcd: a new leader is pushed the moment etcd
has it (no read asked for it), a deleted key is no leader, the watch comes back after etcd restarts,
a watch gone stale never undoes a newer read, and close() ends its thread."""

from __future__ import annotations

import base64
import json
import shutil
import threading
import time
import urllib.request

import pytest

from kvstore_cli.cluster import LocalEtcd
from transfer.discovery import EtcdCluster, MasterLocator, MasterRecord

pytestmark = [
    pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian: apt install etcd-server)"),
    pytest.mark.timeout(120),
]

CLUSTER = "watch-test"


def _post(etcd: LocalEtcd, path: str, body: dict[str, str]) -> None:
    request = urllib.request.Request(f"http://{etcd.endpoint}{path}", data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        response.read()


def _key(etcd: LocalEtcd) -> str:
    return base64.b64encode(EtcdCluster((etcd.endpoint,), CLUSTER).leader_key).decode()


def elect(etcd: LocalEtcd, address: str) -> None:
    """Name ``address`` leader as a master's election does: a new leader key (a new create revision)."""
    _post(etcd, "/v3/kv/deleterange", {"key": _key(etcd)})
    value = base64.b64encode(MasterRecord(address, None).value()).decode()
    _post(etcd, "/v3/kv/put", {"key": _key(etcd), "value": value})


def resign(etcd: LocalEtcd) -> None:
    _post(etcd, "/v3/kv/deleterange", {"key": _key(etcd)})


def _url(etcd: LocalEtcd) -> str:
    return f"etcd://{etcd.endpoint}/{CLUSTER}"


def test_a_new_leader_is_pushed_without_a_read(etcd: LocalEtcd) -> None:
    elect(etcd, "127.0.0.1:1001")
    watching = MasterLocator(_url(etcd), watch=True)
    polling = MasterLocator(_url(etcd))
    told: list[str | None] = []
    watching.on_change(lambda: told.append(watching.current()))
    try:
        assert watching.address == polling.address == "127.0.0.1:1001"
        elect(etcd, "127.0.0.1:1002")
        # No refresh() here: only the watch can have told it.
        assert watching.wait_moved("127.0.0.1:1001", 30.0)
        assert watching.current() == "127.0.0.1:1002" and watching.address == "127.0.0.1:1002"
        assert told[-1] == "127.0.0.1:1002"
        # Without a watch, nothing moves until a caller asks etcd.
        assert not polling.wait_moved("127.0.0.1:1001", 0.2)
        assert polling.current() == "127.0.0.1:1001"
        assert polling.refresh() == "127.0.0.1:1002"
    finally:
        watching.close()
        polling.close()


def test_a_deleted_leader_key_is_no_leader_until_the_next_election(etcd: LocalEtcd) -> None:
    elect(etcd, "127.0.0.1:1001")
    locator = MasterLocator(_url(etcd), watch=True)
    try:
        assert locator.address == "127.0.0.1:1001"
        resign(etcd)
        moved = threading.Event()
        locator.on_change(moved.set)
        # The key is gone: no leader to go to, and the address to try stays the last one.
        deadline = time.monotonic() + 30
        while locator.current() is not None:
            assert time.monotonic() < deadline, "the watch never saw the key deleted"
            time.sleep(0.01)
        assert not locator.wait_moved("127.0.0.1:1001", 0.2)
        assert locator.address == "127.0.0.1:1001"
        elect(etcd, "127.0.0.1:1003")
        assert locator.wait_moved("127.0.0.1:1001", 30.0)
        assert moved.is_set() and locator.current() == "127.0.0.1:1003"
    finally:
        locator.close()


def test_the_watch_comes_back_after_etcd_restarts(etcd: LocalEtcd) -> None:
    elect(etcd, "127.0.0.1:1001")
    locator = MasterLocator(_url(etcd), watch=True)
    try:
        assert locator.address == "127.0.0.1:1001"
        etcd.stop()
        etcd.start()
        elect(etcd, "127.0.0.1:1004")
        assert locator.wait_moved("127.0.0.1:1001", 60.0)
        assert locator.current() == "127.0.0.1:1004"
    finally:
        locator.close()


def test_close_ends_the_watch(etcd: LocalEtcd) -> None:
    elect(etcd, "127.0.0.1:1001")
    locator = MasterLocator(_url(etcd), watch=True)
    assert locator.address == "127.0.0.1:1001"
    watchers = [t for t in threading.enumerate() if t.name == "master-leader-watch"]
    assert watchers
    locator.close()
    for thread in watchers:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in watchers)


def test_what_the_watch_says_and_a_read_are_ordered_by_revision() -> None:
    """A watch that fell behind (an event of revision 5 after a read at revision 10) leaves the newer
    word; a read older than what was seen before it was sent (etcd restored from a snapshot) stands."""
    locator = MasterLocator("etcd://127.0.0.1:1/c", watch=True)
    locator._saw(10, "127.0.0.1:1002")
    locator._saw(5, "127.0.0.1:1001")
    assert locator.current() == "127.0.0.1:1002"
    locator._saw(11, None)
    assert locator.current() is None and locator.address == "127.0.0.1:1002"
    locator._saw(3, "127.0.0.1:1005", reset=True)
    assert locator.current() == "127.0.0.1:1005"
    locator.close()


def test_a_watch_follows_an_etcd_whose_history_went_back(etcd: LocalEtcd) -> None:
    """etcd's data lost (a member rebuilt, a snapshot restored): its revisions start again below what
    the locator saw; the leader it names now is believed, by the watch and by reads."""
    for n in range(5):
        elect(etcd, f"127.0.0.1:{1100 + n}")  # revisions the fresh etcd will not reach at once
    locator = MasterLocator(_url(etcd), watch=True)
    try:
        assert locator.address == "127.0.0.1:1104"
        etcd.stop()
        shutil.rmtree(etcd.dir / "data")
        etcd.start()
        elect(etcd, "127.0.0.1:1200")
        assert locator.wait_moved("127.0.0.1:1104", 60.0)
        assert locator.current() == "127.0.0.1:1200"
        assert MasterLocator(_url(etcd)).refresh() == "127.0.0.1:1200"
    finally:
        locator.close()
