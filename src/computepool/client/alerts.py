"""`PoolClient`'s alert calls: alerts, alert rules and webhooks.

A mixin so that http.py keeps the plumbing; answers are the server's JSON (AlertOut, AlertRuleOut,
WebhookOut in wire/alerts.py), never client-side copies of those models.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

if TYPE_CHECKING:
    JSON = dict[str, Any]


def _seg(value: object) -> str:
    """A path segment, percent-encoded so a name can never reach another route."""
    return quote(str(value), safe="")


class AlertMethods:
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

    def alerts(self, state: str = "all", since: str | None = None) -> list[JSON]:
        """Alerts newest first; `state` firing, resolved or all; `since` an age (30m, 7d) or ISO time."""
        return self._items("/alerts", {"state": state, "since": since})

    def alert_rules(self) -> list[JSON]:
        return self._items("/alert-rules")

    def set_alert_rule(
        self,
        name: str,
        *,
        enabled: bool | None = None,
        threshold: float | None = None,
        duration_s: int | None = None,
    ) -> JSON:
        """Change a rule (admin); what is left None keeps its value."""
        body = {
            k: v
            for k, v in {"enabled": enabled, "threshold": threshold, "duration_s": duration_s}.items()
            if v is not None
        }
        return dict(self.request("PUT", f"/alert-rules/{_seg(name)}", json=body))

    def add_webhook(self, url: str) -> JSON:
        """Add a webhook (admin); the answer's `secret` signs its notifications and is shown only once."""
        return dict(self.request("POST", "/webhooks", json={"url": url}))

    def webhooks(self) -> list[JSON]:
        return self._items("/webhooks")

    def delete_webhook(self, hook_id: int) -> JSON:
        return dict(self.request("DELETE", f"/webhooks/{_seg(hook_id)}"))
