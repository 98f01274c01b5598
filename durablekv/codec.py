"""Key and value encoding: safe by default, exact types, canonical keys.

The default codec is a small tagged binary format (not pickle): loading a
value can never run code. It round-trips exactly these types:

======  =========================================  ==========================
tag     type                                       payload
======  =========================================  ==========================
``N``   ``None``                                   -
``T``   ``True``                                   -
``F``   ``False``                                  -
``q``   ``int`` in [-2**63, 2**63)                 int64, little-endian
``I``   any other ``int``                          u32 length + two's complement, LE
``d``   ``float``                                  float64, little-endian
``s``   ``str``                                    u32 length + UTF-8 (surrogatepass)
``b``   ``bytes``                                  u32 length + raw bytes
``t``   ``tuple``                                  u32 count + items
``l``   ``list``  (values only)                    u32 count + items
``m``   ``dict``  (values only)                    u32 count + key, value, ...
======  =========================================  ==========================

Subclasses (an ``IntEnum``, a ``str`` subclass) are refused with a
``TypeError`` naming the type, because they could not come back as the same
type. A lookup with one (``get``, ``in``) behaves as a dict lookup does: it
finds an equal plain key (:func:`lookup_key`).

Keys: ``str``, ``bytes``, ``int``, ``float``, ``bool``, ``None`` and tuples of
these. Two keys are the same key exactly when a Python dict says so
(``1 == 1.0 == True``): :func:`canonical_key` maps equal keys to one byte
string (``True`` and ``1.0`` become ``1``; ``-0.0`` becomes ``0``), which is
what the SQLite key index stores; the original key is stored beside it so it
comes back with its own type. NaN is refused as a key: it is not equal to
itself, so it could never be found again.

``serializer="pickle"`` stores values with :mod:`pickle` instead (any
picklable object). Never open a pickle store that others can write: loading a
pickle can run arbitrary code.
"""

from __future__ import annotations

import enum
import numbers
import pickle
import struct
from typing import Any, Callable, Iterable

from ._accel import native as _native

__all__ = [
    "encode_key", "decode_key", "decode_keys", "canonical_key", "check_key",
    "ValueCodec", "SafeCodec", "PickleCodec", "codec_by_name", "MAX_NESTING",
]

_Q = struct.Struct("<q")
_QKEY = struct.Struct("<cq").pack  # an int key: tag q, int64
_D = struct.Struct("<d")
_U32 = struct.Struct("<I")
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

_KEY_SCALARS = (str, bytes, int, float, bool, type(None))


#: Deepest nesting of tuples, lists and dicts in a key or value: ``set``
#: refuses deeper ones (TypeError, like a value that contains itself), and a stored object nested deeper is
#: damage, so no encode or decode recursion can overflow the stack.
MAX_NESTING = 100


def _too_deep(what: str) -> TypeError:
    return TypeError(f"the {what} is nested more than MAX_NESTING={MAX_NESTING} levels deep "
                      "(tuples, lists and dicts inside each other, or one that contains "
                      f"itself); store a flatter {what}")


