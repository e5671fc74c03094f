"""Connections receiving bytes into a block's extent, by key.

A drop of the block (the master's, or of an orphan) cuts them and waits for their receives to end
before the extent is given back, so that a stalled writer never writes into an extent the master
placed another block in; a commit cuts late slices. Thread-safe.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Sequence

from kvstore.keys import BlockKey
from transfer.wire import cut


class Receivers:
    def __init__(self) -> None:
        self._by_key: dict[str, set[socket.socket]] = {}
        self._done = threading.Condition()

    def receiving(self, sock: socket.socket, keys: Sequence[BlockKey]) -> _Receiving:
        """While ``sock`` receives bytes into the extents of ``keys`` (a context manager)."""
        return _Receiving(self, sock, keys)

    def _enter(self, sock: socket.socket, keys: Sequence[BlockKey]) -> None:
        with self._done:
            for key in keys:
                self._by_key.setdefault(key, set()).add(sock)

    def _leave(self, sock: socket.socket, keys: Sequence[BlockKey]) -> None:
        with self._done:
            for key in keys:
                receivers = self._by_key.get(key)
                if receivers is not None:
                    receivers.discard(sock)
                    if not receivers:
                        del self._by_key[key]
            self._done.notify_all()

    def cut(self, keys: Sequence[BlockKey], wait_s: float = 0.0) -> None:
        """Shut the connections receiving into the extents of ``keys``; with ``wait_s``, wait (that
        long at most: a receive is bounded by the socket timeout anyway) until their receives ended."""
        with self._done:
            stale = {sock for key in keys for sock in self._by_key.get(key, ())}
        for sock in stale:
            cut(sock)
        if stale and wait_s:
            with self._done:
                self._done.wait_for(lambda: not any(k in self._by_key for k in keys), wait_s)


class _Receiving:
    """:meth:`Receivers.receiving`'s context: a plain object, no generator per write."""

    __slots__ = ("_keys", "_receivers", "_sock")

    def __init__(self, receivers: Receivers, sock: socket.socket, keys: Sequence[BlockKey]) -> None:
        self._receivers, self._sock, self._keys = receivers, sock, keys

    def __enter__(self) -> None:
        self._receivers._enter(self._sock, self._keys)

    def __exit__(self, *exc: object) -> None:
        self._receivers._leave(self._sock, self._keys)
