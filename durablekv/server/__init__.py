"""durablekv over HTTP: ``durablekv serve DIR`` (FastAPI on uvicorn).

Needs the ``server`` extra (``pip install 'durablekv[server]'``). See
docs/server.md for the routes, auth and deployment.

- :func:`create_app` (in :mod:`durablekv.server.app`): the FastAPI app over a cache.
- :mod:`durablekv.server.command`: the ``serve`` subcommand.
"""

from __future__ import annotations

from typing import Any

__all__ = ["create_app"]


def create_app(*args: Any, **kwargs: Any) -> Any:
    """:func:`durablekv.server.app.create_app` (imported on first use, so
    importing this package needs no FastAPI)."""
    from .app import create_app as _create_app
    return _create_app(*args, **kwargs)
