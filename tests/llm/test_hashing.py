"""block_hashes: chained, cryptographic, stable across processes, full blocks only."""

from __future__ import annotations

import subprocess
import sys

import pytest

from durablekv.llm.hashing import HASH_BYTES, NO_PARENT, block_hashes, hash_block

TOKENS = list(range(100, 137))  # 37 tokens


def test_one_hash_per_full_block_only():
    assert len(block_hashes(TOKENS, 8)) == 4          # 37 // 8; the tail of 5 gets none
    assert block_hashes(TOKENS[:7], 8) == []
    assert len(block_hashes(TOKENS, 1)) == 37
    assert all(len(h) == HASH_BYTES for h in block_hashes(TOKENS, 8))


def test_equal_prefixes_give_equal_leading_hashes():
    a = block_hashes(TOKENS[:24] + [1, 2, 3, 4, 5, 6, 7, 8], 8)
    b = block_hashes(TOKENS[:24] + [9, 9, 9, 9, 9, 9, 9, 9], 8)
    assert a[:3] == b[:3] and a[3] != b[3]
    # a partial tail does not change the full blocks' hashes
    assert block_hashes(TOKENS[:32], 8) == block_hashes(TOKENS[:35], 8)


@pytest.mark.parametrize("j", [0, 1, 3])
def test_change_in_block_j_changes_j_and_every_later_block(j):
    base = block_hashes(TOKENS[:32], 8)
    changed = list(TOKENS[:32])
    changed[j * 8 + 3] += 1
    other = block_hashes(changed, 8)
    assert other[:j] == base[:j]
    assert all(o != b for o, b in zip(other[j:], base[j:]))


def test_chain_covers_the_parent():
    # the same block content after different parents hashes differently
    block = TOKENS[:8]
    assert hash_block(NO_PARENT, block, 8) != hash_block(b"\x01" * 32, block, 8)
    h = block_hashes(TOKENS[:16], 8)
    assert h[1] == hash_block(h[0], TOKENS[8:16], 8)
    assert block_hashes(TOKENS[8:16], 8, parent=h[0]) == [h[1]]


def test_extra_key_and_block_size_are_covered():
    assert block_hashes(TOKENS, 8, "model-a") != block_hashes(TOKENS, 8, "model-b")
    assert block_hashes(TOKENS, 8, None) != block_hashes(TOKENS, 8, "")
    assert block_hashes(TOKENS, 8, ("ab", "c")) != block_hashes(TOKENS, 8, ("a", "bc"))
    assert block_hashes(TOKENS, 8, 1) != block_hashes(TOKENS, 8, "1")
    assert block_hashes(TOKENS[:8], 4)[1] != block_hashes(TOKENS[:8], 8)[0]
    # token boundaries are encoded: [1, 23] and [12, 3] differ
    assert block_hashes([1, 23], 2) != block_hashes([12, 3], 2)


def test_stable_across_processes():
    """Python's hash() is salted per process; these hashes must not be."""
    code = ("from durablekv.llm.hashing import block_hashes\n"
            f"print(','.join(h.hex() for h in block_hashes({TOKENS!r}, 8, ('m', 7))))\n")
    outs = set()
    for seed in ("1", "2"):
        env = {"PYTHONHASHSEED": seed, "PATH": ""}
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=60, check=True)
        outs.add(proc.stdout.strip())
    assert outs == {",".join(h.hex() for h in block_hashes(TOKENS, 8, ("m", 7)))}


def test_canonical_encoding_is_the_documented_one():
    """The encoding is part of the durable format (a change orphans every
    stored block): rebuild it from the module docstring with hashlib."""
    import hashlib
    import struct

    data = (b"durablekv.llm.block.v1\x00" + bytes(32) + struct.pack("<II", 4, 4)
            + struct.pack("<4q", 0, 1, 2, 3) + b"S" + struct.pack("<I", 1) + b"m")
    assert block_hashes([0, 1, 2, 3], 4, "m")[0] == hashlib.sha256(data).digest()
    assert block_hashes([0, 1, 2, 3], 4)[0].hex().startswith("af9e1e561bff8059")


@pytest.mark.parametrize("bad", [0, -1])
def test_block_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        block_hashes(TOKENS, bad)


def test_bad_inputs():
    with pytest.raises(TypeError, match="block_size must be an int"):
        block_hashes(TOKENS, 2.0)
    with pytest.raises(TypeError, match="token ids must be ints"):
        block_hashes([1.5, 2], 2)
    with pytest.raises(ValueError, match="out of range"):
        block_hashes([-1, 2], 2)
    with pytest.raises(TypeError, match="extra key"):
        block_hashes(TOKENS, 2, extra=1.5)
    with pytest.raises(ValueError, match="only full blocks"):
        hash_block(NO_PARENT, [1, 2, 3], 4)
