"""A private redis-server for the bench: loopback, a free port, a temp dir.

Started with ``--appendonly yes --appendfsync everysec --save ''`` (Redis's
usual durable setting: every write is in the AOF within a second, the
counterpart of durablekv's ``durability="log"``) and automatic AOF rewrites
off (see ``ARGS``), stopped (and its directory removed) by
:meth:`RedisServer.stop`. Never touches a system service.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import tempfile
import time


def redis_available() -> str | None:
    """Why the Redis cases cannot run, or None when they can."""
    if shutil.which("redis-server") is None:
        return "redis-server is not on PATH (apt-get install redis-server); Redis cases skipped"
    if importlib.util.find_spec("redis") is None:
        return "the redis package is not installed (pip install -e '.[bench]'); Redis cases skipped"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``with RedisServer(parent_dir) as srv: redis.Redis(port=srv.port)``."""

    # Automatic AOF rewrites are off: a rewrite is a forked process that would
    # steal a CPU from whichever implementation is being timed at that moment.
    ARGS = ("--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
            "--auto-aof-rewrite-percentage", "0")

    def __init__(self, parent: str | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="redis-", dir=parent)
        self.port = 0
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 10.0) -> "RedisServer":
        import redis
        for _attempt in range(3):
            self.port = _free_port()
            self.proc = subprocess.Popen(
                ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                 "--dir", self.dir, "--daemonize", "no", "--logfile", "redis.log",
                 *self.ARGS],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.dir)
            client = redis.Redis(host="127.0.0.1", port=self.port)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    if client.ping():
                        client.close()
                        return self
                except redis.exceptions.ConnectionError:
                    time.sleep(0.02)
            self._kill()  # port taken meanwhile, or too slow: try another port
        raise RuntimeError(f"redis-server did not start (see {self.dir}/redis.log)")

    def version(self) -> str:
        import redis
        c = redis.Redis(host="127.0.0.1", port=self.port)
        try:
            return str(c.info("server").get("redis_version"))
        finally:
            c.close()

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()   # our own child, by its Popen handle
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
