"""Writer process for tests/test_native.py (run as a script).

Usage: python format_writer.py DIR MODE

Writes :func:`dataset` (sets, overwrites, deletes, TTLs) into a cache in
DIR with whichever kernels this process loaded (the parent sets
DURABLEKV_PURE to choose), then either kills itself with SIGKILL before any
flush (MODE ``log``: every record only in the replay log) or closes the
cache (MODE ``store``: every entry only in the store's pages).
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

LONG_TTL = 10 * 365 * 86400.0  # seconds: outlives any test run


def dataset() -> tuple[list[tuple[str, Any, Any, float | None]], dict[Any, Any]]:
    """``(operations, expected)``: operations are ``("set", key, value, expire)``
    or ``("delete", key, None, None)``; ``expected`` maps each live key to
    its final value."""
    values: list[Any] = [None, True, False, 0, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 64, -(3 ** 200),
                         0.0, -0.0, 1.5, float("inf"), "", "x", "é\u2603\U0001f600",
                         "\udcff", b"", b"\x00", b"v" * 100, bytes(range(256)) * 16,
                         os.urandom(0) + b"z" * 50000, (), (1, "a", b"b", None),
                         [1, [2, [3]], {"k": (4,)}], {"a": 1, 2: [b"x"], (1, 2): None},
                         "s" * 4096]
    keys: list[Any] = [f"k{i:05d}" for i in range(300)] + ["ключ", "\U0001f511", b"bk",
                      b"\x00\xff", 7, -7, 2 ** 70, 1.25, (1, "t"), ("a", (b"b", 3)), None]
    ops: list[tuple[str, Any, Any, float | None]] = []
    expected: dict[Any, Any] = {}
    for i, key in enumerate(keys):
        value = values[i % len(values)]
        ops.append(("set", key, value, LONG_TTL if i % 5 == 0 else None))
        expected[key] = value
    for i, key in enumerate(keys):
        if i % 7 == 0:
            ops.append(("delete", key, None, None))
            del expected[key]
        elif i % 3 == 0:
            value = values[(i * 7 + 3) % len(values)]
            ops.append(("set", key, value, None))
            expected[key] = value
    return ops, expected


def main() -> None:
    directory, mode = sys.argv[1], sys.argv[2]
    from durablekv import Cache
    ops, _ = dataset()
    # a fixed clock: both implementations log the same expire_at bytes
    c = Cache(directory, page_size=16, max_pages=4, flush_interval=3600.0,
              flush_batch_pages=1 << 20, max_pending_pages=1 << 20, clock=lambda: 2.0e9)
    for op, key, value, expire in ops:
        if op == "set":
            c.set(key, value, expire)
        else:
            c.delete(key)
    if mode == "log":
        sys.stdout.write("written\n")
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    c.close()
    sys.stdout.write("written\n")


if __name__ == "__main__":
    main()
