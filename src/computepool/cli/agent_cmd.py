"""`cpool agent`: run this machine's node agent against a control plane."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from computepool.cli.common import fail

if TYPE_CHECKING:
    from computepool.agent.config import DiscoveryOptions

DEFAULT_AGENT_DIR = Path("~/.computepool/agent")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def _labels(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise fail(f"--label: expected KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def _cgroup_base(value: str) -> Path | None:
    return None if value.strip().lower() in ("", "none", "off") else Path(value)


def _discovery(
    on: bool, address: str | None, port: int, peers: list[str], no_mdns: bool
) -> DiscoveryOptions | None:
    """The discovery flags as options (None: off); a bad value is one line naming the flag."""
    from computepool.agent.config import DiscoveryOptions
    from computepool.discovery.unicast import parse_peer

    if not (on or peers):
        return None
    for p in peers:
        try:
            parse_peer(p)
        except ValueError:
            raise fail(f"--peer: expected HOST:PORT (port 1-65535), got {p!r}") from None
    if address is not None:
        try:
            ip = ipaddress.IPv4Address(address.strip())
        except ValueError:
            raise fail(f"--discovery-address: expected an IPv4 address, got {address!r}") from None
        if ip.is_unspecified or ip.is_multicast:
            raise fail(f"--discovery-address: {ip} cannot be announced (give this host's own address)")
        address = str(ip)
    return DiscoveryOptions(
        address=address, port=port, peers=tuple(p.strip() for p in peers), mdns=not no_mdns
    )


def register(app: typer.Typer) -> None:
    @app.command("agent")
    def agent(
        server: Annotated[
            list[str],
            typer.Option(
                "--server",
                envvar="CPOOL_SERVER",
                help="Control plane URL, e.g. http://pool:8470; repeat it (or separate URLs by commas) "
                "for several replicas. The agent also uses the replicas the control plane names.",
            ),
        ],
        join_token: Annotated[
            str | None,
            typer.Option(
                "--join-token",
                envvar="CPOOL_JOIN_TOKEN",
                help="Join token (first start only; the node credential is kept in DATA_DIR).",
            ),
        ] = None,
        ca: Annotated[
            Path | None,
            typer.Option(
                "--ca",
                envvar="CPOOL_CA",
                help="PEM file the server's https certificate must chain to. Without it, a join token "
                "from an https server pins that server's certificate (kept as DATA_DIR/server-ca.pem).",
            ),
        ] = None,
        simulate: Annotated[
            str | None,
            typer.Option(
                "--simulate",
                help="Simulated devices instead of real ones, e.g. 2xA100-80GB,1xT4-16GB; "
                "1xA100-80GB:mig=3g.40gb+2g.20gb+2g.20gb splits a GPU into MIG instances.",
            ),
        ] = None,
        data_dir: Annotated[
            Path,
            typer.Option(
                "--data-dir", envvar="CPOOL_AGENT_DIR", help="Credential, job records and run dirs."
            ),
        ] = DEFAULT_AGENT_DIR,
        name: Annotated[
            str | None, typer.Option("--name", help="Node name (default: the host name).")
        ] = None,
        address: Annotated[
            str | None,
            typer.Option(
                "--address",
                envvar="CPOOL_AGENT_ADDRESS",
                help="IP or host name where other nodes reach this one (MASTER_ADDR of the gangs whose "
                "rank 0 it is); default: the address the control plane sees this agent's calls come from.",
            ),
        ] = None,
        label: Annotated[list[str], typer.Option("--label", help="Node label KEY=VALUE (repeatable).")] = [],  # noqa: B006
        cgroup_base: Annotated[
            str,
            typer.Option(
                "--cgroup-base",
                envvar="CPOOL_CGROUP_BASE",
                help="cgroup for job limits (v2 or v1, detected); this agent's jobs go below "
                "BASE/<node name>-<8 hex of DATA_DIR's path>/, its own on the host. 'none': rlimits only.",
            ),
        ] = "/sys/fs/cgroup/computepool",  # jobspec.DEFAULT_CGROUP_BASE (not imported: start-up time)
        poll_wait_s: Annotated[
            float, typer.Option("--poll-wait-s", min=1.0, max=300.0, help="Long-poll wait for assignments.")
        ] = 20.0,
        kill_grace_s: Annotated[
            float, typer.Option("--kill-grace-s", min=0.0, max=3600.0, help="SIGTERM → SIGKILL grace.")
        ] = 10.0,
        fence_s: Annotated[
            float | None,
            typer.Option(
                "--fence-s",
                min=0.1,
                help="Stop restartable work after this long without a heartbeat answered (default: as long "
                "as the control plane's lost-node timeout allows, less the kill grace and a margin).",
            ),
        ] = None,
        single_tenant: Annotated[
            bool,
            typer.Option(
                "--single-tenant",
                help="For an agent that is not root: accept every tenant's jobs, with NO isolation "
                "between them (all run as the agent's user). Without it such an agent serves one tenant.",
            ),
        ] = False,
        tenant_pids: Annotated[
            int,
            typer.Option(
                "--tenant-pids",
                min=0,
                help="Processes and threads one tenant's jobs on this node may hold together (a cgroup "
                "above its jobs'); 0: half of what all jobs together may (3/4 of the host's pid_max).",
            ),
        ] = 0,
        uid_range: Annotated[
            str,
            typer.Option(
                "--uid-range", help="uids (and gids) for the tenants' users cpool-<tenant>, FIRST-LAST."
            ),
        ] = "61000-61999",
        user_prefix: Annotated[
            str,
            typer.Option(
                "--tenant-user-prefix",
                help="Tenants' users are PREFIX<tenant> (default cpool-). A second pool on this host "
                "takes its own (e.g. cpb-), so its tenants never share a uid or a cache with this "
                "pool's tenants of the same name.",
            ),
        ] = "cpool-",
        cache_dir: Annotated[
            Path | None,
            typer.Option(
                "--cache-dir",
                envvar="CPOOL_CACHE_ROOT",
                help="Per-tenant caches kept between jobs (CPOOL_CACHE_DIR, e.g. the SDK's pip "
                "environments): DIR/<tenant>, owned by the tenant's user. Default "
                "/var/cache/computepool, or /var/cache/computepool/PREFIX with another user prefix.",
            ),
        ] = None,
        mps_dir: Annotated[
            Path,
            typer.Option(
                "--mps-dir",
                envvar="CPOOL_MPS_DIR",
                help="MPS daemons' pipes and logs, DIR/<device uuid> (a root agent; the MPS server "
                "runs as the tenant's user and must reach them). A non-root agent uses DATA_DIR/mps.",
            ),
        ] = Path("/run/computepool/mps"),  # sandbox.DEFAULT_MPS_ROOT
        code_max_gib: Annotated[
            float,
            typer.Option(
                "--code-max-gib",
                min=0.001,
                max=4096.0,
                help="A run's code archive may unpack to at most this many GiB (and 100,000 entries).",
            ),
        ] = 8.0,
        log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning, error.")] = "info",
        discovery: Annotated[
            bool,
            typer.Option(
                "--discovery",
                help="Announce this node and its devices on the LAN (mDNS, signed with the pool's key), "
                "find the other nodes, measure the links to them and report them (`cpool peers`).",
            ),
        ] = False,
        discovery_address: Annotated[
            str | None,
            typer.Option(
                "--discovery-address",
                help="IPv4 address to announce and bind the probe port on (default: --address, else the "
                "local address that routes to the control plane).",
            ),
        ] = None,
        discovery_port: Annotated[
            int, typer.Option("--discovery-port", min=0, max=65535, help="UDP + TCP probe port (0: any).")
        ] = 5757,  # config.DEFAULT_DISCOVERY_PORT (not imported: start-up time)
        peer: Annotated[
            list[str],
            typer.Option(
                "--peer",
                help="HOST:PORT of another node's probe port, where multicast is blocked (repeatable; "
                "implies --discovery).",
            ),
        ] = [],  # noqa: B006
        no_discovery_mdns: Annotated[
            bool, typer.Option("--no-discovery-mdns", help="Discovery by --peer only (no multicast).")
        ] = False,
        publish_ports: Annotated[
            str,
            typer.Option(
                "--publish-ports",
                help="FIRST-LAST: the host ports a container job may publish, on this node's address "
                "only (as the server's --publish-ports; never below 1024).",
            ),
        ] = "20000-28999",  # config.DEFAULT_PUBLISH_PORTS
        protect_ports: Annotated[
            str,
            typer.Option(
                "--protect-ports",
                help="P1,P2,...: ports of root's own services on this node's loopback that the tenants' "
                "jobs on the node's network may not reach either (a system user's are refused already).",
            ),
        ] = "",
    ) -> None:
        """Join the pool (once) and run the workloads the control plane assigns to this machine."""
        import os

        from computepool.agent.config import AgentConfig, AgentFatal
        from computepool.agent.sandbox import SandboxConfig
        from computepool.agent.start import run_agent
        from computepool.agent.tenants import check_prefix, parse_uid_range
        from computepool.core.errors import InvalidInput

        os.umask(0o077)  # whatever the agent writes is its own: credential, records, logs
        try:
            cache = Path("/var/cache/computepool")  # sandbox.DEFAULT_CACHE_ROOT (start-up time)
            if user_prefix != "cpool-":  # a sibling: inside, it was the cache of the first pool's
                # tenant named like the prefix, whose user got the second pool's tenants' caches
                cache = cache.with_name(f"computepool-{user_prefix.rstrip('-')}")
            sandbox = SandboxConfig(
                uid_range=parse_uid_range(uid_range),
                user_prefix=check_prefix(user_prefix),
                single_tenant=single_tenant,
                tenant_pids_max=tenant_pids,
                cache_root=(cache_dir or cache).absolute(),
                mps_root=mps_dir.absolute() if os.geteuid() == 0 else None,
            )
        except InvalidInput as e:
            raise fail(f"--{e.where}: {e.message}") from None

        if address:
            from computepool.core.address import check_address

            try:
                address = check_address(address, "--address")
            except InvalidInput as e:
                raise fail(str(e)) from None
        pub_lo, sep, pub_hi = publish_ports.partition("-")
        if not (sep and pub_lo.strip().isdigit() and pub_hi.strip().isdigit()):
            raise fail(f"--publish-ports: expected FIRST-LAST, e.g. 20000-28999, got {publish_ports!r}")
        if not 1024 <= int(pub_lo) <= int(pub_hi) <= 65535:
            raise fail(f"--publish-ports: expected 1024 <= FIRST <= LAST <= 65535, got {publish_ports!r}")
        protected = [p.strip() for p in protect_ports.split(",") if p.strip()]
        if not all(p.isdigit() and 1 <= int(p) <= 65535 for p in protected):
            raise fail(f"--protect-ports: expected ports 1-65535 separated by commas, got {protect_ports!r}")
        discovery_options = _discovery(discovery, discovery_address, discovery_port, peer, no_discovery_mdns)
        if log_level.lower() not in LOG_LEVELS:
            raise fail(f"--log-level: unknown level {log_level!r}")
        urls = [u.strip() for item in server for u in item.split(",") if u.strip()]
        for url in urls or [""]:
            if not url.startswith(("http://", "https://")):
                raise fail(f"--server: expected an http:// or https:// URL, got {url!r}")
        if ca is not None and not ca.expanduser().is_file():
            raise fail(f"--ca: no such file {ca}")
        from computepool.core.logfmt import configure  # noqa: PLC0415

        configure(log_level, "%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)
        config = AgentConfig(
            server=",".join(dict.fromkeys(u.rstrip("/") for u in urls)),
            data_dir=data_dir.expanduser(),
            join_token=join_token or None,
            ca=ca.expanduser().absolute() if ca else None,
            name=name,
            address=address or None,
            simulate=simulate,
            labels=_labels(label),
            cgroup_base=_cgroup_base(cgroup_base),
            kill_grace_s=kill_grace_s,
            poll_wait_s=poll_wait_s,
            fence_s=fence_s,
            sandbox=sandbox,
            code_max_bytes=int(code_max_gib * (1 << 30)),
            discovery=discovery_options,
            publish_ports=(int(pub_lo), int(pub_hi)),
            protect_ports=tuple(int(p) for p in protected),
        )
        from computepool.core.dirlock import DataDirBusy, lock_data_dir

        try:
            held = lock_data_dir(config.data_dir, "cpool agent")  # for as long as it runs
        except DataDirBusy as e:
            raise fail(str(e)) from None
        except OSError as e:
            raise fail(f"--data-dir: cannot use {config.data_dir}: {e.strerror or e}") from None
        try:
            run_agent(config)
        except AgentFatal as e:
            raise fail(str(e), e.code) from None
        except InvalidInput as e:
            raise fail(str(e)) from None
        except OSError as e:
            raise fail(f"{type(e).__name__}: {e}") from None
        finally:
            held.release()
