"""A scheduler's messages to the master: which nodes hold how much of a prefix, and copying hot blocks to a node.

:class:`MatchPrefixNodesReply` is the wire form of the placement table's :class:`PrefixMatch`
(re-exported here with :class:`NodePrefix`); :class:`Replicated` is a replicate's result.
"""

from __future__ import annotations

from typing import NamedTuple

from kvstore.errors import ProtocolError
from kvstore.protocol.base import Message
from kvstore.results import NodePrefix as NodePrefix
from kvstore.results import PrefixMatch as PrefixMatch


class MatchPrefixNodes(Message, tag=45, frozen=True):
    """The longest stored prefix of ``keys``, and how much of it each node holds (a scheduler's question)."""

    keys: list[str]


class MatchPrefixNodesReply(Message, tag=46, frozen=True):
    """A :class:`PrefixMatch` in parallel columns: node ``i`` is ``node_ids[i]``, ``dram[i]``, ``total[i]``."""

    longest: int
    node_ids: list[str]
    dram: list[int]
    total: list[int]

    @classmethod
    def from_match(cls, match: PrefixMatch) -> MatchPrefixNodesReply:
        nodes = match.nodes
        return cls(match.longest, list(nodes), [p.dram for p in nodes.values()], [p.total for p in nodes.values()])

    def prefix_match(self, num_keys: int) -> PrefixMatch:
        """The match, checked for consistency with a query of ``num_keys`` keys (a ProtocolError names
        what does not add up)."""
        n = len(self.node_ids)
        if not len(self.dram) == len(self.total) == n:
            raise ProtocolError(
                f"MatchPrefixNodesReply: {n} node ids but {len(self.dram)} dram and {len(self.total)} total counts"
            )
        if not 0 <= self.longest <= num_keys:
            raise ProtocolError(f"MatchPrefixNodesReply: a prefix of {self.longest} keys for {num_keys} keys asked")
        nodes: dict[str, NodePrefix] = {}
        for node_id, dram, total in zip(self.node_ids, self.dram, self.total, strict=True):
            if not 0 <= dram <= total <= self.longest or total == 0:
                raise ProtocolError(
                    f"MatchPrefixNodesReply: node {node_id!r} holds {dram} in DRAM and {total} in all of a "
                    f"prefix of {self.longest}"
                )
            if node_id in nodes:
                raise ProtocolError(f"MatchPrefixNodesReply: node {node_id!r} is listed twice")
            nodes[node_id] = NodePrefix(dram, total)
        return PrefixMatch(self.longest, nodes)


class Replicate(Message, tag=47, frozen=True):
    """Copy stored blocks into the DRAM of ``node_id`` and keep their other replicas (hot blocks near
    their readers). Keys are taken in order while they fit the node's free DRAM (nothing is evicted
    for them) and ``max_bytes``; keys not stored or already on the node are skipped."""

    keys: list[str]
    node_id: str
    max_bytes: int


class ReplicateReply(Message, tag=48, frozen=True):
    copied: int
    """Blocks that gained a replica on the node."""
    bytes: int
    """Their bytes."""


class Replicated(NamedTuple):
    """What a replicate did: blocks that gained a replica on the node, and their bytes."""

    copied: int
    bytes: int
