"""The mDNS/DNS-SD transport (python-zeroconf): announce this node, browse for the others.

Wire format: one DNS-SD service per agent start, of type `SERVICE_TYPE`
("_computepool._tcp.local."), instance name "cpool-INSTANCE" (the random per-start instance, so a
restarted or copied agent never collides with a name still cached), SRV port = the probe port, A
record = the announced address, and the announcement in TXT (`Announcement.to_txt`): v, pool, id,
inst, addr, port, at (issued_at), sig, nd (device count), d0…dN ("INDEX:KIND:MEMORY_MIB:MODEL").
The TXT is re-signed with a fresh `at` and re-published every `announce_every_s`.

Security: mDNS itself authenticates nothing — anyone on the link can publish or remove a service —
so the transport believes only the signed TXT, through the registry's `verify`. Goodbye packets
(TTL 0) are not signed either, so they do not remove a peer; a peer leaves the table only when its
signed announcements stop moving forward (`expire_after_s`). Zeroconf is bound to the configured
address's interface only, so discovery does not leak onto other networks of a multi-homed host.

Threads only: zeroconf runs its own event-loop thread; browse callbacks just queue names, and one
worker thread resolves them (resolving blocks, which zeroconf forbids in its callbacks). A name is
read from zeroconf's cache when the records are there (no network wait) and asked for otherwise.

Flooding: anyone on the link can publish thousands of names. A name that does not resolve or does
not verify leaves the polled set at once and is tried again only when the browser reports it again
and its back-off (doubling per failure, at most `_MAX_BACKOFF_S`) is over; such names never count
toward the polled set's cap, so junk cannot lock genuine peers out.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceStateChange, Zeroconf

from computepool.discovery.announce import MAX_SKEW_S, SERVICE_TYPE, Announcement
from computepool.discovery.registry import Registry

log = logging.getLogger(__name__)

_MAX_NAMES = 512
_MAX_FAILED = 4096
_MAX_BACKOFF_S = 300.0
_RESOLVE_TIMEOUT_MS = 1500
_STALE_AFTER_S = MAX_SKEW_S / 2


class MdnsTransport:
    def __init__(
        self,
        *,
        address: str,
        registry: Registry,
        announcement: Callable[[], Announcement],
        announce_every_s: float,
        stop: threading.Event,
        max_names: int = _MAX_NAMES,
    ) -> None:
        self._address = address
        self._max_names = max_names
        self._registry = registry
        self._announcement = announcement
        self._every = announce_every_s
        self._stop = stop
        self._names: queue.Queue[str] = queue.Queue()
        self._known: set[str] = set()  # names polled (none has failed since); capped
        # name -> (failures in a row, monotonic time before which it is not tried again)
        self._failed: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self._last_at: dict[str, tuple[str, float]] = {}  # name -> (TXT "at", when it last changed)
        self._pending: set[str] = set()  # names queued and not yet resolved
        self._known_lock = threading.Lock()
        self._zc: Zeroconf | None = None
        self._browser: ServiceBrowser | None = None
        self._closed = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="cpool-discovery-mdns", daemon=True)

    def start(self) -> None:
        """Returns at once; registering (zeroconf probes the name first, ~1.5 s) runs in the thread."""
        self._thread.start()

    def close(self, timeout_s: float = 0.5) -> None:
        """Idempotent; `stop` must be set first. Unregisters the service (goodbye packets) and closes
        zeroconf without waiting out a registration or resolve in progress (it then fails, quietly)."""
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        with self._closed:
            zc, self._zc = self._zc, None
        if zc is not None:
            try:
                zc.close()
            except Exception as e:  # closing must never fail the agent's exit
                log.debug("zeroconf close: %s", e)

    def _info(self) -> ServiceInfo:
        ann = self._announcement()
        return ServiceInfo(
            SERVICE_TYPE,
            f"cpool-{ann.instance}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(self._address)],
            port=ann.port,
            properties=ann.to_txt(),
            server=f"cpool-{ann.instance}.local.",
        )

    def _run(self) -> None:
        try:
            zc = Zeroconf(interfaces=[self._address], ip_version=IPVersion.V4Only)
        except OSError as e:
            log.warning("mDNS discovery unavailable on %s: %s (unicast peers still work)", self._address, e)
            return
        with self._closed:
            if self._stop.is_set():
                zc.close()
                return
            self._zc = zc
        self._browser = ServiceBrowser(zc, SERVICE_TYPE, handlers=[self._on_change])
        registered = False
        next_announce = next_refresh = 0.0
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if not registered:
                    zc.register_service(self._info())
                    registered, next_announce = True, time.monotonic() + self._every
                elif now >= next_announce:
                    zc.update_service(self._info())
                    next_announce = time.monotonic() + self._every
                if now >= next_refresh:
                    # Re-read what the cache holds: catches TXT updates a missed event would hide.
                    with self._known_lock:
                        names = list(self._known)
                    for name in names:
                        self._queue(name)
                    next_refresh = now + self._every / 2
                try:
                    name = self._names.get(timeout=0.2)
                except queue.Empty:
                    continue
                with self._known_lock:
                    self._pending.discard(name)
                self._resolve(zc, name)
            except Exception as e:  # a blocked event loop, a vanished link: retry, never give up
                if self._stop.is_set():
                    return
                log.warning("mDNS discovery on %s: %s (retrying)", self._address, e)
                self._stop.wait(self._every)

    def _queue(self, name: str) -> None:
        """Queue a name to resolve unless it already waits (so the queue holds each polled or
        retried name at most once: it stays within `max_names` + `_MAX_FAILED`)."""
        with self._known_lock:
            if name in self._pending:
                return
            self._pending.add(name)
        self._names.put(name)

    def _on_change(
        self, zeroconf: Zeroconf, service_type: str, name: str, state_change: ServiceStateChange
    ) -> None:
        with self._known_lock:
            if state_change is ServiceStateChange.Removed:
                self._known.discard(name)  # unsigned goodbye: stop polling it; the registry decides
                return
            failed = self._failed.get(name)
            if failed is not None:
                if time.monotonic() < failed[1]:
                    return  # backing off; it does not take a polled slot meanwhile
            elif name not in self._known:
                if len(self._known) >= self._max_names:
                    return
                self._known.add(name)
        self._queue(name)

    def _failure(self, name: str) -> None:
        """`name` did not resolve or verify: stop polling it, and back off before trying it again."""
        with self._known_lock:
            self._known.discard(name)
            count = self._failed.pop(name, (0, 0.0))[0] + 1
            self._failed[name] = (count, time.monotonic() + min(2.0 ** (count - 1), _MAX_BACKOFF_S))
            while len(self._failed) > _MAX_FAILED:
                self._failed.popitem(last=False)
        self._last_at.pop(name, None)

    def _success(self, name: str) -> None:
        with self._known_lock:
            if self._failed.pop(name, None) is not None and len(self._known) < self._max_names:
                self._known.add(name)  # it verifies now: poll it again like any peer

    def _resolve(self, zc: Zeroconf, name: str) -> None:
        if self._stop.is_set():
            return
        cached = ServiceInfo(SERVICE_TYPE, name)
        info = (
            cached
            if cached.load_from_cache(zc)
            else zc.get_service_info(SERVICE_TYPE, name, timeout=_RESOLVE_TIMEOUT_MS)
        )
        if info is None:
            self._failure(name)
            return
        # Only a changed TXT is news. A crashed agent's record lingers in the cache (TXT TTLs run
        # to an hour): re-reading it would turn a departed peer into a "stale announcement"
        # rejection. Unchanged for _STALE_AFTER_S, the name is no longer polled (an update or a
        # new instance brings it back through the browser).
        at = _s(info.properties.get(b"at")) if info.properties else ""
        now = time.monotonic()
        last = self._last_at.get(name)
        if last is not None and last[0] == at:
            if now - last[1] > _STALE_AFTER_S:
                with self._known_lock:
                    self._known.discard(name)
                self._last_at.pop(name, None)
            return
        if len(self._last_at) >= self._max_names:
            self._last_at.clear()
        self._last_at[name] = (at, now)
        addresses = info.parsed_addresses(IPVersion.V4Only)
        # No address record: "" (a rejection's address must be an IP or nothing at all).
        sender = (addresses[0] if addresses else "", int(info.port or 0))
        try:
            ann: Announcement | Exception = Announcement.from_txt(info.properties)
        except ValueError as e:
            ann = e
        if self._registry.observe(ann, source="mdns", sender=sender, now=time.time()) is None:
            self._success(name)
        else:
            self._failure(name)


def _s(value: bytes | None) -> str:
    return value.decode("utf-8", "replace") if value is not None else ""
