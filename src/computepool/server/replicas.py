"""This replica's reachable URL, published in the database, and the live replicas' URLs.

Join and heartbeat answers name the live replicas, so an agent given one URL learns the others
and survives the loss of the replica it talks to. Each replica renews its row every few seconds
(not leader-only: every replica serves the API); a clean stop withdraws it, a crash lets it age out.
"""

from __future__ import annotations

import ipaddress
import logging
import threading

from computepool.server.loops import Periodic
from computepool.server.settings import ServerSettings
from computepool.store import replicas
from computepool.store.db import Database, db_now

log = logging.getLogger("computepool.server")

PUBLISH_EVERY_S = 5.0
LIVE_FOR_S = 30.0  # a row not renewed for this long is a replica that is gone


def own_url(settings: ServerSettings) -> str | None:
    """`advertise_url`, else http(s)://HOST:PORT when HOST names one address (not 0.0.0.0 or ::)."""
    if settings.advertise_url:
        return settings.advertise_url.rstrip("/")
    host = settings.host.strip("[]")
    if not host or settings.port == 0:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        ip = None  # a host name
    if ip is not None and ip.is_unspecified:
        return None
    scheme = "https" if settings.tls_cert else "http"
    shown = f"[{host}]" if ip is not None and ip.version == 6 else host
    return f"{scheme}://{shown}:{settings.port}"


class Replicas:
    """The live replicas' URLs as of the last renewal (a cheap read for every heartbeat)."""

    def __init__(self, db: Database, settings: ServerSettings) -> None:
        self.db = db
        self.url = own_url(settings)
        self._live: list[str] = [self.url] if self.url else []
        self._lock = threading.Lock()

    def urls(self) -> list[str]:
        with self._lock:
            return list(self._live)

    def step(self) -> None:
        """Renew this replica's row and read the others'."""
        with self.db.write() as s:
            now = db_now(s)
            if self.url:
                replicas.publish(s, self.url, now)
            live = replicas.live(s, now, LIVE_FOR_S)
        with self._lock:
            self._live = live

    def withdraw(self) -> None:
        """On a clean stop: agents are no longer sent here (a failure is only logged: it ages out)."""
        if not self.url:
            return
        try:
            with self.db.write() as s:
                replicas.withdraw(s, self.url)
        except Exception as e:  # noqa: BLE001 - the database may be the reason we stop
            log.warning("could not withdraw %s from the replica list: %s", self.url, e)

    def periodic(self) -> Periodic:
        return Periodic("replicas", PUBLISH_EVERY_S, self.step, quiet=True, first_at_start=True)
