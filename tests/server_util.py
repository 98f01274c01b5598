"""Start a real ``durablekv serve`` process for the server tests; always stop it.

``with running_server(dir, "--token-file", path) as srv: srv.url``. The
start line (``durablekv serving DIR on http://HOST:PORT``) is waited for
with a deadline; a process that dies or says nothing in time fails the test
with its stderr.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Iterator

import pytest

#: ``.ci/run`` sets this: there a missing server extra fails the server
#: tests instead of skipping them.
if os.environ.get("DURABLEKV_REQUIRE_SERVER") == "1":
    import fastapi, httpx, uvicorn  # noqa: E401,F401 - ImportError fails the run
else:
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")

REPO = Path(__file__).resolve().parents[1]
START_LINE = re.compile(r"^durablekv serving (.+) on (http://\S+)$")
#: Seconds a server may take to print its start line (imports, recovery).
START_TIMEOUT = 60.0


class ServerProcess:
    """A ``durablekv serve`` child process; ``url`` once started."""

    def __init__(self, directory: str | os.PathLike, *args: str,
                 env: dict[str, str] | None = None) -> None:
        self.directory = str(directory)
        self.args = args
        full_env = dict(os.environ)
        full_env.pop("DURABLEKV_TOKEN", None)
        full_env.update(env or {})
        parent = Path(self.directory).parent
        parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix="serve-", suffix=".stderr", dir=parent)
        self.stderr_path = Path(name)
        self._stderr = os.fdopen(fd, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "durablekv", "serve", self.directory, "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=self._stderr, env=full_env, cwd=str(REPO),
            text=True)
        self.url = ""
        self._lines: "queue.Queue[str | None]" = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:  # type: ignore[union-attr]
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def wait_started(self, timeout: float = START_TIMEOUT) -> "ServerProcess":
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            pytest.fail(f"server did not print its start line within {timeout} s; "
                        f"stderr: {self.stderr()}")
        if line is None:
            self.proc.wait(10)
            pytest.fail(f"server exited {self.proc.returncode} before starting; "
                        f"stderr: {self.stderr()}")
        m = START_LINE.match(line)
        assert m, f"unexpected first line {line!r}"
        assert m.group(1) == self.directory
        self.url = m.group(2)
        return self

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._stderr.close()


@contextlib.contextmanager
def running_server(directory: str | os.PathLike, *args: str,
                   env: dict[str, str] | None = None) -> Iterator[ServerProcess]:
    srv = ServerProcess(directory, *args, env=env)
    try:
        yield srv.wait_started()
    finally:
        srv.terminate()
