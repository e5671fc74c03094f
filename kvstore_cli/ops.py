"""Operator commands over the master's REST admin API: status, nodes, node, key, keys, evict, drain, top.

Human tables by default (rich), ``--json`` for scripts. ``--admin H:P`` names
the admin API; ``--master H:P`` asks the master where it is (authenticating with
``KVSTORE_TOKEN`` or ``KVSTORE_CLUSTER_SECRET`` where it asks for it). The bearer token is
``KVSTORE_ADMIN_TOKEN`` (an operator's or an admin's) or else ``KVSTORE_TOKEN`` (a tenant's: its
own keys only). Errors are the API's typed errors.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from kvstore.auth import Credential, cluster_credential, secret_from
from kvstore.config import ClientConfig, TlsConfig, format_size
from kvstore.errors import ConnectionFailed, InvalidArgument, KVStoreError, error_from_code
from kvstore.protocol import AdminInfo, AdminInfoReply
from kvstore_cli.registry import arguments, command
from kvstore_client.credentials import master_credential
from transfer.discovery import MasterLocator, read_leader, read_masters
from transfer.rpc import Connection
from transfer.tls import client_context


class AdminClient:
    """JSON over HTTP to the admin API; a 4xx/5xx answer raises its typed error."""

    def __init__(
        self, address: str, token: str | None = None, timeout: float = 10.0, tls: ssl.SSLContext | None = None
    ) -> None:
        """``tls``: the admin API is served over TLS (https), verified with this context."""
        self.base = f"{'https' if tls is not None else 'http'}://{address}"
        self.token = token
        self.timeout = timeout
        self.tls = tls

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        if self.token:
            req.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout, context=self.tls) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            try:
                err = json.loads(exc.read())
            except ValueError:
                raise KVStoreError(f"{method} {path}: HTTP {exc.code}") from None
            if exc.code == 401:
                raise InvalidArgument(f"{err.get('message')} (set KVSTORE_ADMIN_TOKEN or KVSTORE_TOKEN)") from None
            raise error_from_code(int(err.get("code") or 0), str(err.get("message"))) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ConnectionFailed(f"admin API at {self.base}: {reason}") from None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def post(self, path: str, body: Any = None) -> Any:
        return self.request("POST", path, body if body is not None else {})


def connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--master",
        default="127.0.0.1:50051",
        help="the master's RPC host:port, or etcd://H:2379[,H2:2379]/ID for an HA cluster (asked for the admin API)",
    )
    p.add_argument("--admin", default=None, help="the admin API's host:port (instead of asking the master)")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="the master serves TLS: verify it with this CA")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="a client certificate (--tls-verify-clients)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="the private key of --tls-cert")


def _client(args: argparse.Namespace) -> AdminClient:
    address = args.admin
    tls = (
        client_context(TlsConfig(ca_file=args.tls_ca, cert_file=args.tls_cert, key_file=args.tls_key))
        if args.tls_ca or args.tls_cert
        else None
    )
    if address is None:
        conn = Connection(MasterLocator(args.master), timeout=5.0, credential=_master_credential(), tls=tls)
        try:
            address = conn.call(AdminInfo(), AdminInfoReply).address
        finally:
            conn.close()
        if not address:
            raise InvalidArgument(f"the master at {args.master} serves no admin API (start it with --admin-port)")
    return AdminClient(address, os.environ.get("KVSTORE_ADMIN_TOKEN") or os.environ.get("KVSTORE_TOKEN"), tls=tls)


def _master_credential() -> Credential | None:
    """What a tool proves itself with to a master that authenticates: KVSTORE_TOKEN, else the
    cluster secret of KVSTORE_CLUSTER_SECRET; None for one that does not."""
    credential = master_credential(ClientConfig())
    secret = secret_from(None) if credential is None else None
    return cluster_credential(secret) if secret is not None else credential


def _print(args: argparse.Namespace, data: Any, *renderables: Any) -> int:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        console = Console()
        for r in renderables:
            console.print(r)
    return 0


def _usage(used: int, capacity: int, configured: int | None = None, fault: str = "") -> str:
    pct = 100 * used / capacity if capacity else 0.0
    shown = f"{format_size(used)} / {format_size(capacity)} ({pct:.0f}%)"
    if configured is not None and capacity < configured:  # a full or failing disk
        shown += f" [red]degraded[/red] of {format_size(configured)}: {escape(fault)}"
    return shown


def _summary_table(s: dict[str, Any]) -> Table:
    t = Table(title="cluster", show_header=False)
    t.add_column(style="bold")
    t.add_column(justify="right")
    rates = s["rates"]
    for label, value in (
        ("nodes up / down", f"{s['nodes_up']} / {s['nodes_down']}"),
        ("objects (being written)", f"{s['objects']:,} ({s['pending']:,})"),
        ("DRAM", _usage(s["dram"]["used"], s["dram"]["capacity"])),
        ("SSD", _usage(s["ssd"]["used"], s["ssd"]["capacity"])),
        ("hit rate", f"{100 * s['hit_rate']:.1f}%"),
        ("gets / puts per s", f"{rates['gets_per_s']:.0f} / {rates['puts_per_s']:.0f}"),
        ("read / written per s", f"{format_size(int(rates['read_bytes_per_s']))} / "
                                 f"{format_size(int(rates['written_bytes_per_s']))}"),
        ("evictions / demotions / promotions", f"{s['counters']['evictions']} / {s['counters']['demotions']} / "
                                               f"{s['counters']['promotions']}"),
    ):  # fmt: skip
        t.add_row(label, value)
    return t


def _nodes_table(nodes: list[dict[str, Any]]) -> Table:
    t = Table(title="nodes")
    for col in ("node", "state", "address", "DRAM", "SSD", "blocks", "heartbeat"):
        t.add_column(col, justify="right" if col in ("blocks", "heartbeat") else "left")
    for n in nodes:
        d, s = n["tiers"]["dram"], n["tiers"]["ssd"]
        state = "draining" if n["draining"] else "up" if n["up"] else "[red]down[/red]"
        ssd = _usage(s["used"], s["capacity"], s.get("configured"), n.get("faults", {}).get("ssd", ""))
        t.add_row(n["node_id"], state, n["address"], _usage(d["used"], d["capacity"]), ssd,
                  f"{d['blocks'] + s['blocks']:,}", f"{n['last_heartbeat_ms_ago'] / 1000:.1f} s ago")  # fmt: skip
    return t


@arguments("status")
def _status_arguments(p: argparse.ArgumentParser) -> None:
    connection_arguments(p)


@command("status", "cluster summary: nodes, tier use, objects, hit rate, rates; masters and alerts firing")
def _status(args: argparse.Namespace) -> int:
    client = _client(args)
    summary = client.get("/api/v1/cluster")
    alerts = _optional(client, "/api/v1/alerts")
    summary["alerts"] = alerts
    alerts_shown = (_alerts_table(alerts),) if "error_reading" not in alerts else ()
    locator = MasterLocator(args.master)
    if locator.cluster is None:
        return _print(args, summary, _summary_table(summary), *alerts_shown)
    leader = read_leader(locator.cluster, 5.0)
    masters = read_masters(locator.cluster, 5.0)
    summary["ha"] = {
        "cluster_id": locator.cluster.cluster_id,
        "etcd": list(locator.cluster.endpoints),
        "leader": leader.address if leader else None,
        "epoch": leader.epoch if leader else None,
        "standbys": [m.address for m in masters if leader is None or m.address != leader.address],
    }
    ha = Table(title=f"HA cluster {locator.cluster.cluster_id}", show_header=False)
    ha.add_column(style="bold")
    ha.add_column()
    ha.add_row("leader", f"{leader.address} (epoch {leader.epoch})" if leader else "none (an election)")
    ha.add_row("standbys", ", ".join(summary["ha"]["standbys"]) or "none")
    ha.add_row("etcd", ", ".join(locator.cluster.endpoints))
    listed = _optional(client, "/api/v1/masters")
    summary["ha"]["masters"] = listed.get("masters", [])
    shown = (_masters_table(listed["masters"]),) if "masters" in listed else ()
    return _print(args, summary, _summary_table(summary), ha, *shown, *alerts_shown)


def _optional(client: AdminClient, path: str) -> dict[str, Any]:
    """A route ``kvstore status`` shows when the master serves it ({"error_reading": why} when not: an
    older master in a rolling upgrade, say), so the summary is shown all the same."""
    try:
        got: dict[str, Any] = client.get(path)
        return got
    except KVStoreError as exc:
        return {"error_reading": f"{path}: {exc}"}


def _masters_table(masters: list[dict[str, Any]]) -> Table:
    t = Table(title="masters")
    for col in ("master", "role", "behind the leader", "lease confirmed", "etcd"):
        t.add_column(col)
    for m in masters:
        seen = m["leader_epoch_seen"]
        behind = "-" if m["follows"] is None else "follows" if m["follows"] else f"behind (last saw epoch {seen})"
        lease = "-" if m["lease_confirmed_s_ago"] is None else f"{m['lease_confirmed_s_ago']:.1f} s ago"
        etcd = "-" if m["etcd_reachable"] is None else "reachable" if m["etcd_reachable"] else "[red]unreachable[/red]"
        role = m["role"] if not m.get("error") else f"[red]{m['role']}[/red] {escape(m['error'])}"
        t.add_row(m["address"], role, behind, lease, etcd)
    return t


def _alerts_table(alerts: dict[str, Any]) -> Table:
    source = "Prometheus" if alerts["source"] == "prometheus" else "the master's own view"
    t = Table(title=f"alerts firing ({source}{'; ' + alerts['error'] if alerts.get('error') else ''})")
    for col in ("alert", "severity", "labels", "summary"):
        t.add_column(col)
    for a in alerts["alerts"]:
        labels = " ".join(f"{k}={v}" for k, v in sorted(a["labels"].items()))
        severity = f"[red]{a['severity']}[/red]" if a["severity"] == "page" else a["severity"]
        t.add_row(a["name"], severity, escape(labels), escape(a["summary"]))
    if not alerts["alerts"]:
        t.add_row("none", "", "", "")
    return t


def tenants_usage(args: argparse.Namespace) -> int:
    """``kvstore tenants usage``: each tenant's bytes held against its quota, sessions and requests."""
    usage = _client(args).get("/api/v1/tenants")
    t = Table(title="tenants")
    for col in ("tenant", "held / quota", "sessions", "requests / s", "requests"):
        t.add_column(col, justify="left" if col in ("tenant", "held / quota") else "right")
    for u in usage["tenants"]:
        held = (_usage(u["held_bytes"], u["quota_bytes"]) if u["quota_bytes"]
                else f"{format_size(u['held_bytes'])} (no quota)")  # fmt: skip
        t.add_row(u["tenant"], held, str(u["sessions"]), f"{u['requests_per_s']:.1f}", f"{u['requests']:,}")
    return _print(args, usage, t)


