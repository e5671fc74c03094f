"""Process commands: ``kvstore master``, ``kvstore daemon`` and ``kvstore cluster up``.

Flags become the component's config (``KVSTORE_<COMPONENT>_*`` variables fill the rest); the server
modules are imported only when their command runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.config import load, parse_size
from kvstore_cli.registry import arguments, command, size_arg

if TYPE_CHECKING:
    from kvstore_cli.cluster import LocalCluster


@arguments("master")
def _master_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="RPC port (0: any free port)")
    p.add_argument("--placement", default=None, help="local_first, free_ratio or random")
    p.add_argument("--reservation-ms", type=int, default=None, help="revoke an uncommitted put after this")
    p.add_argument("--lease-ms", type=int, default=None, help="read lease length")
    p.add_argument(
        "--default-kv-lease-ttl", "--default_kv_lease_ttl", dest="kv_lease_ms", type=int, default=None, metavar="MS",
        help="Mooncake's KV lease: a key read (get, exists) is not evicted or removed without force for this long",
    )  # fmt: skip
    p.add_argument(
        "--node-ttl-ms", type=int, default=None, help="fence a silent node after this (its daemon stops serving sooner)"
    )
    p.add_argument("--heartbeat-ms", type=int, default=None, help="daemon heartbeat interval")
    p.add_argument(
        "--key-lease-ms", type=int, default=None,
        help="daemons serve reads by key within this of a renewal (a remove waits at most this for a frozen node)",
    )  # fmt: skip
    p.add_argument(
        "--no-fence-refused", dest="fence_refused", action="store_false", default=None,
        help="fence a node only after its TTL, even when its daemon's port refuses (a firewall answers refusals)",
    )  # fmt: skip
    p.add_argument("--admin-port", type=int, default=None, help="REST admin API, /metrics and dashboard port")
    p.add_argument(
        "--admin-advertise", default=None, metavar="H:P",
        help="the address tools and the other masters reach the admin API at (default: where it is served)",
    )  # fmt: skip
    p.add_argument(
        "--prometheus", default=None, metavar="URL",
        help="the Prometheus evaluating docker/prometheus/alerts.yml: its firing alerts on the dashboard and in status",
    )  # fmt: skip
    p.add_argument(
        "--kv-events", default=None, metavar="tcp://H:P",
        help="publish KV events (vLLM's ZMQ format) of every replica stored or dropped on this endpoint",
    )  # fmt: skip
    p.add_argument("--kv-events-replay", default=None, metavar="tcp://H:P", help="replay endpoint of the KV events")
    p.add_argument("--kv-events-buffer", type=int, default=None, metavar="N", help="KV event batches kept for replay")
    p.add_argument("--etcd", default=None, metavar="H:2379[,H2:2379]", help="HA: elect a leader in this etcd")
    p.add_argument("--cluster-id", default=None, help="HA: the cluster's id in etcd (with --etcd)")
    p.add_argument("--etcd-lease-ttl", type=int, default=None, metavar="S", help="HA: the leader's lease (seconds)")
    p.add_argument("--advertise", default=None, metavar="H:P", help="the address others reach this master at")
    p.add_argument("--max-connections", type=int, default=None, help="connections served at once (default 4096)")
    p.add_argument(
        "--cluster-secret-file", default=None, metavar="FILE",
        help="authenticate every connection; daemons and tools prove this secret (also KVSTORE_CLUSTER_SECRET)",
    )  # fmt: skip
    p.add_argument("--tenants", default=None, metavar="FILE", help="tenants' tokens, quotas and operations (TOML/JSON)")
    p.add_argument("--ticket-ttl", type=int, default=None, metavar="S", help="life of a tenant's ticket (seconds)")
    _tls_arguments(p, "serve RPC and the admin API over TLS with this certificate (PEM)")


def _tls_arguments(p: argparse.ArgumentParser, cert_help: str) -> None:
    p.add_argument("--tls-cert", default=None, metavar="PEM", help=cert_help)
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="CA certificates that peers' certificates chain to")
    p.add_argument("--tls-verify-clients", action="store_true", help="require clients' certificates (from --tls-ca)")
    p.add_argument(
        "--tls-data", action="store_true",
        help="daemons' ports (data plane and the master's commands) over TLS too; set alike on every process",
    )  # fmt: skip


def _tls_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The ``tls`` setting of a config from the --tls-* flags (none when no flag is given)."""
    tls = {"cert_file": args.tls_cert, "key_file": args.tls_key, "ca_file": args.tls_ca,
           "verify_clients": args.tls_verify_clients or None, "data_plane": args.tls_data or None}  # fmt: skip
    given = {k: v for k, v in tls.items() if v is not None}
    return {"tls": given} if given else {}


