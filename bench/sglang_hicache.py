"""SGLang HiCache storage: durablekv's backend beside SGLang's own file backend.

Both take the same pages through SGLang's storage API as its generic path
calls it (``batch_set`` of flat host pages, ``batch_get`` into preallocated
pages, ``batch_exists`` for the longest stored prefix), in turn, round by
round, each round on fresh directories. Pages are 64 tokens of a
Llama-3-8B-like layout in bf16: 8 MiB a page (32 layers x K,V x 8 KV heads
x 128 dims), and 2 MiB (the same model's page on one of 4 tensor-parallel
ranks). Reported: set and get MB/s and ``batch_exists`` latency over 32
keys, median (min..max) of the rounds, and the ratios per round.

Needs torch and SGLang (``.ci/sglang/run`` installs the CPU builds):

    python -m bench.sglang_hicache [--rounds 5] [--json OUT] [--markdown OUT]
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.util import rounds_main, span, summarize  # noqa: E402
from tests.llm.sglang_pages import keys_and_pages, make_backend  # noqa: E402

MIB = 1 << 20
#: (page bytes, pages per round): 128 MiB a round either way
CASES = ((2 * MIB, 64), (8 * MIB, 16))
IMPLS = ("durablekv", "file")


def _one(kind: str, root: Path, keys: list[str], pages: list[torch.Tensor]) -> dict[str, float]:
    backend = make_backend(kind, root / kind)
    total = sum(p.numel() * p.element_size() for p in pages) / 1e6
    try:
        t0 = time.perf_counter()
        assert backend.batch_set(keys, pages)
        if kind == "durablekv":
            backend.cache.flush()        # the references stored too, not only logged
        put = time.perf_counter() - t0
        # zero-filled, as SGLang allocates them (get_dummy_flat_data_page is a
        # torch.zeros page; a host pool is touched memory): a first touch of
        # fresh memory is page faults, not storage
        targets = [torch.zeros_like(p) for p in pages]
        t0 = time.perf_counter()
        got = backend.batch_get(keys, targets)
        get = time.perf_counter() - t0
        assert all(g is not None for g in got)
        probe = keys[:32]
        t0 = time.perf_counter()
        for _ in range(10):
            assert backend.batch_exists(probe) == len(probe)
        exists_us = (time.perf_counter() - t0) / 10 * 1e6
    finally:
        if hasattr(backend, "close"):
            backend.close()
    return {"set_mb_s": total / put, "get_mb_s": total / get, "exists_us": exists_us}


def run(rounds: int, tmpdir: str | None = None) -> list[dict[str, Any]]:
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    rows = []
    for size, count in CASES:
        keys, pages = keys_and_pages(count, elems=size // 2)
        samples: dict[str, dict[str, list[float]]] = {i: {} for i in IMPLS}
        ratios: dict[str, list[float]] = {"set": [], "get": [], "exists": []}
        for r in range(rounds):
            got = {}
            for kind in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
                root = Path(tempfile.mkdtemp(prefix="hicache-bench-", dir=tmpdir))
                try:
                    got[kind] = _one(kind, root, keys, pages)
                finally:
                    shutil.rmtree(root, ignore_errors=True)
            for kind, res in got.items():
                for k, v in res.items():
                    samples[kind].setdefault(k, []).append(v)
            ratios["set"].append(got["durablekv"]["set_mb_s"] / got["file"]["set_mb_s"])
            ratios["get"].append(got["durablekv"]["get_mb_s"] / got["file"]["get_mb_s"])
            ratios["exists"].append(got["durablekv"]["exists_us"] / got["file"]["exists_us"])
            print(f"[sglang_hicache] {size // MIB} MiB round {r + 1}: set "
                  f"{got['durablekv']['set_mb_s']:.0f} / {got['file']['set_mb_s']:.0f} MB/s, "
                  f"get {got['durablekv']['get_mb_s']:.0f} / {got['file']['get_mb_s']:.0f}",
                  file=sys.stderr, flush=True)
        rows.append({"page_bytes": size, "pages": count,
                     **{f"{kind}_{k}": summarize(v) for kind in IMPLS
                        for k, v in samples[kind].items()},
                     **{f"{k}_ratio": summarize(v) for k, v in ratios.items()}})
    return rows


def markdown(rows: list[dict[str, Any]], rounds: int) -> str:
    out = [f"`python -m bench.sglang_hicache --rounds {rounds}`: median (min..max) of "
           f"{rounds} rounds, the two backends in turn; MB/s of `batch_set` (durablekv: "
           "with the flush of its references) and `batch_get` into preallocated pages; "
           "`batch_exists` of 32 stored keys in microseconds.", "",
           "| page | durablekv set | file set | set ratio (goal >= 0.8) | durablekv get | "
           "file get | get ratio (goal >= 1) | durablekv exists us | file exists us |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        out.append(f"| {r['page_bytes'] // MIB} MiB x {r['pages']} | "
                   f"{span(r['durablekv_set_mb_s'])} | {span(r['file_set_mb_s'])} | "
                   f"{span(r['set_ratio'], 2)} | {span(r['durablekv_get_mb_s'])} | "
                   f"{span(r['file_get_mb_s'])} | {span(r['get_ratio'], 2)} | "
                   f"{span(r['durablekv_exists_us'])} | {span(r['file_exists_us'])} |")
    return "\n".join(out) + "\n"


def main() -> None:
    rounds_main(__doc__, run, markdown)


if __name__ == "__main__":
    main()