@arguments("nodes")
def _nodes_arguments(p: argparse.ArgumentParser) -> None:
    connection_arguments(p)


@command("nodes", "every node: state, address, tier use, blocks, last heartbeat")
def _nodes(args: argparse.Namespace) -> int:
    nodes = _client(args).get("/api/v1/nodes")
    return _print(args, nodes, _nodes_table(nodes["nodes"]))


@arguments("node")
def _node_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("node_id")
    connection_arguments(p)


@command("node", "one node: tiers, NICs, rails, transfer bytes")
def _node(args: argparse.Namespace) -> int:
    n = _client(args).get(f"/api/v1/nodes/{urllib.parse.quote(args.node_id, safe='')}")
    tiers = Table(title=f"node {n['node_id']} ({'draining' if n['draining'] else 'up' if n['up'] else 'down'})")
    for col in ("tier", "used", "blocks", "pinned", "leased"):
        tiers.add_column(col)
    for name, u in n["tiers"].items():
        tiers.add_row(name, _usage(u["used"], u["capacity"]), str(u["blocks"]), str(u["pinned"]), str(u["leased"]))
    nics = Table(title="NICs")
    for col in ("name", "address", "speed", "NUMA"):
        nics.add_column(col)
    for nic in n["nics"]:
        speed = f"{nic['speed_mbps']} Mb/s" if nic["speed_mbps"] > 0 else "?"
        nics.add_row(nic["name"], nic["address"], speed, str(nic["numa_node"]) if nic["numa_node"] >= 0 else "-")
    info = Table(show_header=False)
    info.add_column(style="bold")
    info.add_column()
    info.add_row("rails", ", ".join(n["rails"]))
    info.add_row("UCX", n["ucx_address"] or "-")
    info.add_row("last heartbeat", f"{n['last_heartbeat_ms_ago'] / 1000:.1f} s ago")
    for name, value in sorted(n["transfer_bytes"].items()):
        info.add_row(name.replace("|", " "), format_size(value))
    return _print(args, n, tiers, nics, info)


