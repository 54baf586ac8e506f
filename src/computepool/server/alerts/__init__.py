"""Alerts: rules evaluated on the leader, firing and resolved alerts, and their notifications.

- `rules`: the built-in rules, their defaults and what each finds in the pool;
- `engine`: `AlertEngine`, the leader's pass that fires and resolves alerts and queues notifications;
- `notify`: the outbox sender (signed webhooks, mail) with retries;
- `signing`: webhook secrets and signatures;
- `api`: what the HTTP routes call.
"""

from __future__ import annotations

from computepool.server.alerts.engine import AlertEngine, AlertReport

__all__ = ["AlertEngine", "AlertReport"]
