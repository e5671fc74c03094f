"""Frames: a 4-byte big-endian payload length, then the payload; :class:`FrameDecoder` splits a byte stream.

The payload is a msgpack array ``[version, request_id, [kind, field, ...]]`` of
:data:`PROTOCOL_VERSION`; :mod:`kvstore.protocol.codec` reads and writes it. Pure: fed bytes,
knows no socket.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

from kvstore.errors import ProtocolError

PROTOCOL_VERSION = 15
MAX_FRAME_BYTES = 64 * 1024 * 1024
FRAME_HEADER = struct.Struct("!I")


class FrameDecoder:
    """Splits a byte stream into frame payloads. Fed bytes; knows no socket.

    A length above ``max_frame`` raises :class:`ProtocolError`: the stream
    cannot be resynchronised, so the connection must close.
    """

    def __init__(self, max_frame: int = MAX_FRAME_BYTES) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()

    def feed(self, data: bytes) -> Iterator[bytes]:
        """Payloads completed by ``data``, in order."""
        self._buf += data
        while len(self._buf) >= FRAME_HEADER.size:
            (length,) = FRAME_HEADER.unpack_from(self._buf)
            if length > self.max_frame:
                raise ProtocolError(f"frame of {length} bytes exceeds the limit of {self.max_frame}")
            end = FRAME_HEADER.size + length
            if len(self._buf) < end:
                return
            payload = bytes(self._buf[FRAME_HEADER.size : end])
            del self._buf[:end]
            yield payload

    @property
    def pending(self) -> int:
        """Bytes of an incomplete frame held back."""
        return len(self._buf)