@arguments("key")
def _key_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("key")
    connection_arguments(p)


@command("key", "one key's metadata: size, checksum, write id, pin, replicas and their tiers and leases")
def _key(args: argparse.Namespace) -> int:
    k = _client(args).get(f"/api/v1/keys/{urllib.parse.quote(args.key, safe='')}")
    write = f", write {k['write_id']:#x}" if k.get("write_id") else ""
    t = Table(title=f"{k['key']}: {format_size(k['size'])}, {k['state']}, checksum {k['checksum']:#018x}"
                    f"{write}{', pinned' if k['pinned'] else ''}")  # fmt: skip
    for col in ("node", "tier", "offset", "leased", "moving", "dropping", "node up"):
        t.add_column(col)
    for r in k["replicas"]:
        t.add_row(r["node_id"], r["tier"], str(r["offset"]) if r["offset"] >= 0 else "-", str(r["leased"]),
                  str(r["moving"]), str(r.get("dropping", False)), str(r["node_up"]))  # fmt: skip
    return _print(args, k, t)


@arguments("keys")
def _keys_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefix", default="", help="keys that start with this")
    p.add_argument("--limit", type=int, default=100, help="keys per page (1-10000)")
    p.add_argument("--cursor", default=None, help="the next_cursor of the previous page")
    connection_arguments(p)


