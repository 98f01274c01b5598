"""Pages and backends both sides of the SGLang tests build the same way."""

from __future__ import annotations

import os

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig
from sglang.srt.mem_cache.utils import get_hash_str

from durablekv.llm.sglang import DurableKVHiCacheStorage

PAGE_TOKENS = 64
#: a small page of a Llama-like layout: 2 layers x K,V x 64 tokens x 2 heads x 16 dims, bf16
PAGE_ELEMS = 2 * 2 * PAGE_TOKENS * 2 * 16


def storage_config(extra: dict, tp_rank: int = 0, tp_size: int = 1) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                                enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="meta-llama/Llama-3.1-8B-Instruct",
                                extra_config=extra)


def make_backend(kind: str, directory: str, **extra):
    """SGLang's reference file backend or ours, built as SGLang's factory builds them."""
    if kind == "file":
        return HiCacheFile(storage_config({"file_storage_path": str(directory), **extra}))
    return DurableKVHiCacheStorage(
        storage_config({"durablekv_path": str(directory), **extra}), {})


def keys_and_pages(n: int, elems: int = PAGE_ELEMS, seed: int = 0):
    """``n`` chained page keys from SGLang's own hash over a token list, and
    ``n`` bf16 page tensors (flat, as the host pool hands them over)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (n * PAGE_TOKENS,), generator=gen).tolist()
    keys, prior = [], None
    for i in range(n):
        prior = get_hash_str(tokens[i * PAGE_TOKENS:(i + 1) * PAGE_TOKENS], prior)
        keys.append(prior)
    pages = [torch.randn(elems, generator=gen).to(torch.bfloat16) for _ in range(n)]
    return keys, pages


def env_for_children() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
