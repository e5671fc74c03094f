"""The one error hierarchy of kvstore.

Every error raised on purpose by kvstore derives from :class:`KVStoreError`.
Categories also inherit the matching built-in exception so that callers can
catch either (``NotFound`` is a ``KeyError``, ``Timeout`` a ``TimeoutError``).
Each class carries a stable numeric ``code`` that travels on the wire; codes are
never reused or renumbered. An expected outcome (a miss, a key that already
exists) is a return value, never an exception.
"""

from __future__ import annotations

from typing import ClassVar


class KVStoreError(Exception):
    """Root of every kvstore error. ``code`` is stable across versions."""

    code: ClassVar[int] = 1

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type[KVStoreError], tuple[str]]:
        return (type(self), (self.message,))


class InvalidArgument(KVStoreError, ValueError):
    """A caller passed a value that can never be valid (wrong type, range or form)."""

    code = 2


class InvalidKey(InvalidArgument):
    """A key that is empty, too long, not UTF-8, or not ``str``/``bytes``."""

    code = 3


class BufferTooSmall(InvalidArgument):
    """A destination buffer cannot hold the block being read into it."""

    code = 4


class ConfigError(InvalidArgument):
    """A configuration value or environment override is unknown or malformed."""

    code = 5


class NotFound(KVStoreError, KeyError):
    """An operation that requires an existing object found none."""

    code = 10


class CapacityError(KVStoreError):
    """A tier cannot make room: the object is larger than the tier, or everything
    that could be evicted is pinned or leased."""

    code = 20


class QuotaExceeded(CapacityError):
    """A tenant's put would take it past its byte quota, even after evicting its own unpinned blocks."""

    code = 21


class ResourceShortage(CapacityError):
    """The machine has less shared memory, memory or disk than a tier was configured with."""

    code = 22


class CorruptBlock(KVStoreError):
    """A block's bytes do not match the checksum recorded when it was written."""

    code = 30


class CorruptStore(KVStoreError):
    """A tier's backing file (shared-memory arena, LMDB environment) is truncated,
    foreign or damaged, so it cannot be opened safely."""

    code = 31


class StoreBusy(KVStoreError, BlockingIOError):
    """A tier's backing file is held open for writing by another process."""

    code = 32


class StoreClosed(KVStoreError):
    """An operation on a store, tier or connection that was already closed."""

    code = 33


class Timeout(KVStoreError, TimeoutError):
    """A wait ran past its deadline."""

    code = 40


class ConnectionFailed(KVStoreError, ConnectionError):
    """A peer could not be reached or dropped the connection."""

    code = 41


class ConnectionRefused(ConnectionFailed):
    """Nothing listens at a peer's address: its process is gone (or not started yet). Raised where
    a connection is opened; a master fences a node whose daemon's port answers this (see
    ``MasterConfig.fence_refused``)."""

    code = 48


class RetryLater(KVStoreError):
    """The key is being moved, removed or written right now; the same call may succeed shortly."""

    code = 43


class NotLeader(RetryLater):
    """This master is not the cluster's leader (a standby, or a leader whose etcd lease ran out):
    it runs nothing. A client given ``etcd://`` resolves the leader again and retries."""

    code = 46


class NotReady(RetryLater):
    """The master is taking over and rebuilding its table from the daemons' inventories; until
    the nodes it expects are back (or a bounded wait passes) it answers this rather than a miss."""

    code = 47


class NoNodes(KVStoreError):
    """No storage node is up to take or serve the request."""

    code = 44


class GrantExpired(KVStoreError):
    """Granted write space that has ended (expired, returned, or unknown to a restarted master)."""

    code = 45


class ProtocolError(KVStoreError):
    """A frame or message that does not follow the wire protocol."""

    code = 42


class AuthFailed(KVStoreError, PermissionError):
    """The peer could not be authenticated: no credential where one is required, an unknown
    tenant, a wrong proof, an expired ticket, or a server that does not authenticate at all."""

    code = 50


class PermissionDenied(KVStoreError, PermissionError):
    """An authenticated peer asked for an operation its identity is not allowed."""

    code = 51


def _all_subclasses(cls: type[KVStoreError]) -> list[type[KVStoreError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out.extend(_all_subclasses(sub))
    return out


def _build_registry() -> dict[int, type[KVStoreError]]:
    registry: dict[int, type[KVStoreError]] = {}
    for cls in _all_subclasses(KVStoreError):
        other = registry.setdefault(cls.code, cls)
        assert other is cls, f"error code {cls.code} used by {other.__name__} and {cls.__name__}"
    return registry


CODE_TO_ERROR: dict[int, type[KVStoreError]] = _build_registry()


def error_from_code(code: int, message: str) -> KVStoreError:
    """Rebuild the typed error for a wire ``code``; unknown codes become the root class."""
    return CODE_TO_ERROR.get(code, KVStoreError)(message)
