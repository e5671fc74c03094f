"""Client -> master questions about what is stored and about the cluster: prefix, existence, keys, stats, nodes.

Also :class:`AdminInfo`: where the master's REST admin API is.
"""

from __future__ import annotations

from kvstore.protocol.base import Message
from kvstore.protocol.membership import NodeInfo


class MatchPrefix(Message, tag=32, frozen=True):
    keys: list[str]


class MatchPrefixReply(Message, tag=33, frozen=True):
    matched: int


class Exists(Message, tag=34, frozen=True):
    keys: list[str]


class ExistsReply(Message, tag=35, frozen=True):
    exists: list[bool]


class ListKeys(Message, tag=86, frozen=True):
    """A page of stored keys that start with ``prefix``, in order, after ``after`` (exclusive; ""
    starts at the beginning); answered by a KeysReply. A tenant lists its own keys, named without
    its ``NAME/``."""

    prefix: str
    after: str
    limit: int


class KeysReply(Message, tag=87, frozen=True):
    keys: list[str]
    next: str
    """Pass as ``after`` for the next page; empty after the last."""


class Stats(Message, tag=38, frozen=True):
    """Ask the master for its counters; answered by a StatsReply."""


class StatsReply(Message, tag=39, frozen=True):
    stats: dict[str, int | float]


class ListNodes(Message, tag=41, frozen=True):
    """Ask the master for every node it knows; answered by a NodesReply."""


class NodesReply(Message, tag=42, frozen=True):
    nodes: list[NodeInfo]


class AdminInfo(Message, tag=43, frozen=True):
    """Where the master's REST admin API is (for tools given only the RPC address)."""


class AdminInfoReply(Message, tag=44, frozen=True):
    address: str
    """host:port of the admin API; empty when the master serves none."""
