"""Same-host clients move block bytes through the daemons' arenas; the network carries only frames."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvstore.config import ClientConfig
from kvstore.errors import CorruptBlock
from kvstore.keys import checksum
from kvstore.protocol import CommitBlocks, Message, OkReply, PutRevoke, PutStart, PutStartReply, WriteReply
from kvstore_cli.cluster import LocalCluster
from kvstore_client.dataplane import ShmPath
from kvstore_client.store import Store
from transfer import topology
from transfer.rpc import Connection
from transfer.transports.shm import ShmTransport

KB = 1024


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="4MiB", ssd="16MiB") as c:
        yield c


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[type[Message]]:
    """The type of every request the client sends."""
    kinds: list[type[Message]] = []
    call = Connection.call
    exchange = Connection.exchange

    def record_call(self: Connection, message: Message, *args: Any, **kwargs: Any) -> Any:
        kinds.append(type(message))
        return call(self, message, *args, **kwargs)

    def record_exchange(self: Connection, message: Message, *args: Any, **kwargs: Any) -> Any:
        kinds.append(type(message))
        return exchange(self, message, *args, **kwargs)

    monkeypatch.setattr(Connection, "call", record_call)
    monkeypatch.setattr(Connection, "exchange", record_exchange)
    return kinds


def test_nodes_advertise_their_host_arena_and_nics(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address) as store:
        nodes = store.nodes()
    assert [n.node_id for n in nodes] == ["node0", "node1"] and all(n.up for n in nodes)
    for node, address in zip(nodes, cluster.daemon_addresses, strict=True):
        assert node.address == address and node.rails == [address]
        assert node.host_id == topology.host_id()
        assert topology.same_file(node.arena_path, node.arena_inode)
        assert any(nic.address == "127.0.0.1" for nic in node.nics)


def test_same_host_puts_and_gets_send_no_block_bytes(cluster: LocalCluster, sent: list[type[Message]]) -> None:
    rng = np.random.default_rng(5)
    blocks = rng.integers(0, 256, (24, 40 * KB), dtype=np.uint8)
    keys = [f"shm-{i}" for i in range(len(blocks))]
    with Store.connect(cluster.master_address) as store:
        for s in range(0, len(keys), 8):
            store.put_many(zip(keys[s : s + 8], blocks[s : s + 8], strict=True))
        out = np.zeros_like(blocks)
        assert store.get_many_into(keys, list(out), verify=True) == [40 * KB] * len(keys)
        assert np.array_equal(out, blocks)
        assert store.get(keys[0]) == blocks[0].tobytes()
        store.remove_many(keys)
    names = {k.__name__ for k in sent}
    assert "CommitBlocks" in names and not names & {"WriteBlocks", "ReadBlocks"}, names


def test_tcp_transport_and_ssd_blocks_still_use_the_network(cluster: LocalCluster, sent: list[type[Message]]) -> None:
    data = b"t" * (8 * KB)
    with Store.connect(cluster.master_address, ClientConfig(transport="tcp")) as store:
        store.put("over-tcp", data)
        with Store.connect(cluster.master_address, ClientConfig(transport="tcp", location_hints=0)) as other:
            assert other.get("over-tcp") == data
        store.remove("over-tcp")
    assert {"WriteGranted", "ReadBlocks"} <= {k.__name__ for k in sent}  # a one-trip put over TCP
    # Blocks demoted to SSD have no extent to copy: a same-host client reads them from the daemon.
    rng = np.random.default_rng(6)
    blocks = rng.integers(0, 256, (200, 64 * KB), dtype=np.uint8)  # 12.5 MiB > 8 MiB of DRAM
    keys = [f"shm-ssd-{i}" for i in range(len(blocks))]
    with Store.connect(cluster.master_address) as store:
        for s in range(0, len(keys), 20):
            store.put_many(zip(keys[s : s + 20], blocks[s : s + 20], strict=True))
        sent.clear()
        out = np.zeros_like(blocks)
        got = store.get_many_into(keys, list(out), verify=True)
        assert sum(n is not None for n in got) >= 180
        assert all(np.array_equal(out[i], blocks[i]) for i, n in enumerate(got) if n is not None)
        assert any(k.__name__ == "ReadBlocks" for k in sent)
        store.remove_many(keys)


def test_bytes_that_do_not_match_their_checksum_are_never_committed(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address) as store:
        reply: PutStartReply = store._call(PutStart(["torn"], [4 * KB], 1, None, False), PutStartReply)
        [replica] = reply.tickets()[0].replicas
        path = store._path(replica.node_id, replica.address)
        assert isinstance(path, ShmPath)
        ShmTransport.write(path.arena, replica.offset, memoryview(b"x" * (4 * KB)))
        answer = path.pool.call(
            CommitBlocks(["torn"], [replica.offset], [4 * KB], [checksum(b"y" * (4 * KB))], False), WriteReply
        )
        assert answer.codes == [CorruptBlock.code] and "checksum" in answer.errors[0]
        store._call(PutRevoke(["torn"]), OkReply)
        assert store.get("torn") is None
