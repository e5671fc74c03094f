"""Arena files as a machine holds them: which exist in a shared-memory directory, which a daemon has
open, and removing a leftover one. Nothing here maps an arena (that is :mod:`kvstore.tiers.dram`)."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import DramConfig
from kvstore.errors import StoreBusy


def arena_path(config: DramConfig) -> Path:
    return config.shm_dir / f"kvstore-{config.name}.arena"


@dataclass(frozen=True, slots=True)
class ArenaFile:
    """An arena file found in a shared-memory directory (:func:`find_arenas`)."""

    name: str
    """The daemon's arena name (``--arena``, by default its node id); "" for a temporary file."""
    path: Path
    size: int
    allocated: int
    """Bytes of memory it holds (its allocated pages)."""
    in_use: bool
    """A daemon has it open (holds its lock); otherwise it is a leftover, to re-attach or remove."""


def _flocked() -> set[tuple[int, int, int]] | None:
    """(device major, minor, inode) of every file some process holds a flock on, from /proc/locks;
    None where it cannot be read."""
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    out = set()
    for line in text.splitlines():
        parts = line.split()
        if "FLOCK" not in parts:
            continue
        where = next((p for p in parts if p.count(":") == 2), None)
        if where is not None:
            major, minor, inode = where.split(":")
            out.add((int(major, 16), int(minor, 16), int(inode)))
    return out


def _in_use(path: Path, st: os.stat_result, flocked: set[tuple[int, int, int]] | None) -> bool:
    """Whether a daemon holds the arena's lock. Read from /proc/locks: trying the lock would make a
    daemon that starts at that moment find it taken (StoreBusy) and exit."""
    if flocked is not None:
        return (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in flocked
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def find_arenas(shm_dir: Path) -> list[ArenaFile]:
    """Every arena file in ``shm_dir``, with temporary files of creations cut short (name "")."""
    out = []
    flocked = _flocked()
    for path in sorted(shm_dir.glob("kvstore-*.arena*")):
        name = path.name.removeprefix("kvstore-")
        if name.endswith(".arena"):
            name = name.removesuffix(".arena")
        elif name.endswith(".tmp"):
            pid = name.rsplit(".", 2)[-2]
            if pid.isdigit() and Path(f"/proc/{pid}").exists():
                continue  # being created now
            name = ""
        else:
            continue
        try:
            st = path.stat()
        except FileNotFoundError:
            continue
        out.append(ArenaFile(name, path, st.st_size, st.st_blocks * 512, _in_use(path, st, flocked)))
    return out


def remove_arena(config: DramConfig) -> int:
    """Delete the arena file of ``config`` unless a daemon has it open (StoreBusy); returns the
    bytes of memory that frees (0 when there was no file). Its blocks are gone for good."""
    path = arena_path(config)
    freed = 0
    for stray in find_arenas(config.shm_dir):  # temporary files of this name's creations cut short
        if not stray.name and stray.path.name.startswith(f"{path.name}."):
            stray.path.unlink(missing_ok=True)
            freed += stray.allocated
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return freed
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreBusy(f"DRAM arena {path} is open in a running daemon: stop it first") from None
        freed += os.fstat(fd).st_blocks * 512
        # Under the lock no daemon holds it. One that opened it before this unlink and locks it
        # after serves a file no client can find by its name: clients read from it over TCP.
        path.unlink()
        return freed
    finally:
        os.close(fd)
