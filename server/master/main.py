"""``kvstore master``: run the master service until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys

from kvstore.config import MasterConfig
from server.master.service import MasterService


async def serve(config: MasterConfig) -> None:
    service = MasterService(config)
    address = await service.start()
    print(f"kvstore master listening on {address}", flush=True)
    admin = None
    if config.admin_port is not None:
        admin = await service.start_admin()
        print(f"kvstore admin on http://{admin}", flush=True)
    if config.etcd is not None:
        service.start_election(admin)
        print(f"kvstore master campaigning for cluster {config.cluster_id} in etcd at {config.etcd}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await service.stop()


def run_master(config: MasterConfig) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    asyncio.run(serve(config))
    return 0