@command("keys", "stored keys by prefix, a page at a time")
def _keys(args: argparse.Namespace) -> int:
    query = {"prefix": args.prefix, "limit": str(args.limit)}
    if args.cursor:
        query["cursor"] = args.cursor
    page = _client(args).get("/api/v1/keys?" + urllib.parse.urlencode(query))
    lines = "\n".join(page["keys"]) or "(none)"
    more = f"\n[dim]more: --cursor {page['next_cursor']}[/dim]" if page["next_cursor"] else ""
    return _print(args, page, lines + more)


@arguments("evict")
def _evict_arguments(p: argparse.ArgumentParser) -> None:
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--key", help="one key")
    what.add_argument("--prefix", help="every key that starts with this")
    what.add_argument("--node", help="a node's tier (with --tier)")
    p.add_argument("--tier", choices=["dram", "ssd"], help="with --node: dram demotes to SSD where it fits, ssd drops")
    connection_arguments(p)


@command("evict", "evict a key, every key with a prefix, or a node's tier (pinned blocks stay)")
def _evict(args: argparse.Namespace) -> int:
    if (args.node is None) != (args.tier is None):
        raise InvalidArgument("--node and --tier go together")
    body = {"key": args.key} if args.key else {"prefix": args.prefix} if args.prefix is not None else {
        "node_id": args.node, "tier": args.tier}  # fmt: skip
    result = _client(args).post("/api/v1/evict", body)
    skipped = f", {len(result['skipped_pinned'])} pinned kept" if result["skipped_pinned"] else ""
    return _print(args, result, f"evicted {result['evicted']}{skipped}")


@arguments("drain")
def _drain_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("node_id")
    connection_arguments(p)


@command("drain", "take a node out of placement and move its blocks to other nodes")
def _drain(args: argparse.Namespace) -> int:
    node_id = urllib.parse.quote(args.node_id, safe="")
    result = _client(args).post(f"/api/v1/nodes/{node_id}/drain")
    left = result["blocks_left"]
    note = "drained" if left == 0 else f"{left} blocks could not be moved (no room elsewhere); drain again later"
    _print(args, result, f"{result['node_id']}: {note}")
    return 0 if left == 0 else 1


@arguments("top")
def _top_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (0: until Ctrl-C)")
    connection_arguments(p)


@command("top", "live cluster summary and nodes, refreshed every --interval seconds")
def _top(args: argparse.Namespace) -> int:
    client = _client(args)
    done = 0

    def frame() -> tuple[dict[str, Any], Group]:
        summary, nodes = client.get("/api/v1/cluster"), client.get("/api/v1/nodes")
        return {"cluster": summary, **nodes}, Group(_summary_table(summary), _nodes_table(nodes["nodes"]))

    if args.json:
        while not args.iterations or done < args.iterations:
            print(json.dumps(frame()[0], sort_keys=True), flush=True)
            done += 1
            time.sleep(args.interval)
        return 0
    with Live(frame()[1], refresh_per_second=4, console=Console()) as live:
        while True:
            done += 1
            if args.iterations and done >= args.iterations:
                return 0
            time.sleep(args.interval)
            live.update(frame()[1])
