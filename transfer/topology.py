"""What a host's network looks like to the transfer engine: its NICs and who it is.

A daemon advertises its NICs when it registers; a client reads its own. Both
come from the kernel: names and IPv4 addresses from ``SIOCGIFADDR``, link
speed and NUMA node from ``/sys/class/net``. Virtual links (loopback, veth)
report no speed; they count as :data:`UNKNOWN_SPEED_MBPS` until a transfer
measures them.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from pathlib import Path

from kvstore.protocol import Nic

SYS_NET = Path("/sys/class/net")
UNKNOWN_SPEED_MBPS = 10_000
"""Assumed for a link that reports no speed (loopback, veth, most virtual NICs)."""

_SIOCGIFADDR = 0x8915
_RDMA_DEVICES = Path("/sys/class/infiniband")


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None  # absent, or the driver refuses (a veth's speed reads EINVAL)


def ipv4_address(name: str) -> str | None:
    """The primary IPv4 address of interface ``name``; None when it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(raw[20:24])


def local_nics(sys_net: Path = SYS_NET, *, include_loopback: bool = True) -> list[Nic]:
    """The interfaces that are up and have an IPv4 address, fastest first, loopback last."""
    out: list[Nic] = []
    for entry in sorted(sys_net.iterdir()) if sys_net.is_dir() else []:
        name = entry.name
        if not include_loopback and name == "lo":
            continue
        state = (entry / "operstate").read_text().strip() if (entry / "operstate").exists() else "unknown"
        if state == "down":
            continue
        address = ipv4_address(name)
        if address is None:
            continue
        speed = _read_int(entry / "speed")
        numa = _read_int(entry / "device" / "numa_node")
        out.append(Nic(name, address, speed if speed and speed > 0 else -1, numa if numa is not None else -1))
    out.sort(key=lambda n: (n.name == "lo", -nic_speed_mbps(n), n.name))
    return out


def nic_speed_mbps(nic: Nic) -> int:
    """The link speed to plan with: the reported one, or :data:`UNKNOWN_SPEED_MBPS`."""
    return nic.speed_mbps if nic.speed_mbps > 0 else UNKNOWN_SPEED_MBPS


def host_id() -> str:
    """Who this host is: its name and this boot of its kernel (two hosts, or two boots, differ).

    Network namespaces on one kernel share it: they share /dev/shm too, so a
    same-host transport works between them.
    """
    boot = Path("/proc/sys/kernel/random/boot_id")
    try:
        boot_id = boot.read_text().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{socket.gethostname()}/{boot_id}"


def has_rdma() -> bool:
    """Whether this host has an RDMA device (InfiniBand, RoCE or iWARP) that UCX could use."""
    try:
        return any(_RDMA_DEVICES.iterdir())
    except OSError:
        return False


def same_file(path: str, inode: int) -> bool:
    """Whether ``path`` here is the file whose inode another process reported (same host, same tmpfs)."""
    try:
        return os.stat(path).st_ino == inode
    except OSError:
        return False


def is_loopback(host: str) -> bool:
    """Whether listening on ``host`` keeps a port to this machine (127.0.0.0/8, ::1, localhost).
    A wildcard (0.0.0.0, ::) or any other address or name is reachable from elsewhere."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def warn_if_open(log: logging.Logger, what: str, host: str, port: int) -> None:
    """Say once, at start, that a server without authentication listens beyond this machine."""
    if not is_loopback(host):
        log.warning(
            "%s listens on %s:%d with no authentication: anyone who can reach that port can read, "
            "overwrite and remove every block; keep it on a trusted network or behind a firewall",
            what, host, port,
        )  # fmt: skip
