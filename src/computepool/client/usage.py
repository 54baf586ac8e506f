"""`PoolClient`'s usage-ledger calls: usage grouped and priced, the static equivalent, prices and
device history. Answers are the server's JSON (wire/usage.py), never client-side copies."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    JSON = dict[str, Any]


def _seg(value: object) -> str:
    """A path segment, percent-encoded so a name can never reach another route."""
    return quote(str(value), safe="")


def _when(value: datetime | str | None) -> str | None:
    return value.isoformat() if isinstance(value, datetime) else value


class UsageMethods:
    """Mixed into PoolClient, which provides `request` and `_items`."""

    if TYPE_CHECKING:

        def request(
            self,
            method: str,
            path: str,
            *,
            json: object = None,
            params: Mapping[str, Any] | None = None,
            headers: Mapping[str, str] | None = None,
            api: bool = True,
        ) -> Any: ...  # PoolClient's

        def _items(self, path: str, params: Mapping[str, Any] | None = None) -> list[JSON]: ...

    def usage_report(
        self, by: str = "tenant", since: datetime | str | None = None, until: datetime | str | None = None
    ) -> JSON:
        """{"items": rows, "unpriced": items without a price}; `since` is a time or an age (7d)."""
        params = {"by": by, "since": _when(since), "until": _when(until)}
        return dict(self.request("GET", "/usage", params=params))

    def usage(
        self, by: str = "tenant", since: datetime | str | None = None, until: datetime | str | None = None
    ) -> list[JSON]:
        """Rows of GPU-hours, CPU-hours, memory-hours, energy, idle waste and cost per group."""
        return list(self.usage_report(by, since, until)["items"])

    def static_equivalent(
        self, since: datetime | str | None = None, until: datetime | str | None = None
    ) -> JSON:
        """Devices static per-tenant partitions would have needed for the same history, and the savings."""
        params = {"since": _when(since), "until": _when(until)}
        return dict(self.request("GET", "/usage/static-equivalent", params=params))

    def prices(self) -> list[JSON]:
        return self._items("/prices")

    def set_price(self, item: str, amount: float) -> JSON:
        """Price per GPU-hour of a device model, or per kWh for item "energy-kwh" (admin)."""
        return dict(self.request("PUT", f"/prices/{_seg(item)}", json={"amount": amount}))

    def delete_price(self, item: str) -> JSON:
        return dict(self.request("DELETE", f"/prices/{_seg(item)}"))

    def node_history(self, name: str, since: datetime | str | None = None) -> list[JSON]:
        """Samples of each device's utilization, memory and power (default: the last hour)."""
        return self._items(f"/nodes/{_seg(name)}/history", {"since": _when(since)})
