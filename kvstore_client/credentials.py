"""What a client proves itself with (see :mod:`kvstore.auth`): to the master, a tenant's token or
the cluster secret; to daemons, the same secret, or for a tenant a ticket from the master, asked for
on first need and again halfway through its life."""

from __future__ import annotations

import os
import threading
import time

from kvstore.auth import Credential, cluster_credential, open_ticket, read_secret_file, tenant_credential
from kvstore.config import ClientConfig
from kvstore.errors import ConfigError
from kvstore.protocol import TicketReply


def master_credential(config: ClientConfig) -> Credential | None:
    """The credential ``config`` names: its token (else ``KVSTORE_TOKEN``), or its cluster secret
    file; None for a cluster that does not authenticate."""
    token = config.token or os.environ.get("KVSTORE_TOKEN") or None
    if token is not None and config.cluster_secret_file is not None:
        raise ConfigError("give a client a tenant's token or the cluster secret, not both")
    if config.cluster_secret_file is not None:
        return cluster_credential(read_secret_file(config.cluster_secret_file))
    return tenant_credential(token) if token is not None else None


class Tickets:
    """A tenant's current ticket; :meth:`fresh` is None when there is none or it is past half its life."""

    def __init__(self, tenant: str) -> None:
        self.tenant = tenant
        self._ticket: Credential | None = None
        self._renew_at = 0.0
        self.lock = threading.Lock()
        """Held while a ticket is asked for (one request at a time, not one per connecting thread)."""

    def fresh(self) -> Credential | None:
        return self._ticket if self._ticket is not None and time.time() < self._renew_at else None

    def take(self, reply: TicketReply, connection_key: bytes) -> Credential:
        ticket = open_ticket(reply, connection_key, self.tenant)
        now = time.time()
        self._renew_at = now + max(reply.expires_ms / 1000 - now, 0) / 2
        self._ticket = ticket
        return ticket
