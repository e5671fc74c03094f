"""Bugs planted on purpose in the cluster's processes, to show that ``bench.chaos``'s checker catches
them (tests/integration/test_chaos.py). Python imports this module at start in every process whose
PYTHONPATH names this directory; ``KVSTORE_PLANT`` picks the bug:

- ``corrupt_reads``: a daemon flips one byte of about one block in twenty it sends to a reader;
- ``forgetful_drops``: a daemon answers that it dropped blocks it keeps (about half of them), so
  a removed key stays readable from it by key;
- ``lost_cached_commits``: a daemon forgets to tell the master of about one cached put in five
  it acknowledged (its block is then an orphan, dropped by the orphan check).
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import Sequence

PLANT = os.environ.get("KVSTORE_PLANT", "")


def _plant_corrupt_reads() -> None:
    import server.daemon.service as service
    from kvstore.protocol import Message, ReadReply

    send = service.send_message

    def corrupting(
        sock: socket.socket, message: Message, request_id: int, payload: Sequence[memoryview | bytes] = ()
    ) -> None:
        if isinstance(message, ReadReply) and payload and random.random() < 0.05:
            first = bytearray(payload[0])
            first[len(first) // 2] ^= 0xFF
            payload = [bytes(first), *payload[1:]]
        send(sock, message, request_id, payload)

    service.send_message = corrupting  # type: ignore[assignment]


def _plant_forgetful_drops() -> None:
    from kvstore.keys import BlockKey
    from server.daemon.storage import DaemonStorage

    drop = DaemonStorage.drop

    def forgetful(
        self: DaemonStorage, keys: Sequence[BlockKey], tier: str = "", fences: Sequence[int] = (),
        at: Sequence[int] = (), keep: object = None,
    ) -> list[bool]:  # fmt: skip
        kept = {k for k in keys if random.random() < 0.5}
        real = [i for i, k in enumerate(keys) if k not in kept]
        done = drop(
            self, [keys[i] for i in real], tier, [fences[i] for i in real] if fences else (),
            [at[i] for i in real] if at else (), keep,  # type: ignore[arg-type]
        )  # fmt: skip
        out = [True] * len(keys)
        for i, ok in zip(real, done, strict=True):
            out[i] = ok
        return out

    DaemonStorage.drop = forgetful  # type: ignore[method-assign]


def _plant_lost_cached_commits() -> None:
    from server.daemon.commits import Committer

    add = Committer.add

    def forgetting(self: Committer, *args: object, **kwargs: object) -> None:
        if random.random() < 0.2:
            self._release(kwargs.get("hold", args[6] if len(args) > 6 else None))
            return
        add(self, *args, **kwargs)  # type: ignore[arg-type]

    Committer.add = forgetting  # type: ignore[method-assign]


if PLANT == "corrupt_reads":
    _plant_corrupt_reads()
elif PLANT == "forgetful_drops":
    _plant_forgetful_drops()
elif PLANT == "lost_cached_commits":
    _plant_lost_cached_commits()
