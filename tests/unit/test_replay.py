from pathlib import Path

import pytest

from kvstore.errors import CorruptBlock, InvalidArgument
from kvstore.node_store import NodeStore
from kvstore.workload import TraceRequest, chat_workload, lru_prefix_hit_rate
from kvstore_client.replay import replay, request_keys
from tests.conftest import node_config


def test_replay_counts_hits_and_moves_real_bytes(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path, dram="8MiB"))
    requests = [TraceRequest(0, 0, 0, (1, 2, 3)), TraceRequest(1, 0, 0, (1, 2, 4)), TraceRequest(2, 0, 0, (1, 2, 3))]
    summary = replay(store, requests, block_bytes=4096, verify=True)
    assert (summary.requests, summary.blocks, summary.hit_blocks, summary.stored_blocks) == (3, 9, 5, 4)
    assert summary.bytes_loaded == 5 * 4096 and summary.to_dict()["hit_rate"] == pytest.approx(5 / 9, abs=1e-6)
    assert store.stats().puts == 4
    store.destroy()


def test_request_keys_are_prefix_chained() -> None:
    a = request_keys(TraceRequest(0, 0, 0, (1, 2, 3)))
    b = request_keys(TraceRequest(0, 0, 0, (1, 2, 4)))
    c = request_keys(TraceRequest(0, 0, 0, (9, 2, 3)))
    assert a[:2] == b[:2] and a[2] != b[2]
    assert not set(a) & set(c)  # same ids after a different first block are different blocks


def test_verify_catches_wrong_bytes(tmp_path: Path) -> None:
    store = NodeStore(node_config(tmp_path, dram="8MiB"))
    req = TraceRequest(0, 0, 0, (1, 2))
    replay(store, [req], block_bytes=1024)
    key = request_keys(req, "replay")[1]
    start = store.dram._data_offset + store.dram.extent(key).offset  # type: ignore[arg-type]
    store.dram._mm[start + 100] ^= 1
    with pytest.raises(CorruptBlock, match=key):
        replay(store, [req], block_bytes=1024, verify=True)
    with pytest.raises(InvalidArgument):
        replay(store, [req], block_bytes=8)
    store.destroy()


def test_replay_hit_rate_tracks_exact_lru(tmp_path: Path) -> None:
    requests = chat_workload(num_sessions=120, seed=5)
    blocks = 300
    store = NodeStore(node_config(tmp_path, dram=blocks * 1024, eviction={"high_watermark": 1.0, "low_watermark": 1.0}))
    summary = replay(store, requests, block_bytes=1024)
    # One tier, one block size, evict-to-fit: the store is an exact LRU.
    assert summary.hit_rate == pytest.approx(lru_prefix_hit_rate(requests, blocks), abs=1e-9)
    store.destroy()