@command("master", "run the master (placement, eviction, leases, membership)")
def _master(args: argparse.Namespace) -> int:
    from kvstore.config import MasterConfig
    from server.master.main import run_master

    fields = {
        "placement": args.placement,
        "reservation_ms": args.reservation_ms,
        "lease_ms": args.lease_ms,
        "kv_lease_ms": args.kv_lease_ms,
        "node_ttl_ms": args.node_ttl_ms,
        "heartbeat_interval_ms": args.heartbeat_ms,
        "key_lease_ms": args.key_lease_ms,
        "fence_refused": args.fence_refused,
        "admin_port": args.admin_port,
        "prometheus_url": args.prometheus,
        "admin_advertise": args.admin_advertise,
        "kv_events": args.kv_events,
        "kv_events_replay": args.kv_events_replay,
        "kv_events_buffer": args.kv_events_buffer,
        "etcd": args.etcd,
        "cluster_id": args.cluster_id,
        "etcd_lease_ttl_s": args.etcd_lease_ttl,
        "advertise": args.advertise,
        "max_connections": args.max_connections,
        "cluster_secret_file": args.cluster_secret_file,
        "tenants_file": args.tenants,
        "ticket_ttl_s": args.ticket_ttl,
    }
    if os.environ.get("KVSTORE_ADMIN_TOKEN"):
        fields["admin_token"] = os.environ["KVSTORE_ADMIN_TOKEN"]
    overrides = {k: v for k, v in fields.items() if v is not None}
    return run_master(load(MasterConfig, "master", host=args.host, port=args.port, **overrides, **_tls_fields(args)))


