"""Which kernels run: the C extension ``durablekv._native`` or the pure-Python code.

The C kernels (record encode and append, segment parse, key and value
decoding for recovery, page blob encode and decode) are built by
``pip install`` when a C compiler is there (``setup.py``); without one the
install still succeeds and every kernel runs in Python. Both read and write
the same files, byte for byte, so a cache directory moves freely between
them.

The choice is made once, at import: the extension is used when it imports,
unless the environment variable ``DURABLEKV_PURE`` is set to anything but
``""`` or ``"0"`` (the test suite's second run, and a way to rule the
extension out when chasing a problem). This is the one environment variable
the library reads, and only at import. :data:`accelerated` says what was
chosen and why.
"""

from __future__ import annotations

import contextlib
import logging
import os
from types import ModuleType
from typing import Iterator

__all__ = ["Acceleration", "accelerated", "native", "pure_kernels"]

#: The kernels the extension provides, by the name :class:`Acceleration` lists.
KERNELS = ("log_record", "segment_parse", "recovery_decode", "page_decode", "page_encode",
           "memory_hit", "overwrite")


class Acceleration:
    """What :data:`durablekv.accelerated` holds: true when the C kernels run.

    :ivar kernels: names of the kernels that run natively (a tuple of str,
        empty when the pure-Python code runs): ``log_record`` (encode and
        append a replay-log record), ``segment_parse`` (read a log segment at
        recovery), ``recovery_decode`` (decode recovered keys and values),
        ``page_decode`` (decode a page blob at a page fault),
        ``page_encode`` (encode a page blob at a flush), ``memory_hit``
        (``Cache.get``'s lock-free memory hit, installed per open cache;
        not on a free-threaded build), ``overwrite`` (``Cache.set``'s
        overwrite of a resident entry, likewise; safe codec, durability
        ``log`` or ``none``).
    :ivar reason: why the pure-Python code runs (``""`` when it does not):
        ``DURABLEKV_PURE`` was set, or the extension failed to import (the
        error's text, e.g. when it was not built for lack of a compiler).
    """

    __slots__ = ("kernels", "reason")

    def __init__(self, kernels: tuple[str, ...], reason: str) -> None:
        self.kernels = kernels
        self.reason = reason

    def __bool__(self) -> bool:
        return bool(self.kernels)

    def __repr__(self) -> str:
        if self.kernels:
            return f"Acceleration(native: {', '.join(self.kernels)})"
        return f"Acceleration(pure Python: {self.reason})"


def _load() -> tuple[ModuleType | None, Acceleration]:
    if os.environ.get("DURABLEKV_PURE", "") not in ("", "0"):
        return None, Acceleration((), "DURABLEKV_PURE is set")
    try:
        from . import _native
    except ImportError as exc:
        here = os.path.dirname(os.path.abspath(__file__))
        built = any(name.startswith("_native.") and name.endswith((".so", ".pyd"))
                    for name in os.listdir(here))
        if not built:
            why = (f"the C extension durablekv._native is not in {here} (it was not built: "
                   "no C compiler or Python headers at install time, or this is a source tree "
                   "where `pip install -e .` was not run); install gcc and python3-dev and "
                   "reinstall to build it")
        else:
            why = (f"the C extension durablekv._native did not import ({exc}); reinstall with "
                   "a C compiler to build it")
        logging.getLogger("durablekv").info("running the pure-Python kernels: %s", why)
        return None, Acceleration((), why)
    return _native, Acceleration(KERNELS, "")


#: The extension module, or None when the pure-Python code runs.
native, accelerated = _load()


#: Where each kernel's module looks the extension up: (module, global name,
#: the value that turns the kernel on).
def _switches() -> list[tuple[ModuleType, str, object]]:
    from . import cache, codec
    from .log import replaylog, segments as logsegments
    from .stores import pageformat
    if native is None:
        return []
    return [(cache, "_HIT_GETTER", cache._HIT_GETTER), (cache, "_HOT_SETTER", cache._HOT_SETTER),
            (codec, "_native", native), (logsegments, "_native", native),
            (pageformat, "_native", native), (replaylog, "_WRITE_RECORD", native.write_record),
            (replaylog, "_WRITE_BYTES_RECORD", native.write_bytes_record),
            (replaylog, "_STORE_RECORD", native.store_record),
            (replaylog, "_STORE_BYTES_RECORD", native.store_bytes_record)]


@contextlib.contextmanager
def pure_kernels() -> Iterator[None]:
    """Run the pure-Python kernels inside the ``with`` block, in a process
    that loaded the extension (for the side-by-side bench and the tests
    that write with one implementation and read with the other). Not for
    production use: it switches module globals, so every thread of the
    process sees the change; nothing else may run meanwhile.
    """
    switches = _switches()
    for module, name, _on in switches:
        setattr(module, name, None)
    try:
        yield
    finally:
        for module, name, on in switches:
            setattr(module, name, on)
