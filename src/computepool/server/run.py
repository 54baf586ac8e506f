"""Run the control plane under uvicorn."""

from __future__ import annotations

import os

import uvicorn

from computepool.server.app import create_app
from computepool.server.settings import ServerSettings

SHUTDOWN_GRACE_S = 2


def serve(settings: ServerSettings) -> None:
    """HTTP, or HTTPS when a certificate and key are set (uvicorn's own TLS)."""
    os.umask(0o077)  # every file the server makes (database, keys, tokens) is readable by it alone
    from computepool.core.logfmt import configure  # noqa: PLC0415

    configure(settings.log_level, "%(levelname)s %(name)s: %(message)s")
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        access_log=settings.access_log,
        ssl_certfile=str(settings.tls_cert) if settings.tls_cert else None,
        ssl_keyfile=str(settings.tls_key) if settings.tls_key else None,
        # Agents hold long-polls open; waiting for them to end while the scheduling loop still runs
        # would let nodes miss heartbeats and be declared lost during an orderly stop.
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
