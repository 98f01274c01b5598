"""The argument types and shared options of the command line, for every
command (``durablekv replay``, ``serve``, ...): each type gives argparse a
clear message for bad input."""

from __future__ import annotations

import argparse
import math

__all__ = ["add_byte_limit_arguments", "byte_size", "float_between", "int_at_least",
           "non_negative_float", "nonneg_int", "port", "positive_float", "positive_int"]


_BYTE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10,
               "m": 1 << 20, "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30,
               "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40, "tib": 1 << 40}


def byte_size(text: str) -> int:
    """An argparse type: a positive number of bytes, with an optional binary
    unit (``64MiB``, ``64M`` and ``64MB`` all mean 64 x 2**20)."""
    t = text.strip().lower().replace("_", "")
    num = t.rstrip("bkmgti")
    unit = t[len(num):]
    try:
        value = float(num) * _BYTE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size in bytes; use a number with an optional unit, e.g. "
            "1048576, 64MiB or 1G") from None
    if not 1 <= value < 1 << 62 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a whole number of bytes >= 1")
    return int(value)



def add_byte_limit_arguments(p: "argparse._ActionsContainer") -> None:
    """``--max-memory-bytes`` and ``--size-limit`` (``replay`` and ``serve``):
    sizes as :func:`byte_size` reads them, into ``max_memory_bytes`` and
    ``size_limit`` (None when not given)."""
    p.add_argument("--max-memory-bytes", type=byte_size, default=None, metavar="BYTES",
                   help="bound the memory tier in bytes of entries too (e.g. 64MiB, 1G, "
                   "1048576; default: pages only)")
    p.add_argument("--size-limit", type=byte_size, default=None, metavar="BYTES",
                   help="bound the store in bytes of pages: least recently used pages are "
                   "evicted from it (e.g. 1GiB; default: no bound)")

def int_at_least(minimum: int):
    """An argparse type: a whole number >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if v < minimum:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {minimum}, got {v}")
        return v
    return parse


positive_int = int_at_least(1)
nonneg_int = int_at_least(0)


def port(text: str) -> int:
    v = nonneg_int(text)
    if v > 65535:
        raise argparse.ArgumentTypeError(f"a port is 0..65535, got {v}")
    return v


def float_between(lo: float, hi: float):
    """An argparse type: a number in [lo, hi]."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected a number from {lo:g} to {hi:g}, got {v:g}")
        return v
    return parse


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text}")
    return v
