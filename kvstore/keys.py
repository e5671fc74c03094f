"""Block keys: validation of user keys and prefix hashing of token sequences.

Prefix hashing chains xxh3-128 over full blocks of tokens::

    h_{-1} = xxh3_128("kvstore-prefix-v1" || u32 block_size || namespace)
    h_i    = xxh3_128(h_{i-1} || tokens of block i)

Tokens of a block are hashed as little-endian int32 when every token of that
block fits in int32, else as int64. The width depends on the values only, never
on the container's dtype, so a list, an int64 numpy array and a torch tensor of
the same tokens give the same keys, in every process, on every machine and
under any PYTHONHASHSEED. A trailing partial block gets no key. Folding the
block size into the seed keeps keys of different block sizes apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NewType

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument, InvalidKey

MAX_KEY_BYTES = 256
"""Longest key, in bytes of UTF-8."""

BlockKey = NewType("BlockKey", str)
"""A validated key: a non-empty str of at most MAX_KEY_BYTES bytes of UTF-8."""

_INT32_MAX = 2**31 - 1
_SEED_TAG = b"kvstore-prefix-v1"
_TAIL_TAG = b"kvstore-tail-v1"


def validate_key(key: object) -> BlockKey:
    """Return ``key`` as a :data:`BlockKey`, or raise :class:`InvalidKey` naming the fault.

    ``bytes`` keys must be valid UTF-8 and are decoded to ``str``.
    """
    if type(key) is str:
        # Fast path: an ASCII string has one byte of UTF-8 per character.
        if 0 < len(key) <= MAX_KEY_BYTES and key.isascii():
            return BlockKey(key)
        text = key
    elif isinstance(key, bytes | bytearray | memoryview):
        try:
            text = bytes(key).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidKey(f"key {bytes(key)[:40]!r} is not valid UTF-8: {exc.reason}") from None
    elif isinstance(key, str):
        text = str(key)
    else:
        raise InvalidKey(f"key must be str or bytes, not {type(key).__name__}")
    if not text:
        raise InvalidKey("key must not be empty")
    try:
        size = len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidKey(f"key {text[:40]!r} cannot be encoded as UTF-8: {exc.reason}") from None
    if size > MAX_KEY_BYTES:
        raise InvalidKey(f"key is {size} bytes of UTF-8, more than the limit of {MAX_KEY_BYTES}: {text[:40]!r}...")
    return BlockKey(text)


def _tokens_to_array(token_ids: Any) -> np.ndarray:
    """Turn a list, tuple, numpy array or torch tensor of token ids into a 1-D int64 array."""
    if type(token_ids).__module__.startswith("torch"):
        # Avoid importing torch: a tensor converts through its own numpy().
        token_ids = token_ids.detach().cpu().numpy()
    if isinstance(token_ids, np.ndarray):
        arr = token_ids
    elif isinstance(token_ids, Sequence) and not isinstance(token_ids, str | bytes | bytearray):
        if any(type(t) is bool or not isinstance(t, int | np.integer) for t in token_ids):
            bad = next(t for t in token_ids if type(t) is bool or not isinstance(t, int | np.integer))
            raise InvalidArgument(f"token ids must be integers, got {type(bad).__name__} {bad!r}")
        try:
            arr = np.asarray(token_ids, dtype=np.int64)
        except OverflowError:
            raise InvalidArgument("token ids must fit in int64") from None
    else:
        raise InvalidArgument(
            f"token_ids must be a list, tuple, numpy array or torch tensor, not {type(token_ids).__name__}"
        )
    if arr.ndim != 1:
        raise InvalidArgument(f"token_ids must be one-dimensional, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidArgument("token ids must fit in int64")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and int(arr.min()) < 0:
        raise InvalidArgument(f"token ids must be non-negative, got {int(arr.min())}")
    return arr


def prefix_seed(block_size: int, namespace: str = "") -> bytes:
    """The 16-byte chain seed ``h_{-1}`` for a namespace and block size."""
    if type(block_size) is not int or block_size <= 0:
        raise InvalidArgument(f"block_size must be a positive int, got {block_size!r}")
    if not isinstance(namespace, str):
        raise InvalidArgument(f"namespace must be str, not {type(namespace).__name__}")
    return xxhash.xxh3_128_digest(_SEED_TAG + block_size.to_bytes(4, "little") + namespace.encode("utf-8"))


def block_keys(token_ids: Any, block_size: int, namespace: str = "") -> list[BlockKey]:
    """One 32-hex-digit key per full block of ``token_ids``, chained by prefix.

    Keys of a token sequence start with the keys of each of its prefixes, so the
    longest stored prefix of a request is a prefix of its key list.
    """
    prev = prefix_seed(block_size, namespace)
    arr = _tokens_to_array(token_ids)
    num_blocks = arr.size // block_size
    if num_blocks == 0:
        return []
    blocks = arr[: num_blocks * block_size].reshape(num_blocks, block_size)
    narrow = blocks.max(axis=1) <= _INT32_MAX
    as32 = blocks.astype("<i4") if bool(narrow.all()) else None
    keys: list[BlockKey] = []
    for i in range(num_blocks):
        row = as32[i] if as32 is not None else (blocks[i].astype("<i4") if narrow[i] else blocks[i].astype("<i8"))
        prev = xxhash.xxh3_128_digest(prev + row.tobytes())
        keys.append(BlockKey(prev.hex()))
    return keys


def tail_key(token_ids: Any, block_size: int, namespace: str = "") -> BlockKey | None:
    """The key of the trailing partial block of ``token_ids``, or None when the last block is full.

    It chains on the key of the last full block (the seed when there is none) under a
    tag of its own, so it never equals a full block's key, and it covers the tail's
    length and tokens: equal token sequences give equal tail keys, any other sequence
    another one. The KV of a partial block is what a prefill hands a decode beside the
    full blocks; it is never a prefix of another request's blocks.
    """
    seed = prefix_seed(block_size, namespace)
    arr = _tokens_to_array(token_ids)
    num_full = arr.size // block_size
    tail = arr[num_full * block_size :]
    if tail.size == 0:
        return None
    keys = block_keys(arr[: num_full * block_size], block_size, namespace)
    prev = bytes.fromhex(keys[-1]) if keys else seed
    width = "<i4" if int(tail.max()) <= _INT32_MAX else "<i8"
    body = _TAIL_TAG + tail.size.to_bytes(4, "little") + tail.astype(width).tobytes()
    return BlockKey(xxhash.xxh3_128_digest(prev + body).hex())


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 checksum kept with every block for end-to-end integrity."""
    return xxhash.xxh3_64_intdigest(data)
