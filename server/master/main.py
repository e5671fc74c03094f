"""``kvstore master``: run the master service until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
import threading

from kvstore.config import MasterConfig
from server.master.admin import AdminApi
from server.master.service import MasterService


async def serve(config: MasterConfig) -> None:
    # Handlers first: a SIGTERM that comes as soon as the master says it listens (a supervisor, a
    # test) is an orderly stop, never the default action's kill mid-start.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    service = MasterService(config)
    address = await service.start()
    print(f"kvstore master listening on {address}", flush=True)
    if service.events_bound is not None:
        pub, replay = service.events_bound
        print(f"kvstore KV events on {pub}" + (f", replay on {replay}" if replay else ""), flush=True)
    # The admin API wraps the service (the service knows only the address, for AdminInfo).
    admin: AdminApi | None = None
    admin_address: str | None = None
    if config.admin_port is not None:
        # Never open on a master that authenticates: without KVSTORE_ADMIN_TOKEN, only the admins'
        # and tenants' tokens of its tenants file get in.
        admin = AdminApi(service, config.admin_token)
        admin_address = await admin.start(config.admin_host or config.host, config.admin_port)
        print(f"kvstore admin on {'https' if service.tls is not None else 'http'}://{admin_address}", flush=True)
        if config.admin_advertise:  # what AdminInfo and this master's record in etcd name
            admin_address = service.admin_address = config.admin_advertise
    if config.etcd is not None:
        service.start_election(admin_address)
        print(f"kvstore master campaigning for cluster {config.cluster_id} in etcd at {config.etcd}", flush=True)
    await stop.wait()
    # A stop that hangs (an await of its etcd or grpc calls that never ends: seen once, etcd down)
    # must not keep a master that was told to go: it exits anyway, loudly, after STOP_DEADLINE_S.
    watchdog = threading.Timer(STOP_DEADLINE_S, _exit_stuck)
    watchdog.daemon = True
    watchdog.start()
    if admin is not None:
        await admin.stop()
    await service.stop()


STOP_DEADLINE_S = 15.0
"""How long a master told to stop (SIGINT, SIGTERM) may take before it exits regardless."""


def _exit_stuck() -> None:
    logging.getLogger("kvstore.master").error(
        "the master did not stop within %.0f s of being told to: exiting without finishing", STOP_DEADLINE_S
    )
    logging.shutdown()
    os._exit(1)


GC_THRESHOLDS = (100_000, 50, 100)
"""The master holds a few objects per key for millions of keys: at Python's default thresholds
(700, 10, 10) the collector walks them so often that it cost ~10 µs of the ~23 µs of CPU a put
takes per key in the placement table (measured in-process over 200,000 keys). Its own records hold
no cycles the collector must break promptly; collections still run, a hundred times less often."""


def run_master(config: MasterConfig) -> int:
    gc.set_threshold(*GC_THRESHOLDS)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(serve(config))
    return 0
