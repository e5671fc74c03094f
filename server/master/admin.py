"""The master's REST admin API (aiohttp, pydantic models), Prometheus ``/metrics`` (its collector is
:class:`server.master.metrics.MasterCollector`) and dashboard.

Everything under ``/api/v1`` answers JSON; an error is ``{"code", "error",
"message"}`` with a 4xx status for a bad request or an unknown thing. Every
route is declared once with its models, and the OpenAPI 3 document at
``/api/v1/openapi.json`` is generated from those declarations.

Who may call what. With no token configured and no cluster secret, anyone may (loopback use).
Otherwise every route but health, the dashboard page and its static files needs
``Authorization: Bearer <token>``, and the token decides:

- ``KVSTORE_ADMIN_TOKEN``, or an admin of the tenants file with role ``operator``: everything;
- an admin with role ``read-only``: every GET route and ``/metrics``, no eviction or drain;
- a tenant's own token: the key routes only, inside its namespace (it lists, describes and, with
  the remove operation, evicts its own keys, named without their ``NAME/``); everything else 403.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema

from kvstore.errors import InvalidArgument, KVStoreError, NotFound, NotLeader, NotReady, PermissionDenied
from kvstore.keys import validate_key
from kvstore.policy import TierName
from kvstore.tenants import Admin, Tenant
from server.master.admin_guard import AdminGuard
from server.master.admin_models import (
    AlertList,
    ClusterSummary,
    DrainResult,
    ErrorBody,
    EvictionModel,
    EvictionPage,
    EvictKey,
    EvictRequest,
    EvictResult,
    EvictTier,
    Health,
    History,
    HistoryPoint,
    KeyModel,
    KeyPage,
    Leadership,
    MasterList,
    NicModel,
    NodeList,
    NodeModel,
    Rates,
    Ready,
    TenantUsage,
    TenantUsageList,
    TierUsage,
)
from server.master.alerts import OwnAlerts, samples_of
from server.master.metrics import MasterCollector
from server.master.overview import RELAYED, on_this_host, relay
from server.master.overview import alerts as alerts_now
from server.master.overview import masters as masters_now

if TYPE_CHECKING:
    from server.master.nodes import NodeView
    from server.master.service import MasterService

STATIC = Path(__file__).parent / "static"
log = logging.getLogger("kvstore.master.admin")
M = TypeVar("M", bound=BaseModel)


# -- routes ------------------------------------------------------------------------------------------
Handler = Callable[["AdminApi", web.Request], Awaitable[BaseModel]]
_Next = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    handler: Handler
    response: type[BaseModel]
    summary: str
    body: type[BaseModel] | None = None
    query: tuple[tuple[str, dict[str, Any], bool], ...] = ()
    """(name, JSON schema, required) of each query parameter."""
    errors: tuple[int, ...] = (400,)
    public: bool = False
    tenants: bool = False
    """Whether tenants may call it (on their own keys)."""


@dataclass(frozen=True)
class Caller:
    """Who an admin request comes from: a role, and for a tenant its entry (and namespace)."""

    role: Literal["operator", "read-only", "tenant"]
    tenant: Tenant | None = None

    def refusal(self, method: str, r: Route | None) -> str | None:
        """Why this caller may not call ``method`` on route ``r`` (None: a route of no model, as
        /metrics); None when it may."""
        if self.tenant is not None:
            if r is None or not r.tenants:
                return f"tenant {self.tenant.name!r} may use only the key routes of the admin API"
            needed = "read" if method == "GET" else "remove"
            if needed not in self.tenant.operations:
                return f"tenant {self.tenant.name!r} is not allowed to {needed}"
        elif self.role == "read-only" and method not in ("GET", "HEAD"):
            return "a read-only admin token may not change anything"
        return None

    @property
    def prefix(self) -> str:
        return f"{self.tenant.name}/" if self.tenant is not None else ""

    def key(self, name: str) -> str:
        """A key as the caller names it -> as the store names it."""
        return validate_key(self.prefix + name)

    def shown(self, name: str) -> str:
        """A key as the store names it -> as the caller names it."""
        return name[len(self.prefix) :]


OPERATOR = Caller("operator")


ROUTES: list[Route] = []


def route(method: str, path: str, response: type[BaseModel], summary: str, **kw: Any) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        ROUTES.append(Route(method, path, fn, response, summary, **kw))
        return fn

    return register


class AdminApi:
    def __init__(self, service: MasterService, token: str | None) -> None:
        """``token``: the operator's token (KVSTORE_ADMIN_TOKEN). A master that authenticates also
        takes the admins' and tenants' tokens of its tenants file; one with neither is open."""
        self.service = service
        self.token = token
        self.routes = {(r.method, r.path): r for r in ROUTES}
        self.started = time.monotonic()
        self.registry = CollectorRegistry(auto_describe=False)
        config = service.config
        self.guard = AdminGuard(
            config.admin_header_timeout_s, config.admin_body_timeout_s, config.admin_max_connections
        )
        self.registry.register(MasterCollector(service, self.guard))
        self.app = web.Application(middlewares=[self._errors, self._auth, self._from_leader], client_max_size=1 << 20)
        for r in ROUTES:
            self.app.router.add_route(r.method, r.path, self._wrap(r))
        self.app.router.add_get("/api/v1/openapi.json", self._openapi)
        self.app.router.add_get("/metrics", self._metrics)
        self.app.router.add_get("/", self._index)
        self.app.router.add_static("/static/", STATIC, show_index=False)
        self._runner: web.AppRunner | None = None
        self.address = ""
        self.own_alerts = OwnAlerts()
        """alerts.yml's rules over this master's own metrics, judged every few seconds (see server.master.alerts)."""
        self._judge: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int) -> str:
        """Serve on ``host:port`` (0: any free port); returns host:port, which the service then
        tells tools that ask it by RPC (AdminInfo)."""
        guard = self.guard
        # aiohttp's own idle timeout (between kept-alive requests) just above the guard's head deadline.
        self._runner = web.AppRunner(self.app, access_log=None, keepalive_timeout=guard.header_timeout_s + 1,
                                     lingering_time=0)  # fmt: skip
        await self._runner.setup()
        assert self._runner.server is not None
        guard.install(self._runner.server)
        site = web.TCPSite(self._runner, host, port, ssl_context=self.service.tls)
        await site.start()
        self.address = f"{host}:{self._runner.addresses[0][1]}"
        self.service.admin_address = self.address
        self._judge = asyncio.create_task(self._judge_alerts(), name="admin-alerts")
        return self.address

    async def _judge_alerts(self) -> None:
        """Sample this master's metrics for its own view of the alerts, every few seconds."""
        while True:
            try:
                if self.own_alerts.due():
                    role = self.service.role()
                    facts = {"ha": role["ha"], "leader_known": role["leader"] is not None}
                    self.own_alerts.sample(samples_of(self.registry.collect()), facts)
            except Exception:  # a bug here must not stop the judging, nor the admin API
                log.exception("judging the alerts failed")
            await asyncio.sleep(1.0)

    async def stop(self) -> None:
        if self._judge is not None:
            self._judge.cancel()
        if self._runner is not None:
            self.service.admin_address = ""
            await self._runner.cleanup()

    # -- middleware ----------------------------------------------------------------------------------
    @web.middleware
    async def _errors(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except NotFound as exc:
            return _error(404, exc.code, type(exc).__name__, str(exc))
        except PermissionDenied as exc:
            return _error(403, exc.code, type(exc).__name__, str(exc))
        except (NotLeader, NotReady) as exc:
            return _error(503, exc.code, type(exc).__name__, str(exc))
        except KVStoreError as exc:
            return _error(400, exc.code, type(exc).__name__, str(exc))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors()[:5])
            return _error(400, InvalidArgument.code, "InvalidArgument", problems)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            response = _error(exc.status, 0, type(exc).__name__, exc.reason)
            if "Allow" in exc.headers:  # a 405 names the methods there are (RFC 9110)
                response.headers["Allow"] = exc.headers["Allow"]
            return response

    @web.middleware
    async def _auth(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        if _is_public(request):
            return await handler(request)
        private = self._private(request)
        caller = self._caller(request.headers.get("Authorization", ""), private)
        if caller is None:
            return _error(
                401,
                0,
                "Unauthorized",
                "this route needs 'Authorization: Bearer <token>'"
                + ("" if private else " (tokens of the tenants file: over https only)"),
            )
        resource = request.match_info.route.resource
        r = self.routes.get((request.method, resource.canonical)) if resource is not None else None
        refusal = caller.refusal(request.method, r)
        if refusal is not None and request.path != "/api/v1/openapi.json":
            return _error(403, PermissionDenied.code, "PermissionDenied", refusal)
        request["caller"] = caller
        # Whether this caller's credentials may be sent on to any other master (relayed reads, the
        # masters' list): over TLS, or the operator's token (taken in clear anyway), or none needed;
        # a token of the tenants file goes only to masters on this host, never across a network in clear.
        request["relay"] = self.service.tls is not None or caller is OPERATOR
        return await handler(request)

    @web.middleware
    async def _from_leader(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """A standby answers the cluster's GET routes with the leader's answer (its own table is empty:
        a Service in front of both masters, as on Kubernetes, shows the cluster whichever it picks); its
        own word where that is what is asked (health, readiness, leadership, the masters) or where the
        leader does not answer. Writes stay refused with NotLeader."""
        if (
            request.method != "GET" or not request.path.startswith("/api/v1/") or request.path in _OWN_WORD
            or request.headers.get(RELAYED)
        ):  # fmt: skip
            return await handler(request)
        leader = self.service.leader_admin()
        if leader is None or not (request.get("relay", False) or on_this_host(leader)):
            return await handler(request)
        got = await relay(self.service, leader, request.path_qs, request.headers.get("Authorization"))
        if got is None:
            return await handler(request)
        status, body = got
        return web.Response(status=status, body=body, content_type="application/json",
                            headers={RELAYED: self.service.leadership.address})  # fmt: skip

    def _private(self, request: web.Request) -> bool:
        """Whether a bearer token reached us unseen: over TLS, or from this host."""
        if self.service.tls is not None:
            return True
        try:
            return ipaddress.ip_address(request.remote or "").is_loopback
        except ValueError:
            return False

    def _caller(self, header: str, private: bool) -> Caller | None:
        """Who sent ``header``. Tokens of the tenants file (which also log in over RPC) count only
        when ``private``: a tenant's token must not cross a network in clear."""
        authority = self.service.authority
        if self.token is None and authority is None:
            return OPERATOR  # nothing configured: open, as on loopback before authentication
        # Header bytes that are not UTF-8 come as surrogates: compared as the bytes they were, never a 500.
        given = header.encode("utf-8", "surrogateescape")
        if self.token is not None and hmac.compare_digest(given, f"Bearer {self.token}".encode()):
            return OPERATOR
        scheme, _, token = header.partition(" ")
        if authority is None or scheme != "Bearer" or not token.isascii() or not private:
            return None
        entry = authority.bearer(token)
        if isinstance(entry, Admin):
            return Caller("operator" if entry.role == "operator" else "read-only")
        return Caller("tenant", entry) if entry is not None else None

    def _wrap(self, r: Route) -> Callable[[web.Request], Awaitable[web.Response]]:
        allowed = {name for name, _, _ in r.query}

        async def handle(request: web.Request) -> web.Response:
            for name in request.query:
                if name not in allowed:
                    raise InvalidArgument(f"unknown query parameter {name!r}; {r.path} takes {sorted(allowed)}")
                if len(request.query.getall(name)) > 1:
                    raise InvalidArgument(f"query parameter {name!r} given more than once")
            model = await r.handler(self, request)
            return web.json_response(text=model.model_dump_json())

        return handle

    # -- documents and pages ---------------------------------------------------------------------------
    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _index(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")


def _node_model(api: AdminApi, view: NodeView) -> NodeModel:
    node, info = view.state, view.info
    return NodeModel(
        node_id=view.node_id, address=info.address, rails=info.rails, up=info.up, draining=view.draining,
        last_heartbeat_ms_ago=max(0, api.service.now_ms() - node.last_seen_ms),
        host_id=info.host_id, ucx_address=info.ucx_address,
        nics=[NicModel(name=n.name, address=n.address, speed_mbps=n.speed_mbps, numa_node=n.numa_node)
              for n in info.nics],
        tiers={t: TierUsage(**u) for t, u in view.tiers.items()},
        faults={"ssd": node.ssd_fault} if node.ssd_fault else {},
        commands_in_flight=node.inflight, transfer_bytes=dict(view.transfer_bytes),
    )  # fmt: skip


_OWN_WORD = frozenset((
    "/api/v1/health", "/api/v1/ready", "/api/v1/leadership", "/api/v1/masters", "/api/v1/openapi.json",
    "/api/v1/evictions",  # each master's own log (bench.chaos reads every master's, each with its cursor)
))  # fmt: skip
"""Routes under /api/v1/ a standby answers itself (the others: the leader's answer; /metrics, the page
and its files are always its own)."""


def _is_public(request: web.Request) -> bool:
    path = request.path
    return path in ("/", "/api/v1/health") or path.startswith("/static/")


def _error(status: int, code: int, error: str, message: str) -> web.Response:
    return web.json_response(ErrorBody(code=code, error=error, message=message).model_dump(), status=status)


def _int_query(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"query parameter {name!r} must be an integer, got {raw!r}") from None
    if not low <= value <= high:
        raise InvalidArgument(f"query parameter {name!r} must be in [{low}, {high}], got {value}")
    return value


async def _json_body(request: web.Request, model: type[M]) -> M:
    try:
        raw = await request.json()
    except ValueError:
        raise InvalidArgument("the request body must be JSON") from None
    if not isinstance(raw, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return model.model_validate(raw)


# -- handlers ------------------------------------------------------------------------------------------
@route("GET", "/api/v1/health", Health, "Liveness: the master's event loop answers.", public=True, errors=())
async def health(api: AdminApi, request: web.Request) -> Health:
    return Health(status="ok", uptime_s=round(time.monotonic() - api.started, 3))


@route("GET", "/api/v1/ready", Ready, "Readiness: this master leads, has taken over, and a storage node is up.",
       errors=())  # fmt: skip
async def ready(api: AdminApi, request: web.Request) -> Ready:
    service = api.service
    up = len(service.table.membership.up_nodes())
    refusal = service.refusal()
    reason = str(refusal) if refusal is not None else "" if up else "no storage node is up"
    return Ready(ready=not reason, nodes_up=up, reason=reason)


@route("GET", "/api/v1/leadership", Leadership, "Role, epoch and failovers of this master; etcd as it sees it.",
       errors=())  # fmt: skip
async def leadership(api: AdminApi, request: web.Request) -> Leadership:
    return Leadership(**api.service.role())


@route("GET", "/api/v1/cluster", ClusterSummary, "Nodes, tier capacity and use, objects, hit rate, rates.",
       errors=())  # fmt: skip
async def cluster(api: AdminApi, request: web.Request) -> ClusterSummary:
    table = api.service.table
    usage = table.inspection.node_usage()
    tiers = {t: TierUsage(**{f: sum(u[t][f] for u in usage) for f in TierUsage.model_fields}) for t in ("dram", "ssd")}
    counters = dict(table.counters)
    lookups = counters["hits"] + counters["misses"]
    up = len(table.membership.up_nodes())
    rates = api.service.sampler.rates()
    return ClusterSummary(
        nodes=len(usage), nodes_up=up, nodes_down=len(usage) - up, objects=table.inspection.num_objects(),
        pending=int(table.stats()["pending"]), dram=tiers["dram"], ssd=tiers["ssd"],
        hit_rate=counters["hits"] / lookups if lookups else 0.0,
        rates=Rates(**{k: v for k, v in rates.items() if k != "hit_rate"}), counters=counters,
    )  # fmt: skip


@route("GET", "/api/v1/nodes", NodeList, "Every registered node.", errors=())
async def nodes(api: AdminApi, request: web.Request) -> NodeList:
    return NodeList(nodes=[_node_model(api, v) for v in api.service.nodes.views()])


@route("GET", "/api/v1/nodes/{node_id}", NodeModel, "One node: tiers, NICs, inventory counts, last heartbeat.",
       errors=(404,))  # fmt: skip
async def node(api: AdminApi, request: web.Request) -> NodeModel:
    node_id = request.match_info["node_id"]
    view = api.service.nodes.view(node_id)
    if view is None:
        raise NotFound(f"node {node_id!r} is not registered")
    return _node_model(api, view)


@route("GET", "/api/v1/keys", KeyPage, "Stored keys starting with a prefix, in order, a page at a time.",
       query=(("prefix", {"type": "string"}, False), ("cursor", {"type": "string"}, False),
              ("limit", {"type": "integer", "minimum": 1, "maximum": 10_000}, False)),
       errors=(400,), tenants=True)  # fmt: skip
async def keys(api: AdminApi, request: web.Request) -> KeyPage:
    caller: Caller = request["caller"]
    limit = _int_query(request, "limit", 100, 1, 10_000)
    cursor = request.query.get("cursor")
    page, after = api.service.table.inspection.keys_page(
        caller.prefix + request.query.get("prefix", ""), caller.prefix + cursor if cursor is not None else None, limit
    )
    return KeyPage(keys=[caller.shown(k) for k in page], next_cursor=caller.shown(after) if after else after)


@route("GET", "/api/v1/keys/{key}", KeyModel, "One key's metadata: replicas, tiers, size, lease, pin, checksum.",
       errors=(400, 404), tenants=True)  # fmt: skip
async def key(api: AdminApi, request: web.Request) -> KeyModel:
    caller: Caller = request["caller"]
    shown = validate_key(request.match_info["key"])
    described = api.service.table.inspection.describe(caller.key(shown))
    if described is None:
        raise NotFound(f"key {shown!r} is not stored")
    return KeyModel.model_validate({**described, "key": shown})


def _may_change(api: AdminApi) -> None:
    """Raise why this master must not change the table now (a standby's table is not the cluster's;
    a leader taking over does not know every key yet: "0 evicted" would be an answer it cannot give)."""
    refusal = api.service.refusal()
    if refusal is not None:
        raise refusal


@route("POST", "/api/v1/evict", EvictResult, "Evict a key, every key with a prefix, or a node's tier.",
       body=EvictRequest, errors=(400, 404, 503), tenants=True)  # fmt: skip
async def evict(api: AdminApi, request: web.Request) -> EvictResult:
    caller: Caller = request["caller"]
    req = (await _json_body(request, EvictRequest)).root
    _may_change(api)
    core = api.service.core
    if isinstance(req, EvictTier):
        if caller.tenant is not None:
            raise PermissionDenied(f"tenant {caller.tenant.name!r} may evict its own keys, not a node's tier")
        return EvictResult(evicted=core.evict_tier(req.node_id, TierName(req.tier)), skipped_pinned=[])
    if isinstance(req, EvictKey):
        targets = [caller.key(req.key)]
    else:
        prefix = caller.prefix + req.prefix
        targets = [validate_key(k) for k in core.table.inspection.stored_keys(prefix)]
    evicted, pinned = core.evict_keys(targets)
    return EvictResult(evicted=evicted, skipped_pinned=[caller.shown(k) for k in pinned[:1000]])


@route("GET", "/api/v1/evictions", EvictionPage,
       "What this master evicted, oldest first, a page at a time: key, node, why and when.",
       query=(("after", {"type": "integer", "minimum": 0}, False),
              ("limit", {"type": "integer", "minimum": 1, "maximum": 10_000}, False)),
       errors=(400,), tenants=True)  # fmt: skip
async def evictions(api: AdminApi, request: web.Request) -> EvictionPage:
    caller: Caller = request["caller"]
    after = _int_query(request, "after", 0, 0, 1 << 62)
    limit = _int_query(request, "limit", 1000, 1, 10_000)
    log = api.service.evictions
    log.add(api.service.table.tiering.take_evictions(), time.time())  # what the last tick has not taken yet
    page, last, lost = log.page(after, limit, caller.prefix)
    return EvictionPage(
        evictions=[EvictionModel(seq=e.seq, at=e.at, key=caller.shown(e.key), node_id=e.node_id, reason=e.reason)
                   for e in page],
        next_after=last, lost=lost,
    )  # fmt: skip


@route("POST", "/api/v1/nodes/{node_id}/drain", DrainResult,
       "Take a node out of placement and move its blocks to other nodes.", errors=(400, 404, 503))  # fmt: skip
async def drain(api: AdminApi, request: web.Request) -> DrainResult:
    node_id = request.match_info["node_id"]
    _may_change(api)
    left = await api.service.core.drain(node_id)
    return DrainResult(node_id=node_id, draining=True, blocks_left=left)


@route("GET", "/api/v1/history", History, "Hit rate, throughput and tier use, one point a second (5 minutes).",
       errors=())  # fmt: skip
async def history(api: AdminApi, request: web.Request) -> History:
    return History(points=[HistoryPoint(**point._asdict()) for point in api.service.sampler.history()])


@route("GET", "/api/v1/masters", MasterList, "Every master (leader, standbys) as it sees itself, asked over "
       "its admin API with the caller's token.", errors=())  # fmt: skip
async def masters(api: AdminApi, request: web.Request) -> MasterList:
    anywhere = bool(request.get("relay", False))
    return MasterList(**await masters_now(api.service, request.headers.get("Authorization"), anywhere))


@route("GET", "/api/v1/tenants", TenantUsageList, "Each tenant's bytes held against its quota, sessions and "
       "requests per second.", errors=())  # fmt: skip
async def tenants(api: AdminApi, request: web.Request) -> TenantUsageList:
    return TenantUsageList(tenants=[TenantUsage(**t) for t in api.service.tenant_usage()])


@route("GET", "/api/v1/alerts", AlertList, "Alerts firing now: the Prometheus of --prometheus, else this "
       "master's own view of alerts.yml's rules.", errors=())  # fmt: skip
async def alerts(api: AdminApi, request: web.Request) -> AlertList:
    return AlertList(**await alerts_now(api.service, api.own_alerts))


# -- OpenAPI ----------------------------------------------------------------------------------------------
def openapi_document() -> dict[str, Any]:
    models = {ErrorBody} | {r.response for r in ROUTES} | {r.body for r in ROUTES if r.body is not None}
    _, defs = models_json_schema([(m, "serialization") for m in sorted(models, key=lambda m: m.__name__)],
                                 ref_template="#/components/schemas/{model}")  # fmt: skip
    paths: dict[str, dict[str, Any]] = {}
    for r in ROUTES:
        params = [
            {
                "name": name,
                "in": "path",
                "required": True,
                "schema": {"type": "string", "minLength": 1, "maxLength": 256 if name == "key" else 64},
            }
            for name in _path_params(r.path)
        ] + [{"name": n, "in": "query", "required": req, "schema": schema} for n, schema, req in r.query]
        op: dict[str, Any] = {
            "summary": r.summary,
            "operationId": r.handler.__name__,
            "parameters": params,
            "responses": {
                "200": {"description": "OK", "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{r.response.__name__}"}}}},
                **{str(code): {"description": "Error", "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ErrorBody"}}}} for code in _error_codes(r)},
            },
        }  # fmt: skip
        if r.body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{r.body.__name__}"}}}}  # fmt: skip
        if not r.public:
            op["security"] = [{"bearer": []}]
        paths.setdefault(r.path, {})[r.method.lower()] = op
    return {
        "openapi": "3.0.3",
        "info": {"title": "kvstore admin API", "version": "1"},
        "paths": paths,
        "components": {
            "schemas": defs.get("$defs", {}),
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }


def _error_codes(r: Route) -> list[int]:
    """What a route may answer besides 200: its own errors, and 401 and 403 unless it is public."""
    return sorted(set(r.errors) | (set() if r.public else {401, 403}))


def _path_params(path: str) -> list[str]:
    return [part[1:-1] for part in path.split("/") if part.startswith("{") and part.endswith("}")]
