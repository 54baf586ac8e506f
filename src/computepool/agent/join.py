"""How a node gets into the pool: its name, joining with a join token, reusing the stored credential.

`connect` prefers the credential in the data dir (mode 0600); `check_credential` tries it once with a
heartbeat before the loop starts, so a refused one is replaced by a new join or ends as AgentFatal.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import stat
from dataclasses import replace
from pathlib import Path
from typing import Any

from computepool.agent import fencing
from computepool.agent.api import (
    CREDENTIAL_FILE,
    AgentApi,
    ApiError,
    Credential,
    Unreachable,
    load_credential,
    save_credential,
)
from computepool.agent.config import EXIT_CREDENTIAL_REFUSED, AgentConfig, AgentFatal
from computepool.agent.devices import DeviceInfo, NodeInventory
from computepool.agent.devices.stack import stack_labels
from computepool.agent.sandbox import FIXED_PATH

log = logging.getLogger("computepool.agent")

_NAME_BAD = re.compile(r"[^a-z0-9_.-]+")
_PYTHON = re.compile(r"python(3\.[0-9]+)")


def default_node_name() -> str:
    """The host name, made into a valid node name (lower case, [a-z0-9_.-], at most 63)."""
    name = _NAME_BAD.sub("-", socket.gethostname().lower()).strip("-._")
    return (name or "node")[:63]


def tenant_pythons(path: str = FIXED_PATH) -> list[str]:
    """The Python versions ("3.11") a job can run here: `python3.X` on the PATH jobs get, executable
    by anyone through every directory on the way (a tenant's user is no one special)."""
    found: set[str] = set()
    for folder in path.split(os.pathsep):
        try:
            names = os.listdir(folder)
        except OSError:
            continue
        for name in names:
            m = _PYTHON.fullmatch(name)
            if m and _anyone_runs(Path(folder) / name):
                found.add(m.group(1))
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))


def _anyone_runs(exe: Path) -> bool:
    try:
        real = exe.resolve(strict=True)
        if not real.stat().st_mode & stat.S_IXOTH or not real.is_file():
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in (*real.parents, *exe.parents))
    except OSError:
        return False


def _device_body(d: DeviceInfo) -> dict[str, Any]:
    return {
        "index": d.index,
        "vendor": d.vendor,
        "model": d.model,
        "memory_mib": d.memory_mib,
        "uuid": d.uuid,
        "compute_milli": d.compute_milli,
        "link_group": d.link_group,
        "mig_parent_uuid": d.mig_parent_uuid,
    }


def connect(config: AgentConfig, inventory: NodeInventory, api: AgentApi) -> Credential:
    """The node's credential: the one in the data dir, else a join with the join token.

    The join token is only needed once; afterwards the stored credential (mode 0600) is used and
    the token can have expired or been used up.
    """
    cred = load_credential(config.data_dir)
    if cred is not None:
        if config.name and config.name != cred.name:
            raise AgentFatal(
                f"{config.data_dir} holds the credential of node '{cred.name}', not '{config.name}' "
                "(use another --data-dir, or leave out --name)"
            )
        if config.simulate and config.simulate != cred.simulate:
            raise AgentFatal(
                f"node '{cred.name}' joined with {_devices_said(cred.simulate)}, not --simulate "
                f"{config.simulate}: the devices of a node are fixed at its join (remove the node and "
                f"{config.data_dir / CREDENTIAL_FILE} to join again)"
            )
        if cred.server.rstrip("/") != config.server.rstrip("/"):
            cred = replace(cred, server=config.server)
            save_credential(config.data_dir, cred)
        api.use(cred)
        return cred
    return join(config, inventory, api)


def _devices_said(simulate: str | None) -> str:
    return f"--simulate {simulate}" if simulate else "its real devices"


def join(config: AgentConfig, inventory: NodeInventory, api: AgentApi, name: str | None = None) -> Credential:
    if not config.join_token:
        raise AgentFatal(
            f"no node credential in {config.data_dir} and no join token: "
            "pass --join-token (an admin creates one with POST /api/v1/join-tokens)"
        )
    name = name or config.name or default_node_name()
    labels = dict(config.labels)
    if config.simulate:
        labels.setdefault("simulated", "true")
    for key, value in stack_labels(inventory.devices).items():  # the operator's own labels win
        labels.setdefault(key, value)
    body = {
        "join_token": config.join_token,
        "name": name,
        "cpu_milli": inventory.cpu.cpu_milli,
        "memory_mib": inventory.cpu.memory_mib,
        "labels": labels,
        "devices": [_device_body(d) for d in inventory.devices],
        "pythons": tenant_pythons(),  # a function needs its caller's Python on the node
    }
    if config.address:
        body["address"] = config.address
    try:
        answer = api.join(body)
    except Unreachable as e:
        raise AgentFatal(f"cannot reach the control plane to join: {e}") from None
    except ApiError as e:
        raise AgentFatal(f"join refused by {config.server}: {e.message}") from None
    cred = Credential(
        config.server,
        name,
        str(answer["credential"]),
        float(answer.get("heartbeat_interval_s") or 5.0),
        config.simulate,
    )
    path = save_credential(config.data_dir, cred)
    log.info("joined the pool at %s as node '%s' with %d device(s); credential in %s",
             config.server, name, len(inventory.devices), path)  # fmt: skip
    api.use(cred)
    return cred


def check_credential(
    config: AgentConfig, inventory: NodeInventory, api: AgentApi, cred: Credential
) -> Credential:
    """One heartbeat before starting: a refused credential is replaced by a new join when a join
    token was given (the pool was reset, the node removed), else it is fatal. An unreachable
    server is no reason to wait: the jobs this node runs carry on and the loop retries."""
    try:
        answer = api.heartbeat([])
        contact = fencing.Contact(config.data_dir, config.kill_grace_s, config.fence_s)
        contact.learn(answer.get("lost_after_s"), answer.get("heartbeat_interval_s"))
        return cred
    except fencing.FenceConfigError as e:
        raise AgentFatal(str(e)) from None
    except Unreachable as e:
        log.warning("control plane unreachable at start (%s); running on, retrying", e)
        return cred
    except ApiError as e:
        if e.status not in (401, 404):
            raise AgentFatal(f"heartbeat refused by {config.server}: {e.message}") from None
        if not config.join_token:
            raise AgentFatal(
                f"the control plane refused node '{cred.name}' ({e.message}): delete "
                f"{config.data_dir / 'node.json'} and join again with --join-token",
                EXIT_CREDENTIAL_REFUSED,
            ) from None
        log.warning(
            "credential of node '%s' refused (%s); joining again with the join token", cred.name, e.message
        )
        return join(config, inventory, api, name=cred.name)
