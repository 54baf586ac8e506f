"""The usage ledger: books GPU-hours, CPU-hours, memory-hours and energy of every allocation.

(Being built: `Accountant` runs on the leader; see routers/usage.py for the API.)
"""

from __future__ import annotations

from computepool.server.hub import Hub
from computepool.server.scheduling import Controller
from computepool.server.settings import ServerSettings
from computepool.store.db import Database


class Accountant:
    """Books use and energy every `ledger_interval_s` on the leader."""

    def __init__(self, db: Database, settings: ServerSettings, hub: Hub, controller: Controller) -> None:
        self.db, self.settings, self.hub, self.controller = db, settings, hub, controller

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass
