"""Other stores' client APIs on kvstore, so that engines written for them switch by import.

- :mod:`.mooncake`: Mooncake Store's ``MooncakeDistributedStore``. ``kvstore compat-path
  mooncake`` prints a directory holding a ``mooncake`` package that re-exports it: put on
  ``PYTHONPATH``, ``from mooncake.store import MooncakeDistributedStore`` loads ours.
"""

from __future__ import annotations

from pathlib import Path

from kvstore.errors import InvalidArgument

SHIMS = Path(__file__).with_name("shims")
"""Directories of import shims, one per API: ``SHIMS / "mooncake"`` holds the ``mooncake`` package."""


def compat_path(api: str) -> Path:
    """The directory to put on ``PYTHONPATH`` for ``api`` (only "mooncake" so far)."""
    path = SHIMS / api
    if not (path / api).is_dir():
        known = sorted(p.name for p in SHIMS.iterdir() if p.is_dir())
        raise InvalidArgument(f"no compatibility shim for {api!r}; known: {', '.join(known)}")
    return path
