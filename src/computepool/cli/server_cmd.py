"""`cpool server`: run the control plane (HTTP API + database) on this machine."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from computepool.cli.common import fail
from computepool.core.errors import InvalidInput
from computepool.core.quantities import parse_cpu_milli, parse_memory_mib


def _quantity(parse: Callable[[str, str], int], text: str, opt: str) -> int:
    """A positive quantity from its option, or the one line that says what is wrong with it."""
    try:
        value = parse(text, opt)
    except InvalidInput as e:
        raise fail(str(e)) from None
    if value <= 0:
        raise fail(f"{opt}: must be above 0, got {text!r}")
    return value


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
        advertise_url: Annotated[
            str | None,
            typer.Option(
                "--advertise-url",
                envvar="CPOOL_ADVERTISE_URL",
                help="Where agents reach this replica, e.g. https://cp-2:8470: published so that agents "
                "given another replica's URL find it (default: from --host and --port, unless --host is "
                "0.0.0.0 or ::).",
            ),
        ] = None,
        heartbeat_s: Annotated[float, typer.Option("--heartbeat-s", help="Node heartbeat interval.")] = 5.0,
        suspect_s: Annotated[float, typer.Option("--suspect-s", help="Heartbeat age → suspect.")] = 20.0,
        lost_s: Annotated[
            float,
            typer.Option(
                "--lost-s",
                help="Heartbeat age → lost; restartable work rides out an outage of the control plane "
                "or its database a little shorter than this (its node's fence time).",
            ),
        ] = 60.0,
        lost_brake_share: Annotated[
            float,
            typer.Option(
                "--lost-brake-share",
                help="When more than this share of nodes are silent together, declare none lost (1: off).",
            ),
        ] = 0.5,
        token_cache_s: Annotated[
            float,
            typer.Option(
                "--token-cache-s",
                help="Seconds a checked user token is trusted without a query (revocation on other "
                "replicas takes this long); 0 disables the cache.",
            ),
        ] = 1.0,
        log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning, error.")] = "info",
        access_log: Annotated[
            bool,
            typer.Option(
                "--access-log/--no-access-log",
                envvar="CPOOL_ACCESS_LOG",
                help="Log one line per API request (off by default: heartbeats and long-polls are "
                "requests too; the audit log records every change).",
            ),
        ] = False,
        max_body_bytes: Annotated[
            int,
            typer.Option(
                "--max-body-bytes", help="Larger request bodies are refused with 413 (default 1 MiB)."
            ),
        ] = 1 << 20,
        blob_max_mib: Annotated[
            int,
            typer.Option(
                "--blob-max-mib", help="Largest upload of code, stdin or job files, in MiB (default 256)."
            ),
        ] = 256,
        tenant_blob_max_mib: Annotated[
            int,
            typer.Option("--tenant-blob-max-mib", help="Blob MiB one tenant may hold in all (default 2048)."),
        ] = 2048,
        log_max_mib: Annotated[
            int,
            typer.Option(
                "--log-max-mib",
                help="Output MiB one attempt of a job keeps per stream; past it the oldest goes and a line "
                "in the log says how much (default 64).",
            ),
        ] = 64,
        tenant_log_max_mib: Annotated[
            int,
            typer.Option(
                "--tenant-log-max-mib",
                help="Job output MiB one tenant keeps in all, oldest dropped first (default 4096).",
            ),
        ] = 4096,
        log_keep_days: Annotated[
            float,
            typer.Option(
                "--log-keep-days", help="Delete the logs of allocations ended longer ago (default 30)."
            ),
        ] = 30.0,
        api_rate: Annotated[
            float,
            typer.Option(
                "--api-rate",
                help="API requests a second one tenant may make (0: no limit); past it and --api-burst "
                "they get 429 with Retry-After. Nodes and admins are not limited (default 100).",
            ),
        ] = 100.0,
        api_burst: Annotated[
            int, typer.Option("--api-burst", help="API requests a tenant may make at once (default 500).")
        ] = 500,
        auth_fail_rate: Annotated[
            float,
            typer.Option(
                "--auth-fail-rate",
                help="Failed authentications a second one client address may make (0: no limit); past it "
                "and --auth-fail-burst its unknown tokens get 429 (default 10).",
            ),
        ] = 10.0,
        auth_fail_burst: Annotated[
            int,
            typer.Option("--auth-fail-burst", help="Failed authentications one address may make at once."),
        ] = 200,
        gateway_rpm: Annotated[
            int,
            typer.Option(
                "--gateway-rpm",
                help="Gateway requests a minute of a tenant with no limit of its own (0: none; 3000).",
            ),
        ] = 3000,
        gateway_burst: Annotated[
            int, typer.Option("--gateway-burst", help="…and at once (default 500).")
        ] = 500,
        blob_dir: Annotated[
            Path | None,
            typer.Option(
                "--blob-dir",
                envvar="CPOOL_BLOB_DIR",
                help="Where uploaded code, stdin and job files are kept (default DATA_DIR/blobs). "
                "Replicas sharing one database must all use the same directory (e.g. an NFS mount).",
            ),
        ] = None,
        tls_cert: Annotated[
            Path | None,
            typer.Option(
                "--tls-cert", envvar="CPOOL_TLS_CERT", help="PEM certificate: serve HTTPS (with --tls-key)."
            ),
        ] = None,
        tls_key: Annotated[
            Path | None,
            typer.Option("--tls-key", envvar="CPOOL_TLS_KEY", help="PEM private key of --tls-cert."),
        ] = None,
        topology_label: Annotated[
            str | None,
            typer.Option(
                "--topology-label",
                envvar="CPOOL_TOPOLOGY_LABEL",
                help="Node label (e.g. rack or switch) whose value a gang's nodes prefer to share.",
            ),
        ] = None,
        gang_ports: Annotated[
            str,
            typer.Option(
                "--gang-ports",
                help="FIRST-LAST: the ports a gang's rank-0 node may be given as MASTER_PORT.",
            ),
        ] = "29500-29999",
        service_ports: Annotated[
            str,
            typer.Option(
                "--service-ports",
                help="FIRST-LAST: the ports a model service's replicas may be given to listen on.",
            ),
        ] = "31000-31999",
        rpc_ports: Annotated[
            str,
            typer.Option(
                "--rpc-ports",
                help="FIRST-LAST: the ports a cooperative service's llama.cpp RPC servers may be given.",
            ),
        ] = "32000-32999",
        publish_ports: Annotated[
            str,
            typer.Option(
                "--publish-ports",
                help="FIRST-LAST: the host ports a container job may publish (on its node's address), "
                "apart from the gang, service and RPC ports and never below 1024.",
            ),
        ] = "20000-28999",
        allowed_registries: Annotated[
            str,
            typer.Option(
                "--allowed-registries",
                help="Comma-separated registries (or registry/path prefixes) any tenant may run images "
                "from, e.g. docker.io,ghcr.io/acme. Default none: tenants run only the images an admin "
                "published to them (cpool images publish).",
            ),
        ] = "",
        max_replicas_per_tenant: Annotated[
            int,
            typer.Option(
                "--max-replicas-per-tenant",
                help="Live model-service replicas one tenant may have over all its services.",
            ),
        ] = 256,
        default_cpus: Annotated[
            str,
            typer.Option(
                "--default-cpus",
                help="CPUs a request that names none gets, booked and enforced (e.g. 1 or 500m); "
                "`cpool tenants defaults` sets a tenant's own.",
            ),
        ] = "1",
        default_mem: Annotated[
            str,
            typer.Option(
                "--default-mem",
                help="Memory a request that names none gets, booked and enforced (e.g. 1GiB); a job's "
                "/tmp and /dev/shm hold half of its memory each.",
            ),
        ] = "1GiB",
        default_pids: Annotated[
            int,
            typer.Option(
                "--default-pids", min=8, max=4_194_304, help="Processes (and threads) a job may run at once."
            ),
        ] = 1024,
        audit_key_file: Annotated[
            Path | None,
            typer.Option(
                "--audit-key-file",
                envvar="CPOOL_AUDIT_KEY_FILE",
                help="Key that seals the audit log's head (default DATA_DIR/audit-key, made on first start). "
                "Replicas sharing one PostgreSQL database must all use the same key.",
            ),
        ] = None,
        alerts_interval: Annotated[
            float, typer.Option("--alerts-interval", help="Seconds between passes of the alert rules.")
        ] = 5.0,
        ledger_interval: Annotated[
            float, typer.Option("--ledger-interval", help="Seconds between bookings of the usage ledger.")
        ] = 10.0,
        webhook_key_file: Annotated[
            Path | None,
            typer.Option(
                "--webhook-key-file",
                envvar="CPOOL_WEBHOOK_KEY_FILE",
                help="Key webhook secrets are derived from (default DATA_DIR/webhook-key, made on first "
                "start). Replicas sharing one database must all use the same key.",
            ),
        ] = None,
        secrets_key_file: Annotated[
            Path | None,
            typer.Option(
                "--secrets-key-file",
                envvar="CPOOL_SECRETS_KEY_FILE",
                help="Key tenants' secrets are sealed with (default DATA_DIR/secrets-key, made on first "
                "start). Replicas sharing one database must all use the same key.",
            ),
        ] = None,
        smtp_host: Annotated[
            str | None,
            typer.Option("--smtp-host", envvar="CPOOL_SMTP_HOST", help="Mail server for alert mail."),
        ] = None,
        smtp_port: Annotated[int, typer.Option("--smtp-port", help="Its port.")] = 25,
        smtp_starttls: Annotated[
            bool, typer.Option("--smtp-starttls", help="Upgrade the mail connection with STARTTLS.")
        ] = False,
        smtp_tls: Annotated[
            bool,
            typer.Option("--smtp-tls", help="Speak TLS from the start (SMTPS, usually --smtp-port 465)."),
        ] = False,
        smtp_user: Annotated[
            str | None,
            typer.Option("--smtp-user", help="SMTP login name (needs --smtp-starttls or --smtp-tls)."),
        ] = None,
        smtp_password_file: Annotated[
            Path | None, typer.Option("--smtp-password-file", help="File holding the SMTP password.")
        ] = None,
        mail_from: Annotated[
            str, typer.Option("--mail-from", help="From address of alert mail.")
        ] = "computepool@localhost",
        mail_to: Annotated[
            list[str] | None,
            typer.Option("--mail-to", help="Where alert mail goes (repeat for several; none: no mail)."),
        ] = None,
    ) -> None:
        """Start the control plane; the first start writes an admin token to DATA_DIR/admin-token."""
        from pydantic import ValidationError

        from computepool.server.run import serve
        from computepool.server.settings import ServerSettings

        if smtp_tls and smtp_starttls:
            raise fail("--smtp-tls and --smtp-starttls: give one of them")
        if smtp_user and not (smtp_tls or smtp_starttls):
            raise fail(
                "--smtp-user needs --smtp-starttls or --smtp-tls: the password must not be sent unencrypted"
            )
        if log_level.lower() not in ("critical", "error", "warning", "info", "debug", "trace"):
            raise fail(f"--log-level: unknown level {log_level!r}")
        port_lo, sep, port_hi = gang_ports.partition("-")
        if not (sep and port_lo.strip().isdigit() and port_hi.strip().isdigit()):
            raise fail(f"--gang-ports: expected FIRST-LAST, e.g. 29500-29999, got {gang_ports!r}")
        svc_lo, sep, svc_hi = service_ports.partition("-")
        if not (sep and svc_lo.strip().isdigit() and svc_hi.strip().isdigit()):
            raise fail(f"--service-ports: expected FIRST-LAST, e.g. 31000-31999, got {service_ports!r}")
        rpc_lo, sep, rpc_hi = rpc_ports.partition("-")
        if not (sep and rpc_lo.strip().isdigit() and rpc_hi.strip().isdigit()):
            raise fail(f"--rpc-ports: expected FIRST-LAST, e.g. 32000-32999, got {rpc_ports!r}")
        pub_lo, sep, pub_hi = publish_ports.partition("-")
        if not (sep and pub_lo.strip().isdigit() and pub_hi.strip().isdigit()):
            raise fail(f"--publish-ports: expected FIRST-LAST, e.g. 20000-28999, got {publish_ports!r}")
        try:
            settings = ServerSettings(
                data_dir=data_dir.expanduser(),
                db_url=db,
                host=host,
                port=port,
                advertise_url=advertise_url.rstrip("/") if advertise_url else None,
                heartbeat_interval_s=heartbeat_s,
                suspect_after_s=suspect_s,
                lost_after_s=lost_s,
                lost_brake_share=lost_brake_share,
                token_cache_s=token_cache_s,
                log_level=log_level.lower(),
                access_log=access_log,
                max_body_bytes=max_body_bytes,
                blob_max_mib=blob_max_mib,
                tenant_blob_max_mib=tenant_blob_max_mib,
                log_max_mib=log_max_mib,
                tenant_log_max_mib=tenant_log_max_mib,
                log_keep_days=log_keep_days,
                api_rate_per_s=api_rate,
                api_burst=api_burst,
                auth_fail_rate_per_s=auth_fail_rate,
                auth_fail_burst=auth_fail_burst,
                gateway_rpm=gateway_rpm,
                gateway_burst=gateway_burst,
                blob_dir=blob_dir.expanduser() if blob_dir else None,
                tls_cert=tls_cert.expanduser() if tls_cert else None,
                tls_key=tls_key.expanduser() if tls_key else None,
                audit_key_file=audit_key_file.expanduser() if audit_key_file else None,
                topology_label=topology_label,
                gang_port_min=int(port_lo),
                gang_port_max=int(port_hi),
                service_port_min=int(svc_lo),
                service_port_max=int(svc_hi),
                rpc_port_min=int(rpc_lo),
                rpc_port_max=int(rpc_hi),
                publish_port_min=int(pub_lo),
                publish_port_max=int(pub_hi),
                max_replicas_per_tenant=max_replicas_per_tenant,
                default_cpu_milli=_quantity(parse_cpu_milli, default_cpus, "--default-cpus"),
                default_memory_mib=_quantity(parse_memory_mib, default_mem, "--default-mem"),
                default_pids_max=default_pids,
                allowed_registries=tuple(r.strip() for r in allowed_registries.split(",") if r.strip()),
                alerts_interval_s=alerts_interval,
                ledger_interval_s=ledger_interval,
                webhook_key_file=webhook_key_file.expanduser() if webhook_key_file else None,
                secrets_key_file=secrets_key_file.expanduser() if secrets_key_file else None,
                smtp_host=smtp_host or None,
                smtp_port=smtp_port,
                smtp_starttls=smtp_starttls,
                smtp_tls=smtp_tls,
                smtp_user=smtp_user or None,
                smtp_password_file=smtp_password_file.expanduser() if smtp_password_file else None,
                mail_from=mail_from,
                mail_to=tuple(mail_to or ()),
            )
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "settings"
            raise fail(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None
        if settings.db_url and not settings.db_url.startswith(("sqlite", "postgres")):
            raise fail(f"--db: expected a sqlite:/// or postgresql+psycopg:// URL, got {settings.db_url!r}")
        if settings.smtp_password_file is not None and not settings.smtp_password_file.is_file():
            raise fail(f"--smtp-password-file: no such file {settings.smtp_password_file}")
        if settings.smtp_user and settings.smtp_password_file is None:
            raise fail("--smtp-user needs --smtp-password-file")
        for addr in (settings.mail_from, *settings.mail_to):
            if "@" not in addr or any(c.isspace() for c in addr):
                raise fail(f"--mail-from/--mail-to: not a mail address: {addr!r}")
        if settings.mail_to and not settings.smtp_host:
            raise fail("--mail-to needs --smtp-host (the mail server that sends it)")
        for opt, path in (("--tls-cert", settings.tls_cert), ("--tls-key", settings.tls_key)):
            if path is not None and not path.is_file():
                raise fail(f"{opt}: no such file {path}")
        if settings.tls_cert is not None and settings.tls_key is not None:
            from computepool.core.tls import TlsError, check_pair

            try:
                check_pair(settings.tls_cert, settings.tls_key)
            except TlsError as e:
                raise fail(str(e)) from None
        from computepool.core.dirlock import DataDirBusy, lock_data_dir

        try:
            held = lock_data_dir(settings.data_dir, "cpool server")  # for as long as it serves
        except DataDirBusy as e:
            raise fail(str(e)) from None
        except OSError as e:
            raise fail(f"--data-dir: cannot use {settings.data_dir}: {e.strerror or e}") from None
        try:
            serve(settings)
        finally:
            held.release()
