"""The wire's building blocks: the base classes of every struct and message, and what many messages share.

:class:`Struct` is any wire struct; :class:`Message` a top-level one, with its kind (its msgspec
union tag) declared in its class line. The structs here (:class:`Replica`, :class:`PutTicket`,
:class:`InventoryItem`) travel inside several messages; :class:`ErrorReply` and :class:`OkReply`
answer many requests.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import msgspec

from kvstore.errors import KVStoreError, error_from_code

Tier = Literal["dram", "ssd"]


class Struct(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """Base of every wire struct: frozen, and sent as the array of its fields in declaration order.

    ``forbid_unknown_fields`` makes an array with more items than fields an
    error (msgspec would otherwise drop the extras). Lists inside a struct are
    plain lists: its builder may fill them before sending it, nobody changes
    them after. Subclasses repeat ``frozen=True``: mypy's reading of
    ``dataclass_transform`` does not inherit it.
    """


class Message(Struct, frozen=True):
    """A top-level message; ``KIND`` is its stable number on the wire, declared as its ``tag``.

    Every subclass names its kind in its class line (``class Exists(Message, tag=34, frozen=True)``);
    its array on the wire starts with it, and :data:`KIND_TO_MESSAGE` refuses a kind used twice.
    """

    KIND: ClassVar[int] = 0


# -- structs ---------------------------------------------------------------------


class Replica(Struct, frozen=True):
    """Where one copy of a block lives: a node's data-plane address, its tier and DRAM extent."""

    node_id: str
    address: str
    tier: Tier
    offset: int
    """Offset in the node's DRAM arena; -1 for an SSD replica (LMDB has no extents)."""
    size: int
    seal: bytes = b""
    """A reservation's seal, for a tenant's write into it (see :meth:`kvstore.auth.Authority.seal`)."""


class PutTicket(Struct, frozen=True):
    """The answer to one key of a put_start: where to write, or why not."""

    status: Literal["ok", "exists", "error"]
    replicas: list[Replica]
    error_code: int
    error: str


class InventoryItem(Struct, frozen=True):
    """One block a daemon holds, as it reports it when (re)registering."""

    key: str
    tier: Tier
    offset: int
    size: int
    checksum: int
    pinned: bool = False
    """Written with pin=True: never evicted, including by a master that rebuilt its table."""
    write_id: int = 0
    """The write id of the put that wrote it (0: not known here: read back after a restart, or on SSD)."""


# -- replies shared by many requests ----------------------------------------------


class ErrorReply(Message, tag=1, frozen=True):
    code: int
    message: str

    def to_error(self) -> KVStoreError:
        return error_from_code(self.code, self.message)

    @classmethod
    def from_error(cls, exc: KVStoreError) -> ErrorReply:
        return cls(exc.code, str(exc))


class OkReply(Message, tag=2, frozen=True):
    """The success reply of a request that returns nothing else."""
