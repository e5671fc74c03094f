"""What this machine can give a tier, and reserving it for real.

A tier sized past what the machine has fails late and badly when nothing
checks: a tmpfs file larger than ``/dev/shm``'s free space is created sparse,
and the first write to a page that cannot be backed kills the writer (the
daemon, or a same-host client that mapped the file) with SIGBUS; an arena
larger than memory fills it and the OOM killer picks a victim; an SSD tier
larger than its disk fails its writes at run time. So a daemon compares its
sizes with the machine before it creates anything (:func:`check_dram`,
:func:`check_ssd`), and reserves an arena's pages at creation
(:func:`reserve`), turning every shortage into a :class:`ResourceShortage`
at start.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.config import format_size
from kvstore.errors import ResourceShortage

RESERVE_CHUNK = 64 * 1024**2
"""Bytes reserved per call: between two calls a signal handler runs, so a stop is honoured promptly."""

CLAMP_FRACTION = 0.9
"""A clamped size leaves this fraction of what is free to the tier, the rest to everything else."""


def fs_free(path: Path) -> int:
    """Bytes an unprivileged writer may still allocate on the filesystem of ``path`` (or of its
    nearest existing parent: a directory the daemon would create)."""
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    st = os.statvfs(probe)
    return st.f_bavail * st.f_frsize


def allocated(path: Path) -> int:
    """Bytes of ``path`` backed by storage (its allocated blocks; 0 when it does not exist)."""
    try:
        return os.stat(path).st_blocks * 512
    except FileNotFoundError:
        return 0


def _meminfo(field: str, text: str) -> int | None:
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == field:
            return int(rest.split()[0]) * 1024
    return None


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still charge, counting its inactive page cache (which
    the kernel reclaims first) as room; None when it sets no limit."""
    try:
        entry = Path("/proc/self/cgroup").read_text().splitlines()
        rel = next(line.split("::", 1)[1] for line in entry if line.startswith("0::"))
        base = Path("/sys/fs/cgroup") / rel.lstrip("/")
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        stat = dict(line.split() for line in (base / "memory.stat").read_text().splitlines() if line.count(" ") == 1)
        reclaimable = int(stat.get("inactive_file", 0))
        return max(0, int(limit) - int((base / "memory.current").read_text()) + reclaimable)
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def memory_available() -> int | None:
    """Bytes of memory a new allocation can take without pushing anything out: the kernel's
    MemAvailable, or the cgroup's room where that is less. None where neither can be read."""
    try:
        avail = _meminfo("MemAvailable", Path("/proc/meminfo").read_text())
    except OSError:
        avail = None
    room = _cgroup_room()
    known = [v for v in (avail, room) if v is not None]
    return min(known) if known else None


@dataclass(frozen=True, slots=True)
class Fit:
    """The outcome of a size check: the size to use (the one asked for, or a clamped one) and,
    when clamped, the warning that says why."""

    size: int
    warning: str | None = None


def _fit(what: str, flag: str, asked: int, need: int, limits: list[tuple[str, int]], clamp: bool) -> Fit:
    """``asked`` bytes of which ``need`` are still to be allocated, against named ``limits``."""
    short = [(name, have) for name, have in limits if need > have]
    if not short:
        return Fit(asked)
    name, have = min(short, key=lambda item: item[1])
    told = f"{what} of {format_size(asked)} needs {format_size(need)} more, but {name} has {format_size(have)}"
    if not clamp:
        raise ResourceShortage(
            f"{told}: start with a smaller {flag}, free some, or pass --clamp-to-free to use what there is"
        )
    size = int((asked - need + have) * CLAMP_FRACTION)
    if size <= 0:
        raise ResourceShortage(f"{told}: nothing to clamp to")
    return Fit(size, f"{told}; clamped {flag} to {format_size(size)}")


def check_dram(arena: Path, total: int, *, clamp: bool = False) -> Fit:
    """Whether an arena file of ``total`` bytes (index and data) fits this machine: its pages not
    yet allocated against free space in its directory's filesystem and free memory. The size to
    use comes back as a total too (a clamped one when ``clamp``); raises :class:`ResourceShortage`."""
    need = max(0, total - allocated(arena))
    limits = [(f"{arena.parent} (free)", fs_free(arena.parent))]
    mem = memory_available()
    if mem is not None:
        limits.append(("memory (available)", mem))
    return _fit(f"DRAM arena {arena}", "--dram", total, need, limits, clamp)


def check_ssd(directory: Path, capacity: int, used: int = 0, *, clamp: bool = False) -> Fit:
    """Whether ``capacity`` bytes of SSD tier, ``used`` of them on disk already, fit the free space
    of ``directory``'s filesystem; raises :class:`ResourceShortage` (or clamps when ``clamp``)."""
    need = max(0, capacity - used)
    return _fit(f"SSD tier {directory}", "--ssd", capacity, need, [(f"{directory} (free)", fs_free(directory))], clamp)


def reserve(fd: int, length: int, what: str, *, start: int = 0, chunk: int = RESERVE_CHUNK) -> None:
    """Allocate every byte of the first ``length`` of the file at ``fd`` (from ``start`` on: the bytes
    before are allocated already), so that no later write to it can fault for want of a page. In
    chunks: a signal's Python handler runs between two, so SIGTERM stops a reservation of many GiB
    promptly. Raises :class:`ResourceShortage` when the filesystem or memory runs out."""
    done = start
    while done < length:
        step = min(chunk, length - done)
        try:
            os.posix_fallocate(fd, done, step)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
                raise ResourceShortage(
                    f"{what}: only {format_size(done)} of {format_size(length)} could be reserved ({exc.strerror})"
                ) from None
            raise
        done += step
