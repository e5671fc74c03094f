"""TLS on a real cluster (a master and two daemons started with certificates of a CA made for the
test): what crosses the control plane cannot be read on the wire, peers that do not speak TLS or
show a certificate of another CA are refused with typed errors, the admin API and the CLI speak
https, and with ``--tls-data`` and ``--tls-verify-clients`` the daemons' ports are TLS too and
every peer must show a certificate."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from kvstore.config import ClientConfig, TlsConfig
from kvstore.errors import AuthFailed, ConnectionFailed, KVStoreError, Timeout
from kvstore_cli.cluster import LocalCluster
from kvstore_client import Store
from kvstore_client.aio import AsyncStore

pytest.importorskip("cryptography")
from kvstore_cli.certs import make_certs

SECRET_KEY = "sniff-me-if-you-can"
VALUE = b"the bytes of a prefix nobody else may read " * 100


@contextmanager
def sniffing_relay(target: str) -> Iterator[tuple[str, bytearray]]:
    """A TCP relay to ``target`` that records what clients send through it (an eavesdropper)."""
    host, port = target.rsplit(":", 1)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    seen = bytearray()
    stop = threading.Event()

    def pump(src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    seen.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def accept() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection((host, int(port)), timeout=5)
            for args in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=pump, args=args, daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}", seen
    finally:
        stop.set()
        listener.close()
        thread.join(timeout=2)


def test_control_plane_tls_hides_what_it_carries_and_refuses_other_peers(tmp_path: Path) -> None:
    with LocalCluster(2, dram="16MiB", tls=True, authenticate=True, admin=True) as cluster:
        token = cluster.add_tenant("alice")
        tls = cluster.tls_config()
        assert tls is not None and not tls.data_plane
        with (
            sniffing_relay(cluster.master_address) as (relay, seen),
            Store.connect(relay, ClientConfig(token=token, tls=tls, transport="tcp")) as alice,
        ):
            alice.put(SECRET_KEY, VALUE)
            assert alice.get(SECRET_KEY) == VALUE
            assert alice.exists(SECRET_KEY)
        assert seen.startswith(b"\x16\x03") and len(seen) > 500  # a TLS handshake, then the client's requests ...
        assert SECRET_KEY.encode() not in seen and b"alice" not in seen  # ... and none of it was readable
        # The data plane stays plain (no --tls-data): a same-host client over shared memory, too.
        with Store.connect(cluster.master_address, ClientConfig(token=token, tls=tls)) as alice:
            assert alice.get(SECRET_KEY) == VALUE

        # A client that does not speak TLS, and one that trusts another CA: typed errors, no hang.
        with pytest.raises((ConnectionFailed, Timeout)):
            Store.connect(cluster.master_address, ClientConfig(token=token, timeout_s=3))
        other = make_certs(tmp_path / "other-ca", "other", ["127.0.0.1"])
        with pytest.raises(AuthFailed, match="certificate"):
            Store.connect(cluster.master_address, ClientConfig(token=token, tls=TlsConfig(ca_file=str(other.ca))))

        # The admin API: https only, with the same certificate.
        context = ssl.create_default_context(cafile=str(tls.ca_file))
        with urllib.request.urlopen(f"https://{cluster.admin_address}/api/v1/health", context=context) as resp:
            assert json.loads(resp.read())["status"] == "ok"
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
            urllib.request.urlopen(f"http://{cluster.admin_address}/api/v1/health", timeout=3)
        # The CLI: asks the master (TLS, authenticated) where the admin API is, then speaks https.
        env = {**os.environ, "KVSTORE_TOKEN": token}
        env.pop("KVSTORE_ADMIN_TOKEN", None)
        done = subprocess.run(
            [sys.executable, "-m", "kvstore_cli", "keys", "--master", cluster.master_address,
             "--tls-ca", str(tls.ca_file), "--json"],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["keys"] == [SECRET_KEY]


async def _async_round_trip(master: str, config: ClientConfig, blocks: list[tuple[str, bytes]]) -> None:
    store = await AsyncStore.connect(master, config)
    try:
        await store.put_many([(f"async-{k}", v) for k, v in blocks])
        assert await store.get_many([f"async-{k}" for k, _ in blocks]) == [v for _, v in blocks]
        assert await store.get("block-3") == blocks[3][1]
    finally:
        await store.close()


def test_data_plane_tls_with_client_certificates() -> None:
    verify = ("--tls-verify-clients",)
    with LocalCluster(2, dram="16MiB", tls_data=True, admin=True, master_args=verify, daemon_args=verify) as cluster:
        tls = cluster.tls_config()
        assert tls is not None and tls.data_plane and tls.cert_file is not None
        blocks = [(f"block-{i}", bytes([i]) * (256 * 1024 + i)) for i in range(16)]
        for transport in ("tcp", "auto"):  # tcp: TLS to the daemons; auto: same-host shared memory (not TLS)
            with Store.connect(cluster.master_address, ClientConfig(tls=tls, transport=transport)) as store:
                store.put_many(blocks)
                assert store.get_many([k for k, _ in blocks]) == [v for _, v in blocks]
                store.put("one", VALUE)
                assert store.get("one") == VALUE
        asyncio.run(_async_round_trip(cluster.master_address, ClientConfig(tls=tls), blocks))

        # The daemons speak only TLS: a client that reaches them plain cannot read or write.
        plain_data = tls.model_copy(update={"data_plane": False})
        with Store.connect(cluster.master_address, ClientConfig(tls=plain_data, transport="tcp", timeout_s=3)) as s:
            try:
                got = s.get_many([k for k, _ in blocks])
            except KVStoreError:
                got = [None] * len(blocks)
            assert got == [None] * len(blocks)  # misses (a cache degrades), never bytes over a plain stream
            with pytest.raises(KVStoreError):
                s.put("plain", b"p" * 4096)
        # The CLI shows its certificate too (the admin API asks for one like the RPC port).
        cli = [sys.executable, "-m", "kvstore_cli", "nodes", "--master", cluster.master_address, "--json",
               "--tls-ca", str(tls.ca_file)]  # fmt: skip
        with_cert = subprocess.run([*cli, "--tls-cert", str(tls.cert_file), "--tls-key", str(tls.key_file)],
                                   capture_output=True, text=True, timeout=60)  # fmt: skip
        assert with_cert.returncode == 0, with_cert.stderr
        assert len(json.loads(with_cert.stdout)["nodes"]) == 2
        without = subprocess.run(cli, capture_output=True, text=True, timeout=60)
        assert without.returncode != 0 and "Traceback" not in without.stderr, without.stderr
        # Without a certificate of the cluster's CA, the master lets no client in.
        no_cert = TlsConfig(ca_file=tls.ca_file, data_plane=True)
        with pytest.raises((ConnectionFailed, AuthFailed, Timeout)):
            Store.connect(cluster.master_address, ClientConfig(tls=no_cert, timeout_s=3))
