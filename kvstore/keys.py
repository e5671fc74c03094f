"""Block keys: validation of user keys and prefix hashing of token sequences.

Prefix hashing chains xxh3-128 over full blocks of tokens::

    h_{-1} = xxh3_128("kvstore-prefix-v1" || u32 block_size || namespace)
    h_i    = xxh3_128(h_{i-1} || tokens of block i)
    h_i    = xxh3_128("kvstore-extra-v1" || h_i || u32 len || extra_i)   (only where block i has an extra)
    key_i  = namespace + "/" + hex(h_i)        (hex(h_i) alone when the namespace is "")

An *extra* is whatever besides the tokens changes a block's contents: for KV, a
LoRA adapter or a cache salt (on block 0, so that every later block differs too)
or the images whose placeholders fall in a block. Blocks without one hash as if
there were no extras at all.

The namespace is spelled out in front of each key so that operators can list
and evict one namespace by prefix (``kvstore keys --prefix llama-3-8b/fp16/``);
it is also hashed into the seed, so the hex part alone already differs between
namespaces. Namespaces nest by ``/``: the prefix ``llama-3-8b/`` covers
``llama-3-8b/fp16`` and ``llama-3-8b/bf16``. A namespace is at most
:data:`MAX_NAMESPACE_BYTES` bytes of UTF-8, holds no control character and
does not end with ``/`` (see :func:`validate_namespace`).

Tokens of a block are hashed as little-endian int32 when every token of that
block fits in int32, else as int64. The width depends on the values only, never
on the container's dtype, so a list, an int64 numpy array and a torch tensor of
the same tokens give the same keys, in every process, on every machine and
under any PYTHONHASHSEED. A trailing partial block gets no key. Folding the
block size into the seed keeps keys of different block sizes apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any, NewType

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument, InvalidKey

MAX_KEY_BYTES = 256
"""Longest key, in bytes of UTF-8."""

BlockKey = NewType("BlockKey", str)
"""A validated key: a non-empty str of at most MAX_KEY_BYTES bytes of UTF-8."""

_HEX_DIGITS = 32
MAX_NAMESPACE_BYTES = MAX_KEY_BYTES - _HEX_DIGITS - 1
"""Longest namespace, in bytes of UTF-8: ``<namespace>/`` and 32 hex digits make one key."""
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")

_INT32_MAX = 2**31 - 1
_SEED_TAG = b"kvstore-prefix-v1"
_TAIL_TAG = b"kvstore-tail-v1"
_EXTRA_TAG = b"kvstore-extra-v1"


def validate_keys(keys: Iterable[object]) -> list[BlockKey]:
    """:func:`validate_key` of each key, all of them before anything uses one; the common case
    (an ASCII str of a valid length) checked inline, without a call per key."""
    return [
        key if type(key) is str and 0 < len(key) <= MAX_KEY_BYTES and key.isascii() else validate_key(key)  # type: ignore[misc]
        for key in keys
    ]


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


def validate_namespace(namespace: object) -> str:
    """Return ``namespace``, or raise :class:`InvalidKey` if the keys it prefixes could not be valid keys.

    ``""`` is no namespace (bare hex keys). Otherwise it must fit :data:`MAX_NAMESPACE_BYTES`
    bytes of UTF-8, hold no control character (keys are listed one a line, and a newline
    would split one) and not end with ``/`` (the separator is added to it).
    """
    if not isinstance(namespace, str):
        raise InvalidKey(f"namespace must be str, not {type(namespace).__name__}")
    try:
        size = len(namespace.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidKey(f"namespace {namespace[:40]!r} cannot be encoded as UTF-8: {exc.reason}") from None
    if size > MAX_NAMESPACE_BYTES:
        raise InvalidKey(
            f"namespace is {size} bytes of UTF-8, more than the limit of {MAX_NAMESPACE_BYTES} (a key is"
            f" '<namespace>/' and {_HEX_DIGITS} hex digits, at most {MAX_KEY_BYTES} bytes): {namespace[:40]!r}..."
        )
    control = _CONTROL.search(namespace)
    if control is not None:
        raise InvalidKey(f"namespace {namespace[:40]!r} holds the control character {control.group()!r}")
    if namespace.endswith("/"):
        raise InvalidKey(f"namespace {namespace!r} ends with '/'; keys are '<namespace>/<hex>', so leave it out")
    return namespace


def key_digest(key: str) -> bytes:
    """The 16-byte chain hash ``h_i`` a key of :func:`block_keys` or :func:`tail_key` ends with."""
    try:
        digest = bytes.fromhex(key.rpartition("/")[2])
    except ValueError:
        digest = b""
    if len(digest) != _HEX_DIGITS // 2:  # fromhex also skips spaces: count what it made
        raise InvalidKey(f"key {key[:80]!r} does not end with {_HEX_DIGITS} hex digits")
    return digest


def prefix_seed(block_size: int, namespace: str = "") -> bytes:
    """The 16-byte chain seed ``h_{-1}`` for a namespace and block size."""
    if type(block_size) is not int or block_size <= 0:
        raise InvalidArgument(f"block_size must be a positive int, got {block_size!r}")
    validate_namespace(namespace)
    return xxhash.xxh3_128_digest(_SEED_TAG + block_size.to_bytes(4, "little") + namespace.encode("utf-8"))


def _key(namespace: str, digest: bytes) -> BlockKey:
    return BlockKey(f"{namespace}/{digest.hex()}" if namespace else digest.hex())


def _check_extras(extras: Sequence[bytes] | None) -> Sequence[bytes]:
    if extras is None:
        return ()
    if isinstance(extras, (bytes, str)) or not all(isinstance(e, bytes) for e in extras):
        raise InvalidArgument("extras must be a sequence of bytes, one per block (b'' for none)")
    return extras


def _chain(arr: np.ndarray, block_size: int, seed: bytes, extras: Sequence[bytes] = ()) -> list[bytes]:
    """The digests ``h_0 .. h_{n-1}`` of the full blocks of ``arr``, block ``i`` with ``extras[i]`` if any."""
    num_blocks = arr.size // block_size
    if num_blocks == 0:
        return []
    blocks = arr[: num_blocks * block_size].reshape(num_blocks, block_size)
    narrow = blocks.max(axis=1) <= _INT32_MAX
    as32 = blocks.astype("<i4") if bool(narrow.all()) else None
    digests: list[bytes] = []
    prev = seed
    for i in range(num_blocks):
        row = as32[i] if as32 is not None else (blocks[i].astype("<i4") if narrow[i] else blocks[i].astype("<i8"))
        prev = xxhash.xxh3_128_digest(prev + row.tobytes())
        if i < len(extras) and extras[i]:
            prev = xxhash.xxh3_128_digest(_EXTRA_TAG + prev + len(extras[i]).to_bytes(4, "little") + extras[i])
        digests.append(prev)
    return digests


def block_keys(
    token_ids: Any, block_size: int, namespace: str = "", *, extras: Sequence[bytes] | None = None
) -> list[BlockKey]:
    """One key per full block of ``token_ids``, chained by prefix: ``<namespace>/<32 hex digits>``.

    Without a namespace a key is the 32 hex digits alone. Keys of a token sequence
    start with the keys of each of its prefixes, so the longest stored prefix of a
    request is a prefix of its key list. ``extras[i]`` (bytes; ``b""`` or past the
    end: none) goes into block ``i``'s hash and so into every later one. Raises
    :class:`InvalidKey` for a namespace that :func:`validate_namespace` refuses,
    :class:`InvalidArgument` for bad tokens or extras.
    """
    seed = prefix_seed(block_size, namespace)
    chain = _chain(_tokens_to_array(token_ids), block_size, seed, _check_extras(extras))
    return [_key(namespace, digest) for digest in chain]


def next_block(prev: bytes, tokens: Any, namespace: str = "") -> tuple[bytes, BlockKey]:
    """The digest and key of the block of ``tokens`` (one whole block, no extras) that follows the
    block whose digest is ``prev`` (:func:`prefix_seed` for a first block): what :func:`block_keys`
    gives, one block at a time, for a follower that learns a prefix block by block."""
    arr = _tokens_to_array(tokens)
    if arr.size == 0:
        raise InvalidArgument("a block has at least one token")
    [digest] = _chain(arr, arr.size, prev)
    return digest, _key(namespace, digest)


def tail_key(
    token_ids: Any, block_size: int, namespace: str = "", *, extras: Sequence[bytes] | None = None
) -> BlockKey | None:
    """The key of the trailing partial block of ``token_ids``, or None when the last block is full.

    It chains on the key of the last full block (the seed when there is none) under a
    tag of its own, so it never equals a full block's key, and it covers the tail's
    length and tokens: equal token sequences give equal tail keys, any other sequence
    another one. The KV of a partial block is what a prefill hands a decode beside the
    full blocks; it is never a prefix of another request's blocks. ``extras`` as for
    :func:`block_keys`, the tail's being ``extras[num_full_blocks]``.
    """
    seed = prefix_seed(block_size, namespace)
    arr = _tokens_to_array(token_ids)
    num_full = arr.size // block_size
    tail = arr[num_full * block_size :]
    if tail.size == 0:
        return None
    checked = _check_extras(extras)
    digests = _chain(arr[: num_full * block_size], block_size, seed, checked)
    prev = digests[-1] if digests else seed
    width = "<i4" if int(tail.max()) <= _INT32_MAX else "<i8"
    body = _TAIL_TAG + tail.size.to_bytes(4, "little") + tail.astype(width).tobytes()
    extra = checked[num_full] if num_full < len(checked) else b""
    if extra:  # the tail's own extra (a salt on a prompt shorter than one block)
        body += _EXTRA_TAG + len(extra).to_bytes(4, "little") + extra
    return _key(namespace, xxhash.xxh3_128_digest(prev + body))


def checksum(data: bytes | bytearray | memoryview) -> int:
    """The xxh3-64 checksum kept with every block for end-to-end integrity."""
    return xxhash.xxh3_64_intdigest(data)
