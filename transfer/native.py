"""Which data-plane loops run: the native extension (``transfer/_native.c``) or pure Python.

The extension is built by the install (gcc and the Python headers); it is used unless
``KVSTORE_NO_NATIVE=1``, and when it is missing or cannot load the fallback runs, with one log
line saying why. ``KVSTORE_NATIVE_PATH`` loads the extension from another file (a build with
AddressSanitizer, say: tests/integration/test_native_builds.py). :mod:`transfer.wire` is the only
caller.

The loops drive a socket's descriptor for a whole call (many system calls): a socket may be shut
down from another thread meanwhile (:func:`transfer.wire.cut`), never closed, or its number could
be another connection's before the call ends.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
from types import ModuleType

log = logging.getLogger("kvstore.native")


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("KVSTORE_NO_NATIVE", "") not in ("", "0"):
        return None, "KVSTORE_NO_NATIVE is set"
    path = os.environ.get("KVSTORE_NATIVE_PATH")
    try:
        if path:
            loader = importlib.machinery.ExtensionFileLoader("transfer._native", path)
            spec = importlib.util.spec_from_file_location("transfer._native", path, loader=loader)
            assert spec is not None
            module = importlib.util.module_from_spec(spec)
            loader.exec_module(module)
            return module, f"loaded from {path}"
        from transfer import _native  # type: ignore[attr-defined]

        return _native, "built in"
    except Exception as exc:  # whatever stops it loading (a broken build too), the fallback runs
        log.warning("the native data-plane loops are not available (%s): running the pure-Python fallback", exc)
        return None, f"not available: {exc}"


lib, reason = _load()


def active() -> bool:
    """Whether the native loops run in this process."""
    return lib is not None


def use(on: bool) -> None:
    """Run the native loops (when loaded) or the fallback, in this process and in the processes it
    starts from now on (a benchmark's ``--no-native``)."""
    global lib, reason
    if on:
        os.environ.pop("KVSTORE_NO_NATIVE", None)
        lib, reason = _load()
    else:
        os.environ["KVSTORE_NO_NATIVE"] = "1"
        lib, reason = None, "KVSTORE_NO_NATIVE is set"