@arguments("daemon")
def _daemon_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", help="the master's host:port, or etcd://H:2379[,H2:2379]/ID (HA); required to serve")
    p.add_argument("--name", help="node id, unique in the cluster; required to serve")
    p.add_argument("--arena", default=None, help="shared-memory arena name (default: the node id)")
    p.add_argument("--dram", type=size_arg, default=parse_size("1GiB"), help="DRAM tier capacity")
    p.add_argument("--ssd", type=size_arg, default=0, help="SSD tier capacity (0: none)")
    p.add_argument("--ssd-dir", type=Path, default=None, help="SSD tier directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="data-plane port (0: any free port)")
    p.add_argument(
        "--rail", action="append", default=[], metavar="HOST", help="also serve on this host's address (one per NIC)"
    )
    p.add_argument("--ucx-port", type=int, default=None, help="also serve over UCX on this port (0: any free port)")
    p.add_argument(
        "--metrics-port", type=int, default=None, help="serve Prometheus metrics on this port of --host (0: any free)"
    )
    p.add_argument("--max-connections", type=int, default=None, help="connections served at once (default 4096)")
    p.add_argument(
        "--max-connections-per-peer", type=int, default=None, help="connections served at once per peer (default 1024)"
    )
    p.add_argument(
        "--cluster-secret-file", default=None, metavar="FILE",
        help="authenticate to the master and every peer with this secret (also KVSTORE_CLUSTER_SECRET)",
    )  # fmt: skip
    p.add_argument(
        "--leave-on-exit", action="store_true",
        help="on a clean stop the master forgets this node and its blocks, and the arena is deleted"
        " (by default a restarted daemon re-attaches them)",
    )  # fmt: skip
    p.add_argument(
        "--clamp-to-free", action="store_true",
        help="start with the shared memory, memory and disk that are free when --dram or --ssd ask for more"
        " (a warning says what was clamped); by default the daemon refuses to start",
    )  # fmt: skip
    p.add_argument(
        "--list-arenas", action="store_true",
        help="list the arena files in shared memory (size, memory held, in use or left over) and exit",
    )  # fmt: skip
    p.add_argument(
        "--remove-arena", action="append", default=[], metavar="NAME",
        help="delete the leftover arena NAME (a daemon's --arena, by default its --name) and exit; refused"
        " while a daemon has it open. Its blocks are lost",
    )  # fmt: skip
    _tls_arguments(p, "this daemon's certificate (PEM): serves its port over TLS with --tls-data")


def _arenas(args: argparse.Namespace) -> int:
    """--list-arenas and --remove-arena: leftovers of daemons that are gone for good."""
    from kvstore.config import daemon_dram, format_size
    from kvstore.tiers.arena_files import find_arenas, remove_arena

    shm = daemon_dram()
    for name in args.remove_arena:
        freed = remove_arena(daemon_dram(name=name))
        print(f"removed arena {name}: {format_size(freed)} of memory freed" if freed else f"no arena {name}")
    if args.list_arenas:
        arenas = find_arenas(shm.shm_dir)
        for a in arenas:
            state = "in use" if a.in_use else "leftover" if a.name else "leftover (creation cut short)"
            size, held = format_size(a.size), format_size(a.allocated)
            print(f"{a.name or '-':<32} {size:>10} {held:>10} held  {state}  {a.path}")
        if not arenas:
            print(f"no arenas in {shm.shm_dir}")
    return 0


@command("daemon", "run a storage daemon serving one node's DRAM and SSD")
def _daemon(args: argparse.Namespace) -> int:
    from kvstore.config import DaemonConfig
    from kvstore.errors import ConfigError
    from server.daemon.main import run_daemon

    if args.list_arenas or args.remove_arena:
        return _arenas(args)
    if not args.master or not args.name:
        raise ConfigError("kvstore daemon needs --master and --name (or --list-arenas / --remove-arena NAME)")

    config = load(
        DaemonConfig,
        "daemon",
        master=args.master,
        name=args.name,
        host=args.host,
        port=args.port,
        rails=args.rail,
        ucx_port=args.ucx_port,
        **{
            k: v
            for k, v in (
                ("metrics_port", args.metrics_port),
                ("max_connections", args.max_connections),
                ("max_connections_per_peer", args.max_connections_per_peer),
                ("cluster_secret_file", args.cluster_secret_file),
                ("leave_on_exit", args.leave_on_exit or None),
                ("clamp_to_free", args.clamp_to_free or None),
            )
            if v is not None
        },
        **_tls_fields(args),
        dram={"capacity": args.dram, "name": args.arena or args.name},
        ssd={"capacity": args.ssd, "path": args.ssd_dir if args.ssd else None},
    )
    return run_daemon(config)


@arguments("tenants")
def _tenants_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "action",
        choices=["add", "add-admin", "list", "remove", "rotate", "set-quota", "set-operations", "set-caps", "usage"],
        help="usage: each tenant's bytes held against its quota, sessions and requests per second, from the"
             " leading master (--master or --admin, --json); the others edit --file:"
             " add: a new tenant; add-admin: a new admin API token (--role); list: every tenant and admin;"
             " remove: a tenant (its open sessions end within seconds); rotate: a new token, the old one"
             " taken for --grace seconds more; set-quota / set-operations / set-caps (--max-sessions,"
             " --max-objects, --max-pinned, --max-inflight-bytes, --replicas): change them (open sessions"
             " follow). Tokens are printed once",
    )  # fmt: skip
    p.add_argument(
        "name", nargs="?", help="the tenant's name (letters, digits, '_' and '-'; its keys live under NAME/)"
    )
    p.add_argument("--grace", type=float, default=300.0, help="rotate: seconds the old token is still taken")
    p.add_argument("--role", choices=["read-only", "operator"], default="read-only",
                   help="add-admin: read-only (every GET route) or operator (also evict and drain)")  # fmt: skip
    p.add_argument("--file", type=Path, help="the tenants file the master reads (--tenants); every action but usage")
    p.add_argument("--quota", type=size_arg, default=0, help="bytes the tenant may hold, DRAM and SSD (0: no quota)")
    p.add_argument(
        "--operations",
        default="read,write,remove",
        help="what the tenant may do, comma-separated: read, write, remove",
    )
    p.add_argument("--max-sessions", type=int, help="set-caps: sessions at once on the master and on each daemon"
                   " (0: the cluster's tenant_max_sessions)")  # fmt: skip
    p.add_argument("--max-objects", type=int, help="set-caps: keys the tenant may hold (0: no cap beyond its quota)")
    p.add_argument("--max-pinned", type=int, help="set-caps: pinned keys the tenant may hold (0: no cap)")
    p.add_argument("--max-inflight-bytes", type=size_arg, help="set-caps: bytes of frames begun and not finished,"
                   " over its sessions, on the master and on each daemon (0: tenant_max_inflight_bytes)")  # fmt: skip
    p.add_argument("--replicas", type=int, help="set-caps: copies each of the tenant's puts gets at least,"
                   " whatever its clients ask (0: as they ask)")  # fmt: skip
    from kvstore_cli.ops import connection_arguments

    connection_arguments(p)


