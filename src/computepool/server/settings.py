"""Server settings: one validated object, kept on `app.state.settings` (no globals)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

DEFAULT_PORT = 8470


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    data_dir: Path = Field(
        default_factory=lambda: Path("~/.computepool").expanduser(),
        description="Holds pool.db (the SQLite default) and the first admin token.",
    )
    db_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user@host/db; default SQLite in data_dir.",
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535, description="TCP port to listen on.")
    advertise_url: str | None = Field(
        default=None,
        pattern=r"^https?://[^\s,]+$",
        description="Where agents and the other replicas reach this replica, published in the database "
        "(default: from host and port unless the host is a wildcard address).",
    )
    heartbeat_interval_s: float = Field(default=5.0, gt=0, le=3600, description="How often nodes report.")
    suspect_after_s: float = Field(
        default=20.0, gt=0, description="Heartbeat age after which a node is suspect."
    )
    lost_after_s: float = Field(default=60.0, gt=0, description="Heartbeat age after which a node is lost.")
    lost_brake_share: float = Field(
        default=0.5,
        gt=0,
        le=1,
        description="When more than this share of the nodes are silent together, no node is declared "
        "lost (the control plane's own trouble is likelier); 1 turns the brake off.",
    )
    lost_brake_min_nodes: int = Field(
        default=2, ge=1, description="The brake needs at least this many silent nodes: one is a failure."
    )
    retry_after_s: int = Field(default=2, ge=1, le=600, description="Retry-After sent with 503 answers.")
    token_cache_s: float = Field(
        default=1.0, ge=0, le=60, description="Seconds a checked token is trusted without a query (0: never)."
    )
    shape_cache_s: float = Field(
        default=10.0, ge=0, le=600, description="How long nodes and quotas read for admission are reused."
    )
    worker_threads: int = Field(
        default=3, ge=1, le=256, description="Threads that run database work for API calls."
    )
    log_level: str = Field(default="info", description="uvicorn and server log level.")
    access_log: bool = Field(
        default=False,
        description="One line per API request in the server's log (uvicorn's access log). Off by "
        "default: every heartbeat and long-poll is a request, and formatting and writing the line "
        "took ~7% of the server's CPU on the remote-call path; the audit log records every change.",
    )
    reclaim_interval_s: float = Field(
        default=5.0, gt=0, le=3600, description="How often time limits and idle-reclaim policies are applied."
    )
    audit_key_file: Path | None = Field(
        default=None,
        description="HMAC key that seals the audit head (default DATA_DIR/audit-key, made on first start); "
        "replicas sharing a database must share this key.",
    )
    tls_cert: Path | None = Field(default=None, description="PEM certificate (chain): serve HTTPS.")
    tls_key: Path | None = Field(default=None, description="PEM private key of tls_cert.")
    max_body_bytes: int = Field(
        default=1 << 20, ge=1024, le=1 << 30, description="Larger request bodies are refused with 413."
    )
    blob_max_mib: int = Field(
        default=256, ge=1, le=1 << 20, description="Largest blob one upload may store (code, stdin, files)."
    )
    tenant_blob_max_mib: int = Field(
        default=2048, ge=1, le=1 << 24, description="Blob bytes one tenant may hold in all."
    )
    log_max_mib: int = Field(
        default=64,
        ge=4,
        le=1 << 20,
        description="Output one attempt of a job keeps per stream (stdout, stderr; each gang member its "
        "own): past it the oldest chunks go, and one line in the log says how many bytes.",
    )
    tenant_log_max_mib: int = Field(
        default=4096,
        ge=4,
        le=1 << 24,
        description="Job output one tenant keeps over all its allocations: past it (checked every "
        "minute) the oldest chunks go first.",
    )
    log_keep_days: float = Field(
        default=30.0,
        gt=0,
        le=36500,
        description="Logs of allocations ended longer ago than this are deleted.",
    )
    api_rate_per_s: float = Field(
        default=100.0,
        ge=0,
        le=1e6,
        description="API requests a second one tenant's users may make, all together (0: no limit); "
        "past it and its burst they are answered 429 with Retry-After. Nodes and admins are not limited.",
    )
    api_burst: int = Field(
        default=500, ge=1, le=10_000_000, description="API requests a tenant may make at once above its rate."
    )
    auth_fail_rate_per_s: float = Field(
        default=10.0,
        ge=0,
        le=1e6,
        description="Failed authentications a second one client address may make (0: no limit); past it "
        "and its burst, calls from there whose token is not already known get 429 before any lookup.",
    )
    auth_fail_burst: int = Field(
        default=200, ge=1, le=10_000_000, description="Failed authentications an address may make at once."
    )
    gateway_rpm: int = Field(
        default=3000,
        ge=0,
        le=10_000_000,
        description="Gateway (/v1) requests a minute of a tenant without a limit of its own (0: no limit).",
    )
    gateway_burst: int = Field(
        default=500, ge=1, le=10_000_000, description="Gateway requests at once of such a tenant."
    )
    blob_dir: Path | None = Field(
        default=None,
        description="Where blob bytes live (default DATA_DIR/blobs); replicas sharing a database must "
        "share this directory (e.g. an NFS mount).",
    )
    topology_label: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}$",
        description="Node label (e.g. rack) whose value a gang's nodes prefer to share.",
    )
    gang_port_min: int = Field(
        default=29500, ge=1024, le=65535, description="Lowest master port of a gang's rank-0 node."
    )
    gang_port_max: int = Field(
        default=29999, ge=1024, le=65535, description="Highest master port of a gang's rank-0 node."
    )
    service_port_min: int = Field(
        default=31000, ge=1024, le=65535, description="Lowest port a model service's replica may listen on."
    )
    service_port_max: int = Field(
        default=31999, ge=1024, le=65535, description="Highest port a model service's replica may listen on."
    )
    allowed_registries: tuple[
        Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[a-z0-9._-]+)*$")], ...
    ] = Field(
        default=(),
        max_length=64,
        description="Registries (or registry/path prefixes, e.g. ghcr.io/acme) any tenant may run images "
        "from; none by default: tenants run only the images an admin published to them.",
    )
    default_cpu_milli: int = Field(
        default=1000,
        ge=1,
        le=10**9,
        description="Host CPU a request that names none gets, booked and enforced (a tenant may have its own "
        "too).",
    )
    default_memory_mib: int = Field(
        default=1024,
        ge=1,
        le=2**31 - 1,
        description="Host memory a request that names none gets, booked and enforced (a tenant may have its "
        "own); a job's private /tmp and /dev/shm hold half of its memory each.",
    )
    default_pids_max: int = Field(
        default=1024,
        ge=8,
        le=4_194_304,
        description="Processes and threads one job may run at once (a tenant may have its own).",
    )
    publish_port_min: int = Field(
        default=20000, ge=1024, le=65535, description="Lowest host port a container job may publish."
    )
    publish_port_max: int = Field(
        default=28999, ge=1024, le=65535, description="Highest host port a container job may publish."
    )
    max_replicas_per_tenant: int = Field(
        default=256,
        ge=1,
        le=100_000,
        description="Live replicas one tenant's services may have together (no tenant takes every port).",
    )

    ledger_interval_s: float = Field(
        default=10.0, gt=0, le=3600, description="How often the usage ledger books use and energy."
    )
    history_keep_s: float = Field(
        default=7 * 86400.0, gt=0, description="How long devices' utilization history is kept."
    )
    alerts_interval_s: float = Field(default=5.0, gt=0, le=3600, description="How often alert rules run.")
    webhook_key_file: Path | None = Field(
        default=None,
        description="Key webhook signing secrets are derived from (default DATA_DIR/webhook-key, made on "
        "first start); replicas sharing a database must share it.",
    )
    discovery_key_file: Path | None = Field(
        default=None,
        description="Secret the pool's LAN discovery key is derived from (default DATA_DIR/discovery-key, "
        "made on first start); replicas sharing a database must share it.",
    )
    secrets_key_file: Path | None = Field(
        default=None,
        description="Key tenants' secrets are sealed with (default DATA_DIR/secrets-key, made on first "
        "start); replicas sharing a database must share it.",
    )
    rpc_port_min: int = Field(
        default=32000, ge=1024, le=65535, description="Lowest port a cooperative service's RPC server gets."
    )
    rpc_port_max: int = Field(
        default=32999, ge=1024, le=65535, description="Highest port a cooperative service's RPC server gets."
    )
    coop_interval_s: float = Field(
        default=1.0, gt=0, le=3600, description="How often the coop controller plans cooperative services."
    )
    smtp_host: str | None = Field(default=None, description="Mail server for alert mail (none: no mail).")
    smtp_port: int = Field(default=25, ge=1, le=65535)
    smtp_starttls: bool = Field(default=False, description="Upgrade the SMTP connection with STARTTLS.")
    smtp_tls: bool = Field(default=False, description="Speak TLS from the start (SMTPS, port 465 style).")
    smtp_user: str | None = Field(
        default=None, description="SMTP login (with smtp_password_file; needs smtp_starttls or smtp_tls)."
    )
    smtp_password_file: Path | None = Field(default=None, description="File holding the SMTP password.")
    mail_from: str = Field(default="computepool@localhost", description="From address of alert mail.")
    mail_to: tuple[str, ...] = Field(default=(), description="Where alert mail goes.")

    @model_validator(mode="after")
    def _thresholds(self) -> ServerSettings:
        if self.gang_port_min > self.gang_port_max:
            raise ValueError(
                f"gang_port_min ({self.gang_port_min}) must not exceed gang_port_max ({self.gang_port_max})"
            )
        if self.service_port_min > self.service_port_max:
            raise ValueError(
                f"service_port_min ({self.service_port_min}) must not exceed service_port_max "
                f"({self.service_port_max})"
            )
        if self.rpc_port_min > self.rpc_port_max:
            raise ValueError(
                f"rpc_port_min ({self.rpc_port_min}) must not exceed rpc_port_max ({self.rpc_port_max})"
            )
        publish = (self.publish_port_min, self.publish_port_max)
        if publish[0] > publish[1]:
            raise ValueError(
                f"publish_port_min ({publish[0]}) must not exceed publish_port_max ({publish[1]})"
            )
        for name, lo, hi in (
            ("gang", self.gang_port_min, self.gang_port_max),
            ("service", self.service_port_min, self.service_port_max),
            ("rpc", self.rpc_port_min, self.rpc_port_max),
        ):
            if lo <= publish[1] and publish[0] <= hi:
                raise ValueError(
                    f"publish ports {publish[0]}-{publish[1]} overlap the {name} ports {lo}-{hi}: a "
                    "container could take a port the pool gives out"
                )
        if not self.heartbeat_interval_s < self.suspect_after_s < self.lost_after_s:
            raise ValueError("need heartbeat_interval_s < suspect_after_s < lost_after_s")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key go together: give both or neither")
        if self.smtp_tls and self.smtp_starttls:
            raise ValueError("smtp_tls and smtp_starttls: give one of them (TLS from the start, or upgraded)")
        if self.smtp_user and not (self.smtp_tls or self.smtp_starttls):
            raise ValueError(
                "smtp_user needs smtp_starttls or smtp_tls: the password must not be sent unencrypted"
            )
        if self.lost_after_s < 4 * self.heartbeat_interval_s:
            raise ValueError(
                f"lost_after_s ({self.lost_after_s:g}) must be at least 4 × heartbeat_interval_s "
                f"({self.heartbeat_interval_s:g}): nodes stop restartable work a few heartbeats before "
                "they can be declared lost"
            )
        return self

    @property
    def database_url(self) -> str:
        """The URL to connect to; plain postgresql:// URLs get the psycopg 3 driver we ship."""
        if not self.db_url:
            return f"sqlite:///{self.data_dir / 'pool.db'}"
        for plain in ("postgresql://", "postgres://"):
            if self.db_url.startswith(plain):
                return "postgresql+psycopg://" + self.db_url[len(plain) :]
        return self.db_url

    @property
    def blobs_path(self) -> Path:
        """The directory holding blob bytes (`sha256/…` and upload temp files)."""
        return self.blob_dir or self.data_dir / "blobs"

    @property
    def admin_token_path(self) -> Path:
        return self.data_dir / "admin-token"

    @property
    def audit_key_path(self) -> Path:
        return self.audit_key_file or self.data_dir / "audit-key"

    @property
    def webhook_key_path(self) -> Path:
        return self.webhook_key_file or self.data_dir / "webhook-key"

    @property
    def discovery_key_path(self) -> Path:
        return self.discovery_key_file or self.data_dir / "discovery-key"

    @property
    def secrets_key_path(self) -> Path:
        return self.secrets_key_file or self.data_dir / "secrets-key"

    @property
    def audit_anchor_path(self) -> Path:
        """This replica's record of the last sealed audit head it saw (outside the database)."""
        return self.data_dir / "audit-anchor"
