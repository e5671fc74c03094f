"""What the vLLM connector's scheduler side tells its workers each step: the loads and the saves of
that step (vLLM carries :class:`KVStoreConnectorMetadata` from the scheduler's process to every
worker's). Plain data: the only thing the two sides share besides their settings."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvstore.events import EngineBlock


@dataclass(slots=True)
class LoadSpec:
    """Load stored blocks ``first_block ..`` of a prompt into a request's pages."""

    req_id: str
    tokens: list[int]
    """The prompt up to the end of the last block to load."""
    first_block: int
    pages: list[int]
    """Page ids for those blocks, ``pages_per_block`` each; -1 for a page the engine holds already."""
    num_blocks: int
    extras: list[bytes] | None = None
    """Per block, what else changes its KV (see :func:`~kvstore_client.adapters.vllm_inspect.block_extras`);
    None for nothing."""


@dataclass(slots=True)
class SaveSpec:
    """Save blocks ``first_block ..`` of a prompt from a request's pages."""

    req_id: str
    tokens: list[int]
    first_block: int
    pages: list[int]
    num_blocks: int
    extras: list[bytes] | None = None
    labels: list[EngineBlock] | None = None
    """With ``label_blocks``: per block saved, vLLM's name for it
    (:func:`~kvstore_client.adapters.vllm_scheduler.engine_labels`)."""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