@command("tenants", "manage the tenants of a cluster that authenticates")
def _tenants(args: argparse.Namespace) -> int:
    from kvstore.errors import ConfigError
    from kvstore.tenants import (
        add_admin,
        add_tenant,
        load_access,
        remove_tenant,
        rotate_tenant,
        set_tenant,
    )

    if args.action == "usage":
        from kvstore_cli.ops import tenants_usage

        return tenants_usage(args)
    if args.file is None:
        raise ConfigError(f"kvstore tenants {args.action} needs --file, the tenants file the master reads")
    operations = tuple(o.strip() for o in args.operations.split(",") if o.strip())
    if args.action == "list":
        access = load_access(args.file)
        print(f"{'tenant':<24} {'quota':>14}  operations          caps (sessions/objects/pinned/inflight)  replicas"
              "  token")  # fmt: skip
        for t in sorted(access.tenants.values(), key=lambda t: t.name):
            quota = str(t.quota_bytes) if t.quota_bytes else "none"
            until = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t.previous_until_ms / 1000))
            rotating = (
                f"rotated; the old one taken until {until}" if t.previous_until_ms > time.time() * 1000 else "one"
            )
            limits = (t.max_sessions, t.max_objects, t.max_pinned, t.max_inflight_bytes)
            caps = "/".join(str(c) if c else "-" for c in limits)
            print(f"{t.name:<24} {quota:>14}  {','.join(sorted(t.operations)):<18}  {caps:<39}  "
                  f"{t.replicas or '-':>8}  {rotating}")  # fmt: skip
        for a in sorted(access.admins.values(), key=lambda a: a.name):
            print(f"{a.name:<24} {'(admin API)':>14}  {a.role}")
        return 0
    if not args.name:
        raise ConfigError(f"kvstore tenants {args.action} needs the tenant's name")
    if args.action == "remove":
        remove_tenant(args.file, args.name)
        print(f"tenant {args.name} removed from {args.file}: its sessions end within seconds", file=sys.stderr)
        return 0
    if args.action == "rotate":
        print(rotate_tenant(args.file, args.name, args.grace))
        print(f"tenant {args.name} has a new token, shown this once; the old one is taken for {args.grace:g} s more",
              file=sys.stderr)  # fmt: skip
        return 0
    if args.action in ("set-quota", "set-operations", "set-caps"):
        if args.action == "set-quota":
            set_tenant(args.file, args.name, quota_bytes=args.quota)
        elif args.action == "set-caps":
            given = (args.max_sessions, args.max_objects, args.max_pinned, args.max_inflight_bytes, args.replicas)
            if all(v is None for v in given):
                raise ConfigError("kvstore tenants set-caps needs --max-sessions, --max-objects, --max-pinned,"
                                  " --max-inflight-bytes or --replicas")  # fmt: skip
            set_tenant(args.file, args.name, max_sessions=args.max_sessions, max_objects=args.max_objects,
                       max_pinned=args.max_pinned, max_inflight_bytes=args.max_inflight_bytes,
                       replicas=args.replicas)  # fmt: skip
        else:
            set_tenant(args.file, args.name, operations=operations)
        print(f"tenant {args.name} changed in {args.file}: open sessions follow within seconds", file=sys.stderr)
        return 0
    if args.action == "add-admin":
        print(add_admin(args.file, args.name, args.role))
        print(f"admin {args.name} ({args.role}) added to {args.file}; its token is shown this once"
              " (the admin API's bearer token: KVSTORE_ADMIN_TOKEN)", file=sys.stderr)  # fmt: skip
        return 0
    token = add_tenant(args.file, args.name, args.quota, operations)
    print(token)
    print(f"tenant {args.name} added to {args.file}; its token is shown this once (clients: KVSTORE_TOKEN)",
          file=sys.stderr)  # fmt: skip
    return 0


