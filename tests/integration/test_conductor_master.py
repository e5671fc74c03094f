"""The conductor's calls to a real master, on its event loop (no workers: what it asks the master
alone): where a prompt's stored prefix is, by node, through a master that authenticates; a copy of
blocks to a node; load-only routing when no master answers; and with HA masters on etcd, the first
lookup after the leader died finds its successor."""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator

import pytest

from kvstore.config import ConductorConfig
from kvstore.keys import block_keys
from kvstore.protocol import NodePrefix, PrefixMatch
from kvstore.scheduling import Locality
from kvstore_cli.cluster import LocalCluster, LocalEtcd
from kvstore_client.store import PutOptions, Store
from server.conductor.service import Conductor

BT = 16
NAMESPACE = "conductor-master"


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(2, dram="32MiB", authenticate=True) as c:
        yield c


def conductor(master: str, secret_file: str | None = None) -> Conductor:
    """A conductor in front of no worker it will call: its lookups and copies are what is tested."""
    config = ConductorConfig(master=master, cluster_secret_file=secret_file, openai=["http://127.0.0.1:9"])
    c = Conductor(config)
    c.namespace, c.block_tokens = NAMESPACE, BT
    return c


def prompt(store: Store, name: str, blocks: int, stored: int, node: str) -> list[str]:
    """The keys of a prompt of ``blocks`` blocks whose first ``stored`` are stored on ``node``."""
    keys = [str(k) for k in block_keys(list(range(BT * blocks)), BT, f"{NAMESPACE}-{name}")]
    store.put_many([(k, b"v" * 4096) for k in keys[:stored]], PutOptions(preferred_node=node))
    return keys


async def test_a_lookup_finds_the_stored_prefix_by_node_and_a_copy_goes_to_another_node(
    cluster: LocalCluster,
) -> None:
    with Store.connect(cluster.master_address, cluster.client_config()) as store:
        keys = prompt(store, "lookup", 6, 4, "node0")
        c = conductor(cluster.master_address, str(cluster.secret_file))
        try:
            assert await c.locality(keys) == Locality(4 * BT, {"node0": 4 * BT})
            assert c.master_reachable
            await c._replicate(keys[:4], "node1", 1 << 20)
            assert c.metrics.registry.get_sample_value("kvstore_conductor_replicated_blocks_total") == 4
            assert store.match_prefix_nodes(keys) == PrefixMatch(4, {
                "node0": NodePrefix(dram=4, total=4), "node1": NodePrefix(dram=4, total=4),
            })  # fmt: skip
            assert await c.locality(keys) == Locality(4 * BT, {"node0": 4 * BT, "node1": 4 * BT})
        finally:
            await c.stop()


async def test_no_master_answering_means_load_only_routing() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"  # nothing listens here once closed
    c = conductor(dead)
    try:
        began = time.monotonic()
        assert await c.locality(["a", "b"]) is None
        assert time.monotonic() - began < 2 * c.config.master_timeout_s
        assert not c.master_reachable
    finally:
        await c.stop()


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (Debian: apt install etcd-server)")
@pytest.mark.timeout(120)
async def test_the_first_lookup_after_the_leader_died_finds_its_successor(etcd: LocalEtcd) -> None:
    """One attempt per lookup (a lookup is worth no wait), yet the first after a failover answers:
    its connection to the dead leader refused, it asks the leader etcd names, at once."""
    with (
        LocalCluster(1, dram="32MiB", etcd=etcd.endpoint, cluster_id="conductor-ha", masters=2) as ha,
        Store.connect(ha.master_address) as store,
    ):
        keys = prompt(store, "failover", 4, 3, "node0")
        c = conductor(ha.master_address)
        try:
            assert await c.locality(keys) == Locality(3 * BT, {"node0": 3 * BT})
            old = ha.leader_index()
            ha.kill_ha_master(old)
            deadline = time.monotonic() + 30
            while ha.leader_index() == old or store.match_prefix(keys) != 3:  # the successor serves
                assert time.monotonic() < deadline, "no successor served the stored blocks"
                time.sleep(0.05)
            assert await c.locality(keys) == Locality(3 * BT, {"node0": 3 * BT})
            assert c.master_reachable
        finally:
            await c.stop()
