"""An engine's KV events, indexed in store keys: the keys the index credits are exactly those
block_keys gives the tokens the engine holds, through chained batches, removals, clears, pages
of several sizes, and events it cannot place."""

from __future__ import annotations

import hashlib

from kvstore.engine_blocks import EngineBlocks
from kvstore.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvstore.keys import block_keys

NS = "llama/fp16"


def page_hash(tokens: list[int], page: int) -> bytes:
    """An engine's hash of the page ending at ``page`` (any chained hash will do)."""
    return hashlib.sha256(repr(tokens[: (page + 1) * 16]).encode()).digest()


def stored(tokens: list[int], first: int, last: int, size: int = 16, **extra: object) -> BlockStored:
    """vLLM's event for pages ``first`` .. ``last`` - 1 of ``tokens``."""
    hashes = [page_hash(tokens, p) for p in range(first, last)]
    parent = page_hash(tokens, first - 1) if first else None
    event = BlockStored(hashes, parent, tokens[first * size : last * size], size, None, "GPU", None)
    for k, v in extra.items():
        setattr(event, k, v)
    return event


def test_chained_batches_credit_each_store_block_its_last_page_ends() -> None:
    tokens = [(i * 7) % 300 + 1 for i in range(100)]
    keys = block_keys(tokens, 32, NS)  # 3 store blocks of 2 pages of 16
    index = EngineBlocks(NS, 32)
    index.apply([stored(tokens, 0, 3)])
    assert index.held(keys) == 1  # pages 0-2: the first block whole, the second half
    index.apply([stored(tokens, 3, 6)])
    assert index.held(keys) == 3 and len(index) == 3
    index.apply([BlockRemoved([page_hash(tokens, 3)], "GPU")])  # the page ending block 1
    assert index.held(keys) == 1 and index.holds(keys[2])
    index.apply([AllBlocksCleared()])
    assert index.held(keys) == 0 and len(index) == 0


def test_a_page_whose_parent_was_never_seen_is_not_credited() -> None:
    tokens = list(range(1, 65))
    index = EngineBlocks(NS, 32)
    index.apply([stored(tokens, 2, 4)])  # its parent, page 1, was never told
    assert index.held(block_keys(tokens, 32, NS)) == 0 and index.skipped == 2
    index.apply([stored(tokens, 0, 2), stored(tokens, 2, 4)])
    assert index.held(block_keys(tokens, 32, NS)) == 2


def test_pages_the_size_of_a_block_and_pages_that_do_not_divide_it() -> None:
    tokens = list(range(5, 69))
    same = EngineBlocks(NS, 16)
    same.apply([stored(tokens, 0, 4)])
    assert same.held(block_keys(tokens, 16, NS)) == 4
    odd = EngineBlocks(NS, 24)  # 16-token pages cannot end 24-token blocks
    odd.apply([stored(tokens, 0, 4)])
    assert len(odd) == 0 and odd.skipped == 4


def test_blocks_with_extras_are_not_credited() -> None:
    tokens = list(range(1, 33))
    index = EngineBlocks(NS, 32)
    index.apply([stored(tokens, 0, 2, lora_name="adapter-a")])
    index.apply([stored(tokens, 0, 2, extra_keys=[("salt",), None])])
    assert index.held(block_keys(tokens, 32, NS)) == 0
    index.apply([stored(tokens, 0, 2, extra_keys=[None, None])])  # vLLM's way of saying "none"
    assert index.held(block_keys(tokens, 32, NS)) == 1


def test_the_same_prefix_held_twice_stays_until_both_go() -> None:
    tokens = list(range(1, 33))
    index = EngineBlocks(NS, 32)
    other = [page_hash(tokens, 0) + b"x", page_hash(tokens, 1) + b"x"]
    index.apply([stored(tokens, 0, 2), BlockStored(other, None, tokens, 16, None, "CPU", None)])
    key = block_keys(tokens, 32, NS)
    index.apply([BlockRemoved([page_hash(tokens, 1)], "GPU")])
    assert index.held(key) == 1
    index.apply([BlockRemoved(other, "CPU")])
    assert index.held(key) == 0
