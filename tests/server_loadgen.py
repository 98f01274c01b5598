"""Load generator for the server durability tests (its own process).

Usage: python server_loadgen.py URL ACK_LOG THREADS REQUESTS SECONDS

Each thread overwrites its own 20 keys ``w<thread>-<n>`` with increasing
sequence numbers (JSON ints). After each 204 it appends ``key seq`` to
ACK_LOG (one ``os.write`` of a whole line, O_APPEND), so the log holds
exactly the acknowledged writes. It stops after REQUESTS requests in all,
after SECONDS, or once the server stops answering; exit status 0.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from durablekv.client import Client
from durablekv.errors import RemoteError


def main() -> int:
    url, ack_path, threads, requests, seconds = sys.argv[1:6]
    threads, requests, seconds = int(threads), int(requests), float(seconds)
    fd = os.open(ack_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    deadline = time.monotonic() + seconds
    left = [requests]
    lock = threading.Lock()

    def work(t: int) -> None:
        with Client(url, timeout=30) as kv:
            seq = 0
            while time.monotonic() < deadline:
                with lock:
                    if left[0] <= 0:
                        return
                    left[0] -= 1
                seq += 1
                key = f"w{t}-{seq % 20}"
                try:
                    kv.set(key, seq)
                except RemoteError:
                    return  # killed or shutting down: this write is not acknowledged
                os.write(fd, f"{key} {seq}\n".encode())

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for th in ts:
        th.start()
    print("started", flush=True)
    for th in ts:
        th.join()
    os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
