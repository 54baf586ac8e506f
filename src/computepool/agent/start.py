"""Starting a node agent: discover its devices, join the pool (or reuse the credential), and run
its loop (`agent/loop.py`) until SIGTERM or SIGINT, which stop the agent and leave its workloads
running for the next start to re-adopt."""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import replace
from types import FrameType
from typing import Any

from computepool.agent.api import AgentApi, load_credential, server_verify
from computepool.agent.cgroups import unheld_warning
from computepool.agent.config import AgentConfig, AgentFatal
from computepool.agent.devices import discover_all
from computepool.agent.discovery_link import DiscoveryLink, start_discovery
from computepool.agent.join import check_credential, connect, default_node_name
from computepool.agent.loop import Agent
from computepool.core.tls import TlsError

log = logging.getLogger("computepool.agent")


class _StoppedEarly(Exception):
    """SIGTERM or SIGINT before the agent ran: it exits as cleanly as a running one would."""


def run_agent(config: AgentConfig, *, api: AgentApi | None = None) -> None:
    """Discover, join (or reuse the credential), run until SIGTERM/SIGINT. Raises AgentFatal.

    On SIGTERM/SIGINT the agent stops polling and exits; workloads keep running and are
    re-adopted by the next start (an agent upgrade or restart must not cost running jobs).
    """
    stored = load_credential(config.data_dir)
    if stored is not None and config.simulate is None and stored.simulate:
        config = replace(config, simulate=stored.simulate)  # the devices it joined with
    name = stored.name if stored is not None else (config.name or default_node_name())
    inventory = discover_all(config.simulate, seed=name)  # simulated uuids differ from node to node
    for note in inventory.notes:
        log.info("%s", note)
    unheld = unheld_warning(config.cgroup_base, os.geteuid() == 0)  # a root agent serves every tenant
    if unheld:  # said once the node's devices are known good (a bad --simulate is its one line)
        log.warning("%s", unheld)
    if api is None:
        try:
            verify = server_verify(config.server, config.data_dir, config.ca, config.join_token)
        except TlsError as e:
            raise AgentFatal(str(e)) from None
        api = AgentApi(config.server, verify=verify)
    previous: dict[signal.Signals, Any] = {}
    link: DiscoveryLink | None = None
    joining = [True]
    stopped: list[Agent] = []  # the agent, once made; stopped by a signal whenever that comes

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: stopping the agent; workloads keep running", signal.Signals(signum).name)
        if joining[0]:  # nothing of ours runs yet: leave the join at once
            raise _StoppedEarly
        joining.append(False)  # a stop asked for while the agent is being made
        for a in stopped:
            a.stop()

    try:
        # before the first request: a stop that comes while the agent joins is a clean stop too
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, on_signal)
        cred = check_credential(config, inventory, api, connect(config, inventory, api))
        joining[0] = False
        agent = Agent(config, inventory, api, cred)
        stopped.append(agent)
        if len(joining) > 1:
            agent.stop()
        link = start_discovery(
            api, cred.name, inventory, config.discovery, agent_address=config.address, server=config.server
        )
        log.info("agent of node '%s' talking to %s; data in %s", cred.name, config.server, config.data_dir)
        agent.run()
    except _StoppedEarly:
        return
    finally:
        if link is not None:
            link.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        api.close()
