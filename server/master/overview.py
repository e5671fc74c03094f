"""What the dashboard and ``kvstore status`` show beyond one master's table: every master of the
cluster as it sees itself, and the alerts that fire (Prometheus's, or this master's own view).

Each master is asked over its admin API (``/api/v1/leadership``) with the caller's own credentials,
so an operator sees no more through one master than its token lets it see on the others; a master
that does not answer within :data:`ASK_TIMEOUT_S` is shown unreachable, with the reason.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import ssl
from typing import TYPE_CHECKING, Any

import aiohttp

from kvstore.errors import ConnectionFailed
from server.master.alerts import NOT_JUDGED, OwnAlerts
from transfer.discovery import MasterRecord
from transfer.tls import client_context

if TYPE_CHECKING:
    from server.master.service import MasterService

ASK_TIMEOUT_S = 1.0
"""How long another master's admin API, or Prometheus, has to answer."""


def _client_tls(service: MasterService) -> ssl.SSLContext | None:
    tls = service.config.tls
    return client_context(tls) if service.tls is not None and tls is not None else None


RELAYED = "X-Kvstore-Relayed-By"
"""Set on a request one master relays to the leader (never relayed again) and on its answer."""


async def _get(url: str, headers: dict[str, str], tls: ssl.SSLContext | None, timeout_s: float) -> tuple[int, bytes]:
    """The status and body of a GET of ``url`` (``tls``: https, verified with it), within ``timeout_s``."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
        session.get(url, headers=headers, ssl=tls if tls is not None else False) as resp,
    ):
        return resp.status, await resp.read()


async def _get_json(url: str, headers: dict[str, str], tls: ssl.SSLContext | None) -> Any:
    status, body = await _get(url, headers, tls, ASK_TIMEOUT_S)
    if status != 200:
        raise ConnectionFailed(f"{url}: HTTP {status}")
    return json.loads(body)


NOT_ASKED = (
    "not asked: the caller's token (of the tenants file) may cross a network only over TLS; use"
    " KVSTORE_ADMIN_TOKEN or TLS for the admin API"
)


def on_this_host(address: str | None) -> bool:
    """Whether ``address`` (host:port) is a loopback address: a token sent there crosses no network."""
    if not address:
        return False
    host = address.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def masters(service: MasterService, authorization: str | None, anywhere: bool = True) -> dict[str, Any]:
    """Every master listed in etcd as it sees itself (this one alone without etcd, or with the reason
    when etcd does not answer it now), as MasterList. ``anywhere``: the caller's credentials may be
    sent to any other master (see AdminApi's ``relay``); otherwise only to those on this host, and the
    others are listed, not asked."""
    own = service.role()
    address = service.leadership.address
    me = {"address": address, "admin": service.admin_address or None, "role": own["role"],
          "leader_epoch_seen": own["leader_epoch"] or own["epoch"] or None, "follows": True,
          "lease_confirmed_s_ago": own["lease_confirmed_s_ago"], "etcd_reachable": own["etcd_reachable"] if own["ha"]
          else None, "ready": own["ready"]}  # fmt: skip
    election = service.leadership.election
    if election is None:
        return {"cluster_id": "", "leader": address, "epoch": 0, "masters": [me], "error": ""}
    leader = election.leader
    epoch = leader.epoch if leader is not None else 0
    me["follows"] = bool(epoch) and me["leader_epoch_seen"] == epoch
    base = {"cluster_id": election.cluster.cluster_id, "leader": leader.address if leader else None, "epoch": epoch}
    try:
        records = await election.masters()
    except ConnectionFailed as exc:
        return {**base, "masters": [me], "error": f"the other masters are unknown: {exc}"}
    headers = {"Authorization": authorization} if authorization else {}
    tls = _client_tls(service)
    scheme = "https" if tls is not None else "http"

    async def view(record: MasterRecord) -> dict[str, Any]:
        if record.address == address:
            return me
        out: dict[str, Any] = {"address": record.address, "admin": record.admin, "role": "unreachable",
                               "leader_epoch_seen": None, "follows": None, "lease_confirmed_s_ago": None,
                               "etcd_reachable": None, "ready": None}  # fmt: skip
        if not anywhere and not on_this_host(record.admin):
            return {**out, "role": "unknown", "error": NOT_ASKED}
        try:
            if record.admin is None:
                raise ConnectionFailed("it serves no admin API")
            seen = await _get_json(f"{scheme}://{record.admin}/api/v1/leadership", headers, tls)
        except (ConnectionFailed, aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            return {**out, "error": str(exc) or type(exc).__name__}
        seen_epoch = seen.get("leader_epoch") or seen.get("epoch") or None
        return {**out, "role": seen["role"], "leader_epoch_seen": seen_epoch,
                "follows": bool(epoch) and seen_epoch == epoch,
                **{name: seen.get(name) for name in ("lease_confirmed_s_ago", "etcd_reachable", "ready")}}  # fmt: skip

    views = await asyncio.gather(*(view(r) for r in records))
    if not any(r.address == address for r in records):
        views.append(me)  # not listed (yet, or any more): still this master
    return {**base, "masters": list(views), "error": ""}


async def relay(
    service: MasterService, admin: str, path_qs: str, authorization: str | None
) -> tuple[int, bytes] | None:
    """The leader's answer to a GET of ``path_qs`` at its admin API ``admin`` (status, JSON body),
    asked with the caller's credentials; None when it does not answer."""
    tls = _client_tls(service)
    headers = {RELAYED: service.leadership.address}
    if authorization:
        headers["Authorization"] = authorization
    url = f"{'https' if tls is not None else 'http'}://{admin}{path_qs}"
    try:
        return await _get(url, headers, tls, 2 * ASK_TIMEOUT_S)
    except (aiohttp.ClientError, TimeoutError, OSError):
        return None


async def alerts(service: MasterService, own: OwnAlerts) -> dict[str, Any]:
    """The alerts firing now, as AlertList: Prometheus's when ``MasterConfig.prometheus_url`` is set
    and answers, else this master's own view of the same rules."""
    url = service.config.prometheus_url
    error = ""
    if url:
        try:
            got = await _get_json(url.rstrip("/") + "/api/v1/alerts", {}, None)
            firing = [a for a in got["data"]["alerts"] if a.get("state") == "firing"]
            return {"source": "prometheus", "alerts": [
                {"name": a["labels"].get("alertname", ""), "severity": a["labels"].get("severity", ""),
                 "labels": {k: v for k, v in a["labels"].items() if k not in ("alertname", "severity")},
                 "summary": a.get("annotations", {}).get("summary", ""),
                 "value": _number(a.get("value"))}
                for a in firing
            ]}  # fmt: skip
        except (TimeoutError, ConnectionFailed, aiohttp.ClientError, OSError, ValueError, KeyError) as exc:
            error = f"Prometheus at {url} did not answer: {str(exc) or type(exc).__name__}"
    return {"source": "master", "error": error, "not_judged": NOT_JUDGED, "alerts": [
        {"name": a.name, "severity": a.severity, "labels": a.labels, "summary": a.summary, "value": a.value,
         "since_s": a.since_s}
        for a in own.firing()
    ]}  # fmt: skip


def _number(value: object) -> float | None:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
