"""An engine's own prefix cache, as its KV events tell it (vLLM's ``--kv-events-config``), in the
store's block keys: so that a scheduler can tell "in this engine's GPU cache" from "in the store".

vLLM names its pages by its own hashes; the store names blocks by :func:`kvstore.keys.block_keys`
of their tokens. Each ``BlockStored`` carries the pages' tokens and their parent's hash, so the
index follows each chain from its root, computing the store's key at every page that ends a store
block (``block_tokens`` a multiple of the engine's page size), as the vLLM connector keys what it
saves. A page whose parent it never saw (events lost before it subscribed, or a gap), or that
carries extras (a LoRA, a cache salt, images: keyed by what the connector adds) is not indexed:
the engine is then simply not credited with it. ``BlockRemoved`` drops pages,
``AllBlocksCleared`` all. Pure: events in, counts out.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from typing import Any, NamedTuple

from kvstore.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored
from kvstore.keys import next_block, prefix_seed


class Applied(NamedTuple):
    """What a batch of events spoke of."""

    keys: list[str]
    """Store keys a page of which was stored or removed (stored ones only where indexed)."""
    cleared: bool
    """An ``AllBlocksCleared`` was among them."""


class EngineBlocks:
    """One engine's cache in store keys (see the module's text). Not thread-safe."""

    def __init__(self, namespace: str, block_tokens: int) -> None:
        self.namespace = namespace
        self.block_tokens = block_tokens
        self._seed = prefix_seed(block_tokens, namespace)
        self._pages: dict[BlockHash, tuple[bytes, tuple[int, ...]]] = {}
        """Page hash -> (digest of the last whole store block up to it, the tokens after that block)."""
        self._ends: dict[BlockHash, str] = {}
        """Pages that end a store block -> that block's key."""
        self._held: dict[str, int] = {}
        """Store key -> pages ending it (an engine may hold the same prefix twice)."""
        self.skipped = 0
        """Pages not indexed: their parent unknown, extras, or a page that does not divide a block."""

    def __len__(self) -> int:
        return len(self._held)

    def apply(self, events: Iterable[Any]) -> Applied:
        """Apply an engine's events (vLLM's, or any object with their fields), in order."""
        keys: list[str] = []
        cleared = False
        for event in events:
            kind = type(event).__name__
            if kind == "BlockStored" or isinstance(event, BlockStored):
                self._stored(event, keys)
            elif kind == "BlockRemoved" or isinstance(event, BlockRemoved):
                self._removed(event.block_hashes, keys)
            elif kind == "AllBlocksCleared" or isinstance(event, AllBlocksCleared):
                self.clear()
                cleared = True
        return Applied(keys, cleared)

    def clear(self) -> None:
        self._pages.clear()
        self._ends.clear()
        self._held.clear()

    def _stored(self, event: Any, keys: list[str]) -> None:
        hashes: Sequence[BlockHash] = event.block_hashes
        tokens: Sequence[int] = event.token_ids
        size = int(event.block_size) if event.block_size else (len(tokens) // max(len(hashes), 1))
        parent = event.parent_block_hash
        extras = any(getattr(event, "extra_keys", None) or ()) or getattr(event, "lora_name", None)
        state = (self._seed, ()) if parent is None else self._pages.get(parent)
        if state is None or extras or size <= 0 or self.block_tokens % size or len(tokens) != size * len(hashes):
            self.skipped += len(hashes)
            return
        digest, tail = state
        for i, page in enumerate(hashes):
            tail = (*tail, *tokens[i * size : (i + 1) * size])
            if len(tail) == self.block_tokens:
                digest, key = next_block(digest, list(tail), self.namespace)
                tail = ()
                keys.append(key)
                if page not in self._ends:
                    self._ends[page] = key
                    self._held[key] = self._held.get(key, 0) + 1
            self._pages[page] = (digest, tail)

    def _removed(self, hashes: Iterable[BlockHash], keys: list[str]) -> None:
        for page in hashes:
            self._pages.pop(page, None)
            key = self._ends.pop(page, None)
            if key is not None:
                keys.append(key)
                left = self._held[key] - 1
                if left:
                    self._held[key] = left
                else:
                    del self._held[key]

    def holds(self, key: str) -> bool:
        return key in self._held

    def held(self, keys: Sequence[str]) -> int:
        """How many leading ``keys`` the engine holds."""
        return leading(keys, self._held)


def leading(keys: Iterable[str], held: Container[str]) -> int:
    """How many of ``keys``, from the first, are in ``held``: the prefix a cache holds."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n
