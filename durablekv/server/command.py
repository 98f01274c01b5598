"""``durablekv serve DIR``: the command line of the HTTP server.

Kept free of FastAPI imports, so ``durablekv --help`` works without the
``server`` extra; :func:`run` imports the app when it starts.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys
from typing import Any

from ..errors import ConfigError
from ..policies import POLICIES

__all__ = ["add_arguments", "run", "TOKEN_ENV", "read_token", "is_loopback"]

#: The environment variable that may hold the bearer token (``--token-file`` wins).
TOKEN_ENV = "DURABLEKV_TOKEN"
DEFAULT_PORT = 8470


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``serve`` subcommand's options."""
    from ..cliargs import (add_byte_limit_arguments, non_negative_float as _non_negative_float,
                           port as _port, positive_float as _positive_float)
    p.add_argument("dir", metavar="DIR", type=os.path.expanduser,  # ~ as for Cache
                   help="the cache directory (created 0700 if missing)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default %(default)s: this machine only; any other "
                   "address needs a token)")
    p.add_argument("--port", type=_port, default=DEFAULT_PORT,
                   help="TCP port (default %(default)s; 0 picks a free one, printed at start)")
    p.add_argument("--token-file", metavar="PATH",
                   help=f"file holding the bearer token (surrounding whitespace stripped); "
                   f"default: the {TOKEN_ENV} environment variable, if set")
    p.add_argument("--access-log", action="store_true",
                   help="one JSON line per request on stderr (off by default)")
    p.add_argument("--max-key-chars", type=int, default=1024,
                   help="longest key in characters (414 beyond; default %(default)s)")
    p.add_argument("--request-timeout", type=_positive_float, default=30.0,
                   help="seconds a request body may take to arrive (408 beyond; default "
                   "%(default)s)")
    p.add_argument("--shutdown-timeout", type=_non_negative_float, default=30.0,
                   help="seconds SIGTERM waits for in-flight requests (default %(default)s)")
    g = p.add_argument_group("cache options (as for durablekv.Cache)")
    g.add_argument("--page-size", type=int, help="slots per page (new stores; default 16)")
    g.add_argument("--max-pages", type=int, default=4096, help="pages in memory "
                   "(default %(default)s)")
    g.add_argument("--policy", choices=POLICIES, default="lru",
                   help="which resident page leaves memory first (default %(default)s; "
                   "see docs/policy.md)")
    add_byte_limit_arguments(g)
    g.add_argument("--durability", choices=("fsync", "log", "none"), default="log",
                   help="what a 2xx on a write survives (default %(default)s)")
    g.add_argument("--flush-interval", type=float, default=0.05,
                   help="seconds between write-behind flushes (default %(default)s)")
    g.add_argument("--flush-batch-pages", type=int, default=64,
                   help="dirty pages that start a flush early (default %(default)s)")
    g.add_argument("--max-value-bytes", type=int, default=64 << 20,
                   help="largest value; bigger bodies are answered 413 (default %(default)s)")
    p.set_defaults(func=run)


def read_token(token_file: str | None, environ: Any = os.environ) -> str | None:
    """The token from ``token_file`` (stripped) or :data:`TOKEN_ENV`; None if neither.

    :raises ConfigError: the file cannot be read or the token is empty.
    """
    if token_file is not None:
        try:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read --token-file {token_file!r}: "
                              f"{exc.strerror or exc}") from exc
        except UnicodeDecodeError:
            raise ConfigError(f"--token-file {token_file!r} is not UTF-8 text") from None
        where = f"--token-file {token_file!r}"
    elif environ.get(TOKEN_ENV) is not None:
        token = environ[TOKEN_ENV].strip()
        where = TOKEN_ENV
    else:
        return None
    if not token:
        raise ConfigError(f"the token in {where} is empty; put a long random token there "
                          "(e.g. `python -c 'import secrets; print(secrets.token_urlsafe())'`)")
    if any(c.isspace() or not c.isprintable() for c in token):
        raise ConfigError(f"the token in {where} holds whitespace or control characters; "
                          "a bearer token is one printable word")
    return token


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _private_dir(path: str) -> None:
    """Create the cache directory 0700 when it is missing (an existing one
    keeps the mode its owner gave it).

    :raises ConfigError: as :class:`Cache` does for a path it cannot create."""
    if os.path.isdir(path):
        return
    from ..config import _make_cache_dir
    _make_cache_dir(path)
    os.chmod(path, 0o700)  # the umask may have taken bits off, never added them


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another "
                          "--port (0 picks a free one) or --host") from exc
    sock.set_inheritable(True)
    return sock


def run(args: argparse.Namespace) -> int:
    """Start the server; return the exit code (0 after SIGTERM/SIGINT).

    :raises ConfigError: bad options, a non-loopback host without a token,
        a port that cannot be bound (the CLI prints it and exits 2).
    """
    token = read_token(args.token_file)
    if token is None and not is_loopback(args.host):
        raise ConfigError(f"refusing to serve on {args.host!r} without a token: anyone who can "
                          "reach it could read and write the cache. Pass --token-file PATH (or "
                          f"set {TOKEN_ENV}), or bind 127.0.0.1")
    for name in ("max_key_chars", "max_value_bytes"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1")
    if not args.request_timeout > 0:
        raise ConfigError("--request-timeout must be > 0 seconds")
    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:
        raise ConfigError(f"the server needs the 'server' extra ({exc.name} is missing): "
                          "pip install 'durablekv[server]'") from exc
    from ..cache import Cache

    from ..stores.sqlitefile import stored_serializer as _stored_serializer
    if os.path.isdir(args.dir) and _stored_serializer(args.dir) == "pickle":
        raise ConfigError(f"{args.dir!r} holds a cache written with serializer='pickle'; the "
                          "server never unpickles (a value from the wire could run code), so "
                          "it serves only caches made with the safe serializer. Serve a new "
                          "directory, or copy the entries over with the Python library")
    sock = _bind(args.host, args.port)
    _private_dir(args.dir)
    cache = Cache(args.dir, page_size=args.page_size, max_pages=args.max_pages,
                  durability=args.durability, flush_interval=args.flush_interval,
                  flush_batch_pages=args.flush_batch_pages,
                  max_value_bytes=args.max_value_bytes, serializer="safe",
                  policy=args.policy, max_memory_bytes=args.max_memory_bytes,
                  size_limit=args.size_limit)
    try:
        app = create_app(cache, token, max_key_chars=args.max_key_chars,
                         request_timeout=args.request_timeout, access_log=args.access_log)
        if args.access_log:
            import logging
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger = logging.getLogger("durablekv.server.access")
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                timeout_graceful_shutdown=args.shutdown_timeout,
                                timeout_keep_alive=5, server_header=False)
        server = _Server(config, f"durablekv serving {args.dir} on http://{shown}:{port}")
        # uvicorn handles SIGTERM/SIGINT while it serves (drain, then the
        # lifespan's end closes the cache) and raises the signal again when
        # it is done: that second one must not kill the clean exit.
        previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            server.run(sockets=[sock])
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
    finally:
        sock.close()
        if not cache.closed:
            cache.close()
    return 0 if server.started else 1


class _Server:
    """uvicorn.Server that prints the start line once it is listening."""

    def __new__(cls, config: Any, line: str) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            async def startup(self, sockets: Any = None) -> None:
                await super().startup(sockets=sockets)
                if self.started:
                    print(line, flush=True)

        return Server(config)
