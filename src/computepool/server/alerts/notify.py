"""Sending alert notifications from the outbox: webhooks (signed JSON) and mail.

The rule pass only writes `alert_deliveries` rows; this runs apart from it, so a receiver that
hangs or fails never holds up the rules or the scheduler. Each delivery is sent on its own (a slow
receiver holds up no other) within a deadline for the whole POST or mail conversation, however
slowly the other end trickles bytes. Any replica may send: a delivery is claimed with a
compare-and-set before it goes out, and its result is recorded only while that claim is still
ours. A failed try is retried with back-off (5 s doubling to 10 min) and given up after ten tries,
kept with the last error. Errors and logs name a webhook by id and origin, never by its full URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import smtplib
import socket
import ssl
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from email.message import EmailMessage

import httpx

from computepool.server.alerts.redact import hook_name, scrub
from computepool.server.alerts.signing import load_or_create_key, signed_headers, webhook_secret
from computepool.server.loops import Periodic
from computepool.server.settings import ServerSettings
from computepool.store import alerts as store
from computepool.store.db import Database, db_now
from computepool.store.models import Alert
from computepool.wire.alerts import AlertOut, WebhookBody

log = logging.getLogger("computepool.server")
BATCH = 64  # deliveries one replica has in flight at most
MAX_RESPONSE_BYTES = 4096  # of a refusing receiver's answer, read for the error message
ERROR_BODY_CHARS = 200


def alert_out(a: Alert) -> AlertOut:
    return AlertOut(
        id=a.id,
        rule=a.rule,
        state=a.state,
        severity=a.severity,  # type: ignore[arg-type]
        since=a.since,
        resolved_at=a.resolved_at,
        subject=a.subject,
        tenant=a.tenant,
        summary=a.summary,
        detail=dict(a.detail or {}),
    )


@dataclass(frozen=True)
class Outcome:
    delivery_id: int
    channel: str
    ok: bool
    error: str = ""
    recorded: bool = True  # False: the claim had lapsed, the result was not written


@dataclass(frozen=True)
class _Job:
    due: store.Due
    body: WebhookBody


@dataclass(frozen=True)
class _Claim:
    at: datetime  # when claimed (the time given to `run_once`, or the database's)
    until: datetime  # the claim's end, also the fencing token of the result
    fixed: bool  # `at` was given: results are booked at it, not at the database's time
    jobs: list[_Job]


class Notifier:
    """Sends due deliveries. The server's loop starts each due one as its own task; `run_once` is
    one round that waits for what it sent (tests call it, with `now` to skip ahead)."""

    def __init__(self, db: Database, settings: ServerSettings) -> None:
        self.db, self.settings = db, settings
        self.deadline_s = 10.0  # a whole webhook POST or mail conversation, connect to last byte
        self.backoff_s = 5.0
        self.max_backoff_s = 600.0
        self.max_attempts = 10
        self.tick_s = 1.0
        self.auto = True
        self._key: bytes | None = None
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inflight: set[asyncio.Task[Outcome]] = set()

    @property
    def key(self) -> bytes:
        if self._key is None:
            self._key = load_or_create_key(self.settings.webhook_key_path)
        return self._key

    def _claim(self, now: datetime | None, limit: int) -> _Claim:
        with self.db.read() as s:  # most rounds find nothing: no write lock taken for that
            at = now or db_now(s)
            until = at + timedelta(seconds=self.deadline_s * 2 + 30)  # a sender that died: retried then
            if limit <= 0 or not store.due(s, at, 1):
                return _Claim(at, until, now is not None, [])
        with self.db.write() as s:
            jobs = []
            for d in store.due(s, at, limit):
                if not store.claim(s, d, at, until):
                    continue  # another replica took it
                alert = s.get(Alert, d.alert_id)
                if alert is None:
                    continue
                out = alert_out(alert)
                if d.event == "firing":  # as it was when it fired, even if resolved since
                    out = out.model_copy(update={"state": "firing", "resolved_at": None})
                jobs.append(_Job(d, WebhookBody(event=d.event, alert=out)))  # type: ignore[arg-type]
        return _Claim(at, until, now is not None, jobs)

    def run_once(self, now: datetime | None = None) -> list[Outcome]:
        """Claim what is due, send it all at once, record each result; from a thread with no event loop."""
        return asyncio.run(self._round(now))

    async def _round(self, now: datetime | None) -> list[Outcome]:
        claim = await asyncio.to_thread(self._claim, now, BATCH)
        return list(await asyncio.gather(*(self._deliver(claim, job) for job in claim.jobs)))

    async def _deliver(self, claim: _Claim, job: _Job) -> Outcome:
        outcome = await self._send(job)
        recorded = await asyncio.to_thread(self._record, claim, job, outcome)
        if not recorded:
            log.warning(
                "alert %d %s notification (%s): its claim lapsed before the result; not recorded",
                job.due.alert_id, job.due.event, self._target(job.due),
            )  # fmt: skip
        return Outcome(outcome.delivery_id, outcome.channel, outcome.ok, outcome.error, recorded)

    @staticmethod
    def _target(d: store.Due) -> str:
        return hook_name(d.webhook_id, d.url) if d.channel == "webhook" else "mail"

    async def _send(self, job: _Job) -> Outcome:
        d = job.due
        try:
            async with asyncio.timeout(self.deadline_s):
                if d.channel == "webhook":
                    await self._post(job)
                else:
                    await asyncio.to_thread(self._mail, job.body)
        except TimeoutError:
            error = f"Timeout: {self._target(d)} took more than {self.deadline_s:g} s in all"
        except Exception as e:  # every failure is a retry; the reason is kept for `cpool alerts`
            error = scrub(f"{type(e).__name__}: {e}", d.url)[:500]
        else:
            return Outcome(d.id, d.channel, True)
        log.warning("alert %d %s notification (%s) failed: %s", d.alert_id, d.event, self._target(d), error)
        return Outcome(d.id, d.channel, False, error)

    async def _post(self, job: _Job) -> None:
        d = job.due
        if d.url is None or d.webhook_id is None:
            raise RuntimeError("the webhook was deleted")
        body = job.body.model_dump_json().encode()
        headers = signed_headers(webhook_secret(self.key, d.webhook_id, d.salt or ""), body, d.id)
        async with (
            httpx.AsyncClient(timeout=self.deadline_s, follow_redirects=False) as client,
            client.stream("POST", d.url, content=body, headers=headers) as r,
        ):
            if 200 <= r.status_code < 300:
                return  # the answer's body is not read: nothing in it is needed
            got = b""
            async for chunk in r.aiter_raw():
                got += chunk
                if len(got) >= MAX_RESPONSE_BYTES:
                    break
        said = got[:MAX_RESPONSE_BYTES].decode("utf-8", "replace").strip()[:ERROR_BODY_CHARS]
        raise RuntimeError(f"HTTP {r.status_code} from {hook_name(d.webhook_id, d.url)}: {said!r}")

    def _mail(self, body: WebhookBody) -> None:
        st = self.settings
        if not st.smtp_host or not st.mail_to:
            raise RuntimeError("mail is not set up (smtp_host and mail_to)")
        a = body.alert
        msg = EmailMessage()
        msg["Subject"] = f"[cpool] {body.event.upper()} {a.severity} {a.rule} {a.subject}"
        msg["From"] = st.mail_from
        msg["To"] = ", ".join(st.mail_to)
        lines = [
            a.summary,
            "",
            f"rule: {a.rule}",
            f"state: {body.event}",
            f"severity: {a.severity}",
            f"subject: {a.subject}",
            f"tenant: {a.tenant or '-'}",
            f"since: {a.since.isoformat()}",
        ]
        if body.event == "resolved" and a.resolved_at is not None:
            lines.append(f"resolved at: {a.resolved_at.isoformat()}")
        lines.append(f"detail: {json.dumps(a.detail, sort_keys=True)}")
        msg.set_content("\n".join(lines) + "\n")
        smtp: smtplib.SMTP
        if st.smtp_tls:  # implicit TLS (port 465): the password never crosses in the clear
            smtp = smtplib.SMTP_SSL(timeout=self.deadline_s, context=ssl.create_default_context())
        else:
            smtp = smtplib.SMTP(timeout=self.deadline_s)
        # smtplib's timeout is per read: a server trickling its replies is cut off at the deadline
        watchdog = threading.Timer(self.deadline_s, _abort, args=(smtp,))
        watchdog.daemon = True
        watchdog.start()
        # made unconnected so the watchdog runs from the start (connecting itself is bounded by the
        # socket timeout); the name TLS checks the certificate against is otherwise set only by the
        # constructor's own connect
        smtp._host = st.smtp_host  # type: ignore[attr-defined]
        try:
            smtp.connect(st.smtp_host, st.smtp_port)
            if st.smtp_starttls:
                smtp.starttls(context=ssl.create_default_context())
            if st.smtp_user:
                password = st.smtp_password_file.read_text().strip() if st.smtp_password_file else ""
                smtp.login(st.smtp_user, password)
            smtp.send_message(msg)
            smtp.quit()
        finally:
            watchdog.cancel()
            smtp.close()

    def _record(self, claim: _Claim, job: _Job, o: Outcome) -> bool:
        with self.db.write() as s:
            at = claim.at if claim.fixed else db_now(s)
            attempts = job.due.attempts + 1
            if o.ok:
                return store.finish(s, job.due, claim.until, "sent", at, "")
            if attempts >= self.max_attempts:
                return store.finish(s, job.due, claim.until, "failed", at, o.error)
            wait = min(self.backoff_s * 2 ** (attempts - 1), self.max_backoff_s)
            return store.finish(s, job.due, claim.until, "pending", at + timedelta(seconds=wait), o.error)

    # --- the loop -----------------------------------------------------------------------------------

    def wake(self) -> None:
        """Send now rather than at the next tick (callable from any thread)."""
        loop, ev = self._loop, self._wake
        if loop is not None and ev is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(ev.set)

    def periodic(self) -> Periodic:
        """A round each tick, or at once when `wake` is called (an alert fired)."""
        return Periodic(
            "alert-notify", self.tick_s, self._dispatch, wake=self._event, enabled=lambda: self.auto
        )

    def _event(self) -> asyncio.Event:
        if self._wake is None:
            self._wake = asyncio.Event()
        return self._wake

    async def _dispatch(self) -> None:
        """Claim what is due and start each delivery on its own (none waits for another)."""
        claim = await asyncio.to_thread(self._claim, None, BATCH - len(self._inflight))
        for job in claim.jobs:  # each on its own: none waits for another
            task = asyncio.get_running_loop().create_task(self._deliver(claim, job))
            self._inflight.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[Outcome]) -> None:
        self._inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:  # recording failed: retried later
            log.error("alert notifications: a delivery failed", exc_info=task.exception())

    def start(self) -> None:
        """Bind to the app's loop (its rounds run as a `Periodic` among the app's loops)."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()

    async def stop(self) -> None:
        """Stop sending; deliveries in flight are dropped unrecorded (their claims lapse, and they
        are sent again, by this replica after a restart or by another)."""
        tasks = list(self._inflight)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._inflight.clear()
        self._loop = None


def _abort(smtp: smtplib.SMTP) -> None:
    """Cut a mail conversation past its deadline: the blocked read in the sending thread fails."""
    sock = getattr(smtp, "sock", None)
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
