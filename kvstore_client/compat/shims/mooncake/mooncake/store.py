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
    _deserialize_tensor,
    _serialize_tensor,
    _tensor_metadata_size,
)
