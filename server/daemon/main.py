"""``kvstore daemon``: run a storage daemon until SIGINT or SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from types import FrameType

from kvstore.auth import secret_from
from kvstore.config import DaemonConfig, format_size
from kvstore.errors import ConfigError, KVStoreError, ResourceShortage
from kvstore.resources import allocated, check_dram, check_ssd
from kvstore.tiers.dram import DramArena, arena_path, arena_size, capacity_within
from server.daemon.master_link import MasterLink
from server.daemon.metrics import DaemonCollector, serve_metrics
from server.daemon.service import DaemonServer
from server.daemon.storage import DaemonStorage
from transfer.tls import contexts
from transfer.topology import warn_if_open
from transfer.transports.ucx import UcxServer, tune_environment
from transfer.wire import parse_address

log = logging.getLogger("kvstore.daemon")


def fit_to_machine(config: DaemonConfig) -> DaemonConfig:
    """``config`` with its tiers checked against the machine before anything is created: refused with
    the sizes (ResourceShortage), or with ``clamp_to_free`` shrunk to what is free, with a warning."""
    dram, ssd = config.dram, config.ssd
    fit = check_dram(arena_path(dram), arena_size(dram), clamp=config.clamp_to_free)
    if fit.warning is not None:
        capacity = capacity_within(dram, fit.size)
        if capacity <= 0:
            raise ResourceShortage(f"{fit.warning}: too little for an arena's index and 1 MiB of data")
        dram = dram.model_copy(update={"capacity": capacity})
        log.warning("%s (a data capacity of %s)", fit.warning, format_size(dram.capacity))
    if ssd.capacity > 0 and ssd.path is not None:
        held = allocated(ssd.path / "data.mdb")
        fit = check_ssd(ssd.path, ssd.capacity, held, clamp=config.clamp_to_free)
        if fit.warning is not None:
            ssd = ssd.model_copy(update={"capacity": fit.size})
            log.warning("%s", fit.warning)
    return config.model_copy(update={"dram": dram, "ssd": ssd})


def run_daemon(config: DaemonConfig) -> int:
    logging.basicConfig(
        level=logging.DEBUG if os.environ.get("KVSTORE_DEBUG") else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    stop = threading.Event()
    starting = True

    def on_signal(signum: int, frame: FrameType | None) -> None:
        first = not stop.is_set()
        stop.set()
        if starting and first:  # cut start-up short where it is (reserving an arena takes a while): undone
            raise KeyboardInterrupt(f"{signal.Signals(signum).name} during start-up")

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
    config = fit_to_machine(config)
    with contextlib.ExitStack() as undo:  # what start-up made, undone in reverse however it ends
        try:
            address, metrics = _start(config, secret, undo)
        finally:
            starting = False  # the undo must run whole: from here on a signal only asks to stop
        if stop.is_set():  # a signal came as start-up ended
            return 0
        print(f"kvstore daemon {config.name} listening on {address}", flush=True)
        if metrics is not None:
            print(f"kvstore daemon {config.name} metrics on http://{metrics}/metrics", flush=True)
        while not stop.wait(0.5):
            pass
    return 0


def _start(config: DaemonConfig, secret: bytes | None, undo: contextlib.ExitStack) -> tuple[str, str | None]:
    """Open the tiers, serve, link to the master; each step's undo pushed on ``undo``. Returns the
    address served and, with ``metrics_port``, the metrics' host:port."""
    storage = DaemonStorage(config.dram, config.ssd)
    if config.leave_on_exit:  # ours (never another live daemon's of the same name): gone after close
        undo.callback(DramArena.remove, config.dram)
    undo.callback(storage.close)
    server = DaemonServer(
        storage, config.host, config.port, rails=config.rails, io_timeout=config.io_timeout_s,
        max_connections=config.max_connections, max_per_peer=config.max_connections_per_peer, secret=secret,
        tls=config.tls, node_id=config.name, tenant_shm_writes=config.tenant_shm_writes,
        orphan_check_s=config.orphan_check_s, inventory_sweep_s=config.inventory_sweep_s,
        commit_linger_s=config.commit_linger_ms / 1000,
    )  # fmt: skip
    server.start()
    undo.callback(server.stop)
    for rail in server.rails if secret is None else ():
        host, port = parse_address(rail)
        warn_if_open(log, f"daemon {config.name}", host, port)
    ucx: UcxServer | None = None
    if config.ucx_port is not None:
        ucx = UcxServer(storage, config.ucx_port, count=server.count)
        undo.callback(ucx.stop)
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
        refusals=server.refusals,
        orphans=server.orphans,
        before_register=server.reset_grants,
        registering=storage.registering,
        on_epoch=server.raise_epoch,
        credential=server.credential,
        tls=contexts(config.tls)[0],
        supervisor=server.supervisor,
    )
    server.master = link
    storage.serving = link.serving  # fenced while the master may count its drops done (see MasterLink.serving)
    storage.serving_by_key = link.serving_by_key
    # Before the link starts: a port it cannot have stops it before it registers.
    metrics = None
    if config.metrics_port is not None:
        try:
            metrics, stop_metrics = serve_metrics(
                config.host,
                config.metrics_port,
                DaemonCollector(config.name, link, storage, committer=server.committer),
            )
        except OSError as exc:
            raise ConfigError(f"cannot serve metrics on {config.host}:{config.metrics_port}: {exc}") from None
        undo.callback(stop_metrics)
    link.start()
    undo.callback(link.stop)
    if config.leave_on_exit:

        def leave() -> None:
            server.stop()  # nothing is served any more: then the master forgets the node
            with contextlib.suppress(KVStoreError):
                server.committer.drain(config.io_timeout_s)  # its acknowledged puts first
            link.leave()

        undo.callback(leave)
    if ucx is not None:
        log.info("UCX data plane on %s (%s)", ucx_address, tune_environment())
    return server.address, metrics
