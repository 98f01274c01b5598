"""The public surface of durablekv.llm is pinned, and every name resolves."""

from __future__ import annotations

import durablekv.llm as llm


def test_public_surface_is_pinned():
    assert llm.__all__ == [
        "block_hashes", "paged_attention", "paged_prefill_attention", "BlockPool", "PoolStats",
        "PrefixMatch", "KVBlockStore", "KVBlockCorruptError", "KVBlockCorruptWarning",
        "Request", "Sequence", "ContinuousScheduler", "StaticScheduler", "TinyTransformer",
        "LLMEngine", "KVPoolCollector"]
    for name in llm.__all__:
        obj = getattr(llm, name)
        assert obj.__name__ == name and obj.__doc__, name
    assert sorted(dir(llm)) == sorted(llm.__all__)


def test_unknown_name_is_an_attribute_error():
    import pytest

    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        llm.nope  # noqa: B018
