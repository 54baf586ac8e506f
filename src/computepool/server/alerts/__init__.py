"""Alerts: rules evaluated on the leader, firing and resolved alerts, and their notifications.

(Being built: `AlertEngine` runs the rules and the notifier; see routers/alerts.py for the API.)
"""

from __future__ import annotations

from collections.abc import Callable

from computepool.server.hub import Hub
from computepool.server.scheduling import Controller
from computepool.server.settings import ServerSettings
from computepool.store.db import Database


class AlertEngine:
    """Evaluates the rules every `alerts_interval_s` on the leader and delivers notifications.

    `audit_problem` tells what is wrong with the audit chain as this replica last checked it."""

    def __init__(
        self,
        db: Database,
        settings: ServerSettings,
        hub: Hub,
        controller: Controller,
        audit_problem: Callable[[], str | None],
    ) -> None:
        self.db, self.settings, self.hub, self.controller = db, settings, hub, controller
        self.audit_problem = audit_problem

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
