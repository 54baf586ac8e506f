"""What a service call needs: the database, the settings, who calls, and the request id."""

from __future__ import annotations

from dataclasses import dataclass

from computepool.server.caches import Caches
from computepool.server.policy import Action, Principal
from computepool.server.settings import ServerSettings
from computepool.store.db import Database


@dataclass(frozen=True)
class Ctx:
    db: Database
    settings: ServerSettings
    action: Action
    request_id: str
    principal: Principal | None  # None only for node.join, which the join token authenticates
    caches: Caches | None = None

    def caller(self) -> Principal:
        if self.principal is None:
            raise RuntimeError(f"{self.action} has no authenticated caller")
        return self.principal
