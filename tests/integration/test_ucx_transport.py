"""The UCX data plane between real processes (skipped where UCXX is not installed)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvstore.config import ClientConfig
from kvstore.errors import CorruptBlock
from kvstore.keys import checksum
from kvstore.protocol import Message, OkReply, PutRevoke, PutStart, PutStartReply, WriteBlocks
from kvstore_cli.cluster import LocalCluster
from kvstore_client.dataplane import ShmPath, UcxPath
from kvstore_client.store import Store
from transfer import topology
from transfer.rpc import Connection
from transfer.transports import ucx

pytestmark = pytest.mark.skipif(not ucx.available(), reason="UCXX (ucxx-cu12) is not installed")
KB = 1024


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="16MiB", daemon_args=("--ucx-port", "0")) as c:
        yield c


def test_put_and_get_over_ucx_send_no_block_bytes_over_tcp(
    cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    sent: list[str] = []
    call, exchange = Connection.call, Connection.exchange

    def record_call(self: Connection, message: Message, *args: Any, **kwargs: Any) -> Any:
        sent.append(type(message).__name__)
        return call(self, message, *args, **kwargs)

    def record_exchange(self: Connection, message: Message, *args: Any, **kwargs: Any) -> Any:
        sent.append(type(message).__name__)
        return exchange(self, message, *args, **kwargs)

    monkeypatch.setattr(Connection, "call", record_call)
    monkeypatch.setattr(Connection, "exchange", record_exchange)
    rng = np.random.default_rng(7)
    blocks = rng.integers(0, 256, (32, 96 * KB + 5), dtype=np.uint8)
    keys = [f"ucx-{i}" for i in range(len(blocks))]
    with Store.connect(cluster.master_address, ClientConfig(transport="ucx")) as store:
        assert all(n.ucx_address for n in store.nodes())
        for s in range(0, len(keys), 8):
            store.put_many(zip(keys[s : s + 8], blocks[s : s + 8], strict=True))
        out = np.zeros_like(blocks)
        assert store.get_many_into(keys, list(out), verify=True) == [blocks.shape[1]] * len(keys)
        assert np.array_equal(out, blocks)
        assert store.get_many(["ucx-absent", keys[3]]) == [None, blocks[3].tobytes()]
        store.remove_many(keys)
    assert not {"WriteBlocks", "ReadBlocks"} & set(sent), sent


def test_auto_uses_ucx_only_between_rdma_hosts(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address, ClientConfig(transport="auto")) as store:
        node = store.nodes()[0]
        path = store._path(node.node_id, node.address)
        # Same host: the arena, else UCX only where both ends have RDMA.
        assert isinstance(path, ShmPath) or isinstance(path, UcxPath) == (node.rdma and topology.has_rdma())
    with Store.connect(cluster.master_address, ClientConfig(transport="tcp")) as store:
        assert not isinstance(store._path(node.node_id, node.address), UcxPath | ShmPath)


def test_a_block_that_fails_its_checksum_is_refused_over_ucx(cluster: LocalCluster) -> None:
    with Store.connect(cluster.master_address, ClientConfig(transport="ucx")) as store:
        reply: PutStartReply = store._call(PutStart(["ucx-torn"], [4 * KB], 1, None, False), PutStartReply)
        [replica] = reply.tickets()[0].replicas
        path = store._path(replica.node_id, replica.address)
        assert isinstance(path, UcxPath)
        message = WriteBlocks(["ucx-torn"], [replica.offset], [4 * KB], [checksum(b"y" * 4 * KB)], False)
        answer = path.client.write(message, path.ucx_address, [memoryview(b"x" * 4 * KB)])
        assert answer.codes == [CorruptBlock.code]
        store._call(PutRevoke(["ucx-torn"]), OkReply)
        assert store.get("ucx-torn") is None
