#!/opt/kvstore/bin/python3 -IS
"""The image's HEALTHCHECK: is the kvstore process of this container serving?

Standard library only and no kvstore import, so a probe costs milliseconds of CPU. Every probe must
pass; exit 0 is healthy, 1 is not (Docker's convention). The probes are

- those of ``$KVSTORE_HEALTHCHECK`` when it is set: space-separated ``http://H:P/path`` (a 2xx
  answer) and ``tcp://H:P`` (a connection);
- else what the running ``kvstore`` command serves, read from its command line: ``master``, its
  admin API's ``/api/v1/health`` (``--admin-port``; over TLS, a connection to it), else its RPC port;
  ``daemon``, its data port (with ``--port 0``, any TCP port the process listens on); ``conductor``
  and ``worker``, ``/health``; ``cluster up``, the admin API. Any other command: the process runs.
"""

from __future__ import annotations

import http.client
import os
import socket
import sys
from pathlib import Path

TIMEOUT_S = 3.0
# (subcommand, flag) -> default, as kvstore_cli defines them.
DEFAULTS = {
    ("master", "--host"): "127.0.0.1",
    ("master", "--port"): "50051",
    ("daemon", "--host"): "127.0.0.1",
    ("daemon", "--port"): "0",
    ("conductor", "--host"): "127.0.0.1",
    ("conductor", "--port"): "8600",
    ("worker", "--host"): "127.0.0.1",
    ("worker", "--port"): "0",
    ("cluster", "--admin-port"): "50052",
}


def find_kvstore() -> tuple[int, list[str]] | None:
    """The pid and the arguments after ``kvstore`` of this container's kvstore process."""
    for entry in sorted(Path("/proc").iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 1 << 30):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(argv[:2]):
            if os.path.basename(arg) == b"kvstore":
                return int(entry.name), [a.decode(errors="replace") for a in argv[i + 1 :] if a]
    return None


def flag(command: str, args: list[str], name: str) -> str | None:
    """The value of ``--name`` in ``args`` (the last one given), else the command's default."""
    value = DEFAULTS.get((command, name))
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def reachable(host: str | None) -> str:
    """Where to connect for a server bound to ``host`` (a wildcard address is reached on loopback)."""
    return "127.0.0.1" if host in (None, "", "0.0.0.0", "::", "[::]") else host


def probe_tcp(host: str, port: int) -> str | None:
    try:
        with socket.create_connection((host, port), timeout=TIMEOUT_S):
            return None
    except OSError as exc:
        return f"tcp://{host}:{port}: {exc}"


def probe_http(host: str, port: int, path: str) -> str | None:
    conn = http.client.HTTPConnection(host, port, timeout=TIMEOUT_S)
    try:
        conn.request("GET", path)
        status = conn.getresponse().status
        return None if 200 <= status < 300 else f"http://{host}:{port}{path}: HTTP {status}"
    except (OSError, http.client.HTTPException) as exc:
        return f"http://{host}:{port}{path}: {exc}"
    finally:
        conn.close()


def probe_url(url: str) -> str | None:
    scheme, _, rest = url.partition("://")
    hostport, slash, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    if scheme == "tcp":
        return probe_tcp(host, int(port))
    if scheme == "http":
        return probe_http(host, int(port), slash + path or "/")
    return f"{url}: not a tcp:// or http:// probe"


def listens(pid: int) -> str | None:
    """None when process ``pid`` has a listening TCP socket (a daemon on ``--port 0``)."""
    try:
        inodes = {os.readlink(fd)[8:-1] for fd in Path(f"/proc/{pid}/fd").iterdir()}
    except OSError as exc:
        return f"cannot read the sockets of pid {pid}: {exc}"
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                return None
    return f"pid {pid} listens on no TCP port yet"


def inferred() -> list[str | None]:
    found = find_kvstore()
    if found is None:
        return ["no kvstore process in this container"]
    pid, args = found
    command = args[0] if args else ""
    host = reachable(flag(command, args, "--host"))
    port = int(flag(command, args, "--port") or 0)
    if command == "master":
        admin = flag(command, args, "--admin-port")
        if admin is None:
            return [probe_tcp(host, port)]
        if flag(command, args, "--tls-cert") is not None:  # https: a connection is enough
            return [probe_tcp(host, int(admin))]
        return [probe_http(host, int(admin), "/api/v1/health")]
    if command == "daemon":
        return [probe_tcp(host, port) if port else listens(pid)]
    if command in ("conductor", "worker"):
        return [probe_http(host, port, "/health") if port else listens(pid)]
    if command == "cluster":
        return [probe_http("127.0.0.1", int(flag(command, args, "--admin-port") or 0), "/api/v1/health")]
    return [None]


def main() -> int:
    spec = os.environ.get("KVSTORE_HEALTHCHECK", "").split()
    failures = [f for f in ([probe_url(url) for url in spec] if spec else inferred()) if f is not None]
    for failure in failures:
        print(f"unhealthy: {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
