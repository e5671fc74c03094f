"""Mooncake Store's Python types, as ``mooncake.store`` exports them: error codes, enums,
``ReplicateConfig`` (fields checked on assignment, TypeError as pybind11 raises), ``BufferHandle``,
and the registry of buffers whose raw addresses ``put_from``/``get_into`` may use.
"""

from __future__ import annotations

import bisect
import ctypes
import enum
import re
import threading
from collections.abc import Callable
from typing import Any

from kvstore.buffers import as_view
from kvstore.errors import (
    AuthFailed,
    CapacityError,
    ConnectionFailed,
    CorruptBlock,
    InvalidArgument,
    KVStoreError,
    NoNodes,
    NotFound,
    PermissionDenied,
    QuotaExceeded,
    RetryLater,
    StoreClosed,
    Timeout,
)


class ErrorCode(enum.IntEnum):
    """Mooncake's error codes (``mooncake-store/include/types.h``), those this drop-in returns."""

    OK = 0
    INTERNAL_ERROR = -1
    BUFFER_OVERFLOW = -10
    SEGMENT_NOT_FOUND = -101
    NO_AVAILABLE_HANDLE = -200
    INVALID_KEY = -400
    INVALID_PARAMS = -600
    ILLEGAL_CLIENT = -601
    OBJECT_NOT_FOUND = -704
    OBJECT_ALREADY_EXISTS = -705
    OBJECT_HAS_LEASE = -706
    LEASE_EXPIRED = -707
    OBJECT_REPLICA_BUSY = -714
    TRANSFER_FAIL = -800
    CHECKSUM_MISMATCH = -801
    RPC_FAIL = -900
    RPC_TIMEOUT = -901
    TENANT_QUOTA_EXCEEDED = -1700


_CODES: tuple[tuple[type[KVStoreError], ErrorCode], ...] = (
    (QuotaExceeded, ErrorCode.TENANT_QUOTA_EXCEEDED),  # before CapacityError, its base
    (CapacityError, ErrorCode.NO_AVAILABLE_HANDLE),
    (NoNodes, ErrorCode.NO_AVAILABLE_HANDLE),
    (InvalidArgument, ErrorCode.INVALID_PARAMS),  # also InvalidKey, BufferTooSmall, ConfigError
    (StoreClosed, ErrorCode.INVALID_PARAMS),
    (NotFound, ErrorCode.OBJECT_NOT_FOUND),
    (CorruptBlock, ErrorCode.CHECKSUM_MISMATCH),
    (Timeout, ErrorCode.RPC_TIMEOUT),
    (ConnectionFailed, ErrorCode.RPC_FAIL),
    (RetryLater, ErrorCode.OBJECT_REPLICA_BUSY),
    (AuthFailed, ErrorCode.ILLEGAL_CLIENT),
    (PermissionDenied, ErrorCode.ILLEGAL_CLIENT),
)


def error_code(exc: KVStoreError) -> int:
    """The Mooncake code for a kvstore error."""
    for kind, code in _CODES:
        if isinstance(exc, kind):
            return int(code)
    return int(ErrorCode.INTERNAL_ERROR)


class SoftPinAction(enum.IntEnum):
    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(enum.IntEnum):
    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


MAX_SOFT_PIN_TTL_MS = 24 * 3600 * 1000


def check(name: str, value: Any, kinds: type | tuple[type, ...], *, unsigned: bool = False, bits: int = 64) -> Any:
    """``value`` if it may be assigned to field ``name`` (TypeError otherwise, as pybind11 raises)."""
    if isinstance(value, bool) and kinds is int:
        raise TypeError(f"{name} must be an int, got bool")
    if not isinstance(value, kinds):
        names = kinds.__name__ if isinstance(kinds, type) else " or ".join(k.__name__ for k in kinds)
        raise TypeError(f"{name} must be {names}, got {type(value).__name__}")
    if unsigned and isinstance(value, int) and not 0 <= value < 1 << bits:
        raise TypeError(f"{name} must be an unsigned {bits}-bit int, got {value}")
    return value


