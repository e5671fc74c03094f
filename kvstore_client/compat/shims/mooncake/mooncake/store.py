"""Mooncake Store's Python module, served by kvstore (kvstore_client.compat.mooncake)."""

from kvstore_client.compat.mooncake import *  # noqa: F403
from kvstore_client.compat.mooncake import (  # noqa: F401
    BufferHandle,
    BufferPool,
    ErrorCode,
    MooncakeDistributedStore,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
)
