"""Transports beside the tcp data plane of :mod:`transfer.wire`: same-host shared memory, and UCX."""
