"""Client calls for alerts, alert rules and webhooks (being built)."""

from __future__ import annotations


class AlertMethods:
    """Mixed into PoolClient."""