def _enc(obj: Any, out: list, allow_containers: bool, what: str, depth: int = 0) -> None:
    t = type(obj)
    if t is str:
        b = obj.encode("utf-8", "surrogatepass")
        out.append(b"s" + _U32.pack(len(b)))
        out.append(b)
    elif t is bytes:
        out.append(b"b" + _U32.pack(len(obj)))
        out.append(obj)
    elif t is int:
        if _INT64_MIN <= obj <= _INT64_MAX:
            out.append(b"q" + _Q.pack(obj))
        else:
            # Binary, not decimal: str(int) refuses more than 4300 digits.
            s = obj.to_bytes(obj.bit_length() // 8 + 1, "little", signed=True)
            out.append(b"I" + _U32.pack(len(s)))
            out.append(s)
    elif t is float:
        out.append(b"d" + _D.pack(obj))
    elif obj is None:
        out.append(b"N")
    elif obj is True:
        out.append(b"T")
    elif obj is False:
        out.append(b"F")
    elif t is tuple or allow_containers and (t is list or t is dict):
        if depth >= MAX_NESTING:
            raise _too_deep(what)
        depth += 1
        if t is dict:
            out.append(b"m" + _U32.pack(len(obj)))
            for k, v in obj.items():
                _enc(k, out, True, what, depth)
                _enc(v, out, True, what, depth)
        else:
            out.append((b"t" if t is tuple else b"l") + _U32.pack(len(obj)))
            for item in obj:
                _enc(item, out, allow_containers, what, depth)
    else:
        allowed = ("None, bool, int, float, str, bytes, tuple, list and dict"
                   if allow_containers else
                   "str, bytes, int, float, bool, None and tuples of these")
        hint = (" (pass serializer='pickle' to store arbitrary picklable objects)"
                if allow_containers else "")
        base = next((b for b in (int, float, str, bytes, tuple, list, dict)
                     if isinstance(obj, b)), None)
        if base is not None and t is not base and \
                not (base in (list, dict) and not allow_containers):
            # a subclass (an IntEnum member, a namedtuple, a str enum): its
            # plain value is storable, and reads back as the plain type
            plain = "its .value" if isinstance(obj, enum.Enum) else f"{base.__name__}(x)"
            hint += f"; it is a subclass of {base.__name__}: pass the plain value, {plain}"
        elif base is None:
            hint += _scalar_hint(obj, t)
        # "store" only for values: a key of this type is refused by reads too
        doing = f"cannot store {what} of type" if allow_containers else f"unsupported {what} type"
        raise TypeError(
            f"{doing} {t.__module__}.{t.__qualname__}: "
            f"durablekv {what}s may be {allowed}{hint}")


def _dec(buf: bytes, pos: int, depth: int = 0) -> tuple[Any, int]:
    """Decode one object at ``pos``: ``(object, end)``. Every length and
    count is checked against the bytes left before anything is allocated,
    and nesting deeper than :data:`MAX_NESTING` is damage (ValueError), so
    no blob can cost more than its size nor overflow the stack."""
    tag = buf[pos]
    pos += 1
    if tag == 0x73 or tag == 0x62 or tag == 0x49:  # s, b, I
        (n,) = _U32.unpack_from(buf, pos)
        pos += 4
        if n > len(buf) - pos:
            raise ValueError(f"a length of {n} bytes at byte {pos - 4} runs past the end "
                             f"of the {len(buf)}-byte encoding")
        if tag == 0x73:
            return buf[pos:pos + n].decode("utf-8", "surrogatepass"), pos + n
        if tag == 0x62:
            return buf[pos:pos + n], pos + n
        return int.from_bytes(buf[pos:pos + n], "little", signed=True), pos + n
    if tag == 0x71:  # q
        return _Q.unpack_from(buf, pos)[0], pos + 8
    if tag == 0x64:  # d
        return _D.unpack_from(buf, pos)[0], pos + 8
    if tag == 0x4E:  # N
        return None, pos
    if tag == 0x54:  # T
        return True, pos
    if tag == 0x46:  # F
        return False, pos
    if tag in (0x74, 0x6C, 0x6D):  # t, l, m
        (n,) = _U32.unpack_from(buf, pos)
        pos += 4
        # every item takes at least one byte (two for a dict entry)
        if n * (2 if tag == 0x6D else 1) > len(buf) - pos:
            raise ValueError(f"a count of {n} items at byte {pos - 4} is more than the "
                             f"{len(buf) - pos} bytes left can hold")
        if depth >= MAX_NESTING:
            raise ValueError(f"nested more than MAX_NESTING={MAX_NESTING} levels deep at byte "
                             f"{pos - 5}")
        depth += 1
        if tag == 0x6D:
            d = {}
            for _ in range(n):
                k, pos = _dec(buf, pos, depth)
                v, pos = _dec(buf, pos, depth)
                d[k] = v
            return d, pos
        items = []
        for _ in range(n):
            item, pos = _dec(buf, pos, depth)
            items.append(item)
        return (tuple(items) if tag == 0x74 else items), pos
    raise ValueError(f"unknown type tag {tag!r} at byte {pos - 1}")


def _decode_all(buf: bytes) -> Any:
    # A damaged blob is always a ValueError (never struct.error or IndexError
    # from reading past the end, nor TypeError from an unhashable dict key).
    try:
        obj, pos = _dec(buf, 0)
    except (struct.error, IndexError, TypeError) as exc:
        raise ValueError(f"damaged encoded object of {len(buf)} bytes: {exc}") from exc
    if pos > len(buf):
        raise ValueError(f"encoded object of {len(buf)} bytes is cut short "
                         f"({pos - len(buf)} bytes missing)")
    if pos != len(buf):
        raise ValueError(f"{len(buf) - pos} trailing bytes after the encoded object")
    return obj


def check_key(key: Any, _depth: int = 0) -> None:
    """Raise ``TypeError``/``ValueError`` unless ``key`` is a supported key
    (TypeError also for tuples nested deeper than :data:`MAX_NESTING`)."""
    t = type(key)
    if t is str or t is int or t is bytes:
        return
    if t is float:
        if key != key:
            raise ValueError("a NaN key is never equal to itself, so it could never be "
                             "found again; use another key")
        return
    if t is tuple:
        if _depth >= MAX_NESTING:
            raise _too_deep("key")
        for item in key:
            check_key(item, _depth + 1)
        return
    if key is None or t is bool:
        return
    _enc(key, [], False, "key")  # raises the TypeError naming the type


def _scalar_hint(obj: Any, t: type) -> str:
    """How to pass a number-like object that is not a Python number (a NumPy
    scalar such as ``np.int64``, a ``Decimal``) as a plain one, or ""."""
    if t.__module__ == "numpy" and callable(getattr(obj, "item", None)):
        return ("; it is a NumPy scalar: pass the plain Python value, x.item() "
                "(or int(x), float(x), bool(x))")
    if hasattr(t, "__index__"):
        return "; it is an integer type: pass the plain value, int(x)"
    if isinstance(obj, numbers.Number):
        return "; it is a number type: pass float(x) (or str(x) to keep every digit)"
    return ""


def encode_key(key: Any) -> bytes:
    """Encode ``key`` exactly (its own type kept), for the log and the pages.

    :raises TypeError: the key (or an item of a tuple key) has an unsupported type.
    :raises ValueError: the key is or contains NaN.
    """
    t = type(key)
    if t is str:
        b = key.encode("utf-8", "surrogatepass")
        return b"s" + _U32.pack(len(b)) + b
    if t is int and _INT64_MIN <= key <= _INT64_MAX:
        return _QKEY(b"q", key)
    check_key(key)
    out: list[bytes] = []
    _enc(key, out, False, "key")
    return b"".join(out)


def decode_key(data: bytes) -> Any:
    """Inverse of :func:`encode_key` (and of :func:`canonical_key`)."""
    if data[:1] == b"s" and len(data) >= 5 and _U32.unpack_from(data, 1)[0] == len(data) - 5:
        return data[5:].decode("utf-8", "surrogatepass")
    if len(data) == 9 and data[:1] == b"q":
        return _Q.unpack_from(data, 1)[0]
    return _decode_all(data)


def decode_keys(blobs: Iterable[bytes]) -> tuple[list[Any], list[int]]:
    """:func:`decode_key` for many keys (recovery decodes millions): a str key
    costs no call.

    :returns: the keys, and the positions of those that are neither str nor
        bytes. Only those can equal a key of another type or encoding (``1 ==
        1.0 == True``); a str or bytes key's encoding is its canonical key.
    :raises ValueError: a damaged encoding.
    """
    if _native is not None:
        # str and int64 keys decoded in C; any other key by decode_key
        return _native.decode_keys(blobs, decode_key)
    return _py_decode_keys(blobs)


def _py_decode_keys(blobs: Iterable[bytes]) -> tuple[list[Any], list[int]]:
    """:func:`decode_keys` in Python (the reference the C kernel matches)."""
    keys: list[Any] = []
    others: list[int] = []
    append = keys.append
    u32 = _U32.unpack_from
    for b in blobs:
        if b[:1] == b"s" and len(b) >= 5 and u32(b, 1)[0] == len(b) - 5:
            append(b[5:].decode("utf-8", "surrogatepass"))
        else:
            key = decode_key(b)
            if type(key) is not bytes and type(key) is not str:
                others.append(len(keys))
            append(key)
    return keys, others


def _canon(key: Any, depth: int = 0) -> Any:
    t = type(key)
    if t is bool:
        return int(key)
    if t is float and key.is_integer():
        return int(key)
    if t is tuple:
        if depth >= MAX_NESTING:
            raise _too_deep("key")  # as set() refuses it, before the stack runs out
        return tuple(_canon(k, depth + 1) for k in key)
    return key


#: The plain value of an instance of a subclass of each base type, by the
#: base type's own method (a subclass may override the ones ``int()``,
#: ``str()`` ... call; bytes.__bytes__ is new in Python 3.11).
_PLAIN = {int: int.__int__, float: float.__float__, str: str.__str__,
          bytes: lambda b: bytes.__getitem__(b, slice(None))}


def lookup_key(key: Any) -> Any:
    """The key of a supported type that a dict lookup with ``key`` would find.

    A subclass instance (an ``IntEnum``/``StrEnum`` member, a namedtuple, or
    a tuple holding one) cannot be stored, but it is equal to, and hashes
    like, the plain value (``I.ONE == 1``), so a dict, and the memory tier's
    page table, finds the entry stored under that value. Lookups of keys
    whose page is only in SQLite use this to find the same entry there.
    Returns ``key`` itself when there is no such plain key (the caller's
    :func:`canonical_key` then raises the usual TypeError).
    """
    return _lookup_key(key, 0)


def _lookup_key(key: Any, depth: int) -> Any:
    t = type(key)
    if t is str or t is int or t is bytes or t is float or t is bool or key is None:
        return key
    if isinstance(key, tuple):
        if depth >= MAX_NESTING:
            return key  # no storable key is this deep: the caller raises its TypeError
        plain: Any = tuple([_lookup_key(k, depth + 1) for k in key])
    else:
        for base, to_plain in _PLAIN.items():
            if isinstance(key, base) and t is not bool:
                plain = to_plain(key)
                break
        else:
            return key
    # exactly when a dict holding ``plain`` finds it by ``key``
    if hash(plain) == hash(key) and plain == key:
        return plain
    return key


def canonical_key(key: Any) -> bytes:
    """Bytes that are equal exactly when the keys are equal under ``==``.

    Used as the SQLite key index's primary key. ``True``, ``1`` and ``1.0``
    all map to the encoding of ``1``.
    """
    t = type(key)
    if t is str:
        b = key.encode("utf-8", "surrogatepass")
        return b"s" + _U32.pack(len(b)) + b
    if t is int and _INT64_MIN <= key <= _INT64_MAX:
        return _QKEY(b"q", key)
    return encode_key(_canon(key))


class Frozen:
    """A stored value kept encoded in memory because it is mutable.

    A list or dict handed to ``set`` is encoded at once; ``get`` decodes a
    fresh copy, so mutating what you stored or what you got back never
    changes the cache (as with diskcache, and unlike a plain dict).
    """

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        self.blob = blob


_SHAREABLE_SCALARS = frozenset({str, bytes, int, float, bool, type(None)})


def _shareable(obj: Any) -> bool:
    t = type(obj)
    if t in _SHAREABLE_SCALARS:
        return True
    if t is tuple:
        return all(_shareable(x) for x in obj)
    return False


class ValueCodec:
    """Encodes values for the log and the store; decides what memory may share.

    ``encode(value) -> bytes`` raises ``TypeError`` for unsupported types;
    ``decode(bytes) -> value``; ``memory_form(value, blob)`` is what a slot
    holds: the object itself when it is immutable, else a :class:`Frozen`.
    """

    name = "abstract"

    def encode(self, value: Any) -> bytes:
        raise NotImplementedError

    def decode(self, data: bytes) -> Any:
        raise NotImplementedError

    def memory_form(self, value: Any, blob: bytes) -> Any:
        return value if _shareable(value) else Frozen(blob)

    def value_bytes(self, value: Any, blob: bytes) -> int:
        """Bytes that ``value`` (encoded as ``blob``) counts against
        ``max_value_bytes``: a ``bytes`` value its length, anything else its
        encoded size."""
        return len(value) if type(value) is bytes else len(blob)

    def from_memory(self, held: Any) -> Any:
        return self.decode(held.blob) if type(held) is Frozen else held

    def to_blob(self, held: Any) -> bytes:
        return held.blob if type(held) is Frozen else self.encode(held)

    def memory_form_from_blob(self, blob: bytes) -> Any:
        return self.memory_form(self.decode(blob), blob)

    def memory_forms_from_blobs(self, blobs: Iterable[bytes]) -> list[Any]:
        """:meth:`memory_form_from_blob` of each blob, in order."""
        return list(map(self.memory_form_from_blob, blobs))


class SafeCodec(ValueCodec):
    """The default: the tagged format above; no code runs on load."""

    name = "safe"

    def encode(self, value: Any) -> bytes:
        t = type(value)
        if t is str:
            b = value.encode("utf-8", "surrogatepass")
            return b"s" + _U32.pack(len(b)) + b
        if t is bytes:
            return b"b" + _U32.pack(len(value)) + value
        out: list[bytes] = []
        _enc(value, out, True, "value")  # (TypeError past MAX_NESTING)
        return b"".join(out)

    def decode(self, data: bytes) -> Any:
        return _decode_all(data)

    def value_bytes(self, value: Any, blob: bytes) -> int:
        """A ``str`` or ``bytes`` value counts its data (UTF-8 for str), not
        the 5-byte tag and length in front of it; anything else its encoding."""
        return len(blob) - 5 if blob[0] in (0x73, 0x62) else len(blob)  # s, b

    def memory_form_from_blob(self, blob: bytes) -> Any:
        tag = blob[0]
        if tag == 0x6C or tag == 0x6D:  # list, dict: keep encoded
            _decode_all(blob)  # ... once checked: damage is found here, not at a get
            return Frozen(blob)
        if tag == 0x62 and len(blob) >= 5 and _U32.unpack_from(blob, 1)[0] == len(blob) - 5:
            return blob[5:]  # bytes, the common case
        return self.memory_form(_decode_all(blob), blob)

    def memory_forms_from_blobs(self, blobs: Iterable[bytes]) -> list[Any]:
        """Like the base method; a bytes value costs no call (and, with the
        C kernels, no Python-level step)."""
        if _native is not None:
            return _native.memory_forms(blobs, self.memory_form_from_blob)
        return self._py_memory_forms_from_blobs(blobs)

    def _py_memory_forms_from_blobs(self, blobs: Iterable[bytes]) -> list[Any]:
        out: list[Any] = []
        append = out.append
        u32 = _U32.unpack_from
        slow = self.memory_form_from_blob
        for b in blobs:
            if b[:1] == b"b" and len(b) >= 5 and u32(b, 1)[0] == len(b) - 5:
                append(b[5:])
            else:
                append(slow(b))
        return out


class PickleCodec(ValueCodec):
    """Opt-in pickle values. UNSAFE for stores that others can write."""

    name = "pickle"

    def encode(self, value: Any) -> bytes:
        try:
            return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"cannot pickle value of type {type(value).__qualname__}: {exc}") from exc

    def decode(self, data: bytes) -> Any:
        return pickle.loads(data)

    def memory_form_from_blob(self, blob: bytes) -> Any:
        return Frozen(blob)


_CODECS: dict[str, Callable[[], ValueCodec]] = {"safe": SafeCodec, "json": SafeCodec,
                                                "pickle": PickleCodec}


def codec_by_name(name: str | ValueCodec) -> ValueCodec:
    """``"safe"`` (default; ``"json"`` is an alias) or ``"pickle"``, or a ValueCodec."""
    if isinstance(name, ValueCodec):
        return name
    try:
        return _CODECS[name]()
    except (KeyError, TypeError):
        from .errors import ConfigError
        raise ConfigError(f"unknown serializer {name!r}; use 'safe' (default) or 'pickle'") from None
