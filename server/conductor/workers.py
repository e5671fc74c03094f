"""The instances the conductor routes to, and the shapes of the P/D workers' answers it checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.errors import KVStoreError


class WorkerError(KVStoreError):
    """A worker answered with an error of its own (``status``) or could not be reached (``status`` 0)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


SILENT_CHECKS_TO_DOWN = 3
"""Health checks in a row without an answer in time that mark a worker down. A server busy computing can
answer its /health late; taking it down for one slow answer would route its conversations elsewhere and
forget what its prefix cache holds. A refused connection or an error status marks it down at once."""


@dataclass(slots=True)
class Worker:
    name: str
    url: str
    role: str
    info: dict[str, Any]
    silent_checks: int = 0
    """Health checks in a row it did not answer in time."""

    def checked(self, answer: bool | None, up: bool) -> bool:
        """Whether it is up after a health check that answered ``answer`` (True: healthy; False: refused
        or unhealthy; None: no answer in time), while it was ``up``."""
        if answer is None:
            self.silent_checks += 1
            return up and self.silent_checks < SILENT_CHECKS_TO_DOWN
        self.silent_checks = 0
        return answer

    @property
    def node(self) -> str | None:
        return self.info.get("node")


PREFILL_FIELDS = {"first_token": int, "computed_tokens": int, "loaded_tokens": int, "matched_tokens": int,
                  "load_s": float, "engine_s": float, "service_s": float, "decision": str}  # fmt: skip
DECODE_FIELDS = {"tokens": list, "tbt_s": float, "tail": str}


def check_fields(data: dict[str, Any], fields: dict[str, type]) -> dict[str, Any]:
    """``data`` with each of ``fields`` present and of its type (an int passes for a float), else WorkerError."""
    for name, kind in fields.items():
        value: Any = data.get(name)
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
        if not ok or isinstance(value, bool) or (kind in (int, float) and value < 0):
            raise WorkerError(f"a worker's answer has {name}={value!r}, expected a non-negative {kind.__name__}")
    return data
