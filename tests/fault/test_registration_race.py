"""A drop that lands between a daemon's inventory and the master's reading of it: the master must not
adopt the block again from the inventory (a removed key back in the table, its extent believed taken
by bytes that are gone: shared-memory readers copied stale and foreign bytes from it in bench.chaos,
after a partition between a daemon and the masters healed)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from kvstore.config import ClientConfig, DramConfig, SsdConfig
from kvstore.errors import ConnectionFailed, KVStoreError
from kvstore.protocol import Heartbeat, Message
from kvstore_cli.cluster import LocalCluster
from kvstore_client import Store
from server.daemon.master_link import MasterLink
from server.daemon.service import DaemonServer
from server.daemon.storage import DaemonStorage

MB = 1 << 20


def test_a_drop_made_while_the_inventory_is_read_is_not_undone_by_it(tmp_path: Path) -> None:
    storage = DaemonStorage(DramConfig(capacity=4 * MB, name="racer", shm_dir=tmp_path, prefault=False),
                            SsdConfig(capacity=0))  # fmt: skip
    server = DaemonServer(storage, node_id="racer")
    server.start()
    with LocalCluster(0) as cluster:
        link = MasterLink(cluster.master_address, "racer", server.address, storage, timeout=5.0,
                          before_register=server.reset_grants, registering=storage.registering)  # fmt: skip
        server.master = link
        link.start()
        removed: list[object] = []
        try:
            assert link.registered.wait(10)
            store = Store.connect(cluster.master_address, ClientConfig(transport="tcp", timeout_s=5.0))
            store.put("k", b"v" * 4096)
            real, raced = storage.inventory, threading.Event()

            def remove() -> None:
                try:
                    removed.append(store.remove("k"))
                except KVStoreError as exc:  # the daemon refused the drop for now: the remove is unsure
                    removed.append(exc)

            def inventory() -> list:  # type: ignore[type-arg]
                taken = real()
                if not raced.is_set() and any(item.key == "k" for item in taken):
                    raced.set()  # a client removes "k" now, while this inventory is on its way
                    racer = threading.Thread(target=remove)
                    racer.start()
                    racer.join(3.0)
                return taken

            storage.inventory = inventory  # type: ignore[method-assign]
            registrations = link.registrations
            call = link._conn.call  # a heartbeat fails (the master out of reach): the daemon registers again

            def cut_once(message: Message, expect: type, **kw: Any) -> Any:
                if isinstance(message, Heartbeat) and not raced.is_set():
                    raise ConnectionFailed("cut off for the test")
                return call(message, expect, **kw)

            link._conn.call = cut_once  # type: ignore[method-assign]
            deadline = time.monotonic() + 15
            while link.registrations == registrations:
                assert time.monotonic() < deadline, "the daemon did not register again"
                time.sleep(0.05)
            assert raced.is_set() and removed, removed
            time.sleep(0.5)  # the drops the registration's answer asked for
            # The remove was acknowledged or left unsure; either way "k" is gone, from the master and the daemon.
            assert store.exists("k") is False and store.get("k") is None, removed
            assert all(item.key != "k" for item in real())
            store.close()
        finally:
            link.stop()
            server.stop()
            storage.close()
