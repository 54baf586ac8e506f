"""`cpool server`: run the control plane (HTTP API + database) on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from computepool.cli.common import fail


def register(app: typer.Typer) -> None:
    @app.command("server")
    def server(
        data_dir: Annotated[
            Path,
            typer.Option(
                "--data-dir", envvar="CPOOL_DATA_DIR", help="Holds pool.db and the first admin token."
            ),
        ] = Path("~/.computepool"),
        db: Annotated[
            str | None,
            typer.Option(
                "--db",
                envvar="CPOOL_DB",
                help="Database URL, e.g. postgresql+psycopg://user@host/pool (default: SQLite in DATA_DIR).",
            ),
        ] = None,
        host: Annotated[str, typer.Option("--host", help="Address to listen on.")] = "127.0.0.1",
        port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port.")] = 8470,
        heartbeat_s: Annotated[float, typer.Option("--heartbeat-s", help="Node heartbeat interval.")] = 5.0,
        suspect_s: Annotated[float, typer.Option("--suspect-s", help="Heartbeat age → suspect.")] = 20.0,
        lost_s: Annotated[float, typer.Option("--lost-s", help="Heartbeat age → lost.")] = 60.0,
        token_cache_s: Annotated[
            float,
            typer.Option(
                "--token-cache-s",
                help="Seconds a checked user token is trusted without a query (revocation on other "
                "replicas takes this long); 0 disables the cache.",
            ),
        ] = 1.0,
        log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning, error.")] = "info",
    ) -> None:
        """Start the control plane; the first start writes an admin token to DATA_DIR/admin-token."""
        from computepool.server.run import serve
        from computepool.server.settings import ServerSettings

        if log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise fail(f"--log-level: unknown level {log_level!r}")
        try:
            settings = ServerSettings(
                data_dir=data_dir.expanduser(),
                db_url=db,
                host=host,
                port=port,
                heartbeat_interval_s=heartbeat_s,
                suspect_after_s=suspect_s,
                lost_after_s=lost_s,
                token_cache_s=token_cache_s,
                log_level=log_level.lower(),
            )
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "settings"
            raise fail(f"{where}: {first['msg']}") from None
        if settings.db_url and not settings.db_url.startswith(("sqlite", "postgres")):
            raise fail(f"--db: expected a sqlite:/// or postgresql+psycopg:// URL, got {settings.db_url!r}")
        serve(settings)