class ReplicateConfig:
    """How a put is placed (Mooncake's fields and defaults; see the module docstring for their effect)."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self.soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.preferred_segment = ""
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids: list[str] | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        check = _SETTERS.get(name)
        if check is None:
            raise AttributeError(f"ReplicateConfig has no field {name!r}")
        object.__setattr__(self, name, check(value))

    def __str__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else str(self.soft_pin_ttl_ms)
        parts = [
            f"replica_num: {self.replica_num}", f"nof_replica_num: {self.nof_replica_num}",
            f"dfs_replica_num: {self.dfs_replica_num}", f"soft_pin_action: {self.soft_pin_action.name}",
            f"soft_pin_ttl_ms: {ttl}", f"with_hard_pin: {int(self.with_hard_pin)}",
            f"preferred_segments: [{', '.join(self.preferred_segments)}]",
        ]  # fmt: skip
        if self.preferred_segment:
            parts.append(f"preferred_segment (deprecated): {self.preferred_segment}")
        parts += [
            f"preferred_nof_segments: [{', '.join(self.preferred_nof_segments)}]",
            f"prefer_alloc_in_same_node: {int(self.prefer_alloc_in_same_node)}", f"data_type: {self.data_type.name}",
        ]  # fmt: skip
        if self.group_ids is not None:
            parts.append(f"group_ids: [{', '.join(self.group_ids)}]")
        return "ReplicateConfig: { " + ", ".join(parts) + " }"

    __repr__ = __str__


def _strings(name: str) -> Callable[[Any], list[str]]:
    def strings(value: Any) -> list[str]:
        check(name, value, (list, tuple))
        return [check(f"{name}[]", v, str) for v in value]

    return strings


_SETTERS: dict[str, Callable[[Any], Any]] = {
    "replica_num": lambda v: check("replica_num", v, int, unsigned=True),
    "nof_replica_num": lambda v: check("nof_replica_num", v, int, unsigned=True),
    "dfs_replica_num": lambda v: check("dfs_replica_num", v, int, unsigned=True),
    "soft_pin_action": lambda v: SoftPinAction(check("soft_pin_action", v, SoftPinAction)),
    "soft_pin_ttl_ms": lambda v: None if v is None else check("soft_pin_ttl_ms", v, int, unsigned=True),
    "with_hard_pin": lambda v: check("with_hard_pin", v, bool),
    "preferred_segments": _strings("preferred_segments"),
    "preferred_nof_segments": _strings("preferred_nof_segments"),
    "preferred_segment": lambda v: check("preferred_segment", v, str),
    "prefer_alloc_in_same_node": lambda v: check("prefer_alloc_in_same_node", v, bool),
    "data_type": lambda v: ObjectDataType(check("data_type", v, ObjectDataType)),
    "group_ids": lambda v: None if v is None else _strings("group_ids")(v),
}


class BufferHandle(bytearray):
    """A value read by ``get_buffer``: its bytes (the buffer protocol), ``ptr()`` and ``size()``."""

    def ptr(self) -> int:

        return ctypes.addressof((ctypes.c_char * len(self)).from_buffer(self)) if len(self) else 0

    def size(self) -> int:
        return len(self)


class Registered:
    """Memory given to ``register_buffer``: a raw address is used only inside it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, ptr: int, size: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            if i < len(self._starts) and self._starts[i] == ptr:
                self._ends[i] = max(self._ends[i], ptr + size)
            else:
                self._starts.insert(i, ptr)
                self._ends.insert(i, ptr + size)

    def remove(self, ptr: int) -> bool:
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            if i == len(self._starts) or self._starts[i] != ptr:
                return False
            del self._starts[i], self._ends[i]
            return True

    def room(self, ptr: int) -> int:
        """Bytes registered from ``ptr`` on (0: ``ptr`` is in no registered buffer)."""
        with self._lock:
            best = 0
            for i in range(bisect.bisect_right(self._starts, ptr) - 1, -1, -1):
                best = max(best, self._ends[i] - ptr)
            return best

    def view(self, ptr: Any, size: Any) -> memoryview:
        """``size`` bytes of registered memory at ``ptr``; InvalidArgument when they are not all registered."""
        check("buffer_ptr", ptr, int, unsigned=True)
        check("size", size, int, unsigned=True)
        if size == 0:
            return memoryview(bytearray())
        if self.room(ptr) < size:
            raise InvalidArgument(f"{size} bytes at {ptr:#x} are not inside a buffer given to register_buffer")

        return as_view((ctypes.c_ubyte * size).from_address(ptr), writable=True, what="registered buffer")

    def clear(self) -> None:
        with self._lock:
            self._starts.clear()
            self._ends.clear()


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "m": 1 << 20, "mb": 1 << 20, "g": 1 << 30, "gb": 1 << 30,
          "t": 1 << 40, "tb": 1 << 40}  # fmt: skip
INFINITE = (1 << 64) - 1


def parse_size(value: Any, name: str) -> int:
    """A size as Mooncake's setup dict takes it: a number with an optional unit B, K(B), M(B), G(B),
    T(B) (powers of 1024, any case), or "infinite"; InvalidArgument otherwise (e.g. "50%")."""
    text = str(value).strip()
    if text.lower() == "infinite":
        return INFINITE
    match = _SIZE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"{name} {value!r} is not a size (a number and B, KB, MB, GB or TB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
