"""What a process loads: a client takes the wire protocol, the keys, the errors, the config and the
shared result types, and nothing of the server's storage (the placement table, the tiers, the node
store, LMDB). The import-linter contract ``wire-storage`` checks the imports as written; these tests
check what a fresh interpreter really holds, so an import made at run time cannot slip past."""

from __future__ import annotations

import subprocess
import sys

import pytest

STORAGE = ("lmdb", "kvstore.placement", "kvstore.tiers", "kvstore.node_store")


def run(source: str) -> list[str]:
    """The lines ``source`` prints in a fresh interpreter (this one's, with this environment)."""
    done = subprocess.run([sys.executable, "-c", source], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def storage_loaded_by(statement: str) -> list[str]:
    """The storage modules a fresh interpreter holds after ``statement``."""
    names = run(f"{statement}\nimport sys\nprint('\\n'.join(sorted(sys.modules)))")
    return [name for name in names if any(name == s or name.startswith(f"{s}.") for s in STORAGE)]


@pytest.mark.parametrize(
    "statement",
    [
        "import kvstore_client",
        "import kvstore.protocol",
        "from kvstore.results import PutStatus",
        "from kvstore import KVStoreError, PutStatus, block_keys",
        "from kvstore.arena_format import ArenaMapping",
    ],
)
def test_a_client_loads_nothing_of_the_server_storage(statement: str) -> None:
    assert storage_loaded_by(statement) == []


def test_the_node_store_is_loaded_from_the_package_on_first_use() -> None:
    lines = run(
        "import sys\n"
        "import kvstore\n"
        "print('kvstore.node_store' in sys.modules)\n"
        "from kvstore import NodeStore\n"
        "from kvstore.node_store import NodeStore as Defined\n"
        "print(NodeStore is Defined is kvstore.NodeStore)\n"
        "print('NodeStore' in dir(kvstore))\n"
        "from kvstore import protocol\n"
        "print(protocol.__name__)\n"
        "try:\n"
        "    kvstore.NoSuchName\n"
        "except AttributeError as exc:\n"
        "    print(exc)\n"
    )
    assert lines == ["False", "True", "True", "kvstore.protocol", "module 'kvstore' has no attribute 'NoSuchName'"]


def test_the_storage_modules_are_what_the_probe_looks_for() -> None:
    # Guards the tests above against passing vacuously: the names they look for are the ones loaded.
    loaded = storage_loaded_by("from kvstore import NodeStore")
    assert {"lmdb", "kvstore.node_store", "kvstore.tiers.dram", "kvstore.tiers.ssd"} <= set(loaded)
