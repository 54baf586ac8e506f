"""`cpool gateway`: the OpenAI-compatible gateway alone, beside a control plane, on its database."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from computepool.cli.common import fail

DEFAULT_GATEWAY_PORT = 8471


def register(app: typer.Typer) -> None:
    @app.command("gateway")
    def gateway(
        db: Annotated[
            str,
            typer.Option(
                "--db",
                envvar="CPOOL_DB",
                help="The control plane's database URL (postgresql+psycopg://… or sqlite:///…).",
            ),
        ],
        host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[
            int, typer.Option("--port", min=0, max=65535, help="TCP port.")
        ] = DEFAULT_GATEWAY_PORT,
        token_cache_s: Annotated[
            float,
            typer.Option(
                "--token-cache-s", min=0, max=60, help="Seconds a checked token is trusted without a query."
            ),
        ] = 1.0,
        tls_cert: Annotated[
            Path | None,
            typer.Option("--tls-cert", envvar="CPOOL_TLS_CERT", help="PEM certificate: serve HTTPS."),
        ] = None,
        tls_key: Annotated[
            Path | None,
            typer.Option("--tls-key", envvar="CPOOL_TLS_KEY", help="PEM private key of --tls-cert."),
        ] = None,
        log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning, error.")] = "info",
        gateway_rpm: Annotated[
            int,
            typer.Option(
                "--gateway-rpm",
                min=0,
                help="Requests a minute of a tenant with no gateway limit of its own (0: none; 3000).",
            ),
        ] = 3000,
        gateway_burst: Annotated[
            int, typer.Option("--gateway-burst", min=1, help="…and at once (default 500).")
        ] = 500,
    ) -> None:
        """Serve /v1 (models, chat/completions, completions, embeddings) for the pool's services."""
        if not db.startswith(("sqlite", "postgres")):
            raise fail(f"--db: expected a sqlite:/// or postgresql+psycopg:// URL, got {db!r}")
        if log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise fail(f"--log-level: unknown level {log_level!r}")
        if (tls_cert is None) != (tls_key is None):
            raise fail("--tls-cert and --tls-key go together")
        for opt, path in (("--tls-cert", tls_cert), ("--tls-key", tls_key)):
            if path is not None and not path.expanduser().is_file():
                raise fail(f"{opt}: no such file {path}")
        if tls_cert is not None and tls_key is not None:
            from computepool.core.tls import TlsError, check_pair

            try:
                check_pair(tls_cert.expanduser(), tls_key.expanduser())
            except TlsError as e:
                raise fail(str(e)) from None
        if db.startswith("sqlite"):
            from sqlalchemy.engine import make_url

            database = make_url(db).database
            if not database or not Path(database).expanduser().is_file():
                raise fail(f"--db: no database at {database!r} (start `cpool server` on it first)")

        import uvicorn

        from computepool.core.logfmt import configure  # noqa: PLC0415
        from computepool.server.gateway.app import create_gateway_app

        configure(log_level, "%(levelname)s %(name)s: %(message)s")
        uvicorn.run(
            create_gateway_app(db, token_cache_s, default_limit=(gateway_rpm, gateway_burst)),
            host=host,
            port=port,
            log_level=log_level.lower(),
            ssl_certfile=str(tls_cert.expanduser()) if tls_cert else None,
            ssl_keyfile=str(tls_key.expanduser()) if tls_key else None,
            timeout_graceful_shutdown=2,
        )
