"""``kvstore conductor``: run the conductor's HTTP front door until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

from aiohttp import web

from kvstore.config import ConductorConfig
from server.conductor.service import Conductor


async def serve(config: ConductorConfig) -> None:
    conductor = Conductor(config)
    await conductor.start()
    runner = web.AppRunner(conductor.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    print(f"kvstore conductor on http://{host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await conductor.stop()


def run_conductor(config: ConductorConfig) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(config))
    return 0
