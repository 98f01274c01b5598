"""A separate process using the HiCache backend: ``python sglang_worker.py DIR set|get N``.

``set`` stores N pages (64 tokens each, bf16, keys from SGLang's own page
hash over a token list) and prints ``P i`` after each acknowledged set, then
waits; ``get`` reads them back and prints ``G i <sha256 of the bytes>`` per
page (``G i miss`` for a miss).
"""

from __future__ import annotations

import hashlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.llm.sglang_pages import keys_and_pages, make_backend  # noqa: E402


def main() -> None:
    directory, what, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    backend = make_backend("durablekv", directory)
    keys, pages = keys_and_pages(n)
    if what == "set":
        for i, (k, p) in enumerate(zip(keys, pages)):
            assert backend.set(k, p)
            os.write(1, f"P {i}\n".encode())
        sys.stdin.read()          # killed here, or told to stop
        return
    out = pages[0].clone()
    for i, k in enumerate(keys):
        got = backend.get(k, out)
        digest = hashlib.sha256(out.view(-1).view(__import__("torch").uint8).numpy()).hexdigest()
        print(f"G {i} {'miss' if got is None else digest}", flush=True)


if __name__ == "__main__":
    main()
