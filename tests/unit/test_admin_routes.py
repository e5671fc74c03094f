"""Every admin route through aiohttp's test client, against an in-process master (its real table)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvstore.config import MasterConfig
from kvstore.placement.state import Eviction
from kvstore.protocol import GetReplicas, Nic, PutEnd, PutStart, PutStartReply, RegisterNode
from server.master.admin import ROUTES, AdminApi, openapi_document
from server.master.evictions import EvictionLog
from server.master.service import MasterService

KB = 1024


async def _service() -> MasterService:
    service = MasterService(MasterConfig(port=0))
    for i in range(2):
        await service.core.register(RegisterNode(
            f"n{i}", f"127.0.0.1:{40000 + i}", 64 * KB, 64 * KB, 64, [], [f"127.0.0.1:{40000 + i}"], "host", "", 0,
            [Nic("lo", "127.0.0.1", -1, -1)], False, "", 0, [],
        ))  # fmt: skip
    keys = [f"r-{i}" for i in range(6)]
    start = await service.core.put_start(PutStart(keys, [KB] * 6, 1, None, False))
    assert isinstance(start, PutStartReply)
    await service.core.put_end(PutEnd(keys, [7] * 6))
    await service.core.get_replicas(GetReplicas([*keys, "r-missing"], []))
    return service


@pytest.fixture
async def client() -> AsyncIterator[TestClient]:
    service = await _service()
    api = AdminApi(service, token="t0k")
    async with TestClient(TestServer(api.app)) as c:
        yield c
    await service.stop()


AUTH = {"Authorization": "Bearer t0k"}


async def test_every_route_answers_its_model(client: TestClient) -> None:
    bodies = {"/api/v1/evict": {"key": "r-5"}}
    for r in ROUTES:
        path = r.path.replace("{node_id}", "n1").replace("{key}", "r-1")
        resp = await client.request(r.method, path, json=bodies.get(path), headers=AUTH)
        assert resp.status == 200, (r.path, await resp.text())
        r.response.model_validate(await resp.json())  # the body is what the document promises


async def test_reads_show_the_tables_state(client: TestClient) -> None:
    summary = await (await client.get("/api/v1/cluster", headers=AUTH)).json()
    assert summary["objects"] == 6 and summary["counters"]["hits"] == 6 and summary["counters"]["misses"] == 1
    assert summary["dram"]["capacity"] == 128 * KB and summary["dram"]["used"] == 6 * KB
    node = await (await client.get("/api/v1/nodes/n0", headers=AUTH)).json()
    assert node["nics"] == [{"name": "lo", "address": "127.0.0.1", "speed_mbps": -1, "numa_node": -1}]
    key = await (await client.get("/api/v1/keys/r-2", headers=AUTH)).json()
    assert key["checksum"] == 7 and key["replicas"][0]["leased"] is True  # the get above leased it
    page = await (await client.get("/api/v1/keys?prefix=r-&limit=4", headers=AUTH)).json()
    assert page == {"keys": ["r-0", "r-1", "r-2", "r-3"], "next_cursor": "r-3"}
    page = await (await client.get("/api/v1/keys?prefix=r-&limit=4&cursor=r-3", headers=AUTH)).json()
    assert page == {"keys": ["r-4", "r-5"], "next_cursor": None}


async def test_the_eviction_log_says_what_left_why_and_pages_after_a_number(client: TestClient) -> None:
    for key in ("r-0", "r-1", "r-2"):
        resp = await client.post("/api/v1/evict", json={"key": key}, headers=AUTH)
        assert (await resp.json())["evicted"] == 1
    page = await (await client.get("/api/v1/evictions?limit=2", headers=AUTH)).json()
    assert [(e["seq"], e["key"], e["node_id"], e["reason"]) for e in page["evictions"]] == [
        (1, "r-0", "", "operator"), (2, "r-1", "", "operator")
    ]  # fmt: skip
    assert page["next_after"] == 2 and page["lost"] == 0 and page["evictions"][0]["at"] > 1.7e9
    page = await (await client.get(f"/api/v1/evictions?after={page['next_after']}", headers=AUTH)).json()
    assert [e["key"] for e in page["evictions"]] == ["r-2"] and page["next_after"] == 3
    page = await (await client.get("/api/v1/evictions?after=3", headers=AUTH)).json()
    assert page == {"evictions": [], "next_after": 3, "lost": 0}
    for bad in ("after=-1", "after=x", "limit=0"):
        assert (await client.get(f"/api/v1/evictions?{bad}", headers=AUTH)).status == 400


def test_the_eviction_log_keeps_its_bound_and_counts_what_it_dropped() -> None:
    log = EvictionLog(3)
    log.add([Eviction(f"t/{i}" if i % 2 else f"u/{i}", "n", "lru") for i in range(5)], 1.0)
    page, last, lost = log.page(0, 10)
    assert [e.seq for e in page] == [3, 4, 5] and last == 5 and lost == 2
    page, last, lost = log.page(0, 10, "t/")  # a tenant's own (its prefix) only; the numbers go on
    assert [e.key for e in page] == ["t/3"] and last == 5 and lost == 2
    page, last, lost = log.page(3, 1)
    assert [e.seq for e in page] == [4] and last == 4 and lost == 0
    assert log.page(5, 10) == ([], 5, 0) and EvictionLog(0).page(0, 10) == ([], 0, 0)


async def test_errors_are_json_with_a_code(client: TestClient) -> None:
    for method, path, body, status in [
        ("GET", "/api/v1/nodes/zz", None, 404), ("GET", "/api/v1/keys/zz", None, 404),
        ("GET", "/api/v1/keys?limit=0", None, 400), ("GET", "/api/v1/keys?nope=1", None, 400),
        ("POST", "/api/v1/evict", {"key": "a", "prefix": "b"}, 400), ("POST", "/api/v1/evict", [1], 400),
        ("POST", "/api/v1/nodes/zz/drain", None, 404), ("GET", "/api/v1/nothing-here", None, 404),
        ("DELETE", "/api/v1/cluster", None, 405),
    ]:  # fmt: skip
        resp = await client.request(method, path, json=body, headers=AUTH)
        err = await resp.json()
        assert resp.status == status and set(err) == {"code", "error", "message"}, (path, err)
        if status == 405:
            assert resp.headers["Allow"] == "GET"


async def test_the_token_guards_all_but_health_and_the_page(client: TestClient) -> None:
    assert (await client.get("/api/v1/cluster")).status == 401
    assert (await client.get("/api/v1/cluster", headers={"Authorization": "Bearer wrong"})).status == 401
    assert (await client.get("/metrics")).status == 401
    assert (await client.get("/api/v1/openapi.json")).status == 401
    assert (await client.get("/api/v1/health")).status == 200
    assert (await client.get("/")).status == 200
    assert (await client.get("/static/dashboard.css")).status == 200


async def test_openapi_covers_every_route(client: TestClient) -> None:
    doc = await (await client.get("/api/v1/openapi.json", headers=AUTH)).json()
    assert doc == openapi_document() and doc["openapi"].startswith("3.")
    assert sorted((p, m.upper()) for p, ops in doc["paths"].items() for m in ops) == sorted(
        (r.path, r.method) for r in ROUTES
    )


async def test_leadership_shows_in_its_route_and_in_metrics(client: TestClient) -> None:
    role = await (await client.get("/api/v1/leadership", headers=AUTH)).json()
    assert role["role"] == "leader" and not role["ha"] and role["ready"] and role["epoch"] == 0
    text = await (await client.get("/metrics", headers=AUTH)).text()
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(samples["kvstore_master_leading"]) == 1 and float(samples["kvstore_master_ready"]) == 1
    assert float(samples["kvstore_master_etcd_reachable"]) == 0 and "kvstore_master_failovers_total" in samples


async def test_a_token_of_raw_non_ascii_bytes_is_refused_not_a_crash(client: TestClient) -> None:
    assert client.server.host is not None and client.server.port is not None
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"GET /api/v1/cluster HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xc3\x28\r\n\r\n")
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status.split()[1] == b"401"
