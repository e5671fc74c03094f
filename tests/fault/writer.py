"""A child process for the crash tests: writes and reads blocks until it is killed.

Usage: python -m tests.fault.writer CONFIG_JSON FIRST COUNT SEED

Prints ``committed N`` after put N has returned, and ``ready`` at start.
Between puts it reads earlier blocks (verifying them) so that promotions and
demotions are in flight when the kill lands.
"""

from __future__ import annotations

import json
import random
import sys
import time

from kvstore.config import NodeConfig
from kvstore.node_store import NodeStore


def block_bytes(i: int, size: int = 48 * 1024) -> bytes:
    head = f"block-{i}:".encode()
    return (head * (size // len(head) + 1))[:size]


def main() -> None:
    config = NodeConfig.model_validate(json.loads(sys.argv[1]))
    first, count, seed = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    store = NodeStore(config)
    print("ready", flush=True)
    for i in range(first, first + count):
        store.put(f"k{i}", block_bytes(i))
        print(f"committed {i}", flush=True)
        if i > 0:
            j = rng.randrange(0, i)
            got = store.get(f"k{j}", verify=True)
            assert got is None or got == block_bytes(j), f"k{j} read back wrong bytes"
    print("done", flush=True)
    time.sleep(60)  # wait to be killed: a crash, not a clean close


if __name__ == "__main__":
    main()
