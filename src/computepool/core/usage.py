"""The usage ledger's wire vocabulary, shared by the server's schemas, the client and the CLI
(kept here, free of pydantic, so the CLI can import it without loading the server)."""

from __future__ import annotations

from typing import Literal, get_args

UsageBy = Literal["tenant", "user", "job", "model"]
USAGE_BY: tuple[UsageBy, ...] = get_args(UsageBy)
ENERGY_ITEM = "energy-kwh"  # the price item of a kWh; any other item is a device model
POOL_TENANT = "(pool)"  # how the pool's own row (energy of devices that held nothing) is named
