"""What keeps the admin HTTP port from being held by peers that never finish a request: a cap on
open connections, a deadline for a request's head and one for its body, each refusal counted.

aiohttp closes a connection idle between requests (``keepalive_timeout``) but has no deadline for
a request that arrives a byte at a time, none for its body, and no cap. :class:`AdminGuard` adds
them around the ``web.Server`` an ``AppRunner`` made (its public hooks ``connection_made``,
``connection_lost`` and ``request_factory``; :meth:`install` runs after ``setup()`` and before
the site starts): a connection over the cap is answered 503 and closed; one whose request head has
not come ``header_timeout_s`` after it opened is closed; a body not all in ``body_timeout_s``
after its head fails the request with 408. The idle time between requests of a kept-alive
connection is aiohttp's own timeout, set just above the head's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class AdminGuard:
    def __init__(self, header_timeout_s: float, body_timeout_s: float, max_connections: int) -> None:
        self.header_timeout_s = header_timeout_s
        self.body_timeout_s = body_timeout_s
        self.max_connections = max_connections
        self.open = 0
        self.refused = 0
        """Connections answered 503 and closed: ``max_connections`` were open."""
        self.header_timeouts = 0
        """Connections closed because no request head came in time."""
        self.body_timeouts = 0
        """Requests failed with 408 because their body did not come in time."""
        self._timers: dict[Any, asyncio.TimerHandle] = {}

    def install(self, server: web.Server) -> None:
        made, lost, factory = server.connection_made, server.connection_lost, server.request_factory
        loop, timers = asyncio.get_running_loop(), self._timers

        def connection_made(handler: Any, transport: Any) -> None:
            made(handler, transport)
            self.open += 1
            if self.open > self.max_connections:
                self.refused += 1
                transport.write(_BUSY)
                # Closed on the next turn: closing inside this hook breaks aiohttp's start task.
                loop.call_soon(handler.force_close)
                return
            timers[handler] = loop.call_later(self.header_timeout_s, self._expire, handler, None)

        def connection_lost(handler: Any, exc: BaseException | None) -> None:
            lost(handler, exc)
            self.open -= 1
            timer = timers.pop(handler, None)
            if timer is not None:
                timer.cancel()

        def request_factory(message: Any, payload: Any, protocol: Any, writer: Any, task: Any) -> web.BaseRequest:
            # A request's head was read: its deadline is met; its body's starts.
            timer = timers.pop(protocol, None)
            if timer is not None:
                timer.cancel()
            if not payload.is_eof():
                timers[protocol] = loop.call_later(self.body_timeout_s, self._expire, protocol, payload)
            return factory(message, payload, protocol, writer, task)

        hooks: Any = server  # its hooks are replaced by ones that call them
        hooks.connection_made, hooks.connection_lost, hooks.request_factory = (
            connection_made, connection_lost, request_factory,
        )  # fmt: skip

    def _expire(self, handler: Any, payload: Any) -> None:
        self._timers.pop(handler, None)
        if payload is None:
            self.header_timeouts += 1
            handler.force_close()
        elif not payload.is_eof():
            self.body_timeouts += 1
            payload.set_exception(web.HTTPRequestTimeout())  # the handler's read raises it: a 408
