"""Chained hashes of full KV blocks: the keys of the prefix index and of the durable tier.

Block ``i`` of a token sequence is the token ids at positions
``[i * block_size, (i + 1) * block_size)``. Its hash covers, in one canonical
byte string,

    DOMAIN || parent || u32 block_size || u32 n || n x i64 token id || extra

where ``parent`` is block ``i - 1``'s 32-byte hash (32 zero bytes for block 0),
integers are little-endian, and ``extra`` is encoded by :func:`encode_extra`
(a type tag and a length before every item). The digest is SHA-256.

So a block's hash names the whole prefix up to and including it (as in
vLLM's automatic prefix caching): equal prefixes give equal leading hashes,
and a change in block ``j`` changes the hashes of ``j`` and of every block
after it. The result depends on nothing but the bytes above: it is the same
in every process and on every machine (Python's ``hash()`` is salted per
process and never used). Only full blocks are hashed; a partial tail block
has no hash and is never shared through the prefix index.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Iterable, Sequence

__all__ = ["block_hashes", "hash_block", "encode_extra", "HASH_BYTES", "NO_PARENT"]

#: Bytes in one block hash (SHA-256).
HASH_BYTES = 32
#: The parent of block 0.
NO_PARENT = bytes(HASH_BYTES)
_DOMAIN = b"durablekv.llm.block.v1\x00"
_U32 = struct.Struct("<I")
_MAX_TOKEN = 2 ** 63


def encode_extra(extra: Any) -> bytes:
    """The canonical bytes of ``extra`` (a model or adapter id, a salt).

    :param extra: None, ``bytes``, ``str``, ``int`` (not ``bool``), or a tuple
        of these (nested tuples allowed).
    :returns: tag + length + payload for each item, so ``("ab", "c")`` and
        ``("a", "bc")`` differ.
    :raises TypeError: any other type.
    """
    if extra is None:
        return b"N"
    if isinstance(extra, bytes):
        return b"B" + _U32.pack(len(extra)) + extra
    if isinstance(extra, str):
        data = extra.encode("utf-8")
        return b"S" + _U32.pack(len(data)) + data
    if isinstance(extra, int) and not isinstance(extra, bool):
        text = str(extra).encode("ascii")
        return b"I" + _U32.pack(len(text)) + text
    if isinstance(extra, tuple):
        parts = [encode_extra(item) for item in extra]
        return b"T" + _U32.pack(len(parts)) + b"".join(parts)
    raise TypeError(f"a block hash extra key must be None, bytes, str, int or a tuple of "
                    f"these, not {type(extra).__name__} {extra!r}; pass e.g. the model's "
                    "name as a str")


def _token_bytes(tokens: Sequence[int]) -> bytes:
    out = bytearray()
    for t in tokens:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise TypeError(f"token ids must be ints, not {type(t).__name__} {t!r}")
        t = t.__index__()
        if not 0 <= t < _MAX_TOKEN:
            raise ValueError(f"token id {t!r} is out of range; token ids are in [0, 2**63)")
        out += t.to_bytes(8, "little")
    return bytes(out)


def hash_block(parent: bytes, tokens: Sequence[int], block_size: int,
               extra_bytes: bytes = b"N") -> bytes:
    """The hash of one full block whose predecessor has hash ``parent``.

    :param parent: the previous block's hash, or :data:`NO_PARENT` for block 0.
    :param tokens: exactly ``block_size`` token ids.
    :param extra_bytes: :func:`encode_extra` of the extra key (precomputed, so
        a caller hashing block after block encodes it once).
    :returns: 32 bytes.
    :raises ValueError: ``parent`` is not 32 bytes or ``tokens`` is not one full block.
    """
    if len(parent) != HASH_BYTES:
        raise ValueError(f"a parent block hash is {HASH_BYTES} bytes, not {len(parent)}")
    if len(tokens) != block_size:
        raise ValueError(f"only full blocks are hashed: got {len(tokens)} token ids for a "
                         f"block of {block_size}")
    h = hashlib.sha256(_DOMAIN)
    h.update(parent)
    h.update(_U32.pack(block_size))
    h.update(_U32.pack(len(tokens)))
    h.update(_token_bytes(tokens))
    h.update(extra_bytes)
    return h.digest()


def block_hashes(token_ids: Iterable[int], block_size: int, extra: Any = None,
                 *, parent: bytes = NO_PARENT) -> list[bytes]:
    """One chained hash per FULL block of ``token_ids``.

    :param token_ids: the sequence's token ids (ints in ``[0, 2**63)``).
    :param block_size: tokens per block, an int >= 1.
    :param extra: folded into every block's hash (e.g. a model id), see
        :func:`encode_extra`; None for none.
    :param parent: the hash before the first block (to continue a chain).
    :returns: ``len(token_ids) // block_size`` hashes of 32 bytes each; a
        partial tail block gets none.
    :raises ValueError: ``block_size`` < 1, a negative or too large token id.
    :raises TypeError: ``block_size`` or a token id is not an int; a bad ``extra``.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"block_size must be an int, not {type(block_size).__name__} "
                        f"{block_size!r}")
    if block_size <= 0:
        raise ValueError(f"block_size must be >= 1 (tokens per block), not {block_size!r}")
    tokens = list(token_ids)
    extra_bytes = encode_extra(extra)
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], block_size, extra_bytes)
        out.append(parent)
    return out
