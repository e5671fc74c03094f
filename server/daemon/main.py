"""``kvstore daemon``: run a storage daemon until SIGINT or SIGTERM."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from types import FrameType

from kvstore.auth import secret_from
from kvstore.config import DaemonConfig
from kvstore.errors import ConfigError
from kvstore.tiers.dram import DramArena
from server.daemon.service import DaemonServer, MasterLink
from server.daemon.storage import DaemonStorage
from transfer.tls import contexts
from transfer.topology import warn_if_open
from transfer.transports.ucx import UcxServer, tune_environment
from transfer.wire import parse_address

log = logging.getLogger("kvstore.daemon")


def run_daemon(config: DaemonConfig) -> int:
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("KVSTORE_DEBUG") else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    secret = secret_from(config.cluster_secret_file)
    if secret is not None and config.ucx_port is not None:
        raise ConfigError(
            "the UCX data plane does not authenticate its peers yet: with a cluster secret, serve TCP only"
            " (leave out --ucx-port)"
        )
    if config.tls is not None and config.tls.data_plane and config.ucx_port is not None:
        raise ConfigError("the UCX data plane is not TLS: with --tls-data, serve TCP only (leave out --ucx-port)")
    storage = DaemonStorage(config.dram, config.ssd)
    try:
        server = DaemonServer(
            storage, config.host, config.port, rails=config.rails, io_timeout=config.io_timeout_s,
            max_connections=config.max_connections, max_per_peer=config.max_connections_per_peer, secret=secret,
            tls=config.tls, node_id=config.name,
        )  # fmt: skip
    except BaseException:
        storage.close()
        raise
    server.start()
    for rail in server.rails if secret is None else ():
        host, port = parse_address(rail)
        warn_if_open(log, f"daemon {config.name}", host, port)
    ucx: UcxServer | None = None
    if config.ucx_port is not None:
        try:
            ucx = UcxServer(storage, config.ucx_port, count=server.count)
        except BaseException:
            server.stop()
            storage.close()
            raise
    ucx_address = f"{config.host}:{ucx.port}" if ucx is not None else ""
    link = MasterLink(
        config.master,
        config.name,
        server.address,
        storage,
        timeout=config.io_timeout_s,
        rails=server.rails,
        ucx_address=ucx_address,
        transfer_stats=server.transfer_bytes,
        before_register=server.reset_grants,
        on_epoch=server.raise_epoch,
        credential=server.credential,
        tls=contexts(config.tls)[0],
    )
    server.master = link
    link.start()
    if ucx is not None:
        log.info("UCX data plane on %s (%s)", ucx_address, tune_environment())
    print(f"kvstore daemon {config.name} listening on {server.address}", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        if config.leave_on_exit:
            server.stop()  # nothing is served any more: then the master forgets the node
            link.leave()
        link.stop()
        if ucx is not None:
            ucx.stop()
        server.stop()
        storage.close()
        if config.leave_on_exit:
            DramArena.remove(config.dram)
    return 0