@arguments("certs")
def _certs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", type=Path, help="where the CA (ca.pem, ca.key; made on first use) and NAME.pem go")
    p.add_argument("--name", default="kvstore", help="the certificate's name (its files: NAME.pem, NAME.key)")
    p.add_argument("--hosts", required=True, help="comma-separated IP addresses and DNS names peers reach it at")


@command("certs", "make a cluster CA and a TLS certificate signed by it (for --tls-cert/--tls-key/--tls-ca)")
def _certs(args: argparse.Namespace) -> int:
    from kvstore_cli.certs import make_certs

    files = make_certs(args.directory, args.name, [h.strip() for h in args.hosts.split(",") if h.strip()])
    print(f"--tls-cert {files.cert} --tls-key {files.key} --tls-ca {files.ca}")
    return 0


@arguments("cluster")
def _cluster_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up"], help="up: start a local cluster and keep it running until Ctrl-C")
    p.add_argument("--daemons", type=int, default=2)
    p.add_argument("--dram", default="256MiB", help="DRAM per daemon")
    p.add_argument("--ssd", default="0", help="SSD per daemon")
    p.add_argument("--port", type=int, default=50051, help="master port (0: any free port)")
    p.add_argument("--admin-port", type=int, default=50052, help="admin API and dashboard port (0: any free port)")


@command("cluster", "start a local cluster: a master and daemons as processes on loopback")
def _cluster(args: argparse.Namespace) -> int:
    import signal
    import time

    from kvstore_cli.cluster import LocalCluster

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # unwinds through the ``with``: children stopped, arenas removed

    # Ctrl-C, kill (SIGTERM) and a closed terminal all stop the cluster cleanly; SIGINT too when
    # a non-interactive shell started us in the background with it ignored.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, stop)
    with LocalCluster(
        args.daemons,
        dram=args.dram,
        ssd=args.ssd,
        master_port=args.port,
        admin=True,
        admin_port=args.admin_port,
        die_with_parent=True,  # killed outright, it takes its processes with it (their arenas stay: --list-arenas)
    ) as cluster:
        try:  # from the first line printed: a signal may come as soon as a reader sees the master
            print(f"master  {cluster.master_address}", flush=True)
            print(f"admin   http://{cluster.admin_address}  (REST API, /metrics, dashboard)", flush=True)
            for i, address in enumerate(cluster.daemon_addresses):
                print(f"daemon  {cluster.node_name(i)}  {address}", flush=True)
            print("cluster up; Ctrl-C stops it", flush=True)
            return _supervise(cluster, time.monotonic)
        except KeyboardInterrupt:
            return 0


RESTARTS_PER_MINUTE = 5
"""A daemon of ``cluster up`` that dies is started again, up to this many times a minute (all daemons
together); one more death stops the cluster."""


def _supervise(cluster: LocalCluster, clock: Callable[[], float]) -> int:
    """Until the master exits: a daemon that dies is started again as it was (its name, arena and SSD
    directory: it re-attaches what it held), as a service manager would; one that keeps dying stops
    the cluster."""
    import time

    from kvstore.errors import KVStoreError

    restarts: list[float] = []
    while cluster.master is not None and cluster.master.poll() is None:
        for i, proc in enumerate(cluster.daemons):
            if proc is None or proc.poll() is None:
                continue
            now = clock()
            restarts = [t for t in restarts if now - t < 60] + [now]
            name = cluster.node_name(i)
            print(f"daemon {name} exited (code {proc.returncode}); its log ends:\n{cluster.log_tail(i)}",
                  file=sys.stderr, flush=True)  # fmt: skip
            if len(restarts) > RESTARTS_PER_MINUTE:
                print(f"daemons died {len(restarts)} times within a minute; stopping", file=sys.stderr)
                return 1
            try:
                cluster.restart_daemon(i)
            except KVStoreError as exc:  # it died again at start, or did not register: one more death
                print(f"daemon {name} did not start again: {exc}", file=sys.stderr, flush=True)
                continue
            print(f"daemon  {name}  {cluster.daemon_addresses[i]}  (restarted)", flush=True)
        time.sleep(0.5)
    print("the master exited; stopping", file=sys.stderr)
    return 1
